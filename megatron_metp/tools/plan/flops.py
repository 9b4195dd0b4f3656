"""FLOPs of one layer on one rank (:func:`layer_flops`): forward, backward and METP's per-shard
recompute, as :mod:`.cost` describes them; :mod:`.cost` and :mod:`.step_time` price them.
"""

from __future__ import annotations

from typing import Dict

from .mla import layer_flops as mla_flops
from .model import Job, Model, canonical, layout


def layer_flops(model: Model, job: Job, mode: str) -> Dict[str, float]:
    """Forward, backward and METP's own per-shard recompute FLOPs of one layer on one rank."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    t, c = lay.t, lay.c
    s, b = model.seq, job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    q, kv = A * d, G * d
    k = 2 if model.swiglu else 1
    n = s * b // c
    w_attn, w_mlp = h * (q + 2 * kv) + q * h, k * h * F + F * h
    attn = 2 * n * s * q / t
    gemm = 2 * n * (w_attn + w_mlp) / t
    fwd = gemm + attn
    if model.mla:  # multi-latent attention (.mla): its own widths and K/V up-projection
        m = mla_flops(model, n, s, t, lay.c if mode == "metp" else 0)
        gemm = 2 * n * w_mlp / t + m["gemm"]
        attn = m["core"]
        fwd = gemm + m["up"] + attn
        out = {"forward": fwd, "backward": 2 * gemm + 3 * m["up"] + 2.5 * attn,
               "METP per-shard recompute": 0.0,
               "attention forward": m["gemm"] + m["up"] + attn}
        if mode == "metp":  # the head group's queries again; x·W1ᵀ unless kept
            out["METP per-shard recompute"] = m[
                "q up-projection (re-formed per head group in backward)"] + \
                (0 if job.keep_intermediate else 2 * n * k * h * F / t)
        return out
    out = {"forward": fwd, "backward": 2 * gemm + 2.5 * attn, "METP per-shard recompute": 0.0,
           "attention forward": 2 * n * w_attn / t + 2 * n * s * q / t}
    if mode == "metp":  # Q/K/V always (ops/attention.py); x·W1ᵀ unless --keep-intermediate
        out["METP per-shard recompute"] = 2 * n * (h * (q + 2 * kv) +
                                                   (0 if job.keep_intermediate else k * h * F)) / t
    return out
