"""The full-overlap thresholds of METP's rings: tokens per rank above which one step's compute
hides the next step's transfer."""

from __future__ import annotations

from typing import Dict

from .hardware import Hardware
from .model import Job, Model


def overlap_thresholds(model: Model, job: Job, hw: Hardware, measured: bool = False) -> Dict[str, float]:
    """Tokens per rank above which one ring step's compute hides the next step's transfer.

    * MLP weight ring (DESIGN.md §1): a step computes ``2(k+1)·(s·b/p)·h·F/p`` FLOPs and receives
      ``(k+1)·h·F/p`` bf16 elements, so forward needs ``s·b/p ≥ F_rate/B``; the backward sends
      the weight and its fp32 gradient (3×) for ``(6k+4)/(2k+2)``× the FLOPs (recompute included).
    * Attention head-group weights: projections alone give the same ``s·b/p ≥ F_rate/B``.
    * K/V ring (one block of a head group per step; off-diagonal causal blocks are half full):
      ``2·n²·b·d·a_g`` FLOPs against ``4·n·b·d·g_g`` bytes, so ``s/p ≥ 2·(F_rate/B)·g/a``;
      backward ~2.5× the FLOPs for 3× the bytes.
    """
    rate = (hw.measured_tflops if measured and hw.measured_tflops else hw.bf16_tflops) * 1e12
    fb = rate / (hw.link_gbps * 1e9)
    k = 2 if model.swiglu else 1
    ratio = model.groups / model.heads
    return {
        "F/B (FLOP per byte)": fb,
        "MLP weight ring, forward: tokens/rank": fb,
        "MLP weight ring, backward: tokens/rank": fb * 6 * (k + 1) / (6 * k + 4),
        "attention weights: tokens/rank": fb,
        "K/V ring, forward: s/p": 2 * fb * ratio,
        "K/V ring, backward: s/p": 2 * fb * ratio * 3 / 2.5,
    }
