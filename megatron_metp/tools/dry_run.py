"""Will this Megatron-LM command fit? Parse, validate and measure it on a CPU, without GPUs.

::

    python -m megatron_metp.dry_run --megatron-lm-dir DIR --world-size 8 [--rank 0] \\
        [--gpu-memory-gib 80] [--json out.json] -- <pretrain_gpt.py arguments>

``scripts/pretrain_gpt.sh --dry-run`` calls this with the exact arguments it would launch.

What happens, in one CPU process that plays rank ``--rank`` of a ``--world-size`` job:

1. The **real** Megatron-LM argument parser of the checkout (patched with ``patches/``) parses
   the arguments, with the ``--metp-*`` flags registered as the patched ``pretrain_gpt.py`` does,
   and the patched ``validate_args`` checks them (so METP is mapped onto context parallelism and
   every Megatron check runs). ``get_device_arch_version`` (a CUDA query) answers
   ``--gpu-arch``.
2. torch's ``fake`` process group stands in for the ``world_size`` ranks, and the patched
   ``_initialize_distributed`` creates Megatron's parallel state (with the METP expert-group
   fold) exactly as in training.
3. The model of this rank is built by the same model provider ``pretrain_gpt.py`` passes to
   ``pretrain`` (``model_provider`` around ``wrap_gpt_builder(gpt_builder)``), under
   ``FakeTensorMode``: every tensor has its true shape and dtype and none is allocated.
4. One forward and backward of one micro-batch runs under ``MemTracker``, which follows every
   tensor and reports the peak, with the CUDA-faithful kernels of
   :mod:`megatron_metp.tools.cuda_accounting` (the same fake-rank harness as ``metp measure``:
   :mod:`megatron_metp.tools.fakerank`), so the bytes are what a GPU would hold, not what the
   CPU kernels keep.

Memory reported per rank: parameters (counted), gradient buffer and optimizer state (computed
from Megatron's settings: gradient dtype, optimizer, precision-aware dtypes, distributed
optimizer sharding over the right data-parallel group for METP-sharded and replicated weights),
and activations (measured). Not modelled: the CUDA context, NCCL buffers, allocator
fragmentation, Transformer Engine workspaces; keep a few GiB of headroom.

Substitutions, each printed when it applies: without Transformer Engine on this machine a
``--transformer-impl transformer_engine`` model is built with Megatron's local layers and a
flash-attention core (PyTorch's fused kernel; TE's fused attention stores the same); without
``triton`` the one Megatron module that imports it unconditionally (batch-invariant kernels,
unused by GPT pre-training) is replaced by a stub.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import time
from typing import Dict, List, Optional

from ..megatron_lm.cpu import stub_batch_invariant_kernels
from ..megatron_lm.patch_markers import problem as patch_problem
from . import fakerank as FR
from .dry_run_memory import inflight_microbatches, optimizer_bytes_per_param, static_memory
from .dry_run_report import format_report
from .progress import attach
from .standins import stock_standins

MiB = 2 ** 20
GiB = 2 ** 30



class DryRunError(RuntimeError):
    """A problem with the command or the environment, explained for the user."""


# ------------------------------------------------------------------------------ checkout

def check_checkout(megatron_lm_dir: str) -> str:
    """Absolute path of a patched Megatron-LM checkout, or a ``DryRunError`` saying what to do."""
    if not megatron_lm_dir:
        raise DryRunError("no Megatron-LM checkout: pass --megatron-lm-dir or set MEGATRON_LM_DIR")
    msg = patch_problem(megatron_lm_dir)
    if msg:
        raise DryRunError(msg)
    return os.path.abspath(megatron_lm_dir)


def _have_transformer_engine() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------------------------ the run

def _categories(trk, kind) -> Dict[str, int]:
    got = FR.snap(trk, kind)
    return dict(got["cat"], Total=got["total"])


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def run(megatron_lm_dir: str, megatron_argv: List[str], *, world_size: int, rank: int = 0,
        gpu_arch: float = 9.0, verbose: bool = False, measure_layers: str = "auto",
        cpu_kernels: bool = False, measure_tiles: str = "sampled") -> Dict:
    """Parse, validate, build and measure; return the report as a dict (see :func:`format_report`).

    Runs in this process and initialises global state (Megatron's globals, a fake process
    group): call it once per process.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    d = check_checkout(megatron_lm_dir)
    try:
        FR.tile_sampling(measure_tiles)  # refuses an unknown value before any work
    except ValueError as exc:
        raise DryRunError(str(exc)) from None
    if not 0 <= rank < world_size:
        raise DryRunError(f"--rank {rank} is outside the job's {world_size} ranks")
    if "megatron.core" in sys.modules and \
            not os.path.abspath(sys.modules["megatron.core"].__file__).startswith(d + os.sep):
        raise DryRunError("megatron.core was imported before the dry run; run it in a fresh "
                          "process (python -m megatron_metp.dry_run)")
    sys.path.insert(0, d)
    notes: List[str] = []
    if stub_batch_invariant_kernels():
        notes.append("triton is not installed: Megatron's batch-invariant kernels module "
                     "(triton, unused by GPT pre-training) is stubbed")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    import torch

    from .. import megatron_lm
    from ..megatron_lm import releases

    torch.set_num_threads(1)
    log = io.StringIO()
    out = contextlib.redirect_stdout(log) if not verbose else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        with out:
            sys.argv = ["pretrain_gpt.py"] + list(megatron_argv)
            import pretrain_gpt  # the checkout's script (its __main__ is guarded)
            from megatron.training import arguments as margs
            from megatron.training import global_vars
            from megatron.training import initialize as minit

            import megatron.core

            core_path = os.path.dirname(os.path.abspath(megatron.core.__file__))
            provider = megatron_lm.compose_extra_args_providers(
                pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None,
                megatron_lm.add_metp_args)
            try:
                args = margs.parse_args(provider)
            except SystemExit as exc:
                raise DryRunError(f"Megatron's argument parser rejected the command (exit "
                                  f"{exc.code}):\n{log.getvalue()[-3000:]}") from None
            args.world_size, args.rank = world_size, rank
            arch = lambda: gpu_arch  # noqa: E731 - CUDA query answered for the target GPU
            with _patched(margs, "get_device_arch_version", arch):
                try:
                    releases.validate_args_owner().validate_args(
                        args, {"tokenizer_type": "GPT2BPETokenizer"})
                except (AssertionError, ValueError, RuntimeError) as exc:
                    raise DryRunError(f"validate_args rejected the command: "
                                      f"{type(exc).__name__}: {exc}") from None
            # Dry-run settings that do not change the model or its memory:
            releases.disable_gloo_process_groups(args)  # gloo needs a real store
            args.tensorboard_dir = args.wandb_project = None
            args.use_cpu_initialization = True
            args.perform_initialization = False  # values are never computed on fake tensors
            have_te = _have_transformer_engine()
            te_absent = args.transformer_impl == "transformer_engine" and not have_te
            if not have_te and getattr(args, "apply_rope_fusion", False):
                args.apply_rope_fusion = False  # needs TE; the unfused RoPE stores the same
                notes.append("RoPE fusion needs Transformer Engine: measured unfused")
            if getattr(args, "gradient_accumulation_fusion", False) and \
                    importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
                args.gradient_accumulation_fusion = False  # apex CUDA extension
                notes.append("gradient-accumulation fusion needs apex's CUDA extension: off")
            try:
                global_vars.set_global_variables(args, build_tokenizer=True)
            except Exception as exc:  # noqa: BLE001 - a tokenizer file missing on this machine
                if not getattr(args, "vocab_size", None):
                    raise DryRunError(f"the tokenizer could not be built here ({exc}); pass "
                                      f"--vocab-size N for the dry run") from None
                global_vars.unset_global_variables()
                global_vars.set_global_variables(args, build_tokenizer=False)
                args.padded_vocab_size = releases.vocab_size_with_padding(args.vocab_size, args)
                notes.append(f"tokenizer not built here ({type(exc).__name__}); vocabulary "
                             f"size from --vocab-size ({args.vocab_size})")

            FR.fake_world(world_size, rank)
            with _patched(torch.cuda, "device_count", lambda: 1):
                minit._initialize_distributed(pretrain_gpt.get_embedding_ranks, None, None)
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(args.seed)
            torch.manual_seed(args.seed)
            report = _build_and_measure(args, pretrain_gpt, ps, te_absent, notes, measure_layers,
                                        cpu_kernels, measure_tiles)
    except DryRunError:
        raise
    except Exception as exc:
        tail = log.getvalue()[-4000:]
        raise DryRunError(f"{type(exc).__name__}: {exc}\n--- Megatron output (tail) ---\n{tail}") \
            from exc
    report.update(megatron_lm_dir=d, megatron_core=core_path, notes=notes,
                  argv=list(megatron_argv), seconds_total=time.perf_counter() - t0,
                  megatron_log=log.getvalue() if not verbose else "")
    return report


