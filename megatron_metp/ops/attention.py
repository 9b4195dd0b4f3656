"""METP self-attention: a head-group loop around a K/V ring.

Layout on rank ``r`` of ``p`` (exactly what Megatron TP rank ``r`` holds for the weights):

* ``x``, ``y``: this rank's tokens ``[n, b, h]`` (``n = s/p`` in ``layout`` order);
* ``qkv_weight`` (``Wqkv_r``): ``linear_qkv``'s ColumnParallelLinear shard, the rows of query groups
  ``r·G/p … (r+1)·G/p`` in Megatron's interleaved layout (per group: its ``A/G`` query heads, then
  its key head, then its value head; ``A`` heads, ``G`` query groups, head dim ``d``):
  ``[(G/p)·(A/G + 2)·d, h]``; ``qkv_bias`` likewise;
* ``proj_weight`` (``Wo_r``): ``linear_proj``'s RowParallelLinear shard ``[h, (A/p)·d]``;
  ``proj_bias`` ``[h]`` replicated, added once.

Forward, outer loop over head groups ``g = 0 … p−1``, the same ``g`` on every rank at the same
time (the inner K/V ring exchanges blocks *of one head group* between ranks, so all ranks must be
on that group). The weights of group ``g`` come from their owner by an async broadcast, posted one
step ahead into the second of two buffers, so it travels while group ``g−1`` computes::

    [Q_g | K_g | V_g] = x·Wqkv_gᵀ + bqkv_g,    Q_g, K_g ← RoPE(positions of this rank's tokens)
    O_g = ring_attention(Q_g, K_g, V_g)        (inner K/V ring over the same group, p steps)
    y  += O_g·Wo_gᵀ                           (fp32 accumulator)

then ``y += bo``. Why a broadcast and not the weight ring of :mod:`.mlp`: a ring hands rank ``r``
shard ``r−t`` at step ``t`` — a different head group on every rank — which the K/V ring cannot
serve. Forwarding one shard hop by hop to all ranks costs ``(p−1)`` sequential shard transfers
per step, against about one for a pipelined broadcast (NCCL's ring/tree), with the same bytes.

Backward (same head-group order, weights broadcast again)::

    dO_g = dy·Wo_g            dWo_g  = Σ_r dyᵀ·O_g
    (dQ_g, dK_g, dV_g) = ring_attention backward (dK/dV travel home on the inner ring)
    dQ_g, dK_g ← RoPEᵀ        dqkv_g = [dQ_g | dK_g | dV_g] (Megatron layout)
    dWqkv_g = Σ_r dqkv_gᵀ·x   dbqkv_g = Σ_r Σ_tokens dqkv_g      dx += dqkv_g·Wqkv_g

Each rank's fp32 contribution to ``(dWqkv_g, dbqkv_g, dWo_g)`` is reduced to owner ``g`` with an
async reduce that overlaps the next head group's compute (at most two in flight).

Saved for backward: ``x``, every head group's attention output ``O_g`` and its fp32 log-sum-exp:
``Q/K/V`` are recomputed from ``x`` as the weights pass (no rank ever holds whole Q/K/V, whole
weights, or ``s×s`` scores).

Traffic per rank and call (``W`` = one head group's weight shard, ``KV`` = one K/V block of one head
group): forward ``(p−1)·W`` received + ``p(p−1)·KV``; backward ``(p−1)·W`` received,
``(p−1)·W`` (fp32) sent to owners, and ``p(p−1)·(KV + KV fp32)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..finite import check_finite
from ..groups import METPGroup, as_metp_group
from ..ring import RingExchanger
from ._accum import mm_acc
from ._flat import FlatLayout
from .attention_kernels import select_kernel
from .ring_attention import ring_attention_backward, ring_attention_forward
from .rope import apply_rope
from .sequence import LAYOUTS, local_positions


class _Geometry:
    """Head bookkeeping of one rank's shard: ``A`` heads, ``G`` groups, head dim ``d``, ``p``."""

    def __init__(self, num_heads, num_query_groups, head_dim, p):
        self.A, self.G, self.d, self.p = num_heads, num_query_groups, head_dim, p
        self.q_per_group = num_heads // num_query_groups
        self.groups_local = num_query_groups // p       # query groups per shard
        self.heads_local = num_heads // p               # query heads per shard
        self.qkv_rows = self.groups_local * (self.q_per_group + 2) * head_dim

    def split(self, qkv: torch.Tensor):
        """``[n, b, rows]`` → ``q [n,b,heads_local,d]``, ``k, v [n,b,groups_local,d]``."""
        n, b = qkv.shape[:2]
        t = qkv.view(n, b, self.groups_local, (self.q_per_group + 2) * self.d)
        q, k, v = torch.split(t, [self.q_per_group * self.d, self.d, self.d], dim=-1)
        return (q.reshape(n, b, self.heads_local, self.d), k, v)

    def join(self, dq, dk, dv) -> torch.Tensor:
        """Inverse of :meth:`split` (for gradients): ``[n, b, rows]``."""
        n, b = dq.shape[:2]
        dq = dq.reshape(n, b, self.groups_local, self.q_per_group * self.d)
        return torch.cat([dq, dk, dv], dim=-1).reshape(n, b, self.qkv_rows)


