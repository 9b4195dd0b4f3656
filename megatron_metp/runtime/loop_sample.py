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

Ring steps (:func:`steps`): inside each query tile the K/V ring of :mod:`megatron_metp.ops.
ring_attention` runs ``p`` steps (``p·c`` with METP × CP: 32 at 16M tokens), forward and
backward. Its steps are not all alike, so they are sampled by *kind*: the caller gives each
step's kind, ``(role, shape)``: the role is what the step posts and holds (forward: the first
step, a step that posts the next block's transfer, the last that posts none; backward: the
first step (K/V prefetch only, no ``dK/dV`` sum yet), the steady steps (prefetch + sum), the
step before the own block (sum only), the own block (sum only; frees the ring's buffers)); the
shape is the block's kernel pieces (query rows, key rows, causal, masked: the diagonal causal
block, the half blocks of ``dual_chunk`` before and after the diagonal, a packed sequence's
document pieces). Of each maximal run of equal consecutive kinds only the first step runs, and
stands for the whole run (:func:`run_plan`). The warm-up steps and the last are runs of their
own by role (the first step, which finds no ``dK/dV`` sum yet; the last, which posts nothing
and frees the ring's buffers), so the first step of any other run is already a steady one.
Why this gives the full ring's bytes: a step's device memory is the ring's buffers (two K/V
blocks, two ``dK/dV`` sums: allocated by the second backward step, the same at every steady
step), the lasting per-row-range copies the backward caches (``lse`` rows: created at the first
step of a row range, and that step is always kept: a new row range is a new shape, so a new
run) and the step's kernel transients, which depend only on the pieces' shapes; so every
skipped step's peak equals that of its run's first step, every step of a run posts the same
exchange (so the weights give the full ring's bytes and messages), and the kept steps keep the
full ring's order (the buffers each step finds). Kinds that differ only in position (which
rank a block came from) are one run: at rank 0 under ``dual_chunk`` every off-diagonal block
is ``queries[c:] × all keys``, so a 32-step ring runs 3 steps forward (the own block, one half
block standing for 30, the last) and 4 backward (the first, one standing for 29, the step
before the own block, the own block). A block whose kind changes at every step (a packed
sequence's documents) runs most of its steps: correct, not faster. ``tests/test_fast_dry.py``
checks a sampled 12-step ring against the full one (peak, bytes, messages) at ranks 0 and 5
through each of the ring's code paths, and a METP 2 × CP 4 twin's measurement; negative
controls: the weights ignored, one run over the whole ring (roles ignored), roles without
shapes (a packed block that holds the peak is skipped).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")

_keep: Optional[Tuple[int, int]] = None  # (first, last) while sampling
_weights: List[int] = []  # the weight of the current pass of each open sampled loop
_stats = {"loops": 0, "passes": 0, "skipped": 0, "ring_steps": 0, "ring_skipped": 0}


@contextlib.contextmanager
def sampling(first: int = 2, last: int = 1):
    """While open, :func:`tiles` runs only the first ``first`` and last ``last`` passes of each
    loop (``first >= 1``, ``last >= 0``), :func:`steps` one step of each run of like ring steps;
    yields a dict of counts (``loops`` sampled, ``passes`` run, ``skipped``; ``ring_steps``
    run, ``ring_skipped``)."""
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


def run_plan(kinds: Sequence[Hashable], first: int = 1, last: int = 0) -> List[Tuple[int, int]]:
    """``[(step, weight), ...]``: :func:`plan` applied to each maximal run of equal consecutive
    ``kinds`` (one per step), the runs in order (the weights sum to ``len(kinds)``); by default
    each run's first step, weighted by the run's length."""
    out: List[Tuple[int, int]] = []
    start = 0
    for t in range(1, len(kinds) + 1):
        if t == len(kinds) or kinds[t] != kinds[start]:
            out.extend((start + i, w) for i, w in plan(t - start, first, last))
            start = t
    return out


def steps(count: int, kind: Optional[Callable[[int], Hashable]] = None) -> Iterator[int]:
    """``range(count)``, or while :func:`sampling` (and given ``kind``, step ``t`` → its kind:
    the module docstring) only the steps :func:`run_plan` keeps, in order, each with its
    :func:`weight` set while it runs (the messages it posts count that many times). Without
    ``kind`` every step runs (a loop whose steps cannot be sampled)."""
    if _keep is None or kind is None:
        yield from range(count)
        return
    kept = run_plan([kind(t) for t in range(count)])
    _stats["ring_steps"] += len(kept)
    _stats["ring_skipped"] += count - len(kept)
    _weights.append(1)
    try:
        for t, w in kept:
            _weights[-1] = w
            yield t
    finally:
        _weights.pop()


def weight() -> int:
    """How many passes the code running now stands for (1 unless inside sampled loops)."""
    w = 1
    for x in _weights:
        w *= x
    return w


__all__ = ["active", "plan", "run_plan", "sampling", "steps", "subset", "tiles", "weight"]