def _build_and_measure(args, pretrain_gpt, ps, te_absent: bool, notes: List[str],
                       measure_layers: str = "auto", cpu_kernels: bool = False,
                       measure_tiles: str = "sampled") -> Dict:
    import torch
    import torch.distributed as dist
    from functools import partial

    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import megatron_lm
    from ..megatron.build import model_tree_summary
    from ..megatron_lm.flags import metp_enabled
    from ..megatron.linear import is_metp_sharded
    from ..runtime.offload import ActivationOffloader

    metp = metp_enabled(args)
    if not metp:
        stock_standins(args, te_absent, notes)
    if cpu_kernels:
        notes.append("--cpu-kernels: bytes as this machine's CPU kernels keep them, not as a GPU "
                     "would (docs/cpu-cuda-kernels.md)")
    builder = megatron_lm.wrap_gpt_builder(pretrain_gpt.gpt_builder)
    provider = partial(pretrain_gpt.model_provider, builder)

    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    vpp = args.virtual_pipeline_model_parallel_size if pp_size > 1 else None
    cp = ps.get_context_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    world = {"world": dist.get_world_size(), "tp": tp, "pp": pp_size, "cp": cp,
             "dp": ps.get_data_parallel_world_size(),
             "expert_dp": ps.get_expert_data_parallel_world_size(),
             "ep": ps.get_expert_model_parallel_world_size()}
    where = {"tp_rank": ps.get_tensor_model_parallel_rank(), "cp_rank": ps.get_context_parallel_rank(),
             "pp_rank": pp_rank, "dp_rank": ps.get_data_parallel_rank()}
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    num_mb = get_num_microbatches()
    dtype = args.params_dtype
    mbs, seq = args.micro_batch_size, args.seq_length
    n_local = seq // cp
    sp = bool(getattr(args, "sequence_parallel", False)) and tp > 1

    def build():
        chunks = []
        for v in range(vpp or 1):
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v) if vpp \
                else ps.is_pipeline_first_stage()
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v) if vpp \
                else ps.is_pipeline_last_stage()
            m = provider(pre_process=pre, post_process=post, vp_stage=v if vpp else None,
                         config=None, pg_collection=pgc)
            for prm in m.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(prm)
            chunks.append((m, pre, post))
        return chunks

    docs = dry_run_documents(args, metp, notes)

    tiles_run = {"passes": 0, "skipped": 0, "ring_steps": 0, "ring_skipped": 0}

    def measure(chunks):
        tracker = FR.tracker()
        stored = 0
        layers = sum(len(m.decoder.layers) for m, _, _ in chunks if hasattr(m, "decoder"))
        attach(tracker, f"dry run ({layers} layers)", layers)
        with FR.measuring(tracker, cuda=not cpu_kernels), \
                FR.tile_sampling(measure_tiles) as sampled:
            for m, pre, post in chunks:
                stored += _fwd_bwd(m, pre, post, args, mbs, n_local, sp, tp, dtype, tracker,
                                   docs)
        for k in tiles_run:
            tiles_run[k] += sampled[k] if sampled else 0
        offloaders = [ActivationOffloader.attached_to(m.decoder) for m, _, _ in chunks
                      if getattr(m, "decoder", None) is not None]
        host = sum(o.stats.host_peak for o in offloaders if o is not None)
        return {"stored": float(stored), "work_peak": float(tracker.work_peak),
                "host": float(host),
                "tracker_peak": {k: float(v) for k, v in _categories(tracker, "peak").items()}}

    fake = FakeTensorMode()
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with fake:
            pgc = ProcessGroupCollection.use_mpu_process_groups()
            t_build = time.perf_counter()
            chunks = build()
            build_s = time.perf_counter() - t_build
            tree = "; ".join(model_tree_summary(m) for m, _, _ in chunks)
            params = [p for m, _, _ in chunks for p in m.parameters()]
            n_layers = sum(len(m.decoder.layers) for m, _, _ in chunks if hasattr(m, "decoder"))
            reducible = not vpp and not any(
                getattr(args, a, None) for a in ("decoder_first_pipeline_num_layers",
                                                 "decoder_last_pipeline_num_layers",
                                                 "pipeline_model_parallel_layout"))
            step = (getattr(args, "recompute_num_layers", None) or 1) \
                if getattr(args, "recompute_granularity", None) == "full" and \
                getattr(args, "recompute_method", None) == "uniform" else 1
            try:
                depths = FR.layer_depths(n_layers, measure_layers, step=step, offload=bool(
                    getattr(args, "metp_offload_activations", False)))
            except ValueError as exc:
                raise DryRunError(str(exc)) from None
            extrapolate = depths is not None and (reducible or measure_layers != "auto")
            if extrapolate and not reducible:
                raise DryRunError("--measure-layers needs a model without virtual or uneven "
                                  "pipeline stages; use --measure-layers full")
            t_run = time.perf_counter()
            if not extrapolate:
                act = measure(chunks)
                act["method"] = f"measured on all {n_layers} layers"
            else:
                try:
                    a, k = depths
                except TypeError:
                    raise DryRunError(f"--measure-layers {measure_layers}: nothing to "
                                      f"extrapolate on {n_layers} layers; use full") from None
                full_layers = args.num_layers
                n_off = getattr(args, "metp_offload_activations", False)
                partial = n_off is not True and bool(n_off)  # --metp-offload-activations N
                n_keep = getattr(args, "metp_keep_attention_output", None)
                keep_part = n_keep is not True and bool(n_keep) and n_keep < n_layers
                if keep_part and (partial or step > 1):
                    raise DryRunError(f"--metp-keep-attention-output {n_keep} with "
                                      + (f"--metp-offload-activations {n_off}" if partial else
                                         f"--recompute-num-layers {step}")
                                      + ": the layer extrapolation takes one partial choice "
                                        "of whole layers at a time; use --measure-layers full")
                if partial:  # each measured stage keeps the full stage's kept layers
                    pts, coef = FR.partial_offload_points(n_layers, n_off, (a, k), step=step)
                elif keep_part:  # a shallower stage would keep every layer: slopes in both
                    pts, coef = FR.partial_keep_points(n_layers, n_keep, (a, k))
                else:
                    t_ = (n_layers - k) / (k - a)
                    pts, coef = [(a, n_off), (k, n_off)], [-t_, 1 + t_]
                points = []
                try:
                    for depth, x in pts:
                        args.num_layers = depth * pp_size
                        if partial:
                            args.metp_offload_activations = x
                        if keep_part:
                            args.metp_keep_attention_output = x
                        points.append(measure(build()))
                finally:
                    args.num_layers = full_layers
                    if partial:
                        args.metp_offload_activations = n_off
                    if keep_part:
                        args.metp_keep_attention_output = n_keep
                keys = ("stored", "work_peak", "host")
                act = {key: FR.combine([pt[key] for pt in points], coef) for key in keys}
                per_layer = {key: (points[1][key] - points[0][key]) / (pts[1][0] - pts[0][0])
                             for key in keys}
                act["tracker_peak"] = points[-1]["tracker_peak"]
                act["per_layer"] = per_layer
                act["method"] = (
                    f"measured on {', '.join(f'{d} layers ({o} offloaded)' for d, o in pts)}, "
                    f"combined linearly to {n_layers} layers with {n_off} offloaded" if partial
                    else "measured on " + ", ".join(f"{d} layers ({o} keeping attention)"
                                                    for d, o in pts)
                    + f", combined linearly to {n_layers} layers with {n_keep} keeping it"
                    if keep_part
                    else f"measured on {a} and {k} layers, extrapolated linearly to {n_layers} "
                         f"(+{per_layer['stored'] / MiB:,.0f} MiB stored per layer)")
            run_s = time.perf_counter() - t_run
            if tiles_run["skipped"] or tiles_run["ring_skipped"]:
                act["method"] += "; " + FR.sampled_text(
                    tiles_run, "the first and last passes of each loop, one step of each run "
                               "of like ring steps, --measure-tiles full runs all")
    finally:
        torch.set_default_dtype(prev_dtype)
    static = static_memory(args, params, world)
    inflight = inflight_microbatches(args, pp_rank, pp_size, num_mb)
    act_peak = act["work_peak"] + (inflight - 1) * act["stored"]
    decoder = [m.decoder for m, _, _ in chunks if hasattr(m, "decoder")]
    layer_type = ""
    if decoder and len(decoder[0].layers):
        lay = decoder[0].layers[0]
        layer_type = f"{type(lay.self_attention).__name__} + {type(lay.mlp).__name__}"
    n_sharded = sum(p.numel() for p in params if is_metp_sharded(p))
    n_embed = sum(p.numel() for m, _, _ in chunks for n, p in m.named_parameters()
                  if "embedding" in n or n.startswith("output_layer"))
    total = static["params"] + static["grads"] + static["optimizer"] + act_peak
    return {
        "world": world, "rank": dist.get_rank(), "where": where, "metp": metp,
        "metp_size": args.metp_parallel_size if metp else 1,
        "weight_ring": metp and not args.metp_disable_weight_ring,
        "num_microbatches": num_mb, "micro_batch_size": mbs, "seq_length": seq,
        "tokens_per_rank": n_local, "sequence_parallel": sp,
        "global_batch_size": args.global_batch_size,
        "pre_process": any(pre for _, pre, _ in chunks),
        "post_process": any(post for _, _, post in chunks),
        "layers_on_rank": n_layers, "num_layers": args.num_layers, "layer_type": layer_type,
        "transformer_impl": args.transformer_impl,
        "params_total": sum(p.numel() for p in params), "params_metp_sharded": n_sharded,
        "params_embedding_output": n_embed,
        "bytes": {"params": static["params"], "grads": static["grads"],
                  "optimizer": static["optimizer"], "activations": act_peak, "total": total,
                  "host": act.get("host", 0.0) * inflight},
        "activation_detail": {"stored_for_backward_one_mb": act["stored"],
                              "work_peak_one_mb": act["work_peak"],
                              "inflight_microbatches": inflight, "method": act["method"],
                              "per_layer": act.get("per_layer"),
                              "tracker_peak": act["tracker_peak"]},
        "static_detail": {k: v for k, v in static.items()
                          if k not in ("params", "grads", "optimizer")},
        "optimizer": args.optimizer, "distributed_optimizer": bool(args.use_distributed_optimizer),
        "seconds_build": build_s, "model_tree": tree,
        "padded_vocab_size": int(args.padded_vocab_size), "seconds_fwd_bwd": run_s,
    }


