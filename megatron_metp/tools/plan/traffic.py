"""Bytes one rank sends per layer (ring-algorithm convention), and the sequence length from which
METP sends fewer of them than another mode."""

from __future__ import annotations

import math
from typing import Dict, Optional

from . import mla
from .model import BF16, FP32, Job, Model, canonical, layout
from .streaming import streaming_applies, streaming_traffic
from .tiles import mlp_tile_count


def traffic_per_layer(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> Dict[str, float]:
    """Bytes one rank sends per layer in one forward+backward (ring convention: a send ``N``,
    all-reduce ``2(p−1)/p·N``, all-gather / reduce-scatter / broadcast / reduce ``(p−1)/p·N``).
    The vocabulary split adds no per-layer traffic (its rings run once per step, at the head)."""
    mode, job = canonical(mode, job)
    s = model.seq if seq is None else seq
    lay = layout(mode, job)
    t, c = lay.t, lay.c
    b = job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hk = G * d
    hq = A * d
    k = 2 if model.swiglu else 1
    n = s * b // c
    out: Dict[str, float] = {}
    N = n * h * BF16  # one activation [tokens, h] of this rank's tokens
    if t > 1:
        if lay.sp:
            out["TP+SP: all-gather/reduce-scatter, 5 per block"] = 2 * 5 * (t - 1) * N / t
        else:
            out["TP: all-reduce fwd + bwd, per block"] = 2 * 4 * (t - 1) * N / t
    if mode in ("ring", "cp") and model.mla:  # every head's up-projected K/V (.mla)
        out["K/V ring: fwd K/V, bwd K/V + fp32 dK/dV"] = mla.ring_bytes(model, mode, n, c, t=t)
    elif mode in ("ring", "cp"):
        kva = 2 * n * (hk // t) * BF16
        out["K/V ring: fwd K/V, bwd K/V + fp32 dK/dV"] = 4 * (c - 1) * kva
    if mode == "metp" and not model.mla and streaming_applies(job, lay, mode):  # the streaming layer op
        out.update(streaming_traffic(model, job, lay, n)["layer"])
        return out
    if mode == "metp":
        p = lay.p  # METP group: weights; the K/V ring of each head group runs over c = p·cp
        sh = t * p
        wa = ((hq + 2 * hk) * h + h * hq) // sh * BF16
        wm = (k * F * h + F * h) // sh
        kv = 2 * n * (hk // sh) * BF16
        if model.mla:  # the latent ring, once per head group (.mla)
            wa = mla.attention_elements(model)[0] // sh * BF16
            kv = mla.ring_bytes(model, mode, n, c, p=p) / (4 * p * (c - 1) or 1)
        out["attention weights: bcast fwd+bwd, fp32 reduce"] = 4 * (p - 1) * wa
        out["attention K/V ring (every head group)"] = 4 * p * (c - 1) * kv
        # token tiles (.tiles): the MLP's ring goes round once per tile
        tiles = mlp_tile_count(n, h, F // sh, k, job.keep_intermediate, job.mlp_token_tile)
        out["MLP weight ring fwd+bwd, fp32 gradient ring"] = \
            tiles * (p - 1) * (2 * wm * BF16 + wm * FP32)
    return out


def forward_traffic_per_layer(model: Model, job: Job, mode: str,
                              seq: Optional[int] = None, kept: bool = False) -> float:
    """Bytes one rank sends in one layer's *forward* (what a full recompute sends again): the
    forward shares of :func:`traffic_per_layer`'s terms (TP / TP+SP: half; the K/V ring: the K/V
    blocks; METP: one weight broadcast, one K/V pass per head group, one bf16 weight ring).

    ``kept``: a layer that keeps its attention output (:mod:`.keep`) runs no K/V ring in its
    re-forward (its weight rings run again: the projections re-form q, K, V), and a streaming
    layer that keeps it runs no recompute step at all (its backward forms q, K, V with the
    weights its backward passes bring anyway): nothing again."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    if mode == "metp" and not model.mla and streaming_applies(job, lay, mode):  # its recompute: the attention's
        if kept:
            return 0.0
        s = model.seq if seq is None else seq
        return sum(streaming_traffic(model, job, lay, s * job.micro_batch // lay.c)[
            "recompute"].values())
    out = traffic_per_layer(model, job, mode, seq)
    total = 0.0
    for key, v in out.items():
        if key.startswith("TP"):
            total += v / 2
        elif key.startswith("K/V ring"):
            total += 0.0 if kept else v / 4
        elif key.startswith("attention K/V"):
            total += 0.0 if kept else v / 4
        elif key.startswith("attention weights"):
            total += v / 4
        elif key.startswith("MLP weight ring"):
            total += v * BF16 / (2 * BF16 + FP32)
    return total


def crossover_seq(model: Model, job: Job, versus: str = "tp-sp") -> Optional[int]:
    """Smallest sequence length from which METP sends no more bytes per layer than ``versus``
    (both are affine in ``s``), or None when METP's slope is not smaller."""
    s1, s2 = 2 * job.width * 64, 2 * job.width * 128
    f = lambda m, s: sum(traffic_per_layer(model, job, m, s).values())  # noqa: E731
    a1, a2 = f("metp", s1), f("metp", s2)
    b1, b2 = f(versus, s1), f(versus, s2)
    slope_m, slope_v = (a2 - a1) / (s2 - s1), (b2 - b1) / (s2 - s1)
    if slope_v <= slope_m:
        return None
    s = (a1 - b1) / (slope_v - slope_m) + s1
    return max(0, int(math.ceil(s)))
