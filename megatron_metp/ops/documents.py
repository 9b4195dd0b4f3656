"""Document boundaries of a packed sequence: validation, per-rank maps, the doc-aware block plan.

A packed sequence of ``s`` tokens holds several documents back to back; ``cu_seqlens`` are their
cumulative lengths in natural token order, ``(0, c_1, …, s)``, the same on every rank (the global
sequence, not a rank's share). Document ``d`` is positions ``[c_d, c_{d+1})``. With documents,
query position ``x`` attends key position ``y`` iff ``doc(y) = doc(x)`` and ``y ≤ x``
(block-diagonal ∧ causal over *global* positions); RoPE positions restart at 0 at each document
start (:func:`document_positions`).

Layouts (:mod:`.sequence`): rank ``r`` of ``p`` holds ``n = s/p`` tokens as *runs* of consecutive
global positions (:func:`rank_runs`): ``dual_chunk`` two runs of ``c = n/2`` (chunks ``r`` and
``2p−1−r`` of ``2p``), ``contiguous`` one run of ``n`` (block ``r``). Chunks are aligned, so two
runs are either the same positions or disjoint.

Block plan (:func:`block_pieces`): the block of rank ``r``'s queries against rank ``j``'s keys is
cut into *pieces* ``(rows, keys, causal, masked)`` (local row slices). Per pair of runs, the
visible pairs are rectangles, one per document meeting both runs: a square causal one when the
runs are the same chunk, a full one when the key run precedes the query run (then at most one
document spans from the key run to the query run), none when the keys follow. Where no document
boundary cuts a causally related run pair the block is exactly the plain causal block
(:func:`~megatron_metp.ops.ring_attention.block_plan`). Otherwise a kernel that takes a mask
gets one masked piece over the rectangles' bounding box (its boolean mask from
:func:`piece_mask`), or the single rectangle as a plain piece; a kernel that does not (flash-attn)
gets each rectangle as its own full/causal piece (exact, more launches). A block with no visible
pair is ``()``: skipped, no kernel.

Work (:func:`attention_work`): visible score pairs per rank (``a·b`` per full rectangle,
``a(a+1)/2`` per causal one), and its max/mean over ranks (:func:`work_balance`).
"""

from __future__ import annotations

import bisect
import hashlib
import numbers
from functools import lru_cache
from typing import NamedTuple, Sequence, Tuple

import torch

from .sequence import LAYOUTS, local_positions


