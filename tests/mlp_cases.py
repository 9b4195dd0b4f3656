"""Shared pieces of the MLP parity tests: full weights, Megatron TP sharding, the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def full_mlp_params(s, b, h, ffn, activation, bias, seed=0, dtype=torch.float32):
    """Full (TP=1) weights in Megatron's layout, an input and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    k = 2 if activation == "swiglu" else 1

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return {
        "x": rnd(s, b, h),
        "gy": rnd(s, b, h),
        "w1": rnd(k * ffn, h, scale=h ** -0.5),
        "b1": rnd(k * ffn, scale=0.1) if bias else None,
        "w2": rnd(h, ffn, scale=ffn ** -0.5),
        "b2": rnd(h, scale=0.1) if bias else None,
    }


def fc1_rows(ffn, activation, r, p):
    """Row indices of the full fc1 weight that Megatron's TP rank r holds (gate then up for swiglu)."""
    f = ffn // p
    rows = torch.arange(r * f, (r + 1) * f)
    return torch.cat([rows, rows + ffn]) if activation == "swiglu" else rows


def shard_params(full, ffn, activation, r, p):
    rows = fc1_rows(ffn, activation, r, p)
    f = ffn // p
    return {
        "w1": full["w1"][rows].clone(),
        "b1": None if full["b1"] is None else full["b1"][rows].clone(),
        "w2": full["w2"][:, r * f:(r + 1) * f].clone(),
        "b2": None if full["b2"] is None else full["b2"].clone(),
    }


def unshard_grads(per_rank, ffn, activation, like):
    """Reassemble full-weight gradients from each owner's shard gradient."""
    p = len(per_rank)
    dw1 = torch.empty_like(like["w1"])
    db1 = None if like["b1"] is None else torch.empty_like(like["b1"])
    f = ffn // p
    dw2 = torch.empty_like(like["w2"])
    for r, gr in enumerate(per_rank):
        rows = fc1_rows(ffn, activation, r, p)
        dw1[rows] = gr["w1"]
        if db1 is not None:
            db1[rows] = gr["b1"]
        dw2[:, r * f:(r + 1) * f] = gr["w2"]
    return dw1, db1, dw2


def reference_mlp(full, activation, dtype=torch.float32):
    """Single-device MLP forward/backward by autograd from the full weights."""
    leaf = {k: (None if v is None else v.detach().to(dtype).requires_grad_(k not in ("gy",)))
            for k, v in full.items()}
    z = F.linear(leaf["x"], leaf["w1"], leaf["b1"])
    if activation == "swiglu":
        zg, zu = torch.chunk(z, 2, dim=-1)
        a = F.silu(zg) * zu
    else:
        a = F.gelu(z)
    y = F.linear(a, leaf["w2"], leaf["b2"])
    y.backward(leaf["gy"])
    return {"y": y.detach(), "dx": leaf["x"].grad, "dw1": leaf["w1"].grad, "dw2": leaf["w2"].grad,
            "db1": None if leaf["b1"] is None else leaf["b1"].grad,
            "db2": None if leaf["b2"] is None else leaf["b2"].grad}
