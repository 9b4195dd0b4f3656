"""Glue between a Megatron-LM checkout (tag ``core_v0.16.1``) and METP.

The patches in ``patches/`` (applied with ``scripts/apply_patches.sh``) make Megatron-LM call the
public functions of this module, and nothing else:

* ``pretrain_gpt.py``: the command-line flags, through
  ``extra_args_provider=compose_extra_args_providers(<modelopt's provider or None>, add_metp_args)``,
  and the model, through ``partial(model_provider, wrap_gpt_builder(gpt_builder))``;
* ``megatron/training/arguments.py``: ``validate_metp_args(args)`` at the top of the world-size
  arithmetic of ``validate_args`` (METP becomes Megatron's context-parallel dimension there, so
  Megatron's own checks, DP size and batch arithmetic come out right);
* ``megatron/training/initialize.py``: ``expert_model_parallel_size=
  metp_expert_model_parallel_size(args)`` in the one ``initialize_model_parallel`` call, which
  folds the expert groups onto the METP groups in ``parallel_state`` only (see
  :mod:`megatron_metp.megatron.parallel`): ``args.expert_model_parallel_size`` stays 1.

With ``--metp-parallel-size 1`` (the default) every function here leaves Megatron's behaviour
unchanged. Nothing in this module imports ``megatron.training`` at import time, so it can be
imported from inside ``megatron/training/arguments.py`` without an import cycle, and tested
against megatron-core alone.
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Callable, List, Optional

from ..ops.kernel_choice import KERNELS as _KERNELS

__all__ = [
    "ATTENTION_KERNELS",
    "add_metp_args",
    "compose_extra_args_providers",
    "validate_metp_args",
    "metp_expert_model_parallel_size",
    "check_metp_parallel_state",
    "metp_enabled",
    "wrap_gpt_builder",
    "build_metp_gpt_model",
]

#: choices of ``--metp-attention-kernel``; ``auto`` picks the best available at run time
ATTENTION_KERNELS = ("auto",) + _KERNELS

#: set on ``args`` once ``validate_metp_args`` has moved METP onto the context-parallel dimension
_MAPPED = "metp_context_parallel_mapped"
#: set on ``args``: ``--context-parallel-size`` as given with METP (the outer factor ``c`` of
#: METP × CP; Megatron's context-parallel size becomes ``p·c``)
CP_OUTER = "metp_context_parallel_outer"
#: set on ``args``: ``--make-vocab-size-divisible-by`` as given, before METP's factor
_VOCAB_BASE = "metp_vocab_divisible_by_base"


# ----------------------------------------------------------------------------------- flags

def add_metp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--metp-*`` argument group to Megatron's parser and return the parser."""
    group = parser.add_argument_group(
        title="METP (memory-efficient tensor parallelism)",
        description="Weights and sequence of every transformer layer sharded over one ring of "
                    "GPUs (megatron-metp). METP uses Megatron's context-parallel dimension.")
    group.add_argument(
        "--metp-parallel-size", type=int, default=1,
        help="Number of GPUs in a METP ring (p). Each rank holds 1/p of every linear weight of "
             "the transformer layers (on top of TP) and 1/p of the sequence; weight shards and "
             "K/V blocks travel around the ring. World size must be divisible by "
             "TP x METP x PP, --seq-length by 2 x METP. --context-parallel-size c is the outer "
             "factor (the sequence over p x c ranks). With --num-experts E the experts are "
             "sharded over the ring (expert-model-parallel size p, E divisible by p). Cannot be "
             "combined with --sequence-parallel (with TP > 1). 1 (default) disables METP.")
    group.add_argument(
        "--metp-disable-weight-ring", action="store_true",
        help="Ring self-attention baseline: keep the linear weights replicated over the METP "
             "group (sharded by TP only) and ring only K/V blocks in attention.")
    group.add_argument(
        "--metp-attention-kernel", choices=ATTENTION_KERNELS, default="auto",
        help="Block attention kernel of the K/V ring: cudnn (torch's SDPA cuDNN ops, GPU), "
             "flash_attn_3 (FlashAttention-3, Hopper, installed), flash_attn (FlashAttention-2, "
             "installed), torch_flash (PyTorch's fused flash kernel), reference (plain PyTorch, "
             "stores one score block). auto (default) picks the best available, or "
             "$METP_ATTENTION_KERNEL; the choice is logged once ([METP] attention kernel: ...).")
    group.add_argument(
        "--metp-keep-intermediate", action="store_true",
        help="Keep each MLP weight shard's intermediate f(x W1_j) for backward instead of "
             "recomputing it (faster, more activation memory).")
    group.add_argument(
        "--metp-vocab-parallel", action="store_true",
        help="Shard the word embedding and the output layer by vocabulary over TP x METP too, "
             "and compute the loss with the output-layer shards on the ring (online "
             "log-sum-exp): no rank holds a whole table or full-vocabulary logits. Megatron "
             "pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP x METP.")
    group.add_argument(
        "--metp-offload-activations", nargs="?", const=True, default=False, metavar="N",
        type=_offload_layers_arg,
        help="Copy what the transformer layers keep for backward to pinned host memory as each "
             "layer finishes its forward (side CUDA stream) and bring layer l-1's back while "
             "layer l runs its backward: the GPU holds two layers' saved tensors (with "
             "--recompute-granularity full: two layer inputs), the host the rest. N: offload "
             "only the first N layers of each pipeline stage and keep the last ones on the GPU "
             "(when the node's host memory cannot hold every layer; metp plan says how many it "
             "holds); no N: every layer. Works with and without METP; replaces Megatron's "
             "--cpu-offloading, which cannot be combined with recompute.")
    group.add_argument(
        "--metp-packed-layout", choices=("dual_chunk", "balanced"), default="dual_chunk",
        help="With --reset-attention-mask: how the packed documents' tokens are spread over the "
             "METP ring. dual_chunk (default): Megatron's CP split of the whole sequence. "
             "balanced: documents of at least 2 x METP x 128 tokens are dual-chunked over the "
             "ring on their own, the rest together, so every rank gets the same attention work "
             "(the model's token inputs move there with one all-gather per micro-batch, the "
             "per-token loss comes back).")
    group.add_argument(
        "--metp-mock-max-document-length", type=int, default=None, metavar="N",
        help="With --mock-data: Megatron's mock dataset draws its document lengths (each "
             "document ends with an EOD token) uniformly from [1, N) instead of [1, 4096), so "
             "that short sequences hold several documents (tests and demos of "
             "--reset-attention-mask / --eod-mask-loss). Works with METP on or off.")
    group.add_argument(
        "--metp-ring-timeout", type=float, default=None, metavar="SECONDS",
        help="Seconds a ring step (and each of Megatron-LM's barriers) waits for its peer "
             "before failing with a message naming the group, step and peer (the stalled rank "
             "and where it was last seen) (default: $METP_RING_TIMEOUT_S, else "
             "--distributed-timeout-minutes x 60, the one timeout of every process group; a "
             "longer value is refused).")
    group.add_argument(
        "--metp-rope-fp32-recipe", action="store_true",
        help="METP and the ring baseline keep Megatron's fp32 RoPE angles (fp32 positions times "
             "fp32 inv_freq: bit-compatible with a stock run) instead of exact ones (positions "
             "as int64, the angle reduced mod 2 pi before one fp32 rounding, for this rank's "
             "tokens only). Also $METP_ROPE_RECIPE=megatron. Refused when positions reach 2^24 "
             "(--seq-length > 16,777,216), where fp32 positions collide.")
    from .tiles import add_tile_args

    add_tile_args(group)
    from .yarn_args import offer_yarn_choice

    offer_yarn_choice(parser)  # core_v0.16.1: refused naming the release (yarn_args)
    return parser


