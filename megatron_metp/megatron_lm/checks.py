"""Every METP precondition of a Megatron-LM command line, collected on a plain namespace.

:func:`metp_arg_problems` is what :func:`megatron_metp.megatron_lm.hooks.validate_metp_args`
refuses inside the ranks (all problems in one ``ValueError``) and what the launcher's preflight
(:mod:`megatron_metp.megatron_lm.preflight`) prints before any rank starts: the same checks,
reading ``args`` only, importing neither Megatron nor megatron-core.
"""

from __future__ import annotations

from typing import List

from ..megatron.packing_checks import mock_document_length_problems
from ..megatron.parallel import metp_config_problems
from .hooks import _MAPPED, CP_OUTER, _metp_problems, check_offload_layers_args
from .resume import resume_layout_problems
from ..megatron.rope_checks import rope_reach_problems
from .tiles import tile_arg_problems

__all__ = ["metp_arg_problems"]


def metp_arg_problems(args) -> List[str]:
    """Every METP precondition ``args`` break, each naming the flag and the fix (empty: fine).

    Reads ``args`` only (a Megatron ``Namespace`` or any object with the same attribute names;
    missing ones count as Megatron's defaults) and imports neither Megatron nor megatron-core,
    so the launcher's preflight (:mod:`megatron_metp.megatron_lm.preflight`) runs the same
    checks in one process before any rank starts. ``args.world_size`` is the job's rank count.
    """
    p = getattr(args, "metp_parallel_size", 1)
    out = list(resume_layout_problems(args))
    try:
        check_offload_layers_args(args)
    except ValueError as exc:
        out.append(str(exc))
    if getattr(args, "metp_offload_activations", False) and (
            getattr(args, "cpu_offloading", False) or
            (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0):
        out.append("--metp-offload-activations with --cpu-offloading: two activation "
                   "offloads; keep one (--metp-offload-activations also works with "
                   "--recompute-granularity full, Megatron's does not)")
    out.extend(mock_document_length_problems(args))
    out.extend(tile_arg_problems(args, p is not None and p > 1))
    out.extend(rope_reach_problems(args))
    if p is None or p == 1:
        if getattr(args, "metp_vocab_parallel", False):
            out.append("--metp-vocab-parallel needs --metp-parallel-size > 1 (with METP off the "
                       "vocabulary is Megatron's, split over TP only); drop the flag or set "
                       "--metp-parallel-size")
        return out
    tp = args.tensor_model_parallel_size
    cp = args.context_parallel_size
    if getattr(args, _MAPPED, False):
        cp = getattr(args, CP_OUTER, 1)  # mapped by an earlier call: Megatron's CP is p·c
    if cp > 1 and getattr(args, "metp_disable_weight_ring", False):
        out.append(f"--metp-disable-weight-ring (ring self-attention) with "
                   f"--context-parallel-size {cp}: the ring baseline runs over the METP group "
                   f"only; drop --context-parallel-size (or use stock --context-parallel-size "
                   f"without METP)")
    layout = metp_config_problems(
        world_size=args.world_size, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, metp_parallel_size=p,
        context_parallel_size=cp, seq_length=getattr(args, "seq_length", None),
        # Megatron switches sequence parallelism off by itself when TP is 1
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and tp > 1)
    out.extend(layout)
    if any("must be >= 1" in x for x in layout):
        return out  # no divisibility to check against a size below 1
    out.extend(f"--metp-parallel-size {p} cannot be used with: {problem}"
               for problem in _metp_problems(args, p, tp))
    out.extend(_moe_problems(args, p))
    return out


def _moe_problems(args, p: int) -> List[str]:
    """MoE with METP: megatron-core's table (:mod:`megatron_metp.megatron.moe_checks`, E % p
    included; the GPU-only kernels are refused on CPU ranks by :mod:`.cpu`) and the Megatron-LM
    flags beyond it (:mod:`.moe_args`)."""
    from ..megatron.moe_checks import moe_args_problems
    from .moe_args import release_moe_problems

    return moe_args_problems(args, p, on_cpu=False) + release_moe_problems(args, p)
