"""Which planned layouts have exact RoPE positions past 2^24 (issue 29, ``docs/positions.md``).

METP and the ring baseline compute their RoPE angles exactly for every position below 2^31
(:func:`megatron_metp.ops.rope.rope_angles`); stock Megatron (TP, TP+SP, CP) and stock-kernel
ring schemes such as ALST keep Megatron's fp32 recipe, whose positions collide past 2^24, and
``pretrain_gpt.sh`` refuses such a job. The reach search caps those layouts at 2^24 tokens
(positions 0 … 2^24 − 1) and says why (:mod:`.search`); ``metp plan`` says which modes would
be refused at a longer ``--seq``.
"""

from __future__ import annotations

from typing import Optional

from ...ops.rope_recipe import FP32_EXACT_POSITIONS

#: Planner modes whose models take exact angles (METP, its vocabulary ring, the ring baseline).
EXACT_MODES = ("ring", "metp", "metp+vocab")

#: Why the other modes stop at 2^24, and the fix (one line of the reports).
REASON = (f"Megatron's fp32 RoPE recipe, whose positions collide past 2^24 = "
          f"{FP32_EXACT_POSITIONS:,} (pretrain_gpt.sh refuses such a job); METP and the ring "
          f"baseline compute exact angles")


def exact_positions(mode: str, job=None) -> bool:
    """Whether a ``mode`` job's RoPE angles are exact at every position (``job`` reserved for
    per-job recipes; the planner assumes METP's default, exact angles)."""
    return mode in EXACT_MODES


def refused_modes(modes, job, seq: int):
    """The ``modes`` a job of ``seq`` tokens would be refused in (positions reach 2^24 on
    Megatron's recipe)."""
    return [m for m in modes if (position_cap(m, job) or seq) < seq]


def position_cap(mode: str, job=None) -> Optional[int]:
    """The longest sequence ``mode`` may train (``FP32_EXACT_POSITIONS`` tokens on Megatron's
    recipe), or ``None`` when its positions are exact."""
    return None if exact_positions(mode, job) else FP32_EXACT_POSITIONS


__all__ = ["EXACT_MODES", "FP32_EXACT_POSITIONS", "REASON", "exact_positions", "position_cap", "refused_modes"]