def _offload_layers_arg(raw: str) -> int:
    """``--metp-offload-activations N``: a positive count (checked against the layers of a
    pipeline stage in :func:`validate_metp_args`)."""
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(
            f"N must be a positive number of layers per pipeline stage, got {raw!r}; give no N "
            f"to offload every layer")
    return int(raw)


def check_offload_layers_args(args) -> None:
    """``ValueError`` naming ``--metp-offload-activations N`` when ``N`` does not fit the job's
    pipeline stages or recompute chunks (before any model is built)."""
    n = getattr(args, "metp_offload_activations", False)
    if n is True or not n:
        return
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or \
            getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        raise ValueError(f"--metp-offload-activations {n} with a virtual pipeline: every model "
                         f"chunk of a stage has its own layers and offloader; give no N (every "
                         f"layer) or drop the virtual pipeline")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    layers = args.num_layers // pp
    for flag in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, flag, None):
            layers = min(layers, getattr(args, flag))
    from ..runtime.offload import check_offload_layers

    cfg = argparse.Namespace(recompute_granularity=getattr(args, "recompute_granularity", None),
                             recompute_method=getattr(args, "recompute_method", None),
                             recompute_num_layers=getattr(args, "recompute_num_layers", None))
    check_offload_layers(n, layers, cfg, what=f"--metp-offload-activations {n}")


