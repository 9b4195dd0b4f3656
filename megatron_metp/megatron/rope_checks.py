"""The RoPE-positions check of a Megatron-LM command line (issue 29, ``docs/positions.md``).

:func:`rope_reach_problems` reads ``args`` only and imports neither Megatron nor megatron-core,
so the same check runs in the launcher's preflight (:mod:`megatron_metp.megatron_lm.preflight`,
through :func:`megatron_metp.megatron_lm.checks.metp_arg_problems`) and inside the ranks
(Megatron-LM's ``validate_args``, through
:func:`megatron_metp.megatron_lm.validate.validate_metp_args`; :func:`.rope.check_args_reach`).
"""

from __future__ import annotations

from typing import List

from ..ops.rope_recipe import fp32_recipe_refusal, rope_recipe

__all__ = ["rope_reach_problems"]


def rope_reach_problems(args) -> List[str]:
    """Why ``args`` cannot run as asked, RoPE-wise: a job whose positions (``0 … --seq-length − 1``)
    reach 2^24 while its angles would come from Megatron's fp32 recipe (METP off,
    ``--metp-rope-fp32-recipe`` or ``METP_ROPE_RECIPE=megatron``, a RoPE variant the exact angles
    do not cover), and ``--metp-rope-fp32-recipe`` without METP; each names the flag and the fix.
    Empty when the job is fine (exact angles, or positions below 2^24)."""
    metp = (getattr(args, "metp_parallel_size", 1) or 1) > 1
    fp32 = bool(getattr(args, "metp_rope_fp32_recipe", False))
    if fp32 and not metp:
        return ["--metp-rope-fp32-recipe needs --metp-parallel-size > 1 (with METP off the RoPE "
                "angles are stock Megatron's already): drop the flag"]
    kind = getattr(args, "position_embedding_type", None)
    if kind not in ("rope", "yarn", "mrope"):
        return []  # no rotary angles (learned absolute positions are int64 indices)
    if not metp:
        why, fix = ("METP is off: stock Megatron's RotaryEmbedding", "run with "
                    "--metp-parallel-size > 1 (METP or --metp-disable-weight-ring: exact angles)")
    elif kind not in ("rope", "yarn"):
        why, fix = (f"--position-embedding-type {kind} is not covered by exact angles",
                    "use --position-embedding-type rope or yarn")
    else:
        try:
            recipe = rope_recipe(fp32)
        except ValueError as exc:  # a bad METP_ROPE_RECIPE
            return [str(exc)]
        if recipe != "megatron":
            return []
        why, fix = ("--metp-rope-fp32-recipe or METP_ROPE_RECIPE=megatron",
                    "drop --metp-rope-fp32-recipe and unset METP_ROPE_RECIPE (exact angles)")
    refusal = fp32_recipe_refusal(getattr(args, "seq_length", None), why, fix)
    return [refusal] if refusal else []
