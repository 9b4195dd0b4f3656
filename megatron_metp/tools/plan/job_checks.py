"""The checks of a planned job: :func:`validate` raises a ``ValueError`` naming the flag of a
size or choice that cannot be laid out or planned (the MoE settings: :func:`.moe.check`).
"""

from __future__ import annotations

import math
from typing import Sequence

from .hardware import HARDWARE
from .model import (GiB, KEEP_AUTO, MODES, PEER_MODES, VOCAB_MODES, Job, Model, canonical,
                    layout)
from .mla import check as check_mla
from .moe import check as check_moe


#: the planner modes built with METP settings (:mod:`.settings`)
SETTINGS_MODES = ("tp", "tp-sp", "cp", "ring", "metp", "metp+vocab")


def validate(model: Model, job: Job, modes: Sequence[str] = MODES) -> None:
    """``ValueError`` naming the flag for sizes that cannot be laid out."""
    for flag, v in (("--hidden", model.hidden), ("--layers", model.layers),
                    ("--heads", model.heads), ("--ffn", model.ffn), ("--vocab", model.vocab),
                    ("--seq", model.seq), ("--query-groups", model.groups), ("--tp", job.tp),
                    ("--metp", job.metp), ("--cp", job.cp), ("--pp", job.pp), ("--dp", job.dp),
                    ("--micro-batch", job.micro_batch)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if job.microbatches < 0:
        raise ValueError(f"--microbatches must be >= 0, got {job.microbatches}")
    if not job.offload_prefetch and not job.offload:
        raise ValueError("--no-offload-prefetch (METP_OFFLOAD_PREFETCH=0) changes when "
                         "--offload-activations brings layers back; add --offload-activations "
                         "or drop it")
    if job.host_memory_gib is not None:
        if not job.host_memory_gib > 0:
            raise ValueError(f"--host-memory-gib must be a positive number of GiB, got "
                             f"{job.host_memory_gib!r}")
        if not job.offload:
            raise ValueError("--host-memory-gib bounds the pinned host buffers of "
                             "--offload-activations; add --offload-activations or drop "
                             "--host-memory-gib")
    if model.kv_channels is not None and (not isinstance(model.kv_channels, int) or
                                          model.kv_channels < 1):
        raise ValueError(f"--kv-channels must be a positive integer, got {model.kv_channels!r}")
    if model.kv_channels is None and model.hidden % model.heads:
        raise ValueError(f"--hidden {model.hidden} is not divisible by --heads {model.heads}")
    if model.heads % model.groups:
        raise ValueError(f"--heads {model.heads} is not divisible by --query-groups "
                         f"{model.groups}")
    if model.layers % job.pp:
        raise ValueError(f"--layers {model.layers} is not divisible by --pp {job.pp}")
    from ...runtime.overrides import parse_int

    if job.mlp_token_tile is not None:
        parse_int(job.mlp_token_tile, "--metp-mlp-token-tile", minimum=0,
                  unit="token rows per tile, 0 = whole")
    if job.moe_tile_count is not None:
        parse_int(job.moe_tile_count, "--metp-moe-token-tiles", minimum=1,
                  unit="token tiles per MoE layer, 1 = whole")
        if not model.moe:
            raise ValueError(f"--metp-moe-token-tiles {job.moe_tile_count}: the model has no "
                             f"experts (--num-experts); drop it")
        if not job.moe_token_tiles:
            raise ValueError(f"--metp-moe-token-tiles {job.moe_tile_count} with "
                             f"--no-moe-token-tiles: drop one (--no-moe-token-tiles is "
                             f"--metp-moe-token-tiles 1)")
    if job.kernel not in ("flash", "unfused"):
        raise ValueError(f"--kernel must be 'flash' or 'unfused', got {job.kernel!r}")
    from .rates import KERNEL_ALIASES, KERNELS, resolve_rates
    if job.attention_kernel is not None and job.attention_kernel not in KERNELS + tuple(
            KERNEL_ALIASES):
        raise ValueError(f"--kernel {job.attention_kernel!r}: choose from flash, "
                         f"{', '.join(KERNELS + tuple(KERNEL_ALIASES))}")
    if job.rates_file is not None or job.attention_kernel is not None:
        resolve_rates(job.hardware, job.attention_kernel, job.rates_file)
    if "alst" in modes and (job.pp > 1 or job.dp > 1):
        raise ValueError("--modes alst plans ALST's recipe over the job's TP × METP × CP GPUs "
                         "(Ulysses over all of them, ZeRO-3): drop --pp/--dp or mode alst")
    if job.recompute not in ("none", "selective", "full"):
        raise ValueError(f"--recompute must be none, selective or full, got {job.recompute!r}")
    if job.recompute_method not in ("uniform", "block"):
        raise ValueError(f"--recompute-method must be uniform or block, got "
                         f"{job.recompute_method!r}")
    if not isinstance(job.recompute_num_layers, int) or job.recompute_num_layers < 1:
        raise ValueError(f"--recompute-num-layers must be a positive integer, got "
                         f"{job.recompute_num_layers!r}")
    if job.recompute == "full" and job.recompute_num_layers > model.layers // job.pp:
        raise ValueError(f"--recompute-num-layers {job.recompute_num_layers} exceeds the "
                         f"{model.layers // job.pp} layers of a pipeline stage")
    if job.recompute == "full" and job.recompute_method == "uniform" and \
            (model.layers // job.pp) % job.recompute_num_layers:
        raise ValueError(f"--recompute-num-layers {job.recompute_num_layers} does not divide the "
                         f"{model.layers // job.pp} layers of a pipeline stage (uniform recompute "
                         f"checkpoints chunks of that many layers; Megatron fails otherwise)")
    if job.offload_layers is not None:
        if not job.offload:
            raise ValueError(f"offload_layers={job.offload_layers!r} without offload: pass "
                             f"--offload-activations {job.offload_layers} (it sets both)")
        from ...runtime.offload import check_offload_layers

        cfg = None
        if job.recompute == "full":
            from types import SimpleNamespace

            cfg = SimpleNamespace(recompute_granularity="full",
                                  recompute_method=job.recompute_method,
                                  recompute_num_layers=job.recompute_num_layers)
        check_offload_layers(job.offload_layers, model.layers // job.pp, cfg,
                             what="--offload-activations N")
    _check_keep(job, modes)
    if job.recompute == "selective" and any(canonical(m, job)[0] in ("ring", "cp")
                                            for m in modes):
        raise ValueError("--recompute selective: planned for stock TP / TP+SP (core attention) "
                         "and METP (core_attn: the attention output and LSE not kept, the K/V "
                         "ring forward re-run in backward; megatron/selective.py), not for the "
                         "ring or CP layers; use --recompute full, or --modes metp tp tp-sp")
    reserve = job.reserve_gib
    device = HARDWARE[job.hardware].memory_gib if job.hardware in HARDWARE else math.inf
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or \
            not 0 <= reserve < device:
        raise ValueError(f"--reserve-gib must be >= 0 and below the device's {device:g} GiB, "
                         f"got {reserve!r}")
    if job.precision != "bf16":
        raise ValueError(f"--precision {job.precision!r}: only bf16 is planned")
    if job.hardware not in HARDWARE:
        raise ValueError(f"--hardware {job.hardware!r}: choose from {', '.join(HARDWARE)}")
    if job.cp > 1:
        other = [m for m in modes if m not in VOCAB_MODES + PEER_MODES]
        if other:
            raise ValueError(f"--cp {job.cp} is METP × CP's outer context-parallel factor "
                             f"(Megatron-LM: --metp-parallel-size p --context-parallel-size c): "
                             f"it applies to mode metp only, not to {', '.join(other)}; pass "
                             f"--modes metp, or plan stock context parallelism as mode cp/ring "
                             f"with --metp as its CP size and --cp 1")
    if job.optimizer_offload and not job.distributed_optimizer:
        raise ValueError("--optimizer-cpu-offload needs --distributed-optimizer (Megatron-LM "
                         "asserts --use-precision-aware-optimizer, which needs "
                         "--use-distributed-optimizer); add --distributed-optimizer")
    if job.vocab_parallel:
        other = [m for m in modes if m not in VOCAB_MODES + PEER_MODES]
        if other:
            raise ValueError(f"--vocab-parallel splits METP's word embedding and output layer "
                             f"over TP×METP: it applies to mode metp only, not to "
                             f"{', '.join(other)}; drop --vocab-parallel, or pass --modes metp "
                             f"(mode metp+vocab plans the split next to the other modes)")
    for mode in modes:
        lay = layout(mode, job)
        check_moe(model, job, mode, lay)
        check_mla(model, job, mode, lay)
        mode = canonical(mode, job)[0]
        if lay.weight_shards == 1:
            shards_flag = "1"
        elif mode == "cp" or job.metp == 1:
            shards_flag = "--tp"
        elif job.tp > 1 and lay.weight_shards == job.width:
            shards_flag = "--tp × --metp"
        else:
            shards_flag = "--metp"
        if mode == "cp" and job.metp == 1:
            raise ValueError("--metp 1: context parallelism (mode cp) needs --metp > 1 "
                             "(it is the CP size); drop cp from --modes")
        for flag, count in (("--heads", model.heads), ("--query-groups", model.groups),
                            ("--ffn", model.ffn)):
            if mode == "alst" and flag != "--heads":
                continue  # Ulysses splits the heads (K/V heads replicated up to one per rank)
            if count % lay.weight_shards:
                raise ValueError(f"{flag} {count} is not divisible by {shards_flag} = "
                                 f"{lay.weight_shards} (mode {mode}: {lay.describe()})")
        if lay.c > 1 and model.seq % (2 * lay.c):
            flag = ("--metp × --cp" if mode == "metp" and job.cp > 1 else
                    "--metp" if mode in ("metp", "cp") else "--tp × --metp")
            raise ValueError(f"--seq {model.seq} is not divisible by 2 × {flag} = {2 * lay.c} "
                             f"(mode {mode} splits the sequence into 2·{lay.c} chunks)")
        if lay.sp and (model.seq // lay.c) % lay.t:
            raise ValueError(f"--seq {model.seq} is not divisible by the SP size --tp "
                             f"{'× --metp ' if mode == 'tp-sp' else ''}= {lay.t * lay.c} "
                             f"(mode {mode})")
        if mode in SETTINGS_MODES:  # METP's own rules, as training and Megatron-LM ask them
            from .settings import settings_for

            settings_for(mode, job, model=model)


def _check_keep(job: Job, modes: Sequence[str]) -> None:
    """``--keep-attention-output [N]`` (:mod:`.keep`): N a positive layer count (or
    :data:`.model.KEEP_AUTO`), under full recompute, with a METP mode to apply it to."""
    n = job.keep_attention_output
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or (n < 0 and n != KEEP_AUTO):
        raise ValueError(f"--keep-attention-output {n!r}: N is a positive number of layers per "
                         f"pipeline stage, or no N for as many as the host and the device hold")
    if job.recompute != "full":
        raise ValueError(f"--keep-attention-output with --recompute {job.recompute}: it keeps "
                         f"the attention output that full recompute would compute again; add "
                         f"--recompute full (RECOMPUTE_GRANULARITY=full), or drop it")
    if not any(canonical(m, job)[0] == "metp" for m in modes):
        raise ValueError(f"--keep-attention-output: METP layers only, and --modes "
                         f"{' '.join(modes)} has none (stock layers: --recompute selective "
                         f"recomputes the attention core only); add metp or metp+vocab to "
                         f"--modes, or drop it")