def compose_extra_args_providers(*providers: Optional[Callable]) -> Callable:
    """One ``extra_args_provider`` that runs each given provider in order (``None`` skipped).

    Megatron's ``parse_args`` accepts a single provider; ``pretrain_gpt.py`` already passes
    modelopt's ``add_modelopt_args`` when nvidia-modelopt is installed. Each provider receives
    the parser and must return it.
    """
    active = [p for p in providers if p is not None]
    for p in active:
        if not callable(p):
            raise TypeError(f"extra_args_provider {p!r} is not callable")

    def extra_args_provider(parser):
        for p in active:
            returned = p(parser)
            if returned is None:
                raise TypeError(f"extra_args_provider {getattr(p, '__name__', p)!r} returned "
                                f"None; a provider must return the parser it was given")
            parser = returned
        return parser

    extra_args_provider.providers = tuple(active)
    return extra_args_provider


# ------------------------------------------------------------------------------ validation

def metp_enabled(args) -> bool:
    """Whether ``args`` ask for METP (``--metp-parallel-size`` > 1)."""
    return (getattr(args, "metp_parallel_size", 1) or 1) > 1


def validate_metp_args(args):
    """Map ``--metp-parallel-size p`` onto Megatron's context-parallel size; return ``args``.

    Called by the patched ``validate_args`` before Megatron computes the data-parallel size.
    Every problem of :func:`.checks.metp_arg_problems` is refused first, all in one ``ValueError``
    naming each flag to change (nothing in ``args`` changed). With ``p == 1`` (or no METP flags
    at all, e.g. another entry point) ``args`` is then returned untouched; with ``p > 1``
    ``args.context_parallel_size = p``. Calling it again on the same ``args`` is harmless.
    """
    from .checks import metp_arg_problems

    from .yarn_args import yarn_release_problem

    # YaRN's release check reads the installed Megatron-LM's parser output (inside the ranks only)
    from .ckpt_manifest import rank_checkpoint_problems  # the --load shards against their manifest

    problems = [x for x in (yarn_release_problem(args),) if x] + metp_arg_problems(args) + \
        rank_checkpoint_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    p = getattr(args, "metp_parallel_size", 1)
    from ..megatron.packing import apply_mock_document_length

    mock_note = apply_mock_document_length(args)
    if mock_note and getattr(args, "rank", 0) == 0:
        print(f"> METP: {mock_note}", flush=True)
    from .tiles import map_tile_args

    map_tile_args(args, p is not None and p > 1)
    if p is None or p == 1:
        return args
    cp = args.context_parallel_size
    if getattr(args, _MAPPED, False):
        cp = getattr(args, CP_OUTER, 1)  # mapped by an earlier call: Megatron's CP is p·c
    _map_kernel_flags(args)
    args.context_parallel_size = p * cp
    setattr(args, CP_OUTER, cp)
    setattr(args, _MAPPED, True)
    from .moe_args import fold_expert_parallel

    moe_note = fold_expert_parallel(args, p)  # the TransformerConfig's EP must be p too
    if getattr(args, "rank", 0) == 0:
        cp_note = (f" x --context-parallel-size {cp} (the outer factor: the sequence over all "
                   f"{p * cp} ranks, weights over the {p} of each METP ring)") if cp > 1 else ""
        print(f"> METP: --metp-parallel-size {p}{cp_note} runs on Megatron's context-parallel "
              f"dimension (context-parallel size {p * cp}); expert groups are folded onto the "
              f"METP rings in parallel_state only", flush=True)
        if moe_note:
            print(f"> METP: {moe_note}", flush=True)
    _fold_vocab_padding(args, p)
    return args