#: documents per sequence in the dry run of a packed (--reset-attention-mask) METP config
DRY_RUN_DOCUMENTS = 8


def dry_run_documents(args, metp: bool, notes: List[str]):
    """The METP document boundaries of the dry run's micro-batch (``None`` unless METP runs with
    ``--reset-attention-mask``): :data:`DRY_RUN_DOCUMENTS` equal documents. Fake tensors have no
    token values to find EOD tokens in, so the boundaries are given to the model (made here,
    outside the fake mode) as the training run derives them, in ``packed_seq_params``."""
    if not metp or not getattr(args, "reset_attention_mask", False):
        return None
    from ..megatron.packing import documents

    s = args.seq_length
    n = max(1, min(DRY_RUN_DOCUMENTS, s))
    cu = sorted({round(i * s / n) for i in range(n + 1)})
    notes.append(f"--reset-attention-mask: the micro-batch holds {len(cu) - 1} documents of "
                 f"{s // (len(cu) - 1):,} tokens (fake tensors hold no EOD tokens; a training "
                 f"run derives the boundaries from them)")
    return documents(cu, s, full_rope=not getattr(args, "metp_disable_weight_ring", False),
                     layout=getattr(args, "metp_packed_layout", "dual_chunk"))


def _fwd_bwd(model, pre, post, args, mbs, n_local, sp, tp, dtype, tracker, docs=None) -> int:
    """One forward and backward of one micro-batch on this chunk; returns the bytes the forward
    left alive for the backward (forward allocations still alive when it ends)."""
    import torch

    tokens = torch.zeros(mbs, n_local, dtype=torch.long)
    position_ids = torch.zeros(mbs, n_local, dtype=torch.long)
    labels = torch.zeros(mbs, n_local, dtype=torch.long)
    mask = None
    if getattr(args, "create_attention_mask_in_dataloader", False):
        mask = torch.zeros(mbs, 1, n_local, args.seq_length, dtype=torch.bool)
    if not pre:
        s_in = n_local // tp if sp else n_local
        model.set_input_tensor(torch.zeros(s_in, mbs, args.hidden_size, dtype=dtype,
                                           requires_grad=True))
    act_before = _categories(tracker, "current").get("ACT", 0)
    kw = {"packed_seq_params": docs} if docs is not None else {}
    out = model(tokens, position_ids, mask, labels=labels if post else None, **kw)
    stored = _categories(tracker, "current").get("ACT", 0) - act_before
    if post:
        out.float().sum().backward()
    else:
        out.backward(torch.zeros_like(out))
    return stored


