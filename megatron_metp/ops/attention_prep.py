"""The attention's per-head step before the K/V ring, and its backward: projection → q/k norm → RoPE.

Shared by the separate METP attention (:mod:`.attention`: one GEMM per head-group block over
this rank's tokens) and the streaming layer (:mod:`.layer_attention`: one head group, chunk by
chunk of token rows); each cuts the tokens and the weight rows its own way and calls the same
steps here, so the arithmetic of every element is the same in both.

Notation: ``A`` query heads and ``G`` query groups of the model (``qpg = A/G`` query heads per
group), head dim ``d``, METP size ``p`` (:class:`HeadGeometry`); ``R`` token rows ``[n·b]`` of
``x`` (or ``norm1(x)``) ``[R, h]``; ``W`` some rows of ``linear_qkv``'s shard, ``bias`` the
same rows of its bias. Per query head ``q̃`` and key head ``k̃`` (``[d]`` each)::

    forward     [q̃ | k̃ | v] = x·Wᵀ + bias                       (:func:`project`)
                q = RoPE(norm_q(q̃)),  k = RoPE(norm_k(k̃))     (:func:`norm_rope`)
    backward    dq̃ = norm_qᵀ(RoPEᵀ(dq)),  dk̃ = norm_kᵀ(RoPEᵀ(dk))   (:func:`norm_rope_backward`)
                dw_q += Σ dq̃-side weight grads (:meth:`HeadNorm.backward_one`), likewise k

(no norm: ``norm = id``; no RoPE: ``RoPE = id``; ``RoPEᵀ`` is RoPE with ``−sin``, :mod:`.rope`).
The projection's own backward (``dW = d(qkv)ᵀ·x``, ``dx = d(qkv)·W``) stays with each caller:
it is where they differ (one GEMM per block there, per tile and per weight part here).

:func:`project_block` and :func:`project_block_backward` are the whole step for a block of
head groups in Megatron's interleaved ``linear_qkv`` layout (per query group: its ``qpg``
query heads, its key head, its value head), what :mod:`.attention` runs; the streaming layer
runs :func:`project` and :func:`norm_rope` on its q rows and k/v rows separately
(:func:`split_qkv_rows`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .rope import apply_rope

#: ``(freqs, tables)``: RoPE angles ``[n, 1, 1, r]`` of the rows and their ``(cos, sin)``
#: (:func:`~megatron_metp.ops.rope.rope_tables`), or ``(None, None)`` without RoPE
Rope = Tuple[Optional[torch.Tensor], Optional[tuple]]


class HeadGeometry:
    """Head bookkeeping of one rank's shard: ``A`` heads, ``G`` groups, head dim ``d``, ``p``.

    ``q_per_group = A/G``, ``groups_local = G/p`` (query groups per shard), ``heads_local = A/p``
    (query heads per shard), ``qkv_rows = (G/p)·(A/G+2)·d`` (``linear_qkv`` rows per shard)."""

    def __init__(self, num_heads: int, num_query_groups: int, head_dim: int, p: int):
        self.A, self.G, self.d, self.p = num_heads, num_query_groups, head_dim, p
        self.q_per_group = num_heads // num_query_groups
        self.groups_local = num_query_groups // p
        self.heads_local = num_heads // p
        self.qkv_rows = self.groups_local * (self.q_per_group + 2) * head_dim


def heads_first(t: torch.Tensor, H: int, d: int) -> torch.Tensor:
    """``[n, b, H·d]`` → a ``[b, H, n, d]`` view (last dim dense): a seq-first output buffer
    as the ring's heads-first tensor."""
    n, b = t.shape[:2]
    return t.view(n, b, H, d).permute(1, 2, 0, 3)


def seq_first(t: torch.Tensor) -> torch.Tensor:
    """Heads-first ``[b, heads, n, d]`` → a seq-first ``[n, b, heads, d]`` view."""
    return t.permute(2, 0, 1, 3)