def _fold_vocab_padding(args, p: int) -> None:
    """Make Megatron pad the vocabulary to a multiple of ``divisible_by × TP × METP``.

    Megatron pads to ``--make-vocab-size-divisible-by × TP``; multiplying the first factor by
    ``p`` (once, however often this runs) pads as stock TP of size ``TP × METP`` does, so a METP
    run and its TP twin have the same embedding and output-layer shapes (and checkpoints), and
    with ``--metp-vocab-parallel`` every TP×METP rank the same number of rows.
    """
    base = getattr(args, _VOCAB_BASE, None)
    if base is None:
        base = getattr(args, "make_vocab_size_divisible_by", 128) or 1
        setattr(args, _VOCAB_BASE, base)
    args.make_vocab_size_divisible_by = base * p
    if getattr(args, "rank", 0) == 0:
        split = ("word embedding and output layer sharded over TP x METP"
                 if getattr(args, "metp_vocab_parallel", False) else
                 "as stock TP of size TP x METP pads it")
        print(f"> METP: vocabulary padded to a multiple of {base} x "
              f"{args.tensor_model_parallel_size} x {p} ({split})", flush=True)


def _metp_problems(args, p: int, tp: int) -> List[str]:
    """Everything in ``args`` METP cannot honour, each naming the flag and the fix."""
    out = []

    def flag(name, default=None):
        return getattr(args, name, default)

    if flag("use_legacy_models"):
        out.append("--use-legacy-models (METP needs megatron-core models)")
    experts = bool(flag("num_experts"))  # MoE: EP / ETP are checked by .moe_args
    if not experts and (flag("expert_model_parallel_size", 1) or 1) != 1:
        out.append(f"--expert-model-parallel-size {flag('expert_model_parallel_size')} (METP uses "
                   f"the expert groups for its weight gradients; leave it at 1)")
    etp = flag("expert_tensor_parallel_size")
    if not experts and etp is not None and etp != tp:
        out.append(f"--expert-tensor-parallel-size {etp} (must equal "
                   f"--tensor-model-parallel-size {tp} or be unset)")
    if flag("hierarchical_context_parallel_sizes"):
        out.append("--hierarchical-context-parallel-sizes")
    if flag("hybrid_context_parallel"):
        out.append("--hybrid-context-parallel")
    if flag("attention_dropout"):
        out.append(f"--attention-dropout {flag('attention_dropout')} (the METP K/V ring has no "
                   f"attention dropout; pass --attention-dropout 0)")
    if flag("window_size") is not None:
        out.append(f"--window-size {flag('window_size')} (sliding-window attention; the METP K/V "
                   f"ring attends causally over the whole sequence: drop it, which equals a "
                   f"window >= --seq-length)")
    if flag("spec") is not None:
        out.append("--spec (METP builds its own layer spec)")
    for name, opt in (("experimental_attention_variant", "--experimental-attention-variant"),
                      ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
                      ("mtp_num_layers", "--mtp-num-layers")):
        if flag(name) is not None:
            out.append(opt)
    for name, opt in (("multi_latent_attention", "--multi-latent-attention"),
                      ("qk_l2_norm", "--qk-l2-norm (METP's attention takes --qk-layernorm)"),
                      ("rotary_interleaved", "--rotary-interleaved"),
                      ("squared_relu", "--squared-relu (METP supports GeLU and --swiglu)")):
        if flag(name):
            out.append(opt)
    if not flag("no_persist_layer_norm", True) and \
            (flag("normalization") == "RMSNorm" or not _have_module("apex")):
        out.append("persistent layer norm: pass --no-persist-layer-norm (METP's layers use "
                   "Megatron's local norms, torch's LayerNorm/RMSNorm without apex)")
    shards = tp * p
    heads = flag("num_attention_heads")
    if heads is not None and heads % shards:
        out.append(f"--num-attention-heads {heads} (not divisible by TP x METP = {shards})")
    groups = flag("num_query_groups") if flag("group_query_attention") else None
    if groups is not None and groups % shards:
        out.append(f"--num-query-groups {groups} (not divisible by TP x METP = {shards})")
    ffn = flag("ffn_hidden_size")
    if ffn is not None and ffn % shards:
        out.append(f"--ffn-hidden-size {ffn} (not divisible by TP x METP = {shards})")
    timeout = flag("metp_ring_timeout")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        out.append(f"--metp-ring-timeout {timeout} (must be a positive, finite number of "
                   f"seconds)")
    else:  # the one timeout is --distributed-timeout-minutes; a longer ring timeout is refused
        from ..runtime.watchdog import megatron_lm_timeout_s

        try:
            megatron_lm_timeout_s(args)
        except ValueError as exc:
            out.append(str(exc))
    out.extend(_recompute_problems(args))
    out.extend(_kernel_problems(args))
    from .yarn_args import yarn_problems

    out.extend(yarn_problems(args))
    from ..megatron.packing_checks import packing_problems

    out.extend(packing_problems(args))
    return out


