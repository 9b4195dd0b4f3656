"""Progress lines of the fake-rank instruments (``metp measure``, the Megatron-LM dry run).

A measurement of a long job runs for minutes with nothing to show; :func:`attach` gives the
harness's ``MemTracker`` (:func:`.fakerank.tracker`) a :class:`Progress` that, ticked at every op
the tracker sees, prints a line whenever the model moves to another decoder layer or phase, and a heartbeat at
least every ``every_s`` seconds inside a long one, Megatron-style::

    measure 2 layers: layer 2/2 forward | 14,210 ops | elapsed 31.4 s
    measure 2 layers: layer 2/2 backward | 90,112 ops | elapsed 75.0 s

The layer is read from the tracker's module stack (``...layers.N``); the line goes to stderr
(the report stays on stdout). It costs one integer test per dispatched op and a look at the
module stack every 256 ops.
"""

from __future__ import annotations

import re
import sys
import time

_LAYER = re.compile(r"\.layers\.(\d+)(?:\.|$)")


def where(trk) -> str:
    """``layer i/L`` (1-based) of the deepest decoder layer the tracker is in, or the outermost
    other module's name, or ``""``."""
    parents = getattr(trk._mod_tracker, "parents", set())
    best = None
    for fqn in parents:
        m = _LAYER.search(fqn)
        if m:
            best = int(m.group(1))
    if best is not None:
        return f"layer {best + 1}"
    others = sorted((p for p in parents if p != "Global"), key=len)
    return others[-1].split(".")[-1] if others else ""


class Progress:
    """Prints ``label: <where>/<layers> <phase> | N ops | elapsed s`` (see the module docstring)
    for a model of ``layers`` decoder layers tracked by ``trk``; :meth:`tick` once per op (the
    harness's tracker calls it: :func:`attach`)."""

    def __init__(self, trk, label: str, layers: int, *, every_s: float = 60.0, stream=None):
        self.trk, self.label, self.layers, self.every_s = trk, label, layers, every_s
        self.out = stream or sys.stderr
        self.ops = 0
        self.t0 = self.last_t = time.perf_counter()
        self.last = (None, None)

    def line(self, place: str, phase: str) -> None:
        now = time.perf_counter()
        if place.startswith("layer "):
            place = f"{place}/{self.layers}"
        print(f"{self.label}: {place or 'model'} {phase} | {self.ops:,} ops | "
              f"elapsed {now - self.t0:,.1f} s", file=self.out, flush=True)
        self.last_t = now

    def tick(self) -> None:
        self.ops += 1
        if self.ops & 255:
            return
        state = (where(self.trk), "backward" if self.trk._mod_tracker.is_bw else "forward")
        if state != self.last or time.perf_counter() - self.last_t >= self.every_s:
            self.last = state
            self.line(*state)


def attach(trk, label: str, layers: int, **kw) -> Progress:
    """A :class:`Progress` ticked by the fake-rank tracker ``trk`` at every op it sees
    (:func:`megatron_metp.tools.fakerank.tracker_class`: no extra dispatch mode)."""
    trk.progress = Progress(trk, label, layers, **kw)
    return trk.progress