def check_cu_seqlens(cu_seqlens, s: int) -> Tuple[int, ...]:
    """``cu_seqlens`` as a tuple of Python ints, or ``ValueError`` naming it and the fix.

    Accepts a list/tuple of ints or a 1-D integer tensor (CPU or CUDA: one host read). Must be
    ``(0, …, s)``, strictly increasing (every document at least one token), no negatives."""
    fix = (f"pass the cumulative document lengths of the whole packed sequence, "
           f"[0, len_0, len_0+len_1, …, {s}], the same on every rank")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}; {fix}")
        if cu_seqlens.dtype == torch.bool or cu_seqlens.is_floating_point() \
                or cu_seqlens.is_complex():
            raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}; {fix}")
        values = tuple(int(v) for v in cu_seqlens.tolist())  # the one host read
    elif isinstance(cu_seqlens, (list, tuple)):
        bad = [v for v in cu_seqlens if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if bad:
            raise ValueError(f"cu_seqlens must hold integers, got {bad[0]!r} "
                             f"({type(bad[0]).__name__}); {fix}")
        values = tuple(int(v) for v in cu_seqlens)
    else:
        raise ValueError(f"cu_seqlens must be a list/tuple of ints or a 1-D integer tensor, got "
                         f"{type(cu_seqlens).__name__}; {fix}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens needs at least two entries [0, {s}], got {list(values)}; {fix}")
    neg = [v for v in values if v < 0]
    if neg:
        raise ValueError(f"cu_seqlens must not be negative, got {neg[0]}; {fix}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}; {fix}")
    if values[-1] != s:
        raise ValueError(f"cu_seqlens must end at the sequence length {s} (s/p local tokens × "
                         f"group size), got {values[-1]}; {fix}")
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ValueError(f"cu_seqlens must be strictly increasing (no empty document), got "
                             f"{values[i - 1]} then {values[i]} at index {i}; {fix}")
    return values


def cu_seqlens_digest(cu: Tuple[int, ...]) -> str:
    """A short value naming ``cu`` for the cross-rank agreement check."""
    h = hashlib.blake2b(repr(cu).encode(), digest_size=12).hexdigest()
    return f"{len(cu) - 1} documents, {cu[-1]} tokens, blake2b {h}"


# ---------------------------------------------------------------- layout maps

def rank_runs(rank: int, p: int, n: int, layout: str) -> Tuple[Tuple[int, int, int], ...]:
    """Rank ``rank``'s ``n`` local tokens as runs ``(local start, global start, length)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        return ((0, rank * n, n),)
    c = n // 2
    return ((0, rank * c, c), (c, (2 * p - 1 - rank) * c, c))


def to_layout_order(positions: torch.Tensor, p: int, s: int, layout: str):
    """``(rank, local index)`` of global natural-order ``positions`` (int64 tensors)."""
    if layout == "contiguous":
        n = s // p
        return positions // n, positions % n
    c = s // (2 * p)
    chunk, off = positions // c, positions % c
    first = chunk < p
    rank = torch.where(first, chunk, 2 * p - 1 - chunk)
    return rank, torch.where(first, off, off + c)


def document_ids(cu: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
    """Document index (int64) of each global position."""
    bounds = torch.tensor(list(cu), dtype=torch.int64, device=positions.device)
    return torch.bucketize(positions, bounds, right=True) - 1


def document_positions(cu: Sequence[int], rank: int, p: int, n: int, layout: str,
                       device=None) -> torch.Tensor:
    """Position of each of rank ``rank``'s ``n`` local tokens within its document (int64, local
    order): the RoPE positions of a packed sequence (``x − c_doc(x)``)."""
    pos = local_positions(rank, p, n, layout=layout, device=device)
    bounds = torch.tensor(list(cu), dtype=torch.int64, device=pos.device)
    return pos - bounds[document_ids(cu, pos)]


# ---------------------------------------------------------------- block plan

class Piece(NamedTuple):
    """One kernel call of a block: local query ``rows`` × local ``keys``; ``causal``: square,
    query ``i`` sees keys ``≤ i``; ``masked``: needs :func:`piece_mask` (else full/causal)."""
    rows: slice
    keys: slice
    causal: bool
    masked: bool


def _rectangles(cu, r, j, n, p, layout):
    """Visible rectangles ``(q_lo, q_hi, k_lo, k_hi, causal)`` (local rows) of block ``(r, j)``
    and whether any document boundary cuts a causally related pair of runs."""
    rects, cut = [], False
    for ql, qg, L in rank_runs(r, p, n, layout):
        for kl, kg, M in rank_runs(j, p, n, layout):
            if kg >= qg + L:  # every key after every query
                continue
            if kg == qg:  # the same chunk: one causal square per document in it
                d = bisect.bisect_right(cu, qg) - 1
                while cu[d] < qg + L:
                    lo, hi = max(cu[d], qg), min(cu[d + 1], qg + L)
                    rects.append((ql + lo - qg, ql + hi - qg, kl + lo - kg, kl + hi - kg, True))
                    d += 1
                cut = cut or _docs_in(cu, qg, qg + L) > 1
                continue
            # key run before the query run: only the document holding qg can span both
            d = bisect.bisect_right(cu, qg) - 1
            start, end = cu[d], cu[d + 1]
            if start >= kg + M:
                cut = True
                continue
            q_hi, k_lo = min(end, qg + L), max(start, kg)
            if q_hi != qg + L or k_lo != kg:
                cut = True
            rects.append((ql, ql + q_hi - qg, kl + k_lo - kg, kl + M, False))
    return rects, cut


def _docs_in(cu, lo, hi) -> int:
    """Number of documents meeting positions ``[lo, hi)``."""
    return bisect.bisect_right(cu, hi - 1) - bisect.bisect_right(cu, lo) + 1


@lru_cache(maxsize=4096)
def block_pieces(cu: Tuple[int, ...], r: int, j: int, n: int, p: int, layout: str,
                 masks: bool = True) -> Tuple[Piece, ...]:
    """The pieces of rank ``r``'s queries against rank ``j``'s keys (``()``: skip the block).

    ``masks``: the kernel takes a mask (one masked piece over the bounding box where the block
    has several rectangles); else one full/causal piece per rectangle."""
    from .ring_attention import block_plan

    rects, cut = _rectangles(cu, r, j, n, p, layout)
    if not rects:
        return ()
    if not cut:  # no boundary inside: the plain causal block
        qs, ks, causal = block_plan(r, j, n, True, layout)
        return (Piece(qs, ks, causal, False),)
    if len(rects) == 1 or not masks:
        return tuple(Piece(slice(a, b), slice(c, d), cz, False) for a, b, c, d, cz in rects)
    return (Piece(slice(min(x[0] for x in rects), max(x[1] for x in rects)),
                  slice(min(x[2] for x in rects), max(x[3] for x in rects)), False, True),)


def piece_mask(cu: Sequence[int], piece: Piece, r: int, j: int, n: int, p: int, layout: str,
               device=None) -> torch.Tensor:
    """Boolean ``[rows, keys]`` of a piece: ``True`` where ``doc(key) = doc(query)`` and
    ``key ≤ query`` (global positions)."""
    qpos = local_positions(r, p, n, layout=layout, device=device)[piece.rows]
    kpos = local_positions(j, p, n, layout=layout, device=device)[piece.keys]
    same = document_ids(cu, qpos).unsqueeze(1) == document_ids(cu, kpos).unsqueeze(0)
    return same & (kpos.unsqueeze(0) <= qpos.unsqueeze(1))


def forward_steps(cu: Tuple[int, ...], n: int, p: int, layout: str) -> int:
    """Ring steps the forward needs: ``1 +`` the largest ring distance ``(r − j) mod p`` of a
    block with a visible pair on any rank (the same on every rank; later steps, whose K/V
    blocks no rank would use, are neither sent nor computed)."""
    last = 0
    for r in range(p):
        for t in range(1, p):
            if t > last and _rectangles(cu, r, (r - t) % p, n, p, layout)[0]:
                last = t
    return last + 1


# ---------------------------------------------------------------- work

def _rect_pairs(rect) -> int:
    a, b, c, d, causal = rect
    return (b - a) * (b - a + 1) // 2 if causal else (b - a) * (d - c)


def attention_work(cu: Tuple[int, ...], p: int, layout: str = "dual_chunk") -> Tuple[int, ...]:
    """Visible (unmasked) score pairs of each rank's queries: its share of the attention work."""
    n = cu[-1] // p
    return tuple(sum(_rect_pairs(x) for j in range(p) for x in _rectangles(cu, r, j, n, p,
                                                                          layout)[0])
                 for r in range(p))