def _kernel_problems(args) -> List[str]:
    """Megatron's kernel and precision flags METP cannot honour (the others are mapped with a
    note by :func:`_map_kernel_flags`)."""
    out = []
    if getattr(args, "fp8", None):
        out.append(f"--fp8-format {args.fp8} (METP's shard GEMMs run in bf16/fp16 with fp32 "
                   f"accumulation, not under Transformer Engine's fp8 recipe; drop --fp8-format "
                   f"and the other --fp8-* flags)")
    if getattr(args, "fp4", None):
        out.append(f"--fp4-format {args.fp4} (no fp4 shard GEMMs in METP; drop it)")
    if getattr(args, "tp_comm_overlap", False):
        out.append("--tp-comm-overlap (Transformer Engine's userbuffer overlap of TP all-gathers "
                   "and reduce-scatters; METP has none of those and overlaps its own ring "
                   "transfers with compute already: drop it)")
    kernel = getattr(args, "metp_attention_kernel", "auto")
    if getattr(args, "use_flash_attn", False) and kernel not in ("auto", "flash_attn"):
        out.append(f"--use-flash-attn with --metp-attention-kernel {kernel} (with METP, "
                   f"--use-flash-attn means --metp-attention-kernel flash_attn; keep one)")
    if getattr(args, "use_flash_attn", False) and not _have_module("flash_attn"):
        out.append("--use-flash-attn (the flash-attn package is not installed here; drop the "
                   "flag: --metp-attention-kernel auto uses PyTorch's flash kernel)")
    return out


