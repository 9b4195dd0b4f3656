"""Windows of a ring-attention block: a tile of query rows × tiles of keys, as kernel pieces.

A ring step attends rank ``r``'s queries to the K/V block of rank ``j``: its plan is a few
*pieces* (:class:`~megatron_metp.ops.documents.Piece`: local query ``rows`` × local ``keys``,
full, causal or masked; :func:`~megatron_metp.ops.ring_attention.block_plan`,
:func:`~megatron_metp.ops.documents.block_pieces`), each one kernel call over every row and key
it spans. The streaming METP layer (:mod:`.layer`) runs the ring once per *tile of query rows*
(``rows = [r0, r1)`` of the ``n`` local rows; ``q`` then holds just those rows) and calls the
kernel on *tiles of keys* (at most ``key_tile`` keys per call), so that no transient of a kernel
call (the K/V expanded to the query heads, the block's ``dK/dV``) grows with ``n``.

:func:`clip_rect` cuts a visible rectangle ``(a, b, c, d, causal)`` (rows ``[a, b)`` × keys
``[c, d)``; ``causal``: square and aligned, row ``a + i`` sees key ``c + k`` iff ``k ≤ i``) to a
window ``[r0, r1) × [k0, k1)``. A full rectangle stays one rectangle. A causal one becomes at
most three, each a kernel's own mask kind (``i0 = r0' − a``, ``i1 = r1' − a`` the clipped rows,
``k0'``, ``k1'`` the clipped keys, all relative to the square)::

    keys [k0', min(k1', i0 + 1))          every row sees them         full
    keys [u, min(i1, k1')), u = max(k0', i0 + 1), rows [u, min(i1, k1'))   causal (square)
    keys [u, k1'), rows [k1', i1)         below the diagonal          full

so a window costs exactly its visible pairs, like the whole block. The ring itself may also
carry only a window of every rank's keys (``k_rows``: a sub-block of each K/V block, so that the
travelling K/V and ``dK/dV`` buffers are that size too).

:func:`window_pieces` applies this to a block's pieces: the result's ``rows`` are relative to the
window (``q[:, :, piece.rows]`` indexes the tile's own tensor), ``keys`` stay block-local. A
masked piece (CPU kernels with a mask) keeps one masked piece per key tile whose ``parts`` are
its clipped rectangles.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .documents import Piece

Rect = Tuple[int, int, int, int, bool]


def clip_rect(rect: Rect, r0: int, r1: int, k0: int, k1: int) -> List[Rect]:
    """The visible pairs of ``rect`` inside rows ``[r0, r1)`` × keys ``[k0, k1)`` as full and
    causal rectangles (see the module docstring); ``[]`` when none is visible."""
    a, b, c, d, causal = rect
    A, B, C, D = max(a, r0), min(b, r1), max(c, k0), min(d, k1)
    if A >= B or C >= D:
        return []
    if not causal:
        return [(A, B, C, D, False)]
    if b - a != d - c:
        raise ValueError(f"a causal rectangle must be square, got rows [{a}, {b}) × keys "
                         f"[{c}, {d})")
    i0, i1, j0, j1 = A - a, B - a, C - c, D - c  # the diagonal's coordinates
    out: List[Rect] = []
    full_hi = min(j1, i0 + 1)
    if j0 < full_hi:  # keys at or before the first row: every row sees them
        out.append((A, B, c + j0, c + full_hi, False))
    u = max(j0, i0 + 1)
    if u < j1 and u < i1:
        e = min(i1, j1)
        out.append((a + u, a + e, c + u, c + e, True))  # the diagonal's square
        if j1 < i1:  # rows past the last key see all of [u, j1)
            out.append((a + j1, B, c + u, c + j1, False))
    return out


def key_ranges(lo: int, hi: int, key_tile: Optional[int]) -> List[Tuple[int, int]]:
    """``[lo, hi)`` cut into consecutive ranges of at most ``key_tile`` keys (``None``: one)."""
    if key_tile is None or key_tile >= hi - lo:
        return [(lo, hi)]
    if key_tile < 1:
        raise ValueError(f"key_tile must be a positive number of keys, got {key_tile}")
    return [(k, min(k + key_tile, hi)) for k in range(lo, hi, key_tile)]


def _shift(rect: Rect, dr: int, dk: int = 0) -> Rect:
    a, b, c, d, causal = rect
    return (a - dr, b - dr, c - dk, d - dk, causal)


def _piece(rect: Rect) -> Piece:
    a, b, c, d, causal = rect
    return Piece(slice(a, b), slice(c, d), causal, False)


def _ranges(window) -> List[Tuple[int, int, int]]:
    """``[(start, stop, offset)]`` of a window (a slice or a tuple of disjoint slices): each
    range and where its rows start in the window's own (concatenated) tensor."""
    parts = (window,) if isinstance(window, slice) else tuple(window)
    out, off = [], 0
    for w in parts:
        a = w.start or 0
        out.append((a, w.stop, off))
        off += w.stop - a
    return out


