"""Which RoPE angle recipe a METP model uses, and the refusal of Megatron's fp32 recipe past 2^24
positions (torch-free: the launcher's preflight checks these before any rank starts; the angles
themselves are in :mod:`.rope`)."""

from __future__ import annotations

from typing import Optional

from ..runtime import overrides

#: Where exact angles are used: every METP and ring-baseline model, unless the environment or
#: ``--metp-rope-fp32-recipe`` asks for Megatron's fp32 recipe (bit-compatibility with a stock run).
RECIPES = ("exact", "megatron")
#: the environment variable that picks Megatron's fp32 recipe for METP and ring models
RECIPE_ENV = "METP_ROPE_RECIPE"


def rope_recipe(fp32_recipe: bool = False) -> str:
    """``"megatron"`` when ``fp32_recipe`` (``--metp-rope-fp32-recipe``) or
    ``$METP_ROPE_RECIPE=megatron``, else ``"exact"``; a bad value of the variable is refused."""
    env = overrides.choice(RECIPE_ENV)  # one of RECIPES (exact, the default; megatron)
    return "megatron" if fp32_recipe or env == "megatron" else "exact"


#: fp32 represents every integer only below this: Megatron's recipe is refused when a job's
#: positions reach it (:func:`fp32_recipe_refusal`).
FP32_EXACT_POSITIONS = 1 << 24


def fp32_recipe_refusal(seq_length: int, why: str, fix: str) -> Optional[str]:
    """The refusal of a job whose RoPE positions (``0 … seq_length − 1``) reach 2^24 while its
    angles come from Megatron's fp32 recipe (``why``: which flag or variant puts it there;
    ``fix``: what to change), or ``None`` when its positions stay below 2^24."""
    if seq_length is None or int(seq_length) - 1 < FP32_EXACT_POSITIONS:
        return None
    return (f"--seq-length {int(seq_length):,}: positions reach 2^24 = "
            f"{FP32_EXACT_POSITIONS:,} and the RoPE angles would come from Megatron's fp32 recipe "
            f"({why}), where neighbouring positions collide (fp32 holds every integer only below "
            f"2^24) and angles round by up to pi; {fix}, or keep --seq-length <= "
            f"{FP32_EXACT_POSITIONS:,}")
