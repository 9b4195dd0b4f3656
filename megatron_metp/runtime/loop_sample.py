"""Fewer tiles for the fake-rank instruments: run a repeating loop's first and last passes only.

The streaming METP layer (:mod:`megatron_metp.ops.layer`) repeats the same passes over its token
tiles: per head group, every query tile runs the same K/V ring (``T_q`` tiles), every key
sub-block the same backward ring, every row tile the same projection + MLP ring (``T_rows``
tiles). Under ``FakeTensorMode`` nothing is computed, yet each pass still dispatches thousands of
fake ops: at 6M tokens a layer has 17 query tiles × 8 groups and 70 row tiles, and the measured
layers cost minutes each. Every pass allocates and frees the same shapes (balanced tiles, the
last one shorter), so the device memory of the loop is that of its first passes (the first one
warms up: nothing prefetched yet, accumulators allocated), its steady state and its last pass
(nothing to prefetch; the shorter tile).

:func:`sampling` (the instruments' switch; off by default, and training never enters it) makes
:func:`tiles` yield, of a loop of ``T`` passes, only passes ``0 .. first-1`` and
``T-last .. T-1`` (``first=2, last=1``: three passes), each with an index whose successor is the
next pass run, so that a pass prefetches the tile the loop visits next. What the skipped passes would have sent is kept by weights:
pass ``first-1`` (a steady-state pass) stands for itself and the ``T - first - last`` skipped
ones; :func:`weight` is the product of the current passes' weights over nested loops, and the
byte and message counters (``fakerank.CommCounter``, :class:`~megatron_metp.runtime.groups.
RingStats` via :mod:`.ring`) multiply by it, so the traffic of a sampled run equals the full
run's. ``tests/test_fast_dry.py`` checks peak, stored bytes and traffic of a sampled layer
against the full loop on a shrunk twin (many tiles), with negative controls.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")

_keep: Optional[Tuple[int, int]] = None  # (first, last) while sampling
_weights: List[int] = []  # the weight of the current pass of each open sampled loop
_stats = {"loops": 0, "passes": 0, "skipped": 0}


@contextlib.contextmanager
def sampling(first: int = 2, last: int = 1):
    """While open, :func:`tiles` runs only the first ``first`` and last ``last`` passes of each
    loop (``first >= 1``, ``last >= 0``); yields a dict of counts (``loops`` sampled,
    ``passes`` run, ``skipped``)."""
    global _keep
    if first < 1 or last < 0:
        raise ValueError(f"loop sampling keeps first >= 1 and last >= 0 passes, got "
                         f"first={first}, last={last}")
    old = _keep
    _keep = (int(first), int(last))
    for k in _stats:
        _stats[k] = 0
    try:
        yield _stats
    finally:
        _keep = old


def active() -> bool:
    """Whether a :func:`sampling` block is open."""
    return _keep is not None


def plan(count: int, first: int, last: int) -> List[Tuple[int, int]]:
    """``[(index, weight), ...]``: the passes of a loop of ``count`` that run and what each
    stands for (the weights sum to ``count``)."""
    if count <= first + last:
        return [(i, 1) for i in range(count)]
    kept = list(range(first)) + list(range(count - last, count))
    return [(i, (count - len(kept) + 1) if i == first - 1 else 1) for i in kept]


def tiles(items: Sequence[T]) -> Iterator[Tuple[int, T]]:
    """``enumerate(items)``, or while :func:`sampling` only the passes :func:`plan` keeps, each
    with its :func:`weight` set. The loops use the index only to prefetch the next pass's tile
    (``items[i + 1]``), so a kept pass is yielded with the index *before the next kept pass*:
    the tile it prefetches is the one the loop visits next, as in the full loop (a prefetch of
    a skipped tile would stay alive unread and inflate the peak)."""
    if _keep is None:
        yield from enumerate(items)
        return
    kept = plan(len(items), *_keep)
    _stats["loops"] += 1
    _stats["passes"] += len(kept)
    _stats["skipped"] += len(items) - len(kept)
    _weights.append(1)
    try:
        for j, (i, w) in enumerate(kept):
            _weights[-1] = w
            yield (kept[j + 1][0] - 1 if j + 1 < len(kept) else i), items[i]
    finally:
        _weights.pop()


def subset(items: Sequence[T], first: int = 3, last: int = 1) -> List[T]:
    """``list(items)``, or while :func:`sampling` only its first ``first`` and last ``last``
    (for passes that send nothing: the chunks of a row pass, whose next ``depth`` chunks are
    prefetched from the list itself, so three first chunks give the steady state of a
    prefetch depth of two)."""
    items = list(items)
    if _keep is None or len(items) <= first + last:
        return items
    _stats["loops"] += 1
    _stats["passes"] += first + last
    _stats["skipped"] += len(items) - first - last
    return items[:first] + items[len(items) - last:]


def weight() -> int:
    """How many passes the code running now stands for (1 unless inside sampled loops)."""
    w = 1
    for x in _weights:
        w *= x
    return w


__all__ = ["active", "plan", "sampling", "subset", "tiles", "weight"]