# ------------------------------------------------------------------------- command line

def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, megatron_argv = argv[:i], argv[i + 1:]
    else:
        own, megatron_argv = argv, []
    ap = argparse.ArgumentParser(
        prog="python -m megatron_metp.dry_run",
        description="Parse and validate a pretrain_gpt.py command with the real Megatron-LM "
                    "arguments, build the model of one rank under a fake process group and "
                    "FakeTensorMode, run one micro-batch forward+backward, and print that rank's "
                    "parameters and peak memory. Megatron arguments follow '--'.")
    ap.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                    help="patched Megatron-LM checkout at core_v0.16.1 (default: $MEGATRON_LM_DIR)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="ranks in the job (default: --nnodes × --gpus-per-node)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0, help="which rank to measure (default 0)")
    ap.add_argument("--gpu-arch", type=float, default=9.0,
                    help="compute capability major of the target GPU, answered to Megatron's "
                         "device query (default 9.0: Hopper)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="GPU memory to check the total against (e.g. 80 for H100, 141 for H200)")
    ap.add_argument("--host-memory-gib", type=float, default=None,
                    help="host RAM per node to check the pinned offload buffers against "
                         "(default 1,863 GiB = a DGX node's 2 TB)")
    ap.add_argument("--measure-layers", default="auto", metavar="{auto,full,N}",
                    help="activations: 'full' runs fwd+bwd through every layer of the rank; N "
                         "measures N-1 and N layers and extrapolates linearly per layer; 'auto' "
                         "(default) is full up to 4 layers per rank, else N=2 (METP's rings under "
                         "fake tensors take minutes at full depth)")
    ap.add_argument("--measure-tiles", default="sampled", choices=FR.MEASURE_TILES,
                    help="'sampled' (default) runs the first two and the last pass of each "
                         "repeating tile loop of the streaming METP layer (each pass allocates "
                         "the same) and one step of each run of like K/V ring steps; 'full' runs "
                         "every pass and step")
    ap.add_argument("--cpu-kernels", action="store_true",
                    help="account as this machine's CPU kernels do (what a CPU run would hold), "
                         "not as the CUDA kernels do (the default): shows what the CUDA "
                         "accounting changes (docs/cpu-cuda-kernels.md)")
    ap.add_argument("--json", default=None, help="also write the report as JSON to this file")
    ap.add_argument("--verbose", action="store_true", help="show Megatron's own output")
    opts = ap.parse_args(own)
    world = opts.world_size or opts.nnodes * opts.gpus_per_node
    try:
        report = run(opts.megatron_lm_dir, megatron_argv, world_size=world, rank=opts.rank,
                     gpu_arch=opts.gpu_arch, verbose=opts.verbose,
                     measure_layers=opts.measure_layers, cpu_kernels=opts.cpu_kernels,
                     measure_tiles=opts.measure_tiles)
        report["gpus_per_node"] = opts.gpus_per_node
    except DryRunError as exc:
        print(f"dry run failed: {exc}", file=sys.stderr)
        return 1
    print(format_report(report, opts.gpu_memory_gib, opts.host_memory_gib), flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({k: v for k, v in report.items() if k != "megatron_log"}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
