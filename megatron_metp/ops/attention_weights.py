"""The METP attention's weight traffic: each head group's weights to every rank, their gradients home.

Head group ``g``'s ``linear_qkv`` rows ``Wqkv_g [rows, h]`` (and bias ``[rows]``) and
``linear_proj`` columns ``Wo_g [h, (A/p)·d]`` live on rank ``g`` (Megatron's TP shard ``g``).
Every rank attends every head group in turn (the same group on every rank at the same time: the
K/V ring exchanges blocks of one group), so:

* forward and backward: :func:`block_weights` yields, block by block of ``kb`` consecutive head
  groups, ``(Wqkv_block, bqkv_block, Wo_blockᵀ)`` from their owners (broadcasts; one
  all-gather per piece when one block holds every group), the next block's transfers posted
  before the current block is yielded;
* backward: :func:`deliver_grads` posts the reduce of each rank's contribution to a block's
  ``(dWqkv, dbqkv, dWoᵀ)`` to its owner(s); :func:`keep_owned` waits for them and keeps the
  pieces this rank owns (its shard's complete gradients).

Used by the separate op (:mod:`.attention`, any ``kb``) and the streaming layer (:mod:`.layer`,
``kb = 1``).
"""

from __future__ import annotations

import torch

from ..runtime.groups import METPGroup
from ..runtime.ring import RingExchanger
from ._flat import FlatLayout


def block_weights(group: METPGroup, wqkv, bqkv, wo, phase: str, kb: int, spares: int = 2):
    """Yield ``(i, (WQ, BQ, WOT))`` for the ``p/kb`` blocks of ``kb`` consecutive head groups, on
    every rank: ``WQ [kb·rows, h]`` and ``BQ [kb·rows]`` (or ``None``) the block's ``linear_qkv``
    rows, ``WOT [kb·A/p·d, h]`` its ``linear_proj`` columns transposed, each group's rows
    back to back, so that one GEMM serves the whole block (:func:`block_pieces`)."""
    yield from block_pieces(group, (wqkv, bqkv, wo.t()), phase, kb, spares)


def block_pieces(group: METPGroup, own, phase: str, kb: int, spares: int = 2,
                 what: str = "attention weights"):
    """Yield ``(i, pieces)`` for the ``p/kb`` blocks of ``kb`` consecutive head groups, on every
    rank: for each of this rank's pieces ``own`` (a tuple of tensors whose dim 0 holds one head
    group's rows, or ``None``s) the block's rows, each group's back to back
    (``[kb·rows, ...]``). :func:`block_weights` passes ``(Wqkv, bqkv, Woᵀ)``, multi-latent
    attention (:mod:`.mla`) its up-projections and ``Woᵀ``.

    Group ``g``'s pieces come from their owner (broadcasts; one all-gather per piece when the
    block holds every group); block ``i+1``'s transfers are posted before block ``i`` is yielded
    (two sets of receive buffers, used alternately), so they overlap block ``i``'s compute. An
    all-gather reads the owner's parameters as they are; a broadcast sends a copy (its root's
    buffer is written by the collective). ``spares``: receive buffers of one-group blocks
    (``kb = 1``), used in turn (3: a caller that pulls group ``g + 1`` while it still uses
    group ``g``'s, :func:`~megatron_metp.ops.layer_attention.weights_ahead`)."""
    p, r = group.size, group.rank
    if p == 1:
        yield 0, tuple(own)
        return
    ring = RingExchanger(group, f"{what} ({phase})")
    if kb == 1:  # one message per head group: its pieces packed back to back
        yield from _group_weights(ring, group, tuple(own), spares)
        return
    own = tuple(None if t is None else t.contiguous() for t in own)
    sets = [None, None]

    def buffers(i):
        if sets[i % 2] is None:
            sets[i % 2] = tuple(None if t is None else
                                torch.empty((kb * t.shape[0],) + tuple(t.shape[1:]),
                                            dtype=t.dtype, device=t.device) for t in own)
        return sets[i % 2]

    def post(i):
        if kb == p:  # every group in this block: one all-gather per piece
            bufs = buffers(i)
            return bufs, [ring.all_gather(buf, t, step=i) for buf, t in zip(bufs, own)
                          if t is not None]
        bufs = buffers(i)
        pend = []
        for gi in range(kb):
            g = i * kb + gi
            for buf, t in zip(bufs, own):
                if t is None:
                    continue
                view = buf[gi * t.shape[0]:(gi + 1) * t.shape[0]]
                if g == r:
                    view.copy_(t)
                pend.append(ring.broadcast(view, g, step=g))
        return bufs, pend

    pending = post(0)
    for i in range(p // kb):
        bufs, works = pending
        for w in works:
            w.wait()
        if i + 1 < p // kb:
            pending = post(i + 1)
        yield i, bufs


def _group_weights(ring: RingExchanger, group: METPGroup, own, spares: int = 2):
    """:func:`block_weights` for blocks of one head group: group ``g``'s ``(Wqkv, bqkv, Woᵀ)``
    packed in one buffer and broadcast from its owner, the next group's posted before this
    one is yielded (``spares`` receive buffers, used in turn)."""
    p, r = group.size, group.rank
    layout = FlatLayout.of(own)
    packed_own = layout.pack(own)
    spare = [None] * spares

    def post(g):
        if g == r:
            buf = packed_own
        else:
            if spare[g % spares] is None:
                spare[g % spares] = torch.empty_like(packed_own)
            buf = spare[g % spares]
        return ring.broadcast(buf, g, step=g)

    pending = post(0)
    for g in range(p):
        buf = pending.wait()
        if g + 1 < p:
            pending = post(g + 1)
        yield g, (own if g == r else tuple(layout.unpack(buf)))


def deliver_grads(ring: RingExchanger, group: METPGroup, kb: int, i: int, pieces):
    """Post the reduce of block ``i``'s fp32 gradient ``pieces`` (``[kb·rows_piece, ...]``
    each, or ``None``) to their owners: one reduce-scatter per piece when the block holds
    every group, else one reduce per group and piece. Returns ``[(piece, owner, pending, out)]``."""
    out = []
    p = group.size
    for j, t in enumerate(pieces):
        if t is None:
            continue
        rows = t.shape[0] // kb
        if kb == p:
            mine = torch.empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            out.append((j, group.rank, ring.reduce_scatter(mine, t, step=i), mine))
            continue
        for gi in range(kb):
            g = i * kb + gi
            view = t[gi * rows:(gi + 1) * rows]
            out.append((j, g, ring.reduce(view, g, step=g), view))
    return out


def deliver_flat(ring: RingExchanger, i: int, flat: torch.Tensor):
    """Post the reduce of head group ``i``'s gradients packed in one buffer ``flat`` (blocks of
    one group) to owner ``i``; returns the in-flight list :func:`keep_owned` takes."""
    return [(0, i, ring.reduce(flat, i, step=i), flat)]


def keep_owned(in_flight, rank, acc):
    """Wait for every reduce in ``in_flight``; those whose destination is this rank are its
    shard's complete gradient pieces."""
    for j, g, pending, view in in_flight:
        pending.wait()
        if g == rank:
            acc[j] = view
    return acc
