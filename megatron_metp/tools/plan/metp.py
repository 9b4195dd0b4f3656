"""Transients of a METP layer (``ops/mlp.py``, ``ops/attention.py``): the weight rings, the
fp32 accumulators and one head group's K/V ring, at each op's largest step; and the unfused
kernel's live score block."""

from __future__ import annotations

from typing import Dict, Optional

from .model import BF16, FP32, Job, Model
from .ring import ring_backward_buffers, ring_forward_buffers
from .tiles import mlp_tile_rows


def metp_phases(model, job, lay, n, S) -> Dict[str, Dict[str, float]]:
    """Backward transients of the last METP layer: the buffers ``ops/mlp.py`` and
    ``ops/attention.py`` allocate (see their docstrings and ``benchmarks/mlp_memory.py``'s
    ``metp_peak_model``), at each op's largest step. The ops' fp32-accumulating matmuls are taken
    on their CUDA branch (``addmm(out_dtype=fp32, out=acc)``: in place, no product temporary)."""
    t, p = lay.t, lay.p                # METP group: weights, weight ring, head groups
    R = lay.c                          # the K/V ring: METP × CP ranks (p without CP)
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hq, hk = A * d, G * d
    k = 2 if model.swiglu else 1
    sh = t * p
    f = F // sh                        # FFN units of one MLP shard
    hqg, hkg, Ag = hq // sh, hk // sh, A // sh  # one head group's widths
    Wm = k * f * h + h * f             # one MLP shard, elements
    Wa = (hqg + 2 * hkg) * h + h * hqg  # one head group's weights, elements
    ph: Dict[str, Dict[str, float]] = {}
    dxacc = {"dx accumulator (fp32)": FP32 * n * h}

    # MLP: weight ring (own packed + held, bf16), travelling gradient sum (two fp32 buffers),
    # then one shard's z (recomputed unless kept), f(z), d(f(z)) and dz (the dx / dW GEMMs
    # accumulate in place); token tiles (.tiles): per tile of Rm rows, the whole dx output kept
    Rm = mlp_tile_rows(n, h, f, k, job.keep_intermediate, job.mlp_token_tile)
    tiled = Rm < n
    z = 0 if job.keep_intermediate else BF16 * Rm * k * f
    a = BF16 * Rm * f
    dz = BF16 * Rm * k * f
    halves = 2 * BF16 * Rm * f if model.swiglu else 0
    ring = ({"MLP weight ring: own packed + held shard (bf16)": 2 * BF16 * Wm,
             "MLP gradient sum: two travelling buffers (fp32)": 2 * FP32 * Wm}
            if p > 1 else {"MLP gradient sum (fp32)": FP32 * Wm})
    if tiled:
        ring["MLP gradient sums of the tiles so far (fp32)"] = FP32 * Wm
    steps = [z + a + a + halves + dz,
             z + a + dz]
    mlp_dx = ({"dx output, filled tile by tile (bf16)": BF16 * n * h,
               f"dx accumulator of one tile of {Rm:,} rows (fp32)": FP32 * Rm * h}
              if tiled else dxacc)
    ph["MLP backward (last layer)"] = dict(mlp_dx, **ring, **{
        "one shard's z, f(z) and dz": max(steps)})

    # attention: head-group loop; per group recompute q, k, v, run the K/V ring backward, then
    # RoPE-transpose and join dq, dk, dv, and accumulate dW and dx in fp32
    base = {"(MLP and second-norm activations freed)":
            -(S["norm inputs (2 LayerNorms)"] + S["norm outputs (2 LayerNorms)"]
              + S["norm statistics (fp32)"]) / 2
            - S.get("MLP x·W1ᵀ of every shard (keep_intermediate)", 0)}
    common = dict(dxacc)
    if p > 1:
        common["head-group weights: own packed + 2 receive buffers (bf16)"] = 3 * BF16 * Wa
    common["head-group weight gradients: filling, in flight, kept (fp32)"] = \
        min(p, 3) * FP32 * Wa
    common["recomputed q, k, v heads-first (bf16)"] = BF16 * n * (hqg + 2 * hkg)
    if model.qk_layernorm:  # ops/head_norm.py: the block's pre-norm projection is kept
        common["pre-norm q, k, v of the head group (bf16, --qk-layernorm)"] = \
            BF16 * n * (hqg + 2 * hkg)
    common["o_g seq-first copy, d(o_g) (bf16)"] = 2 * BF16 * n * hqg
    # (the METP op holds both dK/dV sum buffers from its first off-diagonal step on; measured)
    ring_step = dict(common, **{"d(o_g) heads-first (bf16)": BF16 * n * hqg},
                     **ring_backward_buffers(n, hqg, hkg, Ag, R, job, off_diagonal_sums=2))
    grads32 = FP32 * n * (hqg + 2 * hkg)  # dq, dk, dv in fp32 (after RoPE: new dq, dk)
    rope_step = dict(common, **{"ring dq, dk, dv (fp32)": grads32,
                                "RoPE transpose of dq: temporaries and result (fp32)":
                                    4 * FP32 * n * hqg})
    join_step = dict(common, **{"RoPE-transposed dq, dk and dv (fp32)": grads32,
                                "dq reshaped (fp32)": FP32 * n * hqg,
                                "joined d(qkv) (fp32)": grads32})
    dx_step = dict(common, **{"RoPE-transposed dq, dk and dv (fp32)": grads32,
                              "d(qkv) (bf16)": BF16 * n * (hqg + 2 * hkg)})
    steps = [ring_step, rope_step, join_step, dx_step]
    if model.qk_layernorm:  # the per-head norm's backward, into d(qkv) in place
        steps.append(dict(common, **{"d(qkv) (bf16)": BF16 * n * (hqg + 2 * hkg),
                                     "q-norm output and input gradient (bf16)":
                                         2 * BF16 * n * hqg,
                                     "q-norm statistics (fp32)": 2 * FP32 * n * Ag}))
    step = max(steps, key=lambda d_: sum(d_.values()))
    ph["attention backward (last layer)"] = dict(base, **step)

    # forward of the last layer: fp32 output accumulator, weight buffers, one head group's
    # q, k, v and the K/V ring forward (the last group's output not stored yet) ...
    later = (-base["(MLP and second-norm activations freed)"]
             + BF16 * n * hqg + FP32 * n * Ag)
    fwd = {"(rest of the last layer not formed yet)": -later,
           "y accumulator (fp32)": FP32 * n * h,
           "recomputed q, k, v heads-first (bf16)": BF16 * n * (hqg + 2 * hkg)}
    if p > 1:
        fwd["head-group weights: own packed + 2 receive buffers (bf16)"] = 3 * BF16 * Wa
    fwd.update(ring_forward_buffers(n, hqg, hkg, Ag, R, job))
    ph["attention forward (last layer)"] = fwd
    # ... and the MLP forward: y in fp32 (accumulated in place), the weight ring, z and f(z)
    mlp_fwd = {"(kept z of the last layer not formed yet)":
               -S.get("MLP x·W1ᵀ of every shard (keep_intermediate)", 0),
               "y accumulator (fp32)": FP32 * Rm * h,
               "one shard's z and f(z) (bf16)": BF16 * Rm * k * f + BF16 * Rm * f}
    if tiled:
        mlp_fwd["y output, filled tile by tile (bf16)"] = BF16 * n * h
    if p > 1:
        mlp_fwd["MLP weight ring: own packed + received shard (bf16)"] = 2 * BF16 * Wm
    ph["MLP forward (last layer)"] = mlp_fwd
    return ph


def unfused_live_block(model: Model, job: Job, seq: Optional[int] = None) -> int:
    """METP without a fused kernel: one head group's fp32 scores of one ring step,
    ``b·(a/p)·(s/p)²·4`` bytes — the paper's O(1/p³) live intermediate."""
    s = model.seq if seq is None else seq
    sh = job.width
    return job.micro_batch * (model.heads // sh) * (s // (job.metp * job.cp)) ** 2 * FP32