def work_balance(cu: Tuple[int, ...], p: int, layout: str = "dual_chunk") -> float:
    """``max / mean`` of :func:`attention_work` over ranks (1.0: perfectly balanced)."""
    work = attention_work(cu, p, layout)
    return max(work) * p / sum(work)


def plan_counts(cu: Tuple[int, ...], p: int, layout: str = "dual_chunk",
                masks: bool = True) -> dict:
    """Per-rank counts of the packed plan (``cu = (0, s)``: plain causal): ``launches`` block-kernel
    calls in one forward (the backward makes as many), ``pairs`` score pairs those kernels
    evaluate (a masked piece: its whole box; causal: the triangle), ``useful`` visible pairs,
    ``steps`` forward ring steps. Lists indexed by rank, except ``steps``."""
    cu = tuple(cu)
    n = cu[-1] // p
    out = {"launches": [0] * p, "pairs": [0] * p, "useful": [0] * p}
    for r in range(p):
        for j in range(p):
            for pc in block_pieces(cu, r, j, n, p, layout, masks):
                a, b = pc.rows.stop - pc.rows.start, pc.keys.stop - pc.keys.start
                out["launches"][r] += 1
                out["pairs"][r] += a * (a + 1) // 2 if pc.causal else a * b
    out["useful"] = list(attention_work(cu, p, layout))
    out["steps"] = forward_steps(cu, n, p, layout)
    return out
