"""``metp``: plan a METP job (``metp plan``), measure one rank of it on a CPU (``metp measure``),
bring Hugging Face checkpoints in and out (``metp hf``).

::

    metp plan --preset gpt-7b --seq 131072 --tp 1 --metp 8 --hardware A100-80GB --png plan.png
    metp plan --config configs/gpt-7b-128k-metp8.sh --kernel unfused --distributed-optimizer
    metp plan --preset gpt-7b --seq 131072 --metp 8 --vocab-parallel   # METP + vocabulary split
    metp measure --preset gpt-7b --seq 32768 --layers 2 --modes tp-sp metp
    metp hf import --hf-dir HF_DIR --out CKPT            # = python -m megatron_metp.tools.hf

(``python -m megatron_metp.cli ...`` until the ``metp`` console script is installed.)

The model geometry comes from ``--preset`` (``gpt-1.3b``, ``gpt-7b``, ``gpt-13b``), then
``--config`` (key=value / YAML / the repo's ``configs/*.sh``), then the individual flags, each
overriding the previous. ``plan`` prints per-rank memory, traffic, overlap thresholds and the
longest sequence for every mode (see :mod:`megatron_metp.tools.plan`); ``measure`` builds the real
models for rank 0 under torch's fake process group and ``FakeTensorMode`` and prints the measured
peak next to the plan (see :mod:`megatron_metp.tools.measure`).
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
from dataclasses import asdict
from typing import List, Optional

from .helptext import FAMILIES_TEXT, plain


class _Plan:
    """:mod:`megatron_metp.tools.plan`, imported on first use: ``metp --help`` lists the
    subcommands without importing the planner (and torch) behind them."""

    def __getattr__(self, name: str):
        from . import plan

        return getattr(plan, name)


P = _Plan()
GiB = 2 ** 30
MiB = 2 ** 20
#: the subcommands ``metp --help`` lists (``hf`` goes to :mod:`.hf`'s own parser)
SUBCOMMANDS = {
    "plan": "per-rank memory, traffic, overlap, longest sequence; what to change when it does "
            "not fit; --reach: the best layouts on N GPUs",
    "measure": "measure rank 0 on CPU (fake group) next to the plan",
    "hf": "Hugging Face checkpoints in and out (" + FAMILIES_TEXT + "): metp hf "
          "{import,export,flags} (docs/huggingface.md)",
}


def _offload_count(raw: str) -> int:
    """``--offload-activations N``: a positive layer count (checked against the stage's layers
    by :func:`.plan.validate`)."""
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"N must be a positive number of layers per pipeline "
                                         f"stage, got {raw!r}; or give no N for every layer")
    return int(raw)


def _keep_count(raw: str) -> int:
    """``--keep-attention-output N``: a positive layer count per pipeline stage."""
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"N must be a positive number of layers per pipeline "
                                         f"stage, got {raw!r}; or give no N for as many as the "
                                         f"host and the device hold")
    return int(raw)


def _kernel_choices() -> List[str]:
    """``--kernel``: ``flash`` / ``unfused`` (the memory model), or a kernel by its planner name
    or its run-time name, both from ``ops/kernel_rates`` (``KERNELS``, ``SHORT_NAMES``:
    ``reference`` is ``unfused``)."""
    kernels, aliases = P.rates.KERNELS, P.rates.KERNEL_ALIASES
    return ["flash", "unfused"] + [k for k in kernels if k != "unfused"] + list(aliases)


def _add_common(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model (preset, then --config, then these flags)")
    g.add_argument("--preset", choices=sorted(P.PRESETS), default=None,
                   help="built-in GPT geometry (default gpt-7b unless --config gives one)")
    g.add_argument("--config", help="key=value / YAML file or a configs/*.sh of this repo (with "
                   "what scripts/pretrain_gpt.sh adds to it: the distributed optimizer, "
                   "NullTokenizer's end-of-document token, DP from the node count)")
    g.add_argument("--hidden", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--query-groups", type=int, help="GQA groups (default = heads)")
    g.add_argument("--ffn", type=int)
    g.add_argument("--vocab", type=int)
    g.add_argument("--seq", type=int, help="sequence length")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head width (Megatron's --kv-channels; default hidden / heads)")
    g.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="per-head q/k norms (Megatron's --qk-layernorm; Qwen3)")
    g.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="bias on q, k, v only (Megatron's --add-qkv-bias; Qwen2.5)")
    g.add_argument("--untie", action="store_true", default=None,
                   help="untied embedding and output layer (GPT ties them)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="Mixture-of-Experts: routed experts per MoE layer (Megatron's "
                        "--num-experts; presets qwen3-30b-a3b, mixtral-8x7b, glm-4.5-air, "
                        "gpt-oss-120b)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="one expert's FFN (default --ffn)")
    g.add_argument("--moe-layer-freq", type=int, default=None,
                   help="layers 0, N, 2N, ... are MoE, the others dense (default 1)")
    j = ap.add_argument_group("job")
    j.add_argument("--ep", type=int, default=None,
                   help="MoE: expert-parallel size of the stock modes, out of TP × CP × DP "
                        "(parallel folding; default 1); METP shards the experts over its group "
                        "(EP = --metp)")
    j.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"],
                   default=None, help="MoE token dispatcher (default allgather, Megatron's)")
    j.add_argument("--moe-imbalance", type=float, default=None,
                   help="MoE load imbalance: the busiest expert-parallel rank's routed rows over "
                        "the mean N·k (default 1: balanced; printed with the plan): its routed "
                        "rows in the memory, its expert GEMMs and dispatch in the time")
    j.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                   help="MoE: the experts as one grouped GEMM (every expert's backward at once: "
                        "n·k·(4h + 12f′) bytes untiled; timed as one kernel per GEMM); default "
                        "Megatron's SequentialMLP (one GEMM per expert)")
    j.add_argument("--no-moe-token-tiles", action="store_true",
                   help="METP: plan the routed part of each MoE layer over the rank's whole "
                        "tokens (default: MoE token tiles sized by METP_TILE_BUDGET_MIB)")
    j.add_argument("--metp-mlp-token-tile", type=int, default=None, metavar="ROWS",
                   help="METP: token rows per pass of the MLP's weight ring, as Megatron-LM's "
                        "flag of that name (0: whole; default: a --config's EXTRA_ARGS or "
                        "METP_MLP_TOKEN_TILE, else $METP_MLP_TOKEN_TILE, else auto from "
                        "METP_TILE_BUDGET_MIB)")
    j.add_argument("--metp-moe-token-tiles", type=int, default=None, metavar="TILES",
                   help="METP: token tiles of every MoE layer, as Megatron-LM's flag of that "
                        "name (1: whole; default: a --config's EXTRA_ARGS, else "
                        "$METP_MOE_TOKEN_TILES, else auto from METP_TILE_BUDGET_MIB)")
    j.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    j.add_argument("--metp", type=int, help="METP / ring / CP size (default 8)")
    j.add_argument("--cp", type=int,
                   help="METP × CP: the outer context-parallel factor c (Megatron-LM "
                        "--context-parallel-size c with --metp-parallel-size p: the sequence "
                        "over p·c ranks, the weights over p; world = TP×METP×CP×PP×DP; mode "
                        "metp only; default 1)")
    j.add_argument("--pp", type=int, help="pipeline stages (default 1)")
    j.add_argument("--dp", type=int, help="data-parallel size (default 1)")
    j.add_argument("--micro-batch", type=int, help="micro-batch size (default 1)")
    j.add_argument("--microbatches", type=int, default=0,
                   help="micro-batches per iteration (PP in-flight count; default: a --config's "
                        "GLOBAL_BATCH_SIZE / (micro-batch x DP), else fill the pipe)")
    j.add_argument("--kernel", choices=_kernel_choices(),
                   default=None,
                   help="attention kernel (default flash; a configs/*.sh with "
                        "TRANSFORMER_IMPL=local plans stock layers unfused, as Megatron's local "
                        "spec runs them). A flash kernel's name plans flash memory and that "
                        "kernel's published rates; the run-time order is cudnn > flash_attn_3 > "
                        "flash_attn > torch_flash > reference, here cudnn > fa3 > fa2 > "
                        "torch_flash > unfused (default: the fastest by the published rates "
                        "of ops/kernel_rates.py, as the run-time choice: fa3 on H100/H200, fa2 "
                        "on A100; mode alst: fa2, ALST's)")
    j.add_argument("--rates", default=None, metavar="FILE",
                   help="measured rates (JSON: hardware, kernel, gemm_tflops, "
                        "attention_fwd_tflops, attention_bwd_tflops, pcie_gbs, source, "
                        "measured_at, optionally kernels: each measured kernel's rates; "
                        "benchmarks/gpu_check.py writes it) overriding the published table")
    j.add_argument("--keep-intermediate", action="store_true",
                   help="METP MLP keeps x·W1ᵀ instead of recomputing it in backward")
    j.add_argument("--distributed-optimizer", action="store_true")
    j.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                   help="activation recompute, as Megatron's --recompute-granularity (default "
                        "none; selective: core attention, stock TP/TP+SP and METP layers)")
    j.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: chunks of N layers (uniform, default) or the first N "
                        "layers of a stage (block), as Megatron's --recompute-method")
    j.add_argument("--recompute-num-layers", type=int, default=None,
                   help="N of --recompute-method (default 1)")
    j.add_argument("--offload-activations", nargs="?", const=True, default=None,
                   type=_offload_count, metavar="N",
                   help="what the layers keep for backward goes to host memory, layer by layer, "
                        "prefetched one layer ahead (Megatron-LM: --metp-offload-activations "
                        "[N]); N: only the first N layers of each pipeline stage, the rest kept "
                        "on the device; without N every layer, or as many as the node's host "
                        "memory holds (--host-memory-gib) when it cannot hold them all")
    j.add_argument("--keep-attention-output", nargs="?", const=-1, default=None,
                   type=_keep_count, metavar="N",
                   help="METP, full recompute: the layers keep the attention output O (bf16) and "
                        "its log-sum-exp (fp32) for the backward instead of running the "
                        "attention forward again (Megatron-LM: --metp-keep-attention-output [N]); "
                        "on the host where the layer is offloaded, else on the device. N: the "
                        "first N layers of each pipeline stage; without N as many as the node's "
                        "host memory (offloaded layers) and the device (the others) hold")
    j.add_argument("--vocab-parallel", action="store_true", default=None,
                   help="METP only (Megatron-LM's --metp-vocab-parallel): split the word "
                        "embedding and output layer over TP×METP, loss on the vocabulary ring; "
                        "plans mode metp this way (default modes: metp only; the mode "
                        "metp+vocab shows the split next to the others without this flag)")
    j.add_argument("--optimizer-cpu-offload", action="store_true", default=None,
                   help="Megatron's --optimizer-cpu-offload (offload fraction 1.0; needs "
                        "--distributed-optimizer): Adam's states and fp32 master weights on the "
                        "host (16 B per parameter of the rank's shard), none on the device")
    j.add_argument("--precision", default="bf16", help="only bf16 is planned")
    j.add_argument("--hardware", default="H100-80GB", choices=list(P.HARDWARE),
                   help="device preset (default H100-80GB)")
    j.add_argument("--no-offload-prefetch", action="store_true",
                   help="--offload-activations brings each layer back only when its backward "
                        "starts (one layer's saved tensors on the device instead of two; "
                        "METP_OFFLOAD_PREFETCH=0 for Megatron-LM)")
    j.add_argument("--host-memory-gib", type=float, default=None,
                   help="host RAM per node for --offload-activations' pinned buffers (default: "
                        "the hardware preset's, 2 TB for the DGX presets)")
    j.add_argument("--reserve-gib", type=float, default=2.0,
                   help="GiB held back for CUDA context, NCCL, fragmentation (default 2)")
    ap.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                    help=f"modes to show (default all: {' '.join(P.MODES)}; cp only with tp>1; "
                         f"alst (ALST's published recipe on the same GPUs) on request; "
                         f"metp only with --vocab-parallel; metp measure --config: only the "
                         f"mode the config runs)")
    ap.add_argument("--json", help="also write the results as JSON")


def _config_name(config: str) -> str:
    """A ``--config``'s model name: its file name for a config of the repository's
    ``configs/``, else its absolute path."""
    path = os.path.abspath(config)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                                        "configs"))
    return os.path.basename(path) if os.path.dirname(path) == repo else path


def build_model(args) -> tuple:
    """``(Model, job fields from --config)`` from parsed arguments."""
    base = P.PRESETS[args.preset or "gpt-7b"]
    fields = asdict(base)
    job_fields = {}
    if args.config:
        mf, jf = P.from_config(args.config)
        fields.update(mf)
        job_fields.update(jf)
        if not args.preset:  # the config names the model (launch lines find its model file)
            fields["name"] = _config_name(args.config)
    for flag, key in (("hidden", "hidden"), ("layers", "layers"), ("heads", "heads"),
                      ("query_groups", "query_groups"), ("ffn", "ffn"), ("vocab", "vocab"),
                      ("seq", "seq"), ("swiglu", "swiglu"), ("kv_channels", "kv_channels"),
                      ("qk_layernorm", "qk_layernorm"), ("add_qkv_bias", "add_qkv_bias"),
                      ("num_experts", "experts"), ("moe_router_topk", "topk"),
                      ("moe_ffn_hidden_size", "moe_ffn"), ("moe_layer_freq", "moe_layer_freq")):
        v = getattr(args, flag)
        if v is not None:
            fields[key] = v
    if args.untie:
        fields["tied"] = False
    if fields.get("query_groups") == fields.get("heads"):
        fields["query_groups"] = None
    return P.Model(**fields), job_fields


def build(args) -> tuple:
    """``(Model, Job, modes)`` from parsed arguments; ``ValueError`` naming the flag."""
    model, job_fields = build_model(args)
    for flag in ("tp", "metp", "cp", "pp", "dp", "micro_batch", "vocab_parallel", "recompute",
                 "recompute_method", "recompute_num_layers", "ep", "moe_imbalance"):
        v = getattr(args, flag)
        if v is not None:
            job_fields[flag] = v
    if args.moe_token_dispatcher_type:
        job_fields["moe_dispatcher"] = args.moe_token_dispatcher_type
    if args.no_moe_token_tiles:
        job_fields["moe_token_tiles"] = False
    if args.metp_mlp_token_tile is not None:  # the job's flag (wins over a --config's)
        job_fields["mlp_token_tile"] = args.metp_mlp_token_tile
    if args.metp_moe_token_tiles is not None:
        job_fields["moe_tile_count"] = args.metp_moe_token_tiles
    if args.moe_grouped_gemm:
        job_fields["moe_grouped_gemm"] = True
    if args.offload_activations:
        job_fields["offload"] = True
        if args.offload_activations is not True:
            job_fields["offload_layers"] = args.offload_activations
        else:  # no N here: every layer (or the split the host holds), whatever --config says
            job_fields.pop("offload_layers", None)
    if args.keep_attention_output is not None:  # wins over a --config's
        job_fields["keep_attention_output"] = args.keep_attention_output
    if args.optimizer_cpu_offload:
        job_fields["optimizer_offload"] = True
    if args.no_offload_prefetch:
        job_fields["offload_prefetch"] = False
    global_batch = job_fields.pop("global_batch", None)  # --config's GLOBAL_BATCH_SIZE
    micro = args.microbatches
    if not micro and global_batch is not None:  # the iteration of the config's global batch
        micro = P.microbatches(global_batch, job_fields.get("micro_batch") or 1,
                               job_fields.get("dp") or 1)
    if args.kernel is not None and P.rates.kernel_name(args.kernel) == "unfused":
        args.kernel = "unfused"  # reference (the run-time name) plans as unfused
    named = args.kernel not in (None, "flash", "unfused")  # a flash kernel by name
    job = P.Job(microbatches=micro,
                kernel="flash" if named else (args.kernel or job_fields.pop("kernel", "flash")),
                attention_kernel=args.kernel if named else None, rates_file=args.rates,
                keep_intermediate=args.keep_intermediate or job_fields.pop("keep_intermediate",
                                                                          False),
                distributed_optimizer=args.distributed_optimizer or
                job_fields.pop("distributed_optimizer", False), precision=args.precision,
                hardware=args.hardware, reserve_gib=args.reserve_gib,
                host_memory_gib=args.host_memory_gib, **job_fields)
    if args.modes:
        modes = args.modes
    elif job.vocab_parallel or job.cp > 1:
        modes = ["metp"]
    else:
        modes = [m for m in P.MODES if not (m == "cp" and (job.tp == 1 or job.metp == 1))]
        if model.moe:  # Megatron runs MoE with TP > 1 only with SP; --ep: a stock layout
            modes = [m for m in modes if (m != "tp" or job.width == 1) and
                     not (job.ep and m in P.VOCAB_MODES)]
        if model.mla:  # the ring baseline runs no MLA (plan/mla.py)
            modes = [m for m in modes if m != "ring"]
    for m in modes:
        if m not in P.MODES + P.PEER_MODES:
            raise ValueError(f"--modes: unknown mode {m!r}; choose from "
                             f"{', '.join(P.MODES + P.PEER_MODES)}")
    P.validate(model, job, modes)
    return model, job, modes


def build_from_argv(argv: List[str]):
    """``(Model, Job, modes)`` from ``metp plan`` arguments (e.g. ``["--config", path]``)."""
    ap = argparse.ArgumentParser(prog="metp plan")
    _add_common(ap)
    return build(ap.parse_args(list(argv)))


#: flags ``--reach`` searches over itself (refused next to it: each would be ignored)
_REACH_SEARCHED = ("seq", "tp", "metp", "cp", "pp", "dp", "recompute", "recompute_method",
                   "recompute_num_layers", "offload_activations", "optimizer_cpu_offload",
                   "vocab_parallel", "modes", "config")


def _width(args) -> Optional[int]:
    """The columns ``metp plan`` / ``metp measure`` fit their text to: 100
    (``textwidth.DEFAULT_WIDTH``), or none with ``--wide``."""
    from .plan.textwidth import DEFAULT_WIDTH

    return None if args.wide else DEFAULT_WIDTH


def cmd_reach(args) -> int:
    for f in ("png", "json"):
        if getattr(args, f, None):
            raise ValueError(f"--{f} writes a single plan's charts / figures; --reach prints "
                             f"its table only: drop --{f}, or plan one layout without --reach")
    given = [f for f in _REACH_SEARCHED if getattr(args, f, None) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag}: --reach searches every layout and option itself (TP, METP, "
                         f"CP, PP, DP, recompute, offload, optimizer CPU offload); drop {flag}, "
                         f"or plan that one layout without --reach")
    if args.keep_attention_output is not None:
        raise ValueError("--keep-attention-output: --reach finds the longest sequence, and "
                         "keeping the attention output only costs memory (it saves time); drop "
                         "it, or plan one layout with it without --reach")
    if not args.gpus:
        raise ValueError("--reach needs --gpus N (the GPUs of the job)")
    if args.kernel not in (None, "flash") or args.keep_intermediate or args.micro_batch not in \
            (None, 1) or args.precision != "bf16" or args.microbatches:
        raise ValueError("--reach plans micro-batch 1, bf16, flash kernels, the METP MLP "
                         "intermediate recomputed; drop --kernel / --keep-intermediate / "
                         "--micro-batch / --microbatches / --precision")
    for flag in ("metp_mlp_token_tile", "metp_moe_token_tiles"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}: --reach plans each layout with the "
                             f"auto tiles (they follow its tokens per rank); drop it, or plan "
                             f"one layout without --reach")
    model, _ = build_model(args)
    if args.ep is not None:
        raise ValueError("--ep: --reach searches the expert parallelism itself (stock: out of "
                         "TP × CP × DP; METP: multiples of METP); drop --ep")
    from .fastest_cli import moe_settings

    moe = moe_settings(args, model)
    res = P.reach(model, args.gpus, args.hardware, args.reserve_gib, moe=moe)
    print(P.reach_report(model, args.gpus, args.hardware, args.reserve_gib, top=args.reach_top,
                         res=res, width=_width(args)))
    if args.write_config:
        cand = P.search.best_launch(model, res)
        if cand is None:
            raise ValueError(f"--write-config {args.write_config}: no layout of METP or stock "
                             f"Megatron fits {model.name} on {args.gpus} GPUs; nothing written")
        m, j = P.search.launch_job(model, cand)
        title = (f"{model.name} at {cand.seq:,} tokens on {args.gpus} × {args.hardware}: "
                 f"{cand.describe()}; {P.fmt_bytes(cand.total)} per rank planned (written by "
                 f"metp plan --reach: the longest-reaching best layout)")
        with open(args.write_config, "w") as fh:
            fh.write(P.config_text(m, j, cand.mode, title))
        print(f"\nwrote {args.write_config}: scripts/pretrain_gpt.sh --config "
              f"{args.write_config}")
    return 0


def cmd_plan(args) -> int:
    if args.fastest:
        from .fastest_cli import check_args, cmd_fastest

        check_args(args)
        return cmd_fastest(args, build_model(args)[0], _width(args))
    if args.reach:
        return cmd_reach(args)
    if args.write_config:
        raise ValueError("--write-config writes the best layout of --reach or --fastest; add "
                         "--reach --gpus N (or --fastest --gpus N --seq S), or launch this plan "
                         "with the pretrain_gpt.sh line it prints")
    if args.gpus:
        raise ValueError("--gpus is the GPU count of --reach and --fastest; a single plan takes "
                         "the layout (--tp, --metp, --cp, --pp, --dp); add --reach or --fastest, "
                         "or drop --gpus")
    if args.config and not args.modes and _stock_cp(args.config) > 1 and \
            int(P.read_config(args.config).get("metp") or 1) <= 1:
        # a stock CP twin (TP × CP or CP alone) is one job: its own mode, as metp measure and
        # the agreement plan it (the other modes of its width may not divide its heads)
        args.modes = config_modes(args.config)
        print(f"plan: --config {args.config} runs mode {args.modes[0]} (--modes names others)",
              file=sys.stderr, flush=True)
    model, job, modes = build(args)
    print(P.report(model, job, modes, width=_width(args)))
    if args.png:
        paths = P.charts(model, job, args.png, modes)
        print("\nwrote " + ", ".join(paths))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(P.plan(model, job, modes), fh, indent=1)
        print(f"wrote {args.json}")
    return 0


def _stock_cp(config: str) -> int:
    """The stock context-parallel size of a config (``CP``; 1 when it has none)."""
    return int(P.read_config(config).get("cp") or 1)


def mode_of(job: "P.Job", config: Optional[str] = None) -> str:
    """The mode a config's rank 0 runs: METP (with the vocabulary ring when asked), a stock
    context-parallel twin (``CP > 1``: weights replicated, the K/V ring over the CP ranks: mode
    ``ring``), or a stock TP twin (TP+SP when TP > 1, as ``scripts/pretrain_gpt.sh`` sets
    sequence parallelism unless the config sets ``SEQUENCE_PARALLEL=0``)."""
    if config is not None and _stock_cp(config) > 1 and job.cp == 1:
        # (METP × CP configs have job.cp = CP: they run mode metp); TP × CP: mode cp
        return "ring" if job.tp == 1 else "cp"
    if job.metp > 1:
        return "metp"
    sp = P.read_config(config).get("sequence_parallel") if config is not None else None
    return "tp-sp" if job.tp > 1 and sp in (None, "", 1, "1") else "tp"


def model_job(config: str):
    """``(Model, Job)`` of a ``configs/*.sh``, as ``metp plan --config`` builds them (a stock
    CP twin's CP size is the ring size)."""
    kv = P.read_config(config)
    argv = ["--config", config]
    if _stock_cp(config) > 1 and int(kv.get("metp") or 1) <= 1:
        # a stock CP twin, TP × CP or CP alone: its own mode only (the other modes' sizes may not
        # divide: TP 32 over 8 query groups for a CP 32 twin)
        argv += ["--modes", "cp" if int(kv.get("tp") or 1) > 1 else "ring"]
    model, job, _ = build_from_argv(argv)
    return model, job


def config_modes(config: str) -> List[str]:
    """The mode a ``configs/*.sh`` job runs, as a list (``metp measure --config`` without
    ``--modes``): a config is one job, so measure its layout (:func:`mode_of`, the mode
    the dry run is compared with), not every mode of its width as ``metp plan --config`` shows
    them (those may not even divide: TP 32 over a CP 32 twin's 8 query groups)."""
    return [mode_of(model_job(config)[1], config)]


def cmd_measure(args) -> int:
    from . import measure as M
    from . import measure_table as T

    if args.config and not args.modes:
        args.modes = config_modes(args.config)
        print(f"measure: --config {args.config} runs mode {args.modes[0]} (--modes "
              f"{' '.join(P.MODES)} measures the others)", file=sys.stderr, flush=True)
    model, job, modes = build(args)
    t0 = time.perf_counter()
    results = M.measure(model, job, modes, jobs=args.jobs, timeout=args.timeout,
                        cpu_matmul=args.cpu_matmul, measure_layers=args.measure_layers,
                        measure_tiles=args.measure_tiles)
    print(T.measure_table(model, job, modes, results, width=_width(args)))
    tail = T.notes(model, job, modes, results, width=_width(args))
    if tail:
        print(tail)
    print(f"\n{len(results)} measurements in {time.perf_counter() - t0:.1f} s")
    if args.json:
        out = []
        for mode, r in zip(modes, results):
            mem = P.memory(model, job, mode)
            out.append(dict(r, planned_measured_part=mem.measured_part,
                            planned_optimizer=mem.static["optimizer"]))
        with open(args.json, "w") as fh:
            json.dump({"model": asdict(model), "job": asdict(job), "results": out}, fh, indent=1)
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in results) else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["hf"]:  # metp hf import|export|flags: Hugging Face checkpoints in and out
        from .hf import main as hf_main

        return hf_main(argv[1:], prog="metp hf")
    ap = argparse.ArgumentParser(prog="metp", description=plain(__doc__.split("\n\n")[0]))
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    if argv[:1] not in (["plan"], ["measure"]):  # --help, or a usage error: no planner needed
        for name, text in SUBCOMMANDS.items():
            sub.add_parser(name, help=text)
        ap.parse_args(argv)
        return 2  # not reached: argparse exits on --help and on a missing / unknown command
    pl = sub.add_parser("plan", help=SUBCOMMANDS["plan"],
                        description=plain(P.__doc__.split("\n\n")[0]))
    _add_common(pl)
    pl.add_argument("--png", help="write memory-vs-sequence (PATH) and longest-sequence "
                                  "(PATH-longest.png) charts")
    pl.add_argument("--reach", action="store_true",
                    help="search every valid layout of METP (TP×METP×CP×PP×DP) and of stock "
                         "Megatron (TP+SP×CP×PP×DP) on --gpus GPUs, with recompute none / full "
                         "/ full + offload and optimizer CPU offload off / on, and print the "
                         "longest sequence of each family's best layouts")
    pl.add_argument("--fastest", action="store_true",
                    help="at --seq S on --gpus N: search every valid layout of METP, stock "
                         "Megatron and ALST's recipe with recompute none / selective / full / "
                         "block N / full keeping the attention output, activation and optimizer "
                         "CPU offload, and print each family's fastest layout that fits (time "
                         "per sequence, tokens/s and model TFLOP/s per GPU, flags, launch line)")
    pl.add_argument("--wide", action="store_true",
                    help="print the table with every mode's column side by side and every line "
                         "whole (default: fit 100 columns: the table in blocks of columns, long "
                         "lines wrapped)")
    pl.add_argument("--gpus", type=int, default=None,
                    help="GPUs of the job (--reach, --fastest)")
    pl.add_argument("--reach-top", type=int, default=3,
                    help="layouts shown per family (--reach, --fastest; default 3)")
    pl.add_argument("--write-config", metavar="FILE", default=None,
                    help="--reach: write the best layout of METP or stock Megatron (the longer "
                         "sequence); --fastest: the faster of the two; as a configs/*.sh-style "
                         "file for scripts/pretrain_gpt.sh --config FILE (metp plan --config "
                         "FILE plans it again)")
    ms = sub.add_parser("measure", help=SUBCOMMANDS["measure"])
    _add_common(ms)
    ms.add_argument("--jobs", type=int, default=1, help="measurements at once (default 1)")
    ms.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    ms.add_argument("--measure-layers", default="auto", metavar="{auto,full,N}",
                    help="'full' measures every layer of the stage; N measures N-1 and N layers "
                         "and extrapolates linearly; 'auto' (default) is full up to 4 layers per "
                         "stage, else N=2 (as the Megatron-LM dry run)")
    ms.add_argument("--measure-tiles", default="sampled", choices=("sampled", "full"),
                    help="'sampled' (default) runs the first two and the last pass of each "
                         "repeating tile loop of the streaming METP layer (every pass allocates "
                         "the same; the traffic counts every pass) and one step of each run of "
                         "like K/V ring steps; 'full' runs every pass and step")
    ms.add_argument("--wide", action="store_true",
                    help="print the table with every column side by side, one line per mode, "
                         "and every line whole (default: fit 100 columns: the table in blocks of "
                         "columns, long lines wrapped)")
    ms.add_argument("--cpu-matmul", action="store_true",
                    help="keep the METP ops' CPU matmul branch (default: emulate the CUDA one)")
    args = ap.parse_args(argv)
    try:
        return cmd_plan(args) if args.cmd == "plan" else cmd_measure(args)
    except ValueError as exc:
        print(f"metp {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