def _heads_first(t):
    return t.permute(1, 2, 0, 3).contiguous()


def _seq_first(t):
    return t.permute(2, 0, 1, 3)


def _check_inputs(x, wqkv, wo, bqkv, bo, group: METPGroup, A, G, layout, causal, freqs):
    p = group.size
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be this rank's tokens [s/p, b, h], got shape {tuple(x.shape)}")
    n, b, h = x.shape
    if A <= 0 or G <= 0 or A % G:
        raise ValueError(f"num_heads ({A}) must be a positive multiple of num_query_groups ({G})")
    if G % p:
        raise ValueError(f"num_query_groups ({G}) is not divisible by the METP group size {p}; "
                         f"choose a METP size that divides the number of query groups")
    if wqkv.dim() != 2 or wqkv.shape[1] != h:
        raise ValueError(f"qkv_weight must be [(G/p)·(A/G+2)·d, h={h}], got {tuple(wqkv.shape)}")
    per_d = (G // p) * (A // G + 2)
    if wqkv.shape[0] % per_d:
        raise ValueError(f"qkv_weight has {wqkv.shape[0]} rows, not a multiple of "
                         f"(G/p)·(A/G+2) = {per_d}: the shard does not match num_heads={A}, "
                         f"num_query_groups={G} and group size {p}")
    d = wqkv.shape[0] // per_d
    if wo.dim() != 2 or tuple(wo.shape) != (h, (A // p) * d):
        raise ValueError(f"proj_weight must be [h={h}, (A/p)·d={(A // p) * d}] (head dim {d} from "
                         f"qkv_weight), got {tuple(wo.shape)}: mismatched head dims or group size")
    if bqkv is not None and tuple(bqkv.shape) != (wqkv.shape[0],):
        raise ValueError(f"qkv_bias must be [{wqkv.shape[0]}], got {tuple(bqkv.shape)}")
    if bo is not None and tuple(bo.shape) != (h,):
        raise ValueError(f"proj_bias must be replicated [h={h}], got {tuple(bo.shape)}")
    for name, t in (("qkv_weight", wqkv), ("proj_weight", wo), ("qkv_bias", bqkv),
                    ("proj_bias", bo), ("rotary_pos_emb", freqs)):
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
        if name != "rotary_pos_emb" and t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
    if causal and layout == "dual_chunk" and n % 2:
        raise ValueError(f"layout='dual_chunk' needs an even number of local tokens (sequence "
                         f"split into 2·p = {2 * p} chunks), got {n}; make the sequence length "
                         f"divisible by {2 * p}")
    if freqs is not None:
        if freqs.dim() != 4 or freqs.shape[0] not in (n, n * p) or freqs.shape[-1] > d \
                or freqs.shape[-1] % 2:
            raise ValueError(f"rotary_pos_emb must be Megatron's RoPE angles [s/p={n} or s={n * p}, "
                             f"1, 1, r] with even r <= head dim {d}, got {tuple(freqs.shape)}")
    return d


def _head_group_weights(group: METPGroup, layout_w: FlatLayout, own, phase: str):
    """Yield ``(g, (Wqkv_g, bqkv_g, Wo_g))`` for ``g = 0 … p−1`` on every rank.

    Group ``g``'s shard is broadcast from its owner; the broadcast of ``g+1`` is posted before
    ``g`` is yielded (two receive buffers, used alternately), so it overlaps ``g``'s compute.
    """
    p, r = group.size, group.rank
    if p == 1:
        yield 0, own
        return
    ring = RingExchanger(group, f"attention weights ({phase})")
    packed_own = layout_w.pack(own)
    spare = [torch.empty_like(packed_own), torch.empty_like(packed_own)]

    def post(g):
        return ring.broadcast(packed_own if g == r else spare[g % 2], g, step=g)

    pending = post(0)
    for g in range(p):
        buf = pending.wait()
        if g + 1 < p:
            pending = post(g + 1)
        yield g, (own if g == r else tuple(layout_w.unpack(buf)))


def _keep_if_owner(in_flight, rank, acc):
    g, pending = in_flight
    result = pending.wait()
    return result if g == rank else acc


class _METPAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wqkv, bqkv, wo, bo, freqs, group: METPGroup, geo: _Geometry, causal, layout,
                scale, kernel, label):
        check_finite(f"{label} (forward)", x=x, qkv_weight=wqkv, proj_weight=wo, qkv_bias=bqkv,
                     proj_bias=bo)
        ctx.label = label
        p, r = group.size, group.rank
        n, b, h = x.shape
        x2 = x.reshape(n * b, h)
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        y = torch.zeros(n * b, h, dtype=acc_dtype, device=x.device)
        layout_w = FlatLayout.of([wqkv, bqkv, wo])
        outs, lses = [None] * p, [None] * p
        for g, (wq, bq, wp) in _head_group_weights(group, layout_w, (wqkv, bqkv, wo), "fwd"):
            q, k, v = _METPAttentionFunction._qkv(x2, wq, bq, freqs, geo, n, b)
            o, lse = ring_attention_forward(q, k, v, group, causal, layout, scale, kernel)
            o = o.to(x.dtype)
            outs[g], lses[g] = o, lse
            mm_acc(y, _seq_first(o).reshape(n * b, geo.heads_local * geo.d), wp.t())
        if bo is not None:
            y.add_(bo)
        ctx.save_for_backward(x, wqkv, bqkv, wo, freqs, *outs, *lses)
        ctx.args = (group, geo, causal, layout, scale, kernel)
        ctx.has = (bqkv is not None, bo is not None, freqs is not None)
        return y.to(x.dtype).view(n, b, h)

    @staticmethod
    def _qkv(x2, wq, bq, freqs, geo, n, b):
        """Heads-first ``q, k, v`` of one head group for this rank's tokens (RoPE applied)."""
        qkv = torch.addmm(bq, x2, wq.t()) if bq is not None else torch.mm(x2, wq.t())
        q, k, v = geo.split(qkv.view(n, b, -1))
        if freqs is not None:
            q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        return _heads_first(q), _heads_first(k), _heads_first(v)

    @staticmethod
    def backward(ctx, grad_y):
        check_finite(f"{ctx.label} (backward)", grad_output=grad_y)
        group, geo, causal, layout, scale, kernel = ctx.args
        has_bq, has_bo, has_freqs = ctx.has
        saved = ctx.saved_tensors
        x, wqkv, bqkv, wo, freqs = saved[:5]
        p, r = group.size, group.rank
        outs, lses = saved[5:5 + p], saved[5 + p:5 + 2 * p]
        bqkv = bqkv if has_bq else None
        freqs = freqs if has_freqs else None
        n, b, h = x.shape
        x2 = x.reshape(n * b, h)
        gy = grad_y.reshape(n * b, h).to(x.dtype)
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        dx = torch.zeros(n * b, h, dtype=acc_dtype, device=x.device)
        dbo = gy.sum(0, dtype=acc_dtype).to(x.dtype) if has_bo else None
        layout_w = FlatLayout.of([wqkv, bqkv, wo])

        def shard_grads(wq, bq, wp, g):
            q, k, v = _METPAttentionFunction._qkv(x2, wq, bq, freqs, geo, n, b)
            o_flat = _seq_first(outs[g]).reshape(n * b, geo.heads_local * geo.d)
            acc = layout_w.zeros(torch.float32, x.device)
            dwq, dbq, dwp = layout_w.unpack(acc)
            mm_acc(dwp, gy.t(), o_flat)
            d_o = torch.mm(gy, wp).view(n, b, geo.heads_local, geo.d)
            dq, dk, dv = ring_attention_backward(_heads_first(d_o), q, k, v, outs[g], lses[g],
                                                 group, causal, layout, scale, kernel)
            dq, dk, dv = (_seq_first(t_) for t_ in (dq, dk, dv))
            if freqs is not None:
                dq = apply_rope(dq, freqs, transpose=True)
                dk = apply_rope(dk, freqs, transpose=True)
            dqkv = geo.join(dq, dk, dv).reshape(n * b, geo.qkv_rows).to(x.dtype)
            mm_acc(dwq, dqkv.t(), x2)
            if dbq is not None:
                dbq.copy_(dqkv.sum(0, dtype=torch.float32))
            mm_acc(dx, dqkv, wq)
            return acc

        # Each head group's gradient is reduced to its owner while the next group computes;
        # at most two contributions are alive. Only the owner's reduce result is kept.
        grad_ring = RingExchanger(group, "attention weight grads (bwd)")
        acc, in_flight = None, None
        for g, shard in _head_group_weights(group, layout_w, (wqkv, bqkv, wo), "bwd"):
            contrib = shard_grads(*shard, g)
            if p == 1:
                acc = contrib
                continue
            if in_flight is not None:
                acc = _keep_if_owner(in_flight, r, acc)
            in_flight = (g, grad_ring.reduce(contrib, g, step=g))
        if in_flight is not None:
            acc = _keep_if_owner(in_flight, r, acc)
        dwq, dbq, dwp = layout_w.unpack(acc)
        return (dx.to(x.dtype).view(n, b, h), dwq.to(wqkv.dtype),
                dbq.to(wqkv.dtype) if dbq is not None else None, dwp.to(wo.dtype), dbo,
                None, None, None, None, None, None, None, None)


def metp_attention(x: torch.Tensor, qkv_weight: torch.Tensor, proj_weight: torch.Tensor, *, group,
                   num_heads: int, num_query_groups: int, causal: bool = True,
                   layout: str = "dual_chunk", rotary_pos_emb: Optional[torch.Tensor] = None,
                   qkv_bias: Optional[torch.Tensor] = None,
                   proj_bias: Optional[torch.Tensor] = None,
                   softmax_scale: Optional[float] = None,
                   kernel: Optional[str] = None, label: str = "metp_attention") -> torch.Tensor:
    """The METP self-attention block (before the residual): ``y = Attn(x)·Woᵀ + bo``.

    Args:
        x: ``[s/p, b, h]`` this rank's tokens in ``layout`` order.
        qkv_weight: this rank's ``linear_qkv`` ColumnParallelLinear shard
            ``[(G/p)·(A/G+2)·d, h]`` (Megatron's query-group interleaved layout).
        proj_weight: this rank's ``linear_proj`` RowParallelLinear shard ``[h, (A/p)·d]``.
        group: :class:`~megatron_metp.groups.METPGroup` (or ProcessGroup, or ``None`` for p=1).
        num_heads, num_query_groups: ``A`` and ``G`` of the whole model (GQA when ``G < A``).
        causal, layout: as in :func:`~megatron_metp.ops.ring_attention`.
        rotary_pos_emb: Megatron's RoPE angles ``[s/p, 1, 1, r]`` for this rank's tokens (as
            Megatron's ``RotaryEmbedding`` returns them under context parallelism) or ``[s, 1, 1, r]``
            for the whole sequence (this rank's positions are selected).
        qkv_bias: ``[(G/p)·(A/G+2)·d]`` sharded like ``qkv_weight``; proj_bias: ``[h]`` replicated.
        softmax_scale: default ``1/sqrt(d)``. kernel: block kernel name, default best available.
        label: names this call in NaN/Inf reports (:mod:`megatron_metp.finite`) and in the
            cross-rank agreement check (:mod:`megatron_metp.agree`, opt-in), which also requires
            it, every shape/dtype and every option to be equal on all ranks of the group.

    Returns: ``y [s/p, b, h]``. Weight-shard gradients are complete; ``proj_bias``'s is this
    rank's token partial (replicated parameter, reduced over the group by the caller's DDP).
    """
    group = as_metp_group(group)
    try:
        d = _check_inputs(x, qkv_weight, proj_weight, qkv_bias, proj_bias, group, num_heads,
                          num_query_groups, layout, causal, rotary_pos_emb)
        kern = select_kernel(x.device, x.dtype, kernel)
        freqs = rotary_pos_emb
        if freqs is not None and freqs.shape[0] != x.shape[0]:
            pos = local_positions(group.rank, group.size, x.shape[0], layout=layout,
                                  device=x.device)
            freqs = freqs.index_select(0, pos)
    except ValueError as exc:
        refuse_together(group, op_label("metp_attention", label), exc)
        raise
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if agreement_checks_enabled():
        check_group_agrees(group, op_label("metp_attention", label), label=label, x=x,
                           qkv_weight=qkv_weight, proj_weight=proj_weight, qkv_bias=qkv_bias,
                           proj_bias=proj_bias, rotary_pos_emb=rotary_pos_emb,
                           num_heads=num_heads, num_query_groups=num_query_groups,
                           causal=bool(causal), layout=layout, softmax_scale=float(scale),
                           kernel=kern.name,
                           needs_grad=needs_grad(x, qkv_weight, proj_weight, qkv_bias, proj_bias))
    geo = _Geometry(num_heads, num_query_groups, d, group.size)
    return _METPAttentionFunction.apply(x, qkv_weight, qkv_bias, proj_weight, proj_bias, freqs,
                                        group, geo, bool(causal), layout, float(scale), kern,
                                        label)
