"""Ring attention: queries stay, K/V blocks travel the METP ring (the inner loop of METP attention).

Rank ``r`` of ``p`` holds ``q [b, hq, n, d]`` and ``k, v [b, hkv, n, d]`` for its ``n = s/p``
tokens (internal heads-first layout). Forward: ``p`` steps; at step ``t`` it holds the K/V block of
rank ``j = (r − t) mod p`` (K and V packed into one message, sent at their own dtype and head count:
GQA/MQA blocks are never repeated before sending), attends its queries to it with a block kernel
and folds ``(out_b, lse_b)`` into fp32 accumulators with :func:`lse.merge_`. Backward: the K/V
blocks rotate again (rank ``r`` visits ``r−1, …, r+1, r``), each block's ``dK/dV`` accumulator
travels with it in fp32 and arrives complete at its owner; ``dQ`` accumulates locally.

Causal masking by layout (``c = n/2``):

================  =================  ==========================  =============================
layout            block j == r       j < r                       j > r
================  =================  ==========================  =============================
``dual_chunk``    causal, all×all    all queries × K[:c] (full)  queries[c:] × all K (full)
``contiguous``    causal, all×all    all × all (full)            skipped (fully masked)
================  =================  ==========================  =============================

With ``dual_chunk`` every off-diagonal step costs every rank ``2c·c`` scores, so all ranks do the
same work at every step. Non-causal attention uses full blocks everywhere.

Traffic per rank and call: forward ``p−1`` K/V blocks; backward ``p−1`` K/V blocks and ``p−1``
fp32 ``dK/dV`` blocks. Saved for backward: only local ``q, k, v``, ``out`` and the fp32 ``lse``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..finite import check_finite
from ..groups import METPGroup, as_metp_group
from ..ring import RingExchanger, TravellingSum
from . import lse as lse_ops
from ._flat import FlatLayout
from .attention_kernels import select_kernel
from .sequence import LAYOUTS


def block_plan(r: int, j: int, n: int, causal: bool, layout: str):
    """``(query rows, key rows, causal)`` of the block of rank ``r``'s queries against rank
    ``j``'s keys, as slices of the local ``n`` tokens, or ``None`` when fully masked."""
    every = slice(0, n)
    if not causal:
        return every, every, False
    if j == r:
        return every, every, True
    if layout == "contiguous":
        return (every, every, False) if j < r else None
    c = n // 2
    return (every, slice(0, c), False) if j < r else (slice(c, n), every, False)


