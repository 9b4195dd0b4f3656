"""Numerically stable merge of partial attention results by their log-sum-exp.

Two blocks of keys give, for the same query rows, normalised outputs ``o_a, o_b`` and log-sum-exps
``l_a, l_b``. The attention over both is ``o = w_a·o_a + w_b·o_b`` with ``l = log(e^{l_a} + e^{l_b})``
and ``w_x = e^{l_x − l}``. Since ``w_a + w_b = 1``, ``w_b = σ(l_b − l_a)`` (the logistic function)
and ``o = o_a + w_b·(o_b − o_a)``; ``l`` comes from ``logaddexp`` (``max + log1p(exp(−|l_a − l_b|))``).
Neither exponentiates a large number, so nothing overflows in any dtype; the accumulators are fp32.
(Summing raw ``Σ exp(score)`` per block, as an unstabilised merge does, overflows fp16 once a score
passes ~11 and fp32 past ~88.)

The first block of a ring step initialises the accumulators (:func:`start`), so rows no key has
reached yet never occur (every ring schedule here starts with a block that covers all rows); each
further block is folded in by :func:`merge_` in five kernels (``sub`` + ``sigmoid_`` of the
log-sum-exps, ``sub`` + ``addcmul_`` of the outputs, one ``logaddexp``). When every block's
output is kept until the ring ends (:func:`combine`, head-group blocks on a GPU), all weights come
from one ``softmax`` over the stacked log-sum-exps and each block costs one ``addcmul_``.
"""

from __future__ import annotations

import torch


def start(out_b: torch.Tensor, lse_b: torch.Tensor):
    """``(out_acc, lse_acc)`` (fp32) from the first block, which must cover every query row."""
    out = out_b if out_b.dtype == torch.float32 else out_b.to(torch.float32)
    lse = lse_b if lse_b.dtype == torch.float32 else lse_b.to(torch.float32)
    return out, lse


def new_accumulators(q_shape, device):
    """``(out_acc, lse_acc)`` for query rows ``q_shape = [b, h, n, d]``: zeros and ``−inf``, fp32
    (for callers whose first block does not cover every row; fold blocks in with
    :func:`merge_masked_`)."""
    b, h, n, d = q_shape
    return (torch.zeros(b, h, n, d, dtype=torch.float32, device=device),
            torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=device))


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> None:
    """In place: fold block ``(out_b [b,h,n,d], lse_b [b,h,n])`` into the fp32 accumulators,
    whose rows must already hold a finite log-sum-exp (see :func:`start`)."""
    w_b = torch.sub(lse_b, lse_acc).sigmoid_().unsqueeze(-1)
    out_acc.addcmul_(torch.sub(out_b, out_acc), w_b)
    torch.logaddexp(lse_acc, lse_b, out=lse_acc)


def merge_masked_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> None:
    """:func:`merge_` for accumulators that may still hold ``−inf`` rows (nothing reached yet):
    those rows take the block's values (no NaN)."""
    lse_b = lse_b.float()
    new = torch.logaddexp(lse_acc, lse_b)
    shift = new.masked_fill(new == float("-inf"), 0.0)
    w_acc = torch.exp(lse_acc - shift).unsqueeze(-1)
    w_b = torch.exp(lse_b - shift).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out_b.float() * w_b)
    lse_acc.copy_(new)


def combine(blocks, out=None):
    """``(out, lse)`` of blocks ``[(rows, out_b [b,h,n_b,d], lse_b [b,h,n_b]), ...]`` for
    query-row slices ``rows`` of ``n`` rows, the first covering every row.

    The log-sum-exps first, for every block at once: stacked ``[k, b, h, n]`` (:func:`_stack`,
    ``−inf`` where a block has no rows), one ``softmax`` over the blocks gives every weight
    ``w_b = e^{lse_b − lse}``, and ``lse = max_b lse_b − log max_b w_b`` (the largest weight is
    ``1/Σ_b e^{lse_b − max}``, within ``[1/k, 1]``: no under- or overflow). Then
    ``out = Σ_b w_b·out_b`` summed in fp32: the other blocks first (one product, then one
    ``addcmul_`` each), the all-rows block last, written straight into ``out`` when given (any
    dtype and strides: one rounding, no separate cast) or into the fp32 sum.

    Kernels for ``k`` blocks: one per block (its ``addcmul_``), plus a handful for the
    log-sum-exps (per distinct row range a stack, and for a partial range a copy and a fill;
    ``softmax``, two ``amax``, ``log_``, ``sub_``) — against four per block when each block's weight and the running log-sum-exp
    are formed on their own (``logaddexp``, ``sub``, ``exp_``, ``addcmul_``). The extra memory
    is two ``[k, b, h, n]`` fp32 tensors, ``4/d`` of the ``k`` 16-bit block outputs kept."""
    rows0, o0, l0 = blocks[0]
    if len(blocks) == 1:
        lse = l0 if l0.dtype == torch.float32 else l0.to(torch.float32)
        if out is not None:
            out.copy_(o0)
            return out, lse
        return start(o0, lse)
    n = l0.shape[-1]
    stacked, at = _stack(blocks, n)
    w = torch.softmax(stacked, 0)  # e^{lse_b − lse}, 0 on rows a block does not cover
    lse = stacked.amax(0).sub_(w.amax(0).log_())
    acc = torch.empty(o0.shape, dtype=torch.float32, device=o0.device)
    for i, (rows, o_b, _) in enumerate(blocks[1:]):
        w_b = w[at[i + 1], :, :, rows].unsqueeze(-1)
        if i == 0:
            lo, hi = _bounds(rows, n)
            if lo > 0:
                acc[:, :, :lo].zero_()
            if hi < n:
                acc[:, :, hi:].zero_()
            torch.mul(o_b, w_b, out=acc[:, :, rows])
        else:
            acc[:, :, rows].addcmul_(o_b, w_b)
    w0 = w[at[0]].unsqueeze(-1)
    if out is None:
        return acc.addcmul_(o0, w0), lse
    torch.addcmul(acc, o0, w0, out=out)
    return out, lse


def _bounds(rows: slice, n: int):
    return rows.start or 0, n if rows.stop is None else rows.stop


def _stack(blocks, n: int):
    """The blocks' log-sum-exps stacked ``[k, b, h, n]`` (fp32), ``−inf`` on the rows a block
    does not cover, and each block's index in the stack. Blocks with the same rows go in with
    one ``torch.stack`` (one kernel for all of them; a range short of ``n`` rows is stacked
    apart, copied into place and its other rows filled), so the stack costs a few kernels per
    distinct row range (dual-chunk causal rings have two: all rows, and the second half), not
    one per block."""
    groups = {}
    for i, (rows, _, _) in enumerate(blocks):
        groups.setdefault(_bounds(rows, n), []).append(i)
    l0 = blocks[0][2]
    stacked = torch.empty((len(blocks),) + tuple(l0.shape), dtype=torch.float32,
                          device=l0.device)
    k = 0
    for (lo, hi), members in groups.items():
        dst = stacked[k:k + len(members)]
        k += len(members)
        ls = [blocks[i][2] for i in members]
        if (lo, hi) == (0, n):
            torch.stack(ls, out=dst)
            continue
        dst[:, :, :, lo:hi].copy_(torch.stack(ls) if len(ls) > 1 else ls[0])
        if lo > 0:
            dst[:, :, :, :lo].fill_(float("-inf"))
        if hi < n:
            dst[:, :, :, hi:].fill_(float("-inf"))
    at = [0] * len(blocks)
    for pos, i in enumerate(i for members in groups.values() for i in members):
        at[i] = pos
    return stacked, at
