"""The dry run's static memory: parameters, the gradient buffer and the optimizer state of one rank,
from Megatron's settings (gradient dtype, optimizer, precision-aware dtypes, distributed optimizer
sharding over the right data-parallel group for METP-sharded and replicated weights), and the
micro-batches in flight on a pipeline stage (:mod:`.dry_run`)."""

from __future__ import annotations

from typing import Dict, List

__all__ = ["optimizer_bytes_per_param", "static_memory", "inflight_microbatches"]


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


def _nbytes_of(dtype) -> int:
    return _DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 4)


def optimizer_bytes_per_param(args) -> Dict[str, float]:
    """Bytes of optimizer state per parameter, before distributed-optimizer sharding.

    ``main``: fp32 (or ``--main-params-dtype``) master copy, kept when parameters are 16-bit;
    ``state``: Adam's two moments (``--exp-avg(-sq)-dtype`` with the precision-aware optimizer)
    or SGD's momentum buffer.
    """
    import torch

    half = args.params_dtype in (torch.bfloat16, torch.float16)
    aware = getattr(args, "use_precision_aware_optimizer", False)
    main = 0.0
    if half:
        main = float(_nbytes_of(args.main_params_dtype)) if aware else 4.0
    opt = getattr(args, "optimizer", "adam")
    if opt == "sgd":
        state = 4.0 if getattr(args, "sgd_momentum", 0.9) else 0.0
    else:  # adam and its variants keep two moments
        if aware:
            state = float(_nbytes_of(args.exp_avg_dtype) + _nbytes_of(args.exp_avg_sq_dtype))
        else:
            state = 8.0
    return {"main": main, "state": state}


def static_memory(args, params: List, world: Dict[str, int]) -> Dict[str, float]:
    """Parameters, gradient buffer and optimizer state of this rank, in bytes.

    METP-sharded weights (``allreduce=False``) go through Megatron's expert path: their
    distributed-optimizer shards span pure DP; every other parameter's span DP × CP (= DP × METP).
    """
    grad_bytes = 4 if getattr(args, "accumulate_allreduce_grads_in_fp32", False) else \
        _nbytes_of(args.params_dtype)
    per = optimizer_bytes_per_param(args)
    inst = max(1, getattr(args, "num_distributed_optimizer_instances", 1) or 1)
    n_dense = sum(p.numel() for p in params if getattr(p, "allreduce", True))
    n_sharded = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    if args.use_distributed_optimizer:
        dense_shards = max(1, world["dp"] * world["cp"] // inst)
        expert_shards = max(1, world["expert_dp"] // inst)
    else:
        dense_shards = expert_shards = 1
    opt_per_param = per["main"] + per["state"]
    # --optimizer-cpu-offload: that fraction of the optimizer's state lives on the host
    on_host = float(getattr(args, "optimizer_offload_fraction", 1.0) or 0.0) \
        if getattr(args, "optimizer_cpu_offload", False) else 0.0
    return {
        "params": float(sum(p.numel() * p.element_size() for p in params)),
        "grads": float((n_dense + n_sharded) * grad_bytes),
        "optimizer": (1.0 - on_host) * opt_per_param * (n_dense / dense_shards +
                                                         n_sharded / expert_shards),
        "optimizer_on_host_fraction": on_host,
        "grad_dtype": "fp32" if grad_bytes == 4 else str(args.params_dtype).replace("torch.", ""),
        "dense_shards": dense_shards,
        "expert_shards": expert_shards,
        "opt_bytes_per_param": opt_per_param,
        "params_dtype": str(args.params_dtype).replace("torch.", ""),
    }


def inflight_microbatches(args, pp_rank: int, pp_size: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once (1F1B: ``pp - stage``;
    interleaved: about ``pp`` more per extra chunk, bounded by the micro-batch count)."""
    if pp_size <= 1:
        return 1
    n = pp_size - pp_rank
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp:
        n = pp_size * vpp + (pp_size - 2 * pp_rank - 1)  # warm-up depth of the interleaved 1F1B
        n = max(1, n) // vpp  # per model chunk; summed over the chunks below
    return max(1, min(n, num_microbatches))
