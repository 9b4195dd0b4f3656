"""Document boundaries of a packed sequence: validation, per-rank maps, the doc-aware block plan.

A packed sequence of ``s`` tokens holds several documents back to back; ``cu_seqlens`` are their
cumulative lengths in natural token order, ``(0, c_1, …, s)``, the same on every rank (the global
sequence, not a rank's share). Document ``d`` is positions ``[c_d, c_{d+1})``. With documents,
query position ``x`` attends key position ``y`` iff ``doc(y) = doc(x)`` and ``y ≤ x``
(block-diagonal ∧ causal over *global* positions); RoPE positions restart at 0 at each document
start (:func:`document_positions`).

Layouts (:mod:`.sequence`): rank ``r`` of ``p`` holds ``n = s/p`` tokens as *runs* of consecutive
global positions (:func:`rank_runs`): ``dual_chunk`` two runs of ``c = n/2`` (chunks ``r`` and
``2p−1−r`` of ``2p``), ``contiguous`` one run of ``n`` (block ``r``), and, for packed sequences
only, ``balanced`` (:func:`balanced_runs`): every document of at least ``2p·m`` tokens
(``m`` = :data:`BALANCED_MIN_CHUNK`) is dual-chunked *on its own*, its first ``2p·⌊L/2p⌋``
tokens cut into ``2p`` equal chunks and rank ``r`` holding chunks ``r`` and ``2p−1−r`` of it (the
per-sequence split Megatron's THD context parallelism makes); the rest (shorter documents and
those few tail tokens), concatenated in natural order as a *pool*, is dual-chunked as one
sequence. Local order: the long documents' chunks document by document, then the pool's two
chunks. A long document then costs every rank exactly the same causal work; ``dual_chunk`` over
a packed sequence does not balance (``benchmarks/packed.py``: max/mean up to ~1.9 at 128K).
``balanced`` needs only ``s`` divisible by ``2p``; one document, or only short ones, is exactly
``dual_chunk``. Shard tokens for it with :func:`shard_documents`. The runs of all ranks
partition the sequence.

Block plan (:func:`block_pieces`): the block of rank ``r``'s queries against rank ``j``'s keys is
cut into *pieces* ``(rows, keys, causal, masked)`` (local row slices). Per pair of runs, the
visible pairs are rectangles, one per document meeting both runs: a square causal one when the
runs are the same chunk, a full one when the key run precedes the query run (then at most one
document spans from the key run to the query run), none when the keys follow (``balanced``:
the runs are first cut at document boundaries and paired within each document). Where no document
boundary cuts a causally related run pair the block is exactly the plain causal block
(:func:`~megatron_metp.ops.ring_attention.block_plan`). Otherwise a kernel that takes a mask
gets the rectangles grouped (in row order, while a group's bounding box holds at most
:data:`MASK_WASTE` = 2× its visible pairs): a group of one is a plain full/causal piece, a larger
group one masked piece over its box (boolean mask: the union of its rectangles,
:func:`piece_mask`); a kernel that does not (flash-attn, CUDA torch_flash) gets each rectangle as
its own full/causal piece (exact work, more launches). A block with no visible pair is ``()``:
skipped, no kernel.

Work (:func:`attention_work`): visible score pairs per rank (``a·b`` per full rectangle,
``a(a+1)/2`` per causal one), and its max/mean over ranks (:func:`work_balance`).
"""

from __future__ import annotations

import bisect
import hashlib
import numbers
from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

import torch

from .ring_blocks import block_plan
from .layouts import PACKED_LAYOUTS
from .sequence import local_positions, unshard_sequence

#: ``balanced``: documents whose own chunks would have at least this many tokens are dual-chunked
#: on their own (smaller pieces cost more in launches than they gain in balance). Change it with
#: :func:`set_balanced_min_chunk` (the same value on every rank).
BALANCED_MIN_CHUNK = BALANCED_MIN_CHUNK_DEFAULT = 128