def _merge_rows(pieces: List[Piece]) -> List[Piece]:
    """Full pieces with the same keys whose rows follow each other in the window's tensor as
    one piece (the ranges of a multi-range window meet there: one kernel call, not two)."""
    out: List[Piece] = []
    for pc in pieces:
        if not pc.causal and not pc.masked:
            for i, prev in enumerate(out):
                if not prev.causal and not prev.masked and prev.keys == pc.keys and \
                        prev.rows.stop == pc.rows.start:
                    out[i] = Piece(slice(prev.rows.start, pc.rows.stop), pc.keys, False, False)
                    break
            else:
                out.append(pc)
        else:
            out.append(pc)
    return out


def window_pieces(pieces: Sequence[Piece], rows, keys,
                  key_tile: Optional[int] = None) -> Tuple[Piece, ...]:
    """The kernel calls of ``pieces`` (one block's plan, block-local rows and keys) restricted to
    the query rows ``rows`` and the key rows ``keys``, cut into key tiles of at most
    ``key_tile`` keys (a grid starting at each key range's start, the same on every rank and
    step); rows and keys relative to the window's own ``q`` and K/V tensors.

    ``rows`` and ``keys`` are each a slice or a tuple of disjoint slices (a balanced query tile
    or key sub-block, :mod:`.balance`: its tensor holds the ranges' rows concatenated in that
    order); every piece then lies inside one row range and one key range, and full pieces with
    the same keys on consecutive row ranges are one call."""
    row_ranges, key_ranges_ = _ranges(rows), _ranges(keys)
    out: List[Piece] = []
    for pc in pieces:
        for r0, r1, roff in row_ranges:
            for kr0, kr1, koff in key_ranges_:
                out.extend(_window_one(pc, r0, r1, kr0, kr1, key_tile, r0 - roff,
                                       kr0 - koff))
    if len(row_ranges) > 1 or len(key_ranges_) > 1:
        out = _merge_rows(out)
    return tuple(out)


def _window_one(pc: Piece, r0: int, r1: int, kr0: int, kr1: int, key_tile: Optional[int],
                rshift: int, kshift: int) -> List[Piece]:
    """One piece clipped to rows ``[r0, r1)`` × keys ``[kr0, kr1)`` in key tiles, shifted by
    ``rshift`` rows and ``kshift`` keys into the window's tensors."""
    out: List[Piece] = []
    for k0, k1 in key_ranges(kr0, kr1, key_tile):
        if pc.keys.stop <= k0 or pc.keys.start >= k1:
            continue
        if pc.masked:
            parts = [_shift(x, rshift, kshift) for rect in pc.parts
                     for x in clip_rect(rect, r0, r1, k0, k1)]
            if not parts:
                continue
            if len(parts) == 1:
                out.append(_piece(parts[0]))
                continue
            a, b = min(x[0] for x in parts), max(x[1] for x in parts)
            c, d = min(x[2] for x in parts), max(x[3] for x in parts)
            out.append(Piece(slice(a, b), slice(c, d), False, True, tuple(parts)))
            continue
        rect = (pc.rows.start, pc.rows.stop, pc.keys.start, pc.keys.stop, pc.causal)
        out.extend(_piece(_shift(x, rshift, kshift)) for x in clip_rect(rect, r0, r1, k0, k1))
    return out