def seq_first_q(t: torch.Tensor, qpg: int) -> torch.Tensor:
    """Heads-first queries ``[b, G·qpg, n, d]`` → a ``[n, b, G, qpg, d]`` view (grouped as the
    ``linear_qkv`` rows are)."""
    return seq_first(t).unflatten(2, (t.shape[1] // qpg, qpg))


def project(rows: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``rows·wᵀ + bias``: ``rows [R, h]``, ``w [m, h]``, ``bias [m]`` (or ``None``) → ``[R, m]``
    (one GEMM, the bias added by it)."""
    return torch.addmm(bias, rows, w.t()) if bias is not None else torch.mm(rows, w.t())


def split_qkv_rows(w: torch.Tensor, geo: HeadGeometry):
    """One head group's ``linear_qkv`` rows ``[G_g·(qpg+2)·d, ...]`` (weight ``[·, h]`` or bias)
    as ``(q rows, k/v rows)``: ``[G_g·qpg·d, ...]`` and ``[G_g·2·d, ...]`` (copies when
    ``G_g > 1``: interleaved); ``(None, None)`` for ``None``."""
    if w is None:
        return None, None
    Gl, qpg, d = geo.groups_local, geo.q_per_group, geo.d
    t = w.view(Gl, qpg + 2, d, -1)
    rest = tuple(w.shape[1:])
    return (t[:, :qpg].reshape((Gl * qpg * d,) + rest),
            t[:, qpg:].reshape((Gl * 2 * d,) + rest))


def norm_rope(pre: torch.Tensor, which: str, head_norm, rope: Rope, out: torch.Tensor) -> None:
    """``out = RoPE(norm(pre))``: ``pre`` the pre-norm queries (``which="q"``) or keys (``"k"``)
    ``[n, b, heads..., d]`` (any strides), ``head_norm`` a
    :class:`~megatron_metp.ops.head_norm.HeadNorm` or ``None``, ``rope`` the rows' ``(freqs,
    tables)``; ``out`` ``pre``'s shape (any strides, e.g. a heads-first buffer's seq-first view,
    :func:`seq_first`)."""
    src = pre if head_norm is None else head_norm.norm_one(which, pre)
    freqs, tables = rope
    if freqs is not None:
        apply_rope(src, freqs, out=out, tables=tables)
    else:
        out.copy_(src)


def norm_rope_backward(grad: torch.Tensor, which: str, head_norm, pre, rope: Rope,
                       out: torch.Tensor, acc: list) -> None:
    """``out = normᵀ(RoPEᵀ(grad))``, the gradient of :func:`norm_rope`'s ``pre`` for the
    gradient ``grad`` of its ``out`` (both ``[n, b, heads..., d]``, any strides; ``out`` may be
    a slice of ``d(qkv)``); ``pre``: the pre-norm input again (unused without a norm). The norm
    weights' gradients are added into ``acc`` (``[dq_w, dq_b, dk_w, dk_b]``,
    :meth:`~megatron_metp.ops.head_norm.HeadNorm.backward_one`)."""
    freqs, tables = rope
    if freqs is not None:
        apply_rope(grad, freqs, transpose=True, out=out, tables=tables)
    else:
        out.copy_(grad)
    if head_norm is not None:
        head_norm.backward_one(which, pre, out, acc)


def project_block(x2: torch.Tensor, WQ: torch.Tensor, BQ, geo: HeadGeometry, n: int, b: int,
                  kb: int, rope: Rope, head_norm=None, keep_pre: Optional[list] = None):
    """The forward step for a block of ``kb`` head groups over ``x2 [n·b, h]`` (``WQ
    [kb·qkv_rows, h]``, ``BQ [kb·qkv_rows]`` or ``None``): one GEMM, then :func:`norm_rope` of
    the queries and keys. Returns heads-first ``q [b, H, n, d]``, ``k, v [b, Gb, n, d]`` (``H``,
    ``Gb``: the block's query and key heads) and ``kv``, the flat buffer ``k`` and ``v`` live
    in back to back (the K/V ring's block). ``keep_pre``: a list that receives the pre-norm
    projection ``[n, b, Gb, qpg+2, d]`` (for the norm's backward). With one query head per
    group and no q/k norm, ``q``, ``k`` and ``v`` share one buffer (``q`` first, then ``kv``)
    and one RoPE pass rotates ``q`` and ``k`` together (the same products, half the
    launches)."""
    d, qpg = geo.d, geo.q_per_group
    G = kb * geo.groups_local
    t = project(x2, WQ, BQ).view(n, b, G, qpg + 2, d)
    if head_norm is not None and keep_pre is not None:
        keep_pre.append(t)
    m = b * G * n * d  # elements of k (and of v)
    if qpg == 1 and head_norm is None:  # one query head per group: q, k, v back to back
        qkv = torch.empty(3 * m, dtype=x2.dtype, device=x2.device)
        q, kv = qkv[:m].view(b, G, n, d), qkv[m:]
        # q and k in one RoPE pass: [n, b, G, 2, d] over the buffer's first two thirds
        norm_rope(t[:, :, :, :2], "qk", None, rope, qkv[:2 * m].view(2, b, G, n, d).permute(
            3, 1, 2, 0, 4))
    else:
        q = torch.empty(b, G * qpg, n, d, dtype=x2.dtype, device=x2.device)
        kv = torch.empty(2 * m, dtype=x2.dtype, device=x2.device)
        norm_rope(t[:, :, :, :qpg], "q", head_norm, rope, seq_first_q(q, qpg))
        norm_rope(t[:, :, :, qpg], "k", head_norm, rope, seq_first(kv[:m].view(b, G, n, d)))
    k, v = kv[:m].view(b, G, n, d), kv[m:].view(b, G, n, d)
    seq_first(v).copy_(t[:, :, :, qpg + 1])
    return q, k, v, kv


def project_block_backward(dq: torch.Tensor, dk: torch.Tensor, dqkv: torch.Tensor,
                           geo: HeadGeometry, rope: Rope, head_norm, pre, acc: list) -> None:
    """The backward of :func:`project_block` up to the GEMM: the heads-first ``dq [b, H, n,
    d]``, ``dk [b, Gb, n, d]`` through :func:`norm_rope_backward` into ``dqkv`` ``[n, b, Gb,
    qpg+2, d]`` (Megatron's interleaved layout; its value columns are the caller's), ``pre``
    the block's pre-norm projection (``keep_pre``; ``None`` without a norm)."""
    qpg = geo.q_per_group
    q_pre, k_pre = (None, None) if pre is None else (pre[:, :, :, :qpg], pre[:, :, :, qpg])
    norm_rope_backward(seq_first_q(dq, qpg), "q", head_norm, q_pre, rope, dqkv[:, :, :, :qpg],
                       acc)
    norm_rope_backward(seq_first(dk), "k", head_norm, k_pre, rope, dqkv[:, :, :, qpg], acc)