def set_balanced_min_chunk(tokens: int) -> int:
    """Set :data:`BALANCED_MIN_CHUNK` (clears the cached plans); returns the previous value."""
    global BALANCED_MIN_CHUNK
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"balanced min chunk must be a positive int, got {tokens!r}")
    before, BALANCED_MIN_CHUNK = BALANCED_MIN_CHUNK, tokens
    for fn in (balanced_runs, _rank_doc_runs, _rectangles, block_pieces, forward_steps):
        fn.cache_clear()
    return before


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

def check_layout(layout: str, cu, p: int) -> None:
    """ValueError unless ``layout`` can hold the packed sequence ``cu`` on ``p`` ranks."""
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout must be one of {PACKED_LAYOUTS}, got {layout!r}")
    if layout != "balanced":
        return
    if cu is None:
        raise ValueError("layout='balanced' (documents dual-chunked over the ranks) needs "
                         "cu_seqlens")
    if cu[-1] % (2 * p):
        raise ValueError(f"layout='balanced' needs the sequence length (cu_seqlens[-1] = "
                         f"{cu[-1]}) divisible by 2·p = {2 * p}; pad the packed sequence")


def rank_runs(rank: int, p: int, n: int, layout: str,
              cu: Tuple[int, ...] = None) -> Tuple[Tuple[int, int, int], ...]:
    """Rank ``rank``'s ``n`` local tokens as runs ``(local start, global start, length)``
    (``cu``: the documents, needed for ``balanced``)."""
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout must be one of {PACKED_LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        return ((0, rank * n, n),)
    if layout == "balanced":
        return balanced_runs(tuple(cu), rank, p)
    c = n // 2
    return ((0, rank * c, c), (c, (2 * p - 1 - rank) * c, c))


@lru_cache(maxsize=256)
def balanced_runs(cu: Tuple[int, ...], rank: int, p: int) -> Tuple[Tuple[int, int, int], ...]:
    """Rank ``rank``'s runs ``(local start, global start, length)`` in the ``balanced`` layout
    (module docstring): long documents' own chunks ``rank`` and ``2p−1−rank``, then the pool's."""
    q = 2 * p
    own, pool = [], []
    for d in range(len(cu) - 1):
        a, length = cu[d], cu[d + 1] - cu[d]
        c = length // q
        if c >= BALANCED_MIN_CHUNK:
            own.append((a, c))
            if length % q:
                pool.append((a + c * q, length % q))
        elif pool and pool[-1][0] + pool[-1][1] == a:  # contiguous with the pool's last piece
            pool[-1] = (pool[-1][0], pool[-1][1] + length)
        else:
            pool.append((a, length))
    runs, local = [], 0
    for a, c in own:
        for chunk in (rank, q - 1 - rank):
            runs.append((local, a + chunk * c, c))
            local += c
    pc = sum(length for _, length in pool) // q
    for chunk in (rank, q - 1 - rank):
        lo, hi, at = chunk * pc, (chunk + 1) * pc, 0  # pool coordinates
        for a, length in pool:
            s0, s1 = max(lo, at), min(hi, at + length)
            if s0 < s1:
                runs.append((local, a + s0 - at, s1 - s0))
                local += s1 - s0
            at += length
    return tuple(runs)


def layout_positions(rank: int, p: int, n: int, layout: str, cu=None,
                     device=None) -> torch.Tensor:
    """Global positions (int64) of rank ``rank``'s ``n`` tokens in local order (any layout of
    :data:`PACKED_LAYOUTS`; :func:`~megatron_metp.ops.sequence.local_positions` for the plain
    ones)."""
    if layout != "balanced":
        return local_positions(rank, p, n, layout=layout, device=device)
    return torch.cat([torch.arange(g, g + length, device=device)
                      for _, g, length in rank_runs(rank, p, n, layout, cu)])


def shard_documents(x: torch.Tensor, cu, rank: int, p: int, *, layout: str = "balanced",
                    seq_dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tokens of the full packed sequence ``x`` in ``layout`` order (a copy)."""
    cu = check_cu_seqlens(cu, x.shape[seq_dim])
    check_layout(layout, cu, p)
    pos = layout_positions(rank, p, cu[-1] // p, layout, cu, device=x.device)
    return x.index_select(seq_dim, pos)


def unshard_documents(parts: Sequence[torch.Tensor], cu, *, layout: str = "balanced",
                      seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_documents`: ``parts[r]`` is rank ``r``'s tokens."""
    p = len(parts)
    if layout != "balanced":
        return unshard_sequence(parts, layout=layout, seq_dim=seq_dim)
    cu = tuple(cu)
    n = cu[-1] // p
    pos = torch.cat([layout_positions(r, p, n, layout, cu) for r in range(p)])
    out = torch.cat(list(parts), dim=seq_dim)
    return out.index_select(seq_dim, torch.argsort(pos).to(out.device))


def to_layout_order(positions: torch.Tensor, p: int, s: int, layout: str, cu=None):
    """``(rank, local index)`` of global natural-order ``positions`` (int64 tensors)."""
    if layout == "balanced":
        n = s // p
        rank, idx = torch.empty(s, dtype=torch.int64), torch.empty(s, dtype=torch.int64)
        for r in range(p):
            pos = layout_positions(r, p, n, layout, cu)
            rank[pos], idx[pos] = r, torch.arange(n)
        return rank.to(positions.device)[positions], idx.to(positions.device)[positions]
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


def local_document_ids(cu: Sequence[int], rank: int, p: int, n: int, layout: str,
                       device=None) -> torch.Tensor:
    """Document index (int64) of each of rank ``rank``'s ``n`` local tokens (local order)."""
    return document_ids(cu, layout_positions(rank, p, n, layout, cu, device=device))


def document_positions(cu: Sequence[int], rank: int, p: int, n: int, layout: str,
                       device=None) -> torch.Tensor:
    """Position of each of rank ``rank``'s ``n`` local tokens within its document (int64, local
    order): the RoPE positions of a packed sequence (``x − c_doc(x)``)."""
    pos = layout_positions(rank, p, n, layout, cu, device=device)
    bounds = torch.tensor(list(cu), dtype=torch.int64, device=pos.device)
    return pos - bounds[document_ids(cu, pos)]


# ---------------------------------------------------------------- block plan

class Piece(NamedTuple):
    """One kernel call of a block: local query ``rows`` × local ``keys``; ``causal``: square,
    query ``i`` sees keys ``≤ i``; ``masked``: needs :func:`piece_mask` (else full/causal), the
    union of the visible rectangles ``parts`` ``(q_lo, q_hi, k_lo, k_hi, causal)`` (local rows)."""
    rows: slice
    keys: slice
    causal: bool
    masked: bool
    parts: tuple = ()


#: A masked piece covers a group of rectangles only while its box holds at most this many times
#: the group's visible pairs (bounds the masked kernel's wasted work; more pieces otherwise).
MASK_WASTE = 2.0


@lru_cache(maxsize=256)
def _rank_doc_runs(cu, rank, n, p, layout):
    """Rank ``rank``'s runs cut at document boundaries, by document: ``{doc: [(local, global,
    length), ...]}``."""
    out = {}
    for ql, qg, L in rank_runs(rank, p, n, layout, cu):
        d = bisect.bisect_right(cu, qg) - 1
        while cu[d] < qg + L:
            lo, hi = max(cu[d], qg), min(cu[d + 1], qg + L)
            out.setdefault(d, []).append((ql + lo - qg, lo, hi - lo))
            d += 1
    return out


def document_position_runs(cu: Sequence[int], rank: int, p: int, n: int,
                           layout: str) -> List[Tuple[int, int, int]]:
    """Rank ``rank``'s local tokens as runs of consecutive positions within documents, in local
    order: ``[(local start, position in its document, length), ...]`` (plain ints, no tensors:
    :func:`document_positions` is their expansion)."""
    cu = tuple(int(c) for c in cu)
    runs = [(ql, g - cu[d], L) for d, rs in _rank_doc_runs(cu, rank, n, p, layout).items()
            for ql, g, L in rs]
    return sorted(runs)


def _rectangles_by_document(cu, r, j, n, p, layout):
    """:func:`_rectangles` for any partition into runs: per document, each pair of its query
    and key pieces is causal (the same piece), full (keys before) or nothing."""
    keys = _rank_doc_runs(cu, j, n, p, layout)
    rects = []
    for d, qruns in _rank_doc_runs(cu, r, n, p, layout).items():
        for ql, qg, L in qruns:
            for kl, kg, M in keys.get(d, ()):
                if kg == qg:
                    rects.append((ql, ql + L, kl, kl + M, True))
                elif kg + M <= qg:
                    rects.append((ql, ql + L, kl, kl + M, False))
    return tuple(rects), len(cu) > 2  # one document: balanced is dual_chunk


@lru_cache(maxsize=4096)
def _rectangles(cu, r, j, n, p, layout):
    """Visible rectangles ``(q_lo, q_hi, k_lo, k_hi, causal)`` (local rows) of block ``(r, j)``
    and whether any document boundary cuts a causally related pair of runs (cached: the same
    plan serves every head-group block, layer and step)."""
    if layout == "balanced":
        return _rectangles_by_document(cu, r, j, n, p, layout)
    rects, cut = [], False
    for (ql, qg, L) in rank_runs(r, p, n, layout, cu):
        for (kl, kg, M) in rank_runs(j, p, n, layout, cu):
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
    return tuple(rects), cut


def _docs_in(cu, lo, hi) -> int:
    """Number of documents meeting positions ``[lo, hi)``."""
    return bisect.bisect_right(cu, hi - 1) - bisect.bisect_right(cu, lo) + 1


@lru_cache(maxsize=4096)
def block_pieces(cu: Tuple[int, ...], r: int, j: int, n: int, p: int, layout: str,
                 masks: bool = True) -> Tuple[Piece, ...]:
    """The pieces of rank ``r``'s queries against rank ``j``'s keys (``()``: skip the block).

    ``masks``: the kernel takes a mask (rectangles grouped while a group's box holds at most
    :data:`MASK_WASTE` times its visible pairs, one masked piece per group of several); else
    one full/causal piece per rectangle. Cached (the same plan serves every head-group block,
    layer and step)."""
    rects, cut = _rectangles(cu, r, j, n, p, layout)
    if not rects:
        return ()
    if not cut:  # no boundary inside: the plain causal block (balanced: one document)
        qs, ks, causal = block_plan(r, j, n, True, "contiguous" if layout == "contiguous"
                                    else "dual_chunk")
        return (Piece(qs, ks, causal, False),)
    if not masks:
        return tuple(_plain(x) for x in rects)
    return tuple(_plain(g[0]) if len(g) == 1 else _masked(g) for g in _groups(rects))


def _plain(rect) -> Piece:
    a, b, c, d, causal = rect
    return Piece(slice(a, b), slice(c, d), causal, False)


def _box(group):
    return (min(x[0] for x in group), max(x[1] for x in group),
            min(x[2] for x in group), max(x[3] for x in group))


def _masked(group) -> Piece:
    a, b, c, d = _box(group)
    return Piece(slice(a, b), slice(c, d), False, True, tuple(group))


def _groups(rects):
    """Rectangles grouped greedily (in row order) while a group's box stays within
    :data:`MASK_WASTE` times its visible pairs."""
    groups, cur, useful = [], [], 0
    for rect in sorted(rects):
        if cur:
            a, b, c, d = _box(cur + [rect])
            if (b - a) * (d - c) <= MASK_WASTE * (useful + _rect_pairs(rect)):
                cur.append(rect)
                useful += _rect_pairs(rect)
                continue
            groups.append(cur)
        cur, useful = [rect], _rect_pairs(rect)
    groups.append(cur)
    return groups


def piece_mask(piece: Piece, device=None) -> torch.Tensor:
    """Boolean ``[rows, keys]`` of a masked piece: the union of its rectangles, which is
    ``doc(key) = doc(query) ∧ key ≤ query`` over global positions within them."""
    r0, k0 = piece.rows.start, piece.keys.start
    mask = torch.zeros(piece.rows.stop - r0, piece.keys.stop - k0, dtype=torch.bool,
                       device=device)
    for a, b, c, d, causal in piece.parts:
        sub = mask[a - r0:b - r0, c - k0:d - k0]
        if causal:
            sub.copy_(torch.ones(b - a, d - c, dtype=torch.bool, device=device).tril())
        else:
            sub.fill_(True)
    return mask


@lru_cache(maxsize=256)
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
