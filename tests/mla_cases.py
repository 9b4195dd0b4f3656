"""Multi-latent attention test cases: full weights in Megatron's layout, each rank's shard, and a
plain single-device reference written from the equations (``megatron_metp/ops/mla.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_metp.ops.documents import document_ids
from megatron_metp.ops.rope import rope_angles

#: the replicated weights (their gradients are per-rank token partials) and the head-sharded ones
REPLICATED = ("q_down_weight", "q_norm_weight", "kv_down_weight", "kv_norm_weight", "proj_bias")
SHARDED = {"q_up_weight": 0, "kv_up_weight": 0, "proj_weight": 1}  # name -> sharded dim


@dataclass(frozen=True)
class MLACase:
    heads: int
    kvr: int
    dn: int
    dr: int
    dv: int
    ql: Optional[int]  # q_lora_rank (None: linear_q_proj)
    s: int = 12
    b: int = 2
    h: int = 16
    layout: str = "dual_chunk"
    kernel: str = "torch_flash"
    mscale: float = 1.0  # YaRN's rope factor
    scale: Optional[float] = None  # softmax scale (None: 1/sqrt(dn+dr))
    bias: bool = True
    seed: int = 0
    kb: int = 1  # head_block: head groups per latent ring
    cu: Optional[tuple] = None  # packed documents (cu_seqlens)


def full_params(case: MLACase) -> dict:
    """Random full (one-rank) weights, input ``x``, output gradient ``gy`` and exact RoPE angles
    ``[s, 1, 1, dr]`` (base 10,000)."""
    gen = torch.Generator().manual_seed(case.seed)
    A, h = case.heads, case.h

    def rnd(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen) * scale + shift

    q_in = case.ql if case.ql is not None else h
    inv_freq = 1.0 / (10000 ** (torch.arange(0, case.dr, 2, dtype=torch.float32) / case.dr))
    p = {"x": rnd(case.s, case.b, h), "gy": rnd(case.s, case.b, h),
         "q_up_weight": rnd(A * (case.dn + case.dr), q_in, scale=q_in ** -0.5),
         "kv_down_weight": rnd(case.kvr + case.dr, h, scale=h ** -0.5),
         "kv_norm_weight": rnd(case.kvr, scale=0.1, shift=1.0),
         "kv_up_weight": rnd(A * (case.dn + case.dv), case.kvr, scale=case.kvr ** -0.5),
         "proj_weight": rnd(h, A * case.dv, scale=(A * case.dv) ** -0.5),
         "proj_bias": rnd(h, scale=0.1) if case.bias else None,
         "rotary_pos_emb": rope_angles(torch.arange(case.s), inv_freq)}
    if case.ql is not None:
        p["q_down_weight"] = rnd(case.ql, h, scale=h ** -0.5)
        p["q_norm_weight"] = rnd(case.ql, scale=0.1, shift=1.0)
    return p


def shard_weights(full: dict, case: MLACase, rank: int, p: int) -> dict:
    """Rank ``rank``'s weights: the head-sharded ones' head group ``rank``, the rest whole."""
    out = {}
    for name in REPLICATED + tuple(SHARDED):
        t = full.get(name)
        if t is None:
            continue
        if name in SHARDED:
            dim = SHARDED[name]
            size = t.shape[dim] // p
            t = t.narrow(dim, rank * size, size)
        out[name] = t
    return out


def _rms(t, w, eps):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(t, theta, m):
    """DeepSeek's interleaved pairs gathered into halves, rotated by ``theta [s, 1, 1, r/2]``."""
    u = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    half = u.shape[-1] // 2
    u1, u2 = u[..., :half], u[..., half:]
    if t.dim() == 3:
        theta = theta[:, 0]
    cos, sin = torch.cos(theta), torch.sin(theta)
    return torch.cat((u1 * cos - u2 * sin, u2 * cos + u1 * sin), dim=-1) * m


def reference_mla(full: dict, case: MLACase, eps: float = 1e-5, causal: bool = True,
                  rotate_key: bool = True) -> dict:
    """Single-device MLA in fp64 from the full weights: ``y`` and the gradient of ``x`` and of
    every weight for the output gradient ``gy`` (``rotate_key=False``: the shared RoPE key left
    unrotated, a negative control). With ``case.cu`` (packed documents) a query sees the keys of
    its own document only and RoPE positions restart at each document start."""
    leaves = {k: v.double().requires_grad_() for k, v in full.items()
              if v is not None and k not in ("gy", "rotary_pos_emb")}
    x = leaves["x"]
    s, b, _ = x.shape
    A, kvr, dn, dr, dv = case.heads, case.kvr, case.dn, case.dr, case.dv
    pos = torch.arange(s)
    visible = pos[None, :] <= pos[:, None]
    if case.cu is not None:
        doc = document_ids(case.cu, pos)
        visible &= doc[None, :] == doc[:, None]
        pos = pos - torch.tensor(case.cu)[doc]
    theta = full["rotary_pos_emb"].double()[pos][..., :dr // 2]
    q_in = x if case.ql is None else _rms(x @ leaves["q_down_weight"].t(),
                                          leaves["q_norm_weight"], eps)
    q = (q_in @ leaves["q_up_weight"].t()).view(s, b, A, dn + dr)
    ckv = x @ leaves["kv_down_weight"].t()
    c = _rms(ckv[..., :kvr], leaves["kv_norm_weight"], eps)
    k_pe = ckv[..., kvr:]
    k_pe = _rope(k_pe, theta, case.mscale) if rotate_key else k_pe
    kv = (c @ leaves["kv_up_weight"].t()).view(s, b, A, dn + dv)
    qf = torch.cat((q[..., :dn], _rope(q[..., dn:], theta, case.mscale)), dim=-1)
    kf = torch.cat((kv[..., :dn], k_pe[:, :, None].expand(s, b, A, dr)), dim=-1)
    scale = case.scale if case.scale is not None else (dn + dr) ** -0.5
    scores = torch.einsum("sbhd,tbhd->bhst", qf, kf) * scale
    if causal:
        scores = scores.masked_fill(~visible, float("-inf"))
    o = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), kv[..., dn:])
    y = o.reshape(s, b, A * dv) @ leaves["proj_weight"].t()
    if "proj_bias" in leaves:
        y = y + leaves["proj_bias"]
    y.backward(full["gy"].double())
    return {"y": y.detach(), **{"d" + k: v.grad for k, v in leaves.items()}}
