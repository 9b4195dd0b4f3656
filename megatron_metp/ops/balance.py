"""Query tiles of the streaming METP layer, and how evenly they load the K/V ring's ranks.

The streaming layer (:mod:`.layer`, :mod:`.layer_attention`) runs the K/V ring once per *query
tile* of a rank's ``n`` local tokens; a ring moves at its slowest rank, step by step. Under the
causal ``dual_chunk`` layout (:func:`~megatron_metp.ops.ring_attention.block_plan`, ``c = n/2``)
rank ``r``'s block against rank ``j``'s keys is::

    j == r    all rows × all keys, causal        (the same for every rank)
    j <  r    all rows × keys [0, c)             |T|·c pairs for a tile T
    j >  r    rows [c, n) × all keys             |T ∩ [c, n)|·n pairs

so a ring step is balanced over the ranks iff every tile takes as many rows from the second chunk
as from the first: ``|T ∩ [c, n)| = |T|/2``. A contiguous tile lies in one chunk: at step
``t ≥ 1`` the ranks ``r < t`` then do nothing (first-chunk tile) or twice the others' work
(second-chunk tile).

:func:`query_tiles` is the one place the tiles are cut (the op and the planner call it). A tile
is a tuple of disjoint, increasing row ranges (slices); the op's tile tensor is their rows
concatenated in that order.

:func:`tile_step_work` counts, from the op's own plan (:func:`block_plan` clipped to the tile's
rows and the key sub-block by :func:`~megatron_metp.ops.windows.window_pieces`, a causal piece
counting ``m(m+1)/2`` pairs), the visible (query, key) pairs of every rank at every step of every
tile's ring; :func:`ring_imbalance` turns it into the ratio of the time a ring paced by its
busiest rank takes to the time of a perfectly balanced one::

    imbalance = Σ_{tile, step} max_r work / Σ_{tile, step} mean_r work

The forward visits block ``j = (r − t) mod p`` at step ``t``; the backward visits
``(r − 1 − t) mod p`` and its own block last, i.e. the same steps in a rotated order (its steps
``0…p−2`` are the forward's ``1…p−1``), so the figure is the same for both.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple, Union

from .documents import Piece

Tile = Tuple[slice, ...]


def _count(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a positive integer, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return v


def _contiguous(n: int, q: int) -> List[Tile]:
    from .slices import tile_slices

    return [(s,) for s in tile_slices(n, q)]


def balances(n: int, layout: str = "dual_chunk", causal: bool = True,
             packed: bool = False) -> bool:
    """Whether the balanced (mirrored) cut applies: causal ``dual_chunk`` attention of one
    document (``packed``: documents set the work, and their pieces are cut contiguously),
    an even ``n``. Elsewhere every off-diagonal block is whole or absent for every rank alike
    (non-causal: all full; ``contiguous``: ranks ``r > t`` full, the others nothing, whatever
    the cut), so the contiguous cut is kept."""
    return bool(causal) and layout == "dual_chunk" and not packed and n >= 2 and n % 2 == 0


def _mirrored(n: int, half_rows: int) -> List[Tile]:
    """Tiles taking rows ``[a, b)`` of the first chunk and their mirror ``[n − b, n − a)`` of
    the second (one range ``[a, n − a)`` where the two meet at ``c = n/2``)."""
    from .slices import tile_slices

    c = n // 2
    out: List[Tile] = []
    for s in tile_slices(c, half_rows):
        a, b = s.start, s.stop
        out.append((slice(a, n - a),) if b == c else (slice(a, b), slice(n - b, n - a)))
    return out


def query_tiles(n: int, q: int, layout: str = "dual_chunk", causal: bool = True,
                packed: bool = False) -> List[Tile]:
    """The query tiles of ``n`` local tokens, at most ``q`` tokens each (``q ≥ n``: one tile of
    everything): a list of tiles, each a tuple of row ranges (slices of ``[0, n)``).

    Causal ``dual_chunk`` (:func:`balances`): ``ceil(c/⌊q/2⌋)`` tiles, each rows ``[a, b)`` of
    the first chunk and the mirrored ``[n − b, n − a)`` of the second (``⌊q/2⌋`` rows of each
    at most, balanced as :func:`~megatron_metp.ops.tiles.tile_slices`; the last first-chunk
    range ends at ``c`` and its mirror starts there: that tile is one range). Every tile then
    has as many second-chunk rows as first-chunk rows, so every rank does the same work at
    every ring step, and every tile the same work in all (``|T|·n/2`` pairs on the diagonal
    block, up to its own causal squares). Else (packed documents, ``contiguous``, non-causal,
    odd ``n``) contiguous ranges of ``ceil(n/T)`` rows, ``T = ceil(n/q)``."""
    n = int(n)
    q = _count(q, "q (tokens per query tile)")
    if q >= n:
        return [(slice(0, max(n, 0)),)]
    if balances(n, layout, causal, packed):
        return _mirrored(n, max(1, q // 2))
    return _contiguous(n, q)


def kv_blocks(n: int, kv: Optional[int], layout: str = "dual_chunk", causal: bool = True,
              packed: bool = False) -> List[Tile]:
    """The key sub-blocks the backward's K/V ring carries one at a time (``kv`` keys each at
    most; ``None`` or ``kv ≥ n``: the whole block), as tiles (tuples of row ranges), cut as
    :func:`query_tiles` cuts queries: a sub-block of one chunk would load the ranks unevenly
    (``j < r`` sees only first-chunk keys), a mirrored one holds ``|K|/2`` keys of each."""
    if kv is None:
        return [(slice(0, int(n)),)]
    return query_tiles(n, _count(kv, "kv (keys per K/V sub-block)"), layout, causal, packed)


def tile_rows(tile: Union[slice, Tile]) -> int:
    """The number of rows of a tile (a slice or a tuple of slices)."""
    return sum(s.stop - s.start for s in as_tile(tile))


def tile_parts(tile: Union[slice, Tile]) -> List[Tuple[slice, int]]:
    """``[(range, offset)]``: each row range of a tile and where its rows start in the tile's
    own (concatenated) tensor."""
    out, off = [], 0
    for s in as_tile(tile):
        out.append((s, off))
        off += s.stop - s.start
    return out


def as_tile(tile: Union[slice, Tile]) -> Tile:
    """A tile as a tuple of slices (a bare slice: one range)."""
    return (tile,) if isinstance(tile, slice) else tuple(tile)


def _tiles(n: int, tiles, layout: str, causal: bool) -> List[Tile]:
    """``tiles`` as a list of tiles: an int is a tile size (:func:`query_tiles`)."""
    if isinstance(tiles, (list, tuple)):
        return [as_tile(t) for t in tiles]
    return query_tiles(n, tiles, layout, causal)


def _area(pc: Piece) -> int:
    rows, keys = pc.rows.stop - pc.rows.start, pc.keys.stop - pc.keys.start
    if pc.causal:
        return rows * (rows + 1) // 2
    return rows * keys


def _block_work(r: int, j: int, n: int, tile: Tile, keys: Tile, causal: bool,
                layout: str) -> int:
    """Visible pairs of rank ``r``'s tile ``tile`` against key rows ``keys`` of rank ``j``'s
    block (the op's pieces, clipped as the op clips them)."""
    from .ring_attention import block_plan
    from .windows import window_pieces

    plan = block_plan(r, j, n, causal, layout)
    if plan is None:
        return 0
    pieces = (Piece(plan[0], plan[1], plan[2], False),)
    return sum(_area(pc) for pc in window_pieces(pieces, tile, keys))


def tile_step_work(n: int, ring: int, tiles, causal: bool = True, layout: str = "dual_chunk",
                   kv_blocks: Optional[Sequence] = None) -> List[List[List[int]]]:
    """``work[tile][step][rank]``: visible (query, key) pairs of each rank at each forward ring
    step (step ``t``: rank ``r`` holds rank ``(r − t) mod ring``'s block) of each query tile's
    ring. ``tiles``: a list of tiles (:func:`query_tiles`' or slices) or a tile size in tokens.
    ``kv_blocks``: key sub-blocks (each a slice or tuple of slices) the ring carries one at a
    time (the backward's ``kv_rows``); a tile's steps are then ``len(kv_blocks)·ring``,
    sub-block by sub-block. Analytic (rectangle areas): fast for any ``n``."""
    n, p = int(n), _count(ring, "ring (ranks on the K/V ring)")
    tl = _tiles(n, tiles, layout, causal)
    kvs = [as_tile(k) for k in kv_blocks] if kv_blocks is not None else [(slice(0, n),)]
    # the block of (r, j) depends only on j's relation to r: compute each kind once per tile
    out = []
    for tile in tl:
        steps = []
        for keys in kvs:
            memo = {}
            for t in range(p):
                row = []
                for r in range(p):
                    j = (r - t) % p
                    kind = (j > r) - (j < r)
                    if kind not in memo:
                        memo[kind] = _block_work(r, j, n, tile, keys, causal, layout)
                    row.append(memo[kind])
                steps.append(row)
        out.append(steps)
    return out


def ring_imbalance(n: int, ring: int, tiles, causal: bool = True, layout: str = "dual_chunk",
                   kv_blocks: Optional[Sequence] = None) -> float:
    """``Σ max_r work / Σ mean_r work`` over every tile and step (:func:`tile_step_work`): the
    time of a ring paced by its busiest rank over a balanced ring's (1.0: balanced)."""
    return imbalance_figures(n, ring, tiles, causal, layout, kv_blocks)["imbalance"]


def imbalance_figures(n: int, ring: int, tiles, causal: bool = True,
                      layout: str = "dual_chunk", kv_blocks: Optional[Sequence] = None) -> dict:
    """``{"imbalance", "worst_step", "tiles", "steps"}``: :func:`ring_imbalance`, the largest
    ``max/mean`` of any single step with work, the tile count and the steps per tile."""
    work = tile_step_work(n, ring, tiles, causal, layout, kv_blocks)
    p = int(ring)
    busiest = mean = 0.0
    worst = 1.0
    for steps in work:
        for row in steps:
            m, avg = max(row), sum(row) / p
            busiest += m
            mean += avg
            if avg > 0:
                worst = max(worst, m / avg)
    return {"imbalance": busiest / mean if mean else 1.0, "worst_step": worst,
            "tiles": len(work), "steps": len(work[0]) if work else 0}
