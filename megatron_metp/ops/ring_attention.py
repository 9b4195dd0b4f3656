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

Messages: the K/V ring runs on the group's K/V process group (:attr:`METPGroup.kv_ring`: its own
communicator, so K/V never queues behind weight traffic). Forward: one exchange per step, posted
before the step's kernel. Backward: the first block's exchange (which a caller may post early,
:func:`post_first_kv`), then one batched exchange per step carrying the next step's K/V block and
the previous block's ``dK/dV`` sum (``p + 1`` batches for ``p > 2``).

Packed sequences (``cu_seqlens``, :mod:`.documents`): a query attends causally within its own
document. Each block runs the pieces of :func:`documents.block_pieces` (one masked piece, or
full/causal pieces per document for kernels without a mask; a block no document crosses is the
plain block); blocks without a same-document pair launch no kernel, forward and backward. The
pieces fold into zero/``−inf`` accumulators with :func:`lse.merge_masked_` (rows without a
visible key in a piece carry ``lse = −inf``, no NaN). Transfers: the forward ring stops after
:func:`documents.forward_steps` steps (the last step any rank needs: with ``contiguous`` and
documents inside ranks' blocks, no K/V is sent at all); no per-hop skipping, since a block
travelling on may be needed further along the ring (with ``dual_chunk``, rank ``j``'s block is
needed by rank ``j − 1``, ``p − 1`` hops on). The backward ring is unchanged (each block's
``dK/dV`` sum must travel home through every rank).

Fake-rank instruments: inside :func:`runtime.loop_sample.sampling` (never in training) the
forward and backward rings run only some of their steps (:func:`runtime.loop_sample.steps`: the
first of each run of steps alike in role and block pieces, :func:`_kind`), the messages of a
kept step weighted by the steps it stands for, and the kernel blocks counted in
``group.stats.blocks`` too; the deferred merge (``defer_merge``, every block's output kept)
runs every step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..runtime.finite import check_finite
from ..runtime import loop_sample
from ..runtime.groups import METPGroup, as_metp_group
from ..runtime.ring import RingExchanger
from . import documents
from . import lse as lse_ops
from .ring_blocks import block_plan
from ._first_order import first_order_only
from ._flat import FlatLayout
from .attention_kernels import select_kernel
from .ring_checks import check_attention_inputs, check_packed, shape_layout  # noqa: F401
from .windows import window_pieces


def _record_kernel(group: METPGroup, name: str) -> None:
    group.stats.kernels[name] = group.stats.kernels.get(name, 0) + 1


def _record_block(group: METPGroup, name: str) -> None:
    group.stats.blocks[name] = group.stats.blocks.get(name, 0) + loop_sample.weight()


def _kind(pieces) -> tuple:
    """What a ring step's memory depends on besides its role: its kernel pieces' query rows, key
    rows, causal and masked flags (not a mask's contents), for :func:`loop_sample.steps`."""
    return tuple((pc.rows.start, pc.rows.stop, pc.keys.start, pc.keys.stop, pc.causal, pc.masked)
                 for pc in pieces)


def kernel_pieces(r, j, n, p, causal, layout, cu, kernel, q):
    """The kernel calls of block ``(r, j)``: :class:`documents.Piece` s (``()``: skipped): the
    document pieces with ``cu`` (:func:`documents.block_pieces`), else the plain block plan
    (:func:`ring_blocks.block_plan`) as one piece. Shared with the latent ring
    (:mod:`.mla_ring`)."""
    if cu is not None:
        return documents.block_pieces(cu, r, j, n, p, layout, kernel.takes_mask(q))
    plan = block_plan(r, j, n, causal, layout)
    return () if plan is None else (documents.Piece(plan[0], plan[1], plan[2], False),)


def _window(pieces, q_rows: Optional[slice], k_rows: Optional[slice], n: int,
            key_tile: Optional[int]):
    """``pieces`` restricted to the query tile ``q_rows`` and the key sub-block ``k_rows`` of
    the ``n`` local rows, cut into key tiles (:func:`windows.window_pieces`); unchanged
    without any of them."""
    if q_rows is None and k_rows is None and key_tile is None:
        return pieces
    return window_pieces(pieces, q_rows if q_rows is not None else slice(0, n),
                         k_rows if k_rows is not None else slice(0, n), key_tile)


def _block_rows(q, k, q_rows, k_rows, block_rows) -> int:
    """The ``n`` local rows of a block (the plan's), from the tensors or ``block_rows``."""
    if k_rows is None:
        return k.shape[2]
    if block_rows is None:
        raise ValueError("k_rows (a key sub-block) needs block_rows, the local token count")
    return int(block_rows)


def _kv_ring(group: METPGroup) -> METPGroup:
    """The group K/V blocks travel on: the METP group's own K/V communicator where it has one
    (:attr:`METPGroup.kv`, a second process group of the same ranks, so the K/V ring never
    queues behind weight traffic), else the group itself."""
    return group.kv_ring


def ring_attention_forward(q, k, v, group: METPGroup, causal: bool, layout: str, scale: float,
                           kernel, kv_packed=None, defer_merge: bool = False, out=None,
                           cu_seqlens=None, q_rows: Optional[slice] = None,
                           key_tile: Optional[int] = None, k_rows: Optional[slice] = None,
                           block_rows: Optional[int] = None):
    """Heads-first ``q [b,hq,n,d]``, ``k, v [b,hkv,n,d]`` → ``(out [b,hq,n,d] fp32, lse fp32)``.

    Step 0 is this rank's own (diagonal) block, which covers every query row: it initialises
    the accumulators; each later block is folded in by :func:`lse.merge_`. The transfer of the
    next block is posted before each block's kernel (:meth:`RingExchanger.circulate`).
    ``kv_packed``: ``k`` and ``v`` already packed back to back in one buffer (``k, v`` views of
    it, as :class:`FlatLayout` lays them out), which the ring then consumes instead of a copy.
    ``defer_merge``: keep every block's output (16-bit) and fold them in once the final
    log-sum-exp is known (:func:`lse.combine`: every block's weight from one ``softmax`` over
    the stacked log-sum-exps, then one ``addcmul_`` per block into the fp32 output instead of a
    rescale of it: less than half the traffic, one kernel per block instead of
    :func:`lse.merge_`'s five, ``p`` block outputs alive).
    ``out``: where to write the output (``q``'s shape, any strides, e.g. ``q``'s dtype): the
    last fold writes it directly; returned instead of the fp32 accumulator.
    ``cu_seqlens``: checked document boundaries (tuple): :func:`_packed_forward`.
    ``q_rows``: ``q`` holds only these of the ``n`` local query rows (a query tile of the
    streaming layer, :mod:`.windows`: a slice, or a tuple of row ranges whose rows ``q`` holds
    concatenated, :mod:`.balance`); ``k_rows``: ``k``/``v`` (every rank's, on the ring) hold
    only these key rows of each block (a slice or a tuple of ranges; ``block_rows`` = ``n``
    must then be given);
    ``key_tile``: at most this many keys per kernel call. Any of them runs the pieces path of
    :func:`_packed_forward`."""
    if cu_seqlens is not None or q_rows is not None or key_tile is not None or \
            k_rows is not None:
        return _packed_forward(q, k, v, group, layout, scale, kernel, cu_seqlens, kv_packed, out,
                               causal=causal, q_rows=q_rows, key_tile=key_tile, k_rows=k_rows,
                               block_rows=block_rows)
    p, r, n = group.size, group.rank, q.shape[2]
    dest, out, lse = out, None, None
    kept = []
    layout_kv = FlatLayout.of([k, v])
    ring = RingExchanger(_kv_ring(group), "attention K/V (fwd)")
    payload = kv_packed if kv_packed is not None else (layout_kv.pack([k, v]) if p > 1 else None)
    if p > 1:
        def kind(t):
            plan = block_plan(r, (r - t) % p, n, causal, layout)
            return t == 0, t + 1 < p, None if plan is None else (
                plan[0].start, plan[0].stop, plan[1].start, plan[1].stop, plan[2])

        order = loop_sample.steps(p, None if defer_merge else kind)
        blocks = ring.circulate(payload, order=order)
    else:
        blocks = [(0, None)]
    for t, flat in blocks:
        j = (r - t) % p
        kj, vj = (k, v) if flat is None else layout_kv.unpack(flat)
        plan = block_plan(r, j, n, causal, layout)
        if plan is None:
            continue
        qs, ks, blk_causal = plan
        o_b, l_b = kernel.forward(q[:, :, qs], kj[:, :, ks], vj[:, :, ks], blk_causal, scale)
        _record_block(group, kernel.name)
        if defer_merge:
            kept.append((qs, o_b, l_b))
        elif out is None:  # j == r: every row
            out, lse = lse_ops.start(o_b, l_b)
        else:
            lse_ops.merge_(out[:, :, qs], lse[:, :, qs], o_b, l_b)
    _record_kernel(group, kernel.name)
    if defer_merge:
        return lse_ops.combine(kept, out=dest)
    if dest is not None:
        dest.copy_(out)
        out = dest
    return out, lse


def _packed_forward(q, k, v, group: METPGroup, layout: str, scale: float, kernel, cu, kv_packed,
                    dest, causal: bool = True, q_rows: Optional[slice] = None,
                    key_tile: Optional[int] = None, k_rows: Optional[slice] = None,
                    block_rows: Optional[int] = None):
    """:func:`ring_attention_forward` of a packed sequence (document boundaries ``cu``) or of a
    window (``q_rows``, ``key_tile``: :func:`windows.window_pieces`).

    Each block's pieces (:func:`documents.block_pieces`) fold into zero/``−inf`` accumulators by
    :func:`lse.merge_masked_` (a piece's rows without a visible key carry ``lse = −inf`` and add
    nothing); blocks without a visible pair launch no kernel. The ring runs only
    :func:`documents.forward_steps` steps: the K/V blocks no rank needs at later steps are not
    sent (the same count on every rank, computed from ``cu``)."""
    p, r = group.size, group.rank
    n = _block_rows(q, k, q_rows, k_rows, block_rows)
    layout_kv = FlatLayout.of([k, v])
    steps = (documents.forward_steps(cu, n, p, layout) if cu is not None else p) if p > 1 else 1
    ring = RingExchanger(_kv_ring(group), "attention K/V (fwd)")
    pieces = {}

    def pieces_at(t):
        if t not in pieces:
            pieces[t] = _window(kernel_pieces(r, (r - t) % p, n, p, causal, layout, cu, kernel, q),
                                q_rows, k_rows, n, key_tile)
        return pieces[t]

    if steps > 1:
        payload = kv_packed if kv_packed is not None else layout_kv.pack([k, v])
        order = loop_sample.steps(steps, lambda t: (t == 0, t + 1 < steps, _kind(pieces_at(t))))
        blocks = ring.circulate(payload, steps=steps, order=order)
    else:
        blocks = [(0, None)]
    out, lse = lse_ops.new_accumulators(q.shape, q.device)
    for t, flat in blocks:
        kj, vj = (k, v) if flat is None else layout_kv.unpack(flat)
        for pc in pieces_at(t):
            mask = documents.piece_mask(pc, q.device) if pc.masked else None
            o_b, l_b = kernel.forward(q[:, :, pc.rows], kj[:, :, pc.keys], vj[:, :, pc.keys],
                                      pc.causal, scale, mask=mask)
            _record_block(group, kernel.name)
            lse_ops.merge_masked_(out[:, :, pc.rows], lse[:, :, pc.rows], o_b, l_b)
    _record_kernel(group, kernel.name)
    if dest is not None:
        dest.copy_(out)
        out = dest
    return out, lse


def post_first_kv(k, v, group: METPGroup):
    """Post the backward's first K/V exchange (this rank's block to ``next``, ``prev``'s in):
    returns what :func:`ring_attention_backward` takes as ``first``, or ``None`` for ``p = 1``.
    Posting it early (before the previous head group's backward) hides it."""
    if group.size == 1:
        return None
    return post_first_kv_packed(FlatLayout.of([k, v]).pack([k, v]), group, aliases_kv=False)


def post_first_kv_packed(kv_packed, group: METPGroup, *, aliases_kv: bool = True):
    """:func:`post_first_kv` for K/V already packed in one buffer (``aliases_kv``: the ``k, v``
    given to the backward are views of it, so it is not reused as a receive buffer)."""
    if group.size == 1:
        return None
    ring = RingExchanger(_kv_ring(group), "attention K/V (bwd)")
    return ring.start(kv_packed, torch.empty_like(kv_packed), step=0), kv_packed, not aliases_kv


def ring_attention_backward(dout, q, k, v, out, lse, group: METPGroup, causal: bool, layout: str,
                            scale: float, kernel, first=None, dv_out=None, cu_seqlens=None,
                            q_rows: Optional[slice] = None, key_tile: Optional[int] = None,
                            k_rows: Optional[slice] = None, block_rows: Optional[int] = None):
    """Grads of :func:`ring_attention_forward`: ``(dq fp32, dk fp32, dv fp32)``, heads-first.

    ``dk, dv`` are complete (every rank's queries) for this rank's own K/V block. Rank ``r``
    visits blocks ``r−1, r−2, …, r+1`` and its own last; each block's fp32 ``dK/dV`` sum travels
    with it and ends at its owner. One batched exchange per step carries both the K/V block the
    next step needs (posted a step ahead, before this step's kernel) and the ``dK/dV`` sum of the
    previous step's block (waited for only after this step's kernel). ``first``: the first
    exchange from :func:`post_first_kv` if the caller posted it already. ``dv_out``: where to
    write ``dv`` (``v``'s shape, any strides and floating dtype), or a callable returning it
    (called at the last step): the own block's contribution is added into it directly (no fp32
    ``dv`` and no separate cast); then returned as ``dv``. ``cu_seqlens``: document
    boundaries (tuple): each block's pieces as in :func:`_packed_forward` (masked pieces with
    their mask); a block's pieces' ``dK/dV`` are summed over their key rows. The K/V and
    ``dK/dV`` ring itself is unchanged (every sum must travel home).

    ``q_rows``/``key_tile`` (the streaming layer's windows, :mod:`.windows`): ``q``, ``dout``,
    ``out``, ``lse`` hold only the query rows ``q_rows`` of the ``n`` local rows (``dq`` is
    theirs; ``dk``/``dv`` are this tile's contribution to the whole own block, summed over every
    rank's same tile), and each kernel call spans at most ``key_tile`` keys; every piece's
    ``dK/dV`` is added into the travelling sum as soon as it is computed (no block-sized
    temporary); ``k_rows``/``block_rows`` as in :func:`ring_attention_forward` (``dk``/``dv``
    are then the sub-block's). ``dv_out`` is not taken then.
    """
    p, r, nq, nk = group.size, group.rank, q.shape[2], k.shape[2]
    n = _block_rows(q, k, q_rows, k_rows, block_rows)
    windowed = q_rows is not None or key_tile is not None or k_rows is not None
    if windowed and dv_out is not None:
        raise ValueError("ring_attention_backward: dv_out is not taken with q_rows/key_tile")
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dq_started = [False]
    kv_layout = FlatLayout.of([k, v])
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    lse_rows = {}
    workspace = {}
    pieces = {}

    def pieces_of(j):
        if j not in pieces:
            pieces[j] = _window(kernel_pieces(r, j, n, p, causal, layout, cu_seqlens, kernel, q),
                                q_rows, k_rows, n, key_tile)
        return pieces[j]

    def kind(t):
        """Step ``t``'s role (first: no sum yet; posts the next K/V; the own block) and pieces
        (:func:`loop_sample.steps`)."""
        last = t == p - 1
        return (t == 0, not last and t + 1 <= p - 2, last,
                _kind(pieces_of(r if last else (r - 1 - t) % p)))

    def block_grads(kj, vj, j):
        """dq += this block's; returns ``(ks, dk_b, dv_b)`` or ``None`` (fully masked)."""
        pieces = pieces_of(j)
        if not pieces:
            return None
        got = [piece_grads(kj, vj, j, pc) for pc in pieces]
        return got[0] if len(got) == 1 else _sum_key_rows(got)

    def piece_grads(kj, vj, j, pc):
        qs, ks = pc.rows, pc.keys
        mask = documents.piece_mask(pc, q.device) if pc.masked else None
        key = (qs.start, qs.stop)
        if key not in lse_rows:  # one contiguous copy per distinct row range, not per block
            lse_rows[key] = lse[:, :, qs].contiguous()
        dq_b, dk_b, dv_b = kernel.backward(dout[:, :, qs], q[:, :, qs], kj[:, :, ks],
                                           vj[:, :, ks], out[:, :, qs], lse_rows[key],
                                           pc.causal, scale, workspace,
                                           **({} if mask is None else {"mask": mask}))
        _record_block(group, kernel.name)
        if dq_started[0]:
            dq[:, :, qs].add_(dq_b)
        else:
            _write_rows(dq, qs, dq_b, nq)
            dq_started[0] = True
        return ks, dk_b, dv_b

    def add_piece(acc, got, start):
        """Add one piece's ``(ks, dk_b, dv_b)`` into the sum ``acc`` (window mode); ``start``:
        ``acc`` is uninitialised (the piece's rows written, the others zeroed)."""
        ks, dk_b, dv_b = got
        dk_acc, dv_acc = kv_layout.unpack(acc)
        if start:
            _write_rows(dk_acc, ks, dk_b, nk)
            _write_rows(dv_acc, ks, dv_b, nk)
        else:
            dk_acc[:, :, ks].add_(dk_b)
            dv_acc[:, :, ks].add_(dv_b)

    def add_into(acc, grads, start=False, last=False):
        """Add a block's dK/dV into the sum ``acc``; ``start``: ``acc`` is uninitialised (the
        block's rows written, the others zeroed: no separate zero fill); ``last`` (the own,
        complete block) with ``dv_out``: dv's final sum goes straight there."""
        nonlocal dv_out
        dk_acc, dv_acc = kv_layout.unpack(acc)
        fused_dv = last and dv_out is not None
        if fused_dv and callable(dv_out):  # allocated only now: not alive during the ring
            dv_out = dv_out()
        if grads is None:
            if start:
                acc.zero_()
            if fused_dv:
                dv_out.copy_(dv_acc)
            return
        ks, dk_b, dv_b = grads
        if start:
            _write_rows(dk_acc, ks, dk_b, n)
            if fused_dv and ks == slice(0, n):
                dv_out.copy_(dv_b)
                return
            _write_rows(dv_acc, ks, dv_b, n)
        else:
            dk_acc[:, :, ks].add_(dk_b)
            if fused_dv and ks == slice(0, n):
                torch.add(dv_acc, dv_b, out=dv_out)
                return
            dv_acc[:, :, ks].add_(dv_b)
        if fused_dv:
            dv_out.copy_(dv_acc)

    def windowed_block(kj, vj, j, acc_of, start):
        """Window mode: each piece's grads added into ``acc_of()`` (which waits for the arriving
        sum on its first call) right after its kernel."""
        began = False
        for pc in pieces_of(j):
            got = piece_grads(kj, vj, j, pc)
            add_piece(acc_of(), got, start and not began)
            began = True
            got = None
        acc = acc_of()
        if start and not began:
            acc.zero_()

    def dq_done():
        if not dq_started[0]:  # every block masked (a window above the diagonal, say)
            dq.zero_()
        return dq

    if p == 1:
        acc = torch.empty(kv_layout.numel, dtype=torch.float32, device=q.device)
        if windowed:
            windowed_block(k, v, r, lambda: acc, True)
        else:
            add_into(acc, block_grads(k, v, r), start=True, last=True)
        dk, dv = kv_layout.unpack(acc)
        return dq_done(), dk, dv if dv_out is None else dv_out

    ring = RingExchanger(_kv_ring(group), "attention K/V + dK/dV (bwd)")
    pending, own, own_free = first if first is not None else post_first_kv(k, v, group)
    held = pending.wait()  # block r-1 (posted early by a caller that can)
    spare = own if own_free else torch.empty_like(own)  # own: free once the first step is done
    sums = [torch.empty(kv_layout.numel, dtype=torch.float32, device=q.device), None]
    cur = 0  # sums[cur]: the sum of the block being worked on
    for t in loop_sample.steps(p, kind):  # every step (the fake instruments: one per run)
        last = t == p - 1
        j = r if last else (r - 1 - t) % p
        sends, recvs = [], []
        prefetch = not last and t + 1 <= p - 2
        if prefetch:  # K/V of the next step's block (prev's current one)
            sends.append(held)
            recvs.append(spare)
        if t >= 1:  # pass the previous block's sum on; receive this block's
            if sums[1 - cur] is None:
                sums[1 - cur] = torch.empty_like(sums[cur])
            sends.append(sums[cur])
            recvs.append(sums[1 - cur])
        step = ring.exchange(sends, recvs, step=t + 1) if sends else None
        arrived = [False]

        def arrive(step=step, t=t, last=last):
            """The sum of this step's block (waits for it once: it travels during the first
            kernel of the step)."""
            nonlocal cur, held, spare
            if not arrived[0]:
                arrived[0] = True
                if step is not None:
                    step.wait()
                if t >= 1:
                    cur = 1 - cur
                if last:  # free what the ring no longer needs before the last sums (and dv_out)
                    sums[1 - cur] = None
                    held = spare = None
            return sums[cur]

        kv_j = (k, v) if last else kv_layout.unpack(held)
        if windowed:
            windowed_block(*kv_j, j, arrive, t == 0)
        else:
            grads = block_grads(*kv_j, j)
            add_into(arrive(), grads, start=t == 0, last=last)
            grads = None  # this block's dk/dv: not alive during the next kernel
        kv_j = step = None
        if prefetch:
            held, spare = spare, held
    dk, dv = kv_layout.unpack(sums[cur])
    return dq_done(), dk, dv if dv_out is None else dv_out


def _sum_key_rows(grads):
    """``(ks, dk, dv)`` (fp32) over the key rows spanned by pieces ``[(ks_i, dk_i, dv_i)]``."""
    lo, hi = min(g[0].start for g in grads), max(g[0].stop for g in grads)
    dk0 = grads[0][1]
    shape = dk0.shape[:2] + (hi - lo,) + dk0.shape[3:]
    dk = torch.zeros(shape, dtype=torch.float32, device=dk0.device)
    dv = torch.zeros(shape, dtype=torch.float32, device=dk0.device)
    for ks, dk_b, dv_b in grads:
        dk[:, :, ks.start - lo:ks.stop - lo].add_(dk_b)
        dv[:, :, ks.start - lo:ks.stop - lo].add_(dv_b)
    return slice(lo, hi), dk, dv


def _write_rows(acc, rows: slice, block, n: int) -> None:
    """``acc[:, :, rows] = block`` (cast to ``acc``'s dtype) and the other rows of ``acc``'s
    ``n`` zeroed: an accumulator's first contribution without a zero fill of the whole."""
    start, stop = rows.start or 0, n if rows.stop is None else rows.stop
    if start > 0:
        acc[:, :, :start].zero_()
    if stop < n:
        acc[:, :, stop:].zero_()
    acc[:, :, rows].copy_(block)


def _to_heads_first(t):
    return t.permute(1, 2, 0, 3).contiguous()


def _to_seq_first(t):
    return t.permute(2, 0, 1, 3)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, kernel, label, cu):
        check_finite(f"{label} (forward)", group, q=q, k=k, v=v)
        ctx.label = label
        qh, kh, vh = (_to_heads_first(t) for t in (q, k, v))
        out, lse = ring_attention_forward(qh, kh, vh, group, causal, layout, scale, kernel,
                                          cu_seqlens=cu)
        out = out.to(q.dtype)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.args = (group, causal, layout, scale, kernel)
        ctx.cu = cu
        return _to_seq_first(out).contiguous()

    @staticmethod
    @first_order_only("ring_attention")
    def backward(ctx, dout):
        check_finite(f"{ctx.label} (backward)", ctx.args[0], grad_output=dout)
        qh, kh, vh, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(_to_heads_first(dout.to(qh.dtype)), qh, kh, vh, out,
                                             lse, *ctx.args, cu_seqlens=ctx.cu)
        return (_to_seq_first(dq).to(qh.dtype), _to_seq_first(dk).to(kh.dtype),
                _to_seq_first(dv).to(vh.dtype), None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, causal: bool = True,
                   layout: str = "dual_chunk", softmax_scale: Optional[float] = None,
                   kernel: Optional[str] = None, label: str = "ring_attention",
                   cu_seqlens=None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, K/V on a ring.

    Args:
        q: ``[s/p, b, hq, d]`` this rank's queries (tokens in ``layout`` order).
        k, v: ``[s/p, b, hkv, d]`` this rank's keys/values; ``hq`` a multiple of ``hkv`` (GQA/MQA).
        group: :class:`~megatron_metp.runtime.groups.METPGroup` (or ProcessGroup, or ``None`` for p=1).
        causal: causal mask over *global* positions of ``layout``.
        layout: ``"dual_chunk"`` (Megatron CP order) or ``"contiguous"``; with ``cu_seqlens``
            also ``"balanced"`` (long documents dual-chunked over the ranks on their own, the
            rest together: balanced work; shard with :func:`documents.shard_documents`).
        softmax_scale: default ``1/sqrt(d)``.
        kernel: block kernel name (``"cudnn"``, ``"flash_attn_3"``, ``"flash_attn"``,
            ``"torch_flash"``, ``"reference"``); default ``$METP_ATTENTION_KERNEL`` or the best
            available (:mod:`.kernel_choice`). The one used is counted in ``group.stats.kernels``.
        label: names this call in NaN/Inf reports (:mod:`megatron_metp.runtime.finite`).
        cu_seqlens: packed documents: cumulative document lengths of the *global* sequence in
            natural token order ``[0, …, s]`` (list/tuple or 1-D integer tensor), identical on
            every rank; each query then attends causally within its own document only
            (:mod:`.documents`; needs ``causal=True``). Blocks without a same-document pair
            launch no kernel; the forward ring stops after the last step any rank needs.
            ``None``: one document (today's computation, unchanged).

    Returns: ``[s/p, b, hq, d]``. With replicated weights around it this is ring self-attention
    (sequence parallelism); inside :func:`metp_attention` it is the inner loop.
    """
    group = as_metp_group(group)
    try:
        check_attention_inputs(q, k, v, group, causal, shape_layout(layout))
        cu = check_packed(cu_seqlens, q.shape[0] * group.size, causal, layout, group.size)
        kern = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1])
    except ValueError as exc:
        refuse_together(group, op_label("ring_attention", label), exc)
        raise
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if agreement_checks_enabled():
        check_group_agrees(group, op_label("ring_attention", label), label=label, q=q, k=k, v=v,
                           causal=bool(causal), layout=layout, softmax_scale=float(scale),
                           kernel=kern.name, needs_grad=needs_grad(q, k, v),
                           cu_seqlens=None if cu is None else documents.cu_seqlens_digest(cu))
    return _RingAttentionFunction.apply(q, k, v, group, bool(causal), layout, float(scale), kern,
                                        label, cu)