def _map_kernel_flags(args) -> None:
    """Flags METP honours by mapping them onto its own, each with a printed note."""
    from ..megatron.packing import map_packing_flags

    notes = map_packing_flags(args)
    if getattr(args, "use_flash_attn", False) and \
            getattr(args, "metp_attention_kernel", "auto") == "auto":
        args.metp_attention_kernel = "flash_attn"
        notes.append("--use-flash-attn: the METP K/V ring's block kernel is flash-attn "
                     "(--metp-attention-kernel flash_attn)")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        from ..megatron.gpu_stack import select_norm

        notes.append(select_norm("transformer_engine",
                                 getattr(args, "normalization", "LayerNorm")).note
                     + "; the embedding, output layer and final norm are Megatron's and follow "
                       "the flag")
    if getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size == 1:
        notes.append("--sequence-parallel with TP 1: Megatron turns it off itself (METP shards "
                     "the sequence over the METP ring anyway)")
    if getattr(args, "rank", 0) == 0:
        for note in notes:
            print(f"> METP: {note}", flush=True)


def _recompute_problems(args) -> List[str]:
    """Megatron's activation recompute/offload flags METP refuses (``--recompute-granularity
    full`` works: whole layers, rings included, re-run in backward)."""
    out = []
    # validate_metp_args runs before validate_args turns --recompute-activations into
    # recompute_granularity='selective' (and --cpu-offloading-num-layers into --cpu-offloading)
    if getattr(args, "recompute_granularity", None) == "selective" or \
            getattr(args, "recompute_activations", False):
        given = ("--recompute-activations" if getattr(args, "recompute_activations", False)
                 else "--recompute-granularity selective")
        modules = getattr(args, "recompute_modules", None)
        out.append(f"{given}{' --recompute-modules ' + ' '.join(modules) if modules else ''} "
                   f"(selective recompute, also --recompute-granularity selective / "
                   f"--recompute-activations with any --recompute-modules: METP's attention and "
                   f"MLP are fused ring ops that already recompute per weight shard, Q/K/V and "
                   f"the MLP intermediate, and never store s x s scores, so it would save "
                   f"nothing; use --recompute-granularity full with --recompute-method "
                   f"uniform|block and --recompute-num-layers N instead)")
    if getattr(args, "distribute_saved_activations", False):
        out.append("--distribute-saved-activations (it splits the checkpointed layer inputs over "
                   "TP only and needs TP > 1; with METP they are already sharded over the METP "
                   "ring: drop the flag)")
    if getattr(args, "cpu_offloading", False) or \
            (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        out.append("--cpu-offloading / --cpu-offloading-num-layers (Megatron's activation "
                   "offload; with METP use METP's own offload, --metp-offload-activations, "
                   "instead)")
    if getattr(args, "fine_grained_activation_offloading", False):  # core_v0.19.0's flag
        out.append("--fine-grained-activation-offloading (Megatron's per-module offload, not "
                   "wired into the METP layers; use --metp-offload-activations instead)")
    return out


def _have_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------------------- parallel state

def metp_expert_model_parallel_size(args) -> int:
    """The ``expert_model_parallel_size`` to give ``parallel_state.initialize_model_parallel``.

    ``args.expert_model_parallel_size`` unless METP is on, then the METP size: the expert
    groups then coincide with the METP groups and expert data parallelism with pure DP, which is
    where METP-sharded weights reduce their gradients. ``args`` itself is not changed (Megatron
    asserts ``--num-experts`` whenever ``args.expert_model_parallel_size > 1``); with
    ``--num-experts`` :func:`validate_metp_args` has already set it to the METP size
    (:func:`.moe_args.fold_expert_parallel`).

    Called on every rank right after ``init_process_group``, it also installs the last-seen
    records of Megatron-LM's loop (:func:`megatron_metp.megatron_lm.last_seen.install`: a rank
    waiting on a stuck or dead peer ends within the timeout, naming it), METP on or off.
    """
    from .last_seen import install

    install(args)
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if not metp_enabled(args):
        return ep
    if ep != 1 and not (getattr(args, "num_experts", None) and ep == args.metp_parallel_size):
        raise ValueError(f"--expert-model-parallel-size {ep} cannot be combined with "
                         f"--metp-parallel-size {args.metp_parallel_size}")
    return args.metp_parallel_size


_placement_checked = []


def _check_placement_once(groups) -> None:
    """At start-up (the first model chunk built), every rank together: no METP ring spans two
    nodes (:func:`megatron_metp.runtime.placement.check_metp_groups_on_one_node`)."""
    if _placement_checked:
        return
    from ..runtime.placement import check_metp_groups_on_one_node

    check_metp_groups_on_one_node(groups.metp)
    _placement_checked.append(True)


def check_metp_parallel_state(args) -> None:
    """Raise if ``parallel_state`` does not have the METP layout ``args`` ask for.

    Catches a checkout where only some of the patches are applied: the context-parallel group
    must be the METP ring, the expert-model-parallel group the same ranks, and expert data
    parallelism pure data parallelism.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    p = args.metp_parallel_size
    c = getattr(args, CP_OUTER, 1)
    fix = "apply all of patches/ with scripts/apply_patches.sh MEGATRON_LM_DIR"
    cp = ps.get_context_parallel_world_size()
    if cp != p * c:
        raise RuntimeError(f"parallel_state has context-parallel size {cp}, but "
                           f"--metp-parallel-size {p} x --context-parallel-size {c} is {p * c}: "
                           f"validate_args did not map METP onto context parallelism ({fix})")
    ranks = dist.get_process_group_ranks
    cp_ranks = ranks(ps.get_context_parallel_group())
    ep_ranks = ranks(ps.get_expert_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() != p or \
            (ep_ranks != cp_ranks if c == 1 else any(r not in cp_ranks for r in ep_ranks)):
        raise RuntimeError(f"parallel_state's expert-model-parallel groups are not the METP "
                           f"rings (expert-model-parallel size "
                           f"{ps.get_expert_model_parallel_world_size()}, METP {p}): the "
                           f"initialize_model_parallel call does not fold them ({fix})")
    edp = ps.get_expert_data_parallel_group()
    if (c == 1 and ranks(edp) != ranks(ps.get_data_parallel_group())) or \
            dist.get_world_size(edp) != c * ps.get_data_parallel_world_size():
        raise RuntimeError("expert data-parallel groups differ from pure data-parallel groups "
                           "(x the outer context-parallel factor); METP-sharded gradients "
                           "would be reduced over the wrong ranks")
    dp = getattr(args, "data_parallel_size", None)
    if dp is not None and dp != ps.get_data_parallel_world_size():
        raise RuntimeError(f"args.data_parallel_size {dp} differs from parallel_state's "
                           f"{ps.get_data_parallel_world_size()}")


# ------------------------------------------------------------------------------- the model

def wrap_gpt_builder(gpt_builder: Callable) -> Callable:
    """A builder with ``gpt_builder``'s signature that builds a METP ``GPTModel`` when
    ``args.metp_parallel_size > 1`` and otherwise calls ``gpt_builder`` unchanged."""

    @functools.wraps(gpt_builder)
    def builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        if not metp_enabled(args):
            model = gpt_builder(args, pre_process, post_process, vp_stage, config=config,
                                pg_collection=pg_collection)
        else:
            model = build_metp_gpt_model(args, pre_process, post_process, vp_stage,
                                         config=config, pg_collection=pg_collection)
            from ..megatron.streaming import prepare_recompute

            prepare_recompute(model.decoder)
        n_off = getattr(args, "metp_offload_activations", False)
        if n_off:
            from ..runtime.offload import ActivationOffloader

            ActivationOffloader(layers=None if n_off is True else n_off).attach(model.decoder)
        return model

    builder.metp_wrapped_builder = gpt_builder
    return builder


def _config_from_args(args):
    if getattr(args, "yaml_cfg", None) is not None:
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        return core_transformer_config_from_yaml(args, "language_model")
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def build_metp_gpt_model(args, pre_process, post_process, vp_stage=None, config=None,
                         pg_collection=None):
    """megatron-core ``GPTModel`` with the METP layer spec, built like ``gpt_builders.py``
    builds the stock one (same model arguments taken from ``args``)."""
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel

    from ..megatron.gpu_stack import select_norm
    from ..megatron.groups import METPGroups
    from ..megatron.init import initialize_like_tp
    from ..megatron.spec import get_gpt_layer_metp_spec
    from ..megatron.vocab import METPGPTModel
    from .tiles import tile_kwargs

    if config is None:
        config = _config_from_args(args)
    check_metp_parallel_state(args)
    from ..runtime.watchdog import megatron_lm_timeout_s

    groups = METPGroups.from_parallel_state(timeout_s=megatron_lm_timeout_s(args),
                                            context_parallel_size=getattr(args, CP_OUTER, 1))
    _check_placement_once(groups)
    from .last_seen import remember_groups

    remember_groups(groups)  # the pre-save agreement check of Megatron-LM's --save
    vocab_parallel = bool(getattr(args, "metp_vocab_parallel", False))
    if vocab_parallel and args.padded_vocab_size % groups.shards:
        raise ValueError(f"--metp-vocab-parallel: the padded vocabulary ({args.padded_vocab_size}) "
                         f"is not divisible by TP x METP = {groups.shards}; validate_args did not "
                         f"fold METP into --make-vocab-size-divisible-by (apply all of patches/)")
    weight_ring = not getattr(args, "metp_disable_weight_ring", False)
    kernel = getattr(args, "metp_attention_kernel", "auto")
    layer_kwargs = dict(
        weight_ring=weight_ring, normalization=args.normalization,
        kernel=None if kernel in (None, "auto") else kernel,
        keep_intermediate=bool(getattr(args, "metp_keep_intermediate", False)),
        norm=select_norm(getattr(args, "transformer_impl", "local"), args.normalization).module,
        **tile_kwargs(args))  # --metp-mlp-token-tile / --metp-moe-token-tiles as spec arguments
    if config.num_moe_experts:  # Megatron's MoELayer, experts over the METP ring (EP = p)
        from ..megatron.moe import (fold_expert_parallel_into_config,
                                    get_gpt_decoder_block_metp_spec)

        # validate_metp_args gave args (so this config) EP = p; a --yaml-cfg config gets it here
        fold_expert_parallel_into_config(config, groups.metp.size)
        spec = get_gpt_decoder_block_metp_spec(config, groups, vp_stage=vp_stage, **layer_kwargs)
    else:
        spec = get_gpt_layer_metp_spec(groups, qk_layernorm=bool(getattr(args, "qk_layernorm",
                                                                          False)),
                                       **layer_kwargs)
    if not dist.is_initialized() or dist.get_rank() == 0:
        mode = "METP (weight ring + K/V ring)" if weight_ring else "ring self-attention"
        cp_note = (f", context-parallel (outer) {groups.metp.sequence_ring.size // groups.metp.size}"
                   f" (K/V ring over {groups.metp.sequence_ring.size} ranks)"
                   if groups.metp.context is not None else "")
        print(f"building GPT model with {mode}: METP size {groups.metp.size}{cp_note}, TP size "
              f"{groups.tp_size}, attention kernel {kernel}, vocabulary "
              f"{'sharded over TP x METP' if vocab_parallel else 'sharded over TP only'}",
              flush=True)
    cls, extra = (METPGPTModel, {"metp_groups": groups}) if vocab_parallel else (GPTModel, {})
    model = cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        **extra,
    )
    from ..megatron.rope import use_angles_of_args

    use_angles_of_args(model, args)  # exact RoPE angles, this rank's tokens only
    if weight_ring:  # the same global weights as stock TP of size TP x METP
        initialize_like_tp(model, groups)
    if getattr(args, "reset_attention_mask", False):  # packed documents: boundaries from EOD
        from ..megatron.packing import DocumentBoundaries

        DocumentBoundaries(groups.metp.sequence_ring, full_rope=weight_ring,
                           layout=getattr(args, "metp_packed_layout", "dual_chunk")).attach(model)
    return model