def check_attention_inputs(q, k, v, group: METPGroup, causal: bool, layout: str) -> None:
    """ValueErrors for shapes/dtypes/devices/layouts that cannot be computed (``[n, b, h, d]``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be this rank's tokens [s/p, b, heads, d], "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    n, b, hq, d = q.shape
    if min(n, b, hq, d, k.shape[2]) == 0:
        raise ValueError(f"q/k/v must not be empty: q has shape {tuple(q.shape)}, k/v "
                         f"{tuple(k.shape)} [tokens, batch, heads, head dim] on rank "
                         f"{group.rank}; give every rank at least one token (sequence length "
                         f"≥ 2 × METP size)")
    if k.shape[0] != n or k.shape[1] != b:
        raise ValueError(f"k/v hold {tuple(k.shape[:2])} tokens×batch but q holds {(n, b)}")
    if k.shape[3] != d:
        raise ValueError(f"head dims differ: q has {d}, k/v have {k.shape[3]}")
    if hq % k.shape[2]:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({k.shape[2]}) for GQA/MQA")
    if causal and layout == "dual_chunk" and n % 2:
        raise ValueError(f"layout='dual_chunk' needs an even number of local tokens (the sequence "
                         f"split into 2·p = {2 * group.size} chunks), got {n} on rank {group.rank}; "
                         f"make the sequence length divisible by {2 * group.size}")
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point, got {q.dtype}")


def _record_kernel(group: METPGroup, name: str) -> None:
    group.stats.kernels[name] = group.stats.kernels.get(name, 0) + 1


def ring_attention_forward(q, k, v, group: METPGroup, causal: bool, layout: str, scale: float,
                           kernel):
    """Heads-first ``q [b,hq,n,d]``, ``k, v [b,hkv,n,d]`` → ``(out [b,hq,n,d] fp32, lse fp32)``."""
    p, r, n = group.size, group.rank, q.shape[2]
    out, lse = lse_ops.new_accumulators(q.shape, q.device)
    layout_kv = FlatLayout.of([k, v])
    ring = RingExchanger(group, "attention K/V (fwd)")
    blocks = ring.circulate(layout_kv.pack([k, v])) if p > 1 else [(0, None)]
    for t, flat in blocks:
        j = (r - t) % p
        kj, vj = (k, v) if flat is None else layout_kv.unpack(flat)
        plan = block_plan(r, j, n, causal, layout)
        if plan is None:
            continue
        qs, ks, blk_causal = plan
        o_b, l_b = kernel.forward(q[:, :, qs], kj[:, :, ks], vj[:, :, ks], blk_causal, scale)
        lse_ops.merge_(out[:, :, qs], lse[:, :, qs], o_b, l_b)
    _record_kernel(group, kernel.name)
    return out, lse


def ring_attention_backward(dout, q, k, v, out, lse, group: METPGroup, causal: bool, layout: str,
                            scale: float, kernel):
    """Grads of :func:`ring_attention_forward`: ``(dq fp32, dk fp32, dv fp32)``, heads-first.

    ``dk, dv`` are complete (every rank's queries) for this rank's own K/V block.
    """
    p, r, n = group.size, group.rank, q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv_layout = FlatLayout.of([k, v])

    def block_grads(kj, vj, j, sums):
        """dq += this block's; its dK/dV added into the sum travelling with the block (waited
        for only after the kernel has run)."""
        plan = block_plan(r, j, n, causal, layout)
        if plan is None:
            sums.buffer()
            return
        qs, ks, blk_causal = plan
        dq_b, dk_b, dv_b = kernel.backward(dout[:, :, qs], q[:, :, qs], kj[:, :, ks],
                                           vj[:, :, ks], out[:, :, qs], lse[:, :, qs],
                                           blk_causal, scale)
        dq[:, :, qs] += dq_b
        dk_acc, dv_acc = kv_layout.unpack(sums.buffer())
        dk_acc[:, :, ks] += dk_b
        dv_acc[:, :, ks] += dv_b

    sums = TravellingSum(RingExchanger(group, "attention dK/dV (bwd)"), kv_layout.numel,
                         torch.float32, q.device)
    if p > 1:
        kv_ring = RingExchanger(group, "attention K/V (bwd)")
        first = kv_layout.pack([k, v])
        held = kv_ring.start(first, torch.empty_like(first), step=0).wait()  # block r-1
        for t, flat in kv_ring.circulate(held, steps=p - 1, spare=first):
            block_grads(*kv_layout.unpack(flat), (r - 1 - t) % p, sums)
            sums.pass_on()
    block_grads(k, v, r, sums)
    acc = sums.buffer()
    dk, dv = kv_layout.unpack(acc)
    return dq, dk, dv


def _to_heads_first(t):
    return t.permute(1, 2, 0, 3).contiguous()


def _to_seq_first(t):
    return t.permute(2, 0, 1, 3)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, kernel, label):
        check_finite(f"{label} (forward)", q=q, k=k, v=v)
        ctx.label = label
        qh, kh, vh = (_to_heads_first(t) for t in (q, k, v))
        out, lse = ring_attention_forward(qh, kh, vh, group, causal, layout, scale, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.args = (group, causal, layout, scale, kernel)
        return _to_seq_first(out).contiguous()

    @staticmethod
    def backward(ctx, dout):
        check_finite(f"{ctx.label} (backward)", grad_output=dout)
        qh, kh, vh, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(_to_heads_first(dout.to(qh.dtype)), qh, kh, vh, out,
                                             lse, *ctx.args)
        return (_to_seq_first(dq).to(qh.dtype), _to_seq_first(dk).to(kh.dtype),
                _to_seq_first(dv).to(vh.dtype), None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, causal: bool = True,
                   layout: str = "dual_chunk", softmax_scale: Optional[float] = None,
                   kernel: Optional[str] = None, label: str = "ring_attention") -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, K/V on a ring.

    Args:
        q: ``[s/p, b, hq, d]`` this rank's queries (tokens in ``layout`` order).
        k, v: ``[s/p, b, hkv, d]`` this rank's keys/values; ``hq`` a multiple of ``hkv`` (GQA/MQA).
        group: :class:`~megatron_metp.groups.METPGroup` (or ProcessGroup, or ``None`` for p=1).
        causal: causal mask over *global* positions of ``layout``.
        layout: ``"dual_chunk"`` (Megatron CP order) or ``"contiguous"``.
        softmax_scale: default ``1/sqrt(d)``.
        kernel: block kernel name (``"flash_attn"``, ``"torch_flash"``, ``"reference"``); default
            the best available. The one used is counted in ``group.stats.kernels``.
        label: names this call in NaN/Inf reports (:mod:`megatron_metp.finite`).

    Returns: ``[s/p, b, hq, d]``. With replicated weights around it this is ring self-attention
    (sequence parallelism); inside :func:`metp_attention` it is the inner loop.
    """
    group = as_metp_group(group)
    try:
        check_attention_inputs(q, k, v, group, causal, layout)
        kern = select_kernel(q.device, q.dtype, kernel)
    except ValueError as exc:
        refuse_together(group, op_label("ring_attention", label), exc)
        raise
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if agreement_checks_enabled():
        check_group_agrees(group, op_label("ring_attention", label), label=label, q=q, k=k, v=v,
                           causal=bool(causal), layout=layout, softmax_scale=float(scale),
                           kernel=kern.name, needs_grad=needs_grad(q, k, v))
    return _RingAttentionFunction.apply(q, k, v, group, bool(causal), layout, float(scale), kern,
                                        label)
