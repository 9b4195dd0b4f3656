"""Shared machinery of the fake-memory benchmarks (``mlp_memory.py``, ``attention_memory.py``).

One measurement = one forward and one backward on rank 0 of a group of ``p`` ranks, with

* torch's ``fake`` process group (``init_process_group("fake", rank=0, world_size=p,
  store=FakeStore())``): every collective and send/recv is a no-op whose payload shapes are real;
* ``FakeTensorMode``: nothing is allocated, every shape and dtype is exact;
* ``torch.distributed._tools.mem_tracker.MemTracker``: follows every storage and reports the peak
  by category (PARAM, GRAD, ACT = allocated in forward, TEMP = allocated in backward, OTH = the
  caller's tensors).

Each group size runs in its own subprocess (a fresh world): :func:`run_worker` starts
``<script> --worker <json>``; the script's worker calls :func:`worker_loop`, which sets the world up
and prints one tagged JSON line per case.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20


# --------------------------------------------------------------------------- worker side

def init_fake_world(p):
    """Fake world of ``p`` ranks seen from rank 0; bf16 default dtype; shim (c) of
    ``reference/megatron-core-on-cpu.md`` (``torch.cuda.current_device`` → CPU), this process only."""
    import warnings

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=p, store=FakeStore())
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.set_default_dtype(torch.bfloat16)


def worker_loop(spec, tag, measure, setup=None):
    """Runs in a fresh process: one fake world of size ``spec["p"]``, then ``measure(case)`` for
    every case, each result printed as ``tag + json``. ``setup()`` runs once after the world."""
    init_fake_world(spec["p"])
    if setup is not None:
        setup()
    for case in spec["cases"]:
        t0 = time.perf_counter()
        try:
            res = measure(case)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            import traceback
            res = {"error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
        res.update(case)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        print(tag + json.dumps(res), flush=True)


def tracker_class():
    """MemTracker subclass that also records the largest forward+backward allocation (shared
    with ``metp measure``: :func:`megatron_metp.tools.measure.tracker_class`)."""
    from megatron_metp.tools.measure import tracker_class as impl

    return impl()


def snap(tracker, kind):
    """``{"total": bytes, "cat": {category: bytes}}`` of a MemTracker snapshot
    (:func:`megatron_metp.tools.measure.snap`)."""
    from megatron_metp.tools.measure import snap as impl

    return impl(tracker, kind)


def comm_counter_class():
    """A TorchDispatchMode class ``(p, watch=(), track_alloc=False)`` counting what a rank sends.

    * ``sent``: bytes sent by this rank through dispatched c10d ops, ring-algorithm convention:
      ``N`` for a send; ``2(p-1)/p·N`` for an all-reduce of ``N`` bytes; ``(p-1)/p·N`` for an
      all-gather or reduce-scatter whose full tensor is ``N`` bytes, and for a broadcast or a
      reduce of ``N`` bytes (pipelined chain; the rank average, whoever the root is).
    * ``ops``: dispatch count per c10d op name (``"<name> (not counted)"`` when no rule applies).
    * ``watched``: dispatch count of every ATen op whose name contains one of ``watch``.
    * with ``track_alloc``: ``max_alloc`` / ``max_alloc_op``, the largest single tensor any
      non-aliasing op returned (bytes) and that op's name; ``max_alloc_4d`` /
      ``max_alloc_4d_shape`` the same over 4-D tensors only (attention scores are 4-D).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def nbytes(t):
        return t.numel() * t.element_size()

    from megatron_metp.tools.measure import flat_tensors as tensors

    class _CommCounter(TorchDispatchMode):
        def __init__(self, p, watch=(), track_alloc=False):
            super().__init__()
            self.p = p
            self.sent = 0
            self.ops = {}
            self.watch = tuple(watch)
            self.watched = {}
            self.track_alloc = track_alloc
            self.max_alloc = 0
            self.max_alloc_op = None
            self.max_alloc_4d = 0
            self.max_alloc_4d_shape = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if func.namespace == "c10d":
                p = self.p
                if name == "send":
                    sent = sum(nbytes(t) for t in tensors(args[0]))
                elif name in ("recv_", "recv_any_source_"):
                    sent = 0
                elif name == "allreduce_":
                    sent = 2 * (p - 1) * sum(nbytes(t) for t in tensors(args[0])) // p
                elif name == "_allgather_base_":  # (output [N], input [N/p])
                    sent = (p - 1) * nbytes(args[1])
                elif name == "_reduce_scatter_base_":  # (output [N/p], input [N])
                    sent = (p - 1) * nbytes(args[0])
                elif name in ("broadcast_", "reduce_"):
                    sent = (p - 1) * sum(nbytes(t) for t in tensors(args[0])) // p
                elif name in ("barrier", "monitored_barrier_"):
                    sent = 0
                else:
                    sent = None
                key = name if sent is not None else name + " (not counted)"
                self.ops[key] = self.ops.get(key, 0) + 1
                self.sent += sent or 0
            elif self.watch and any(w in name for w in self.watch):
                self.watched[name] = self.watched.get(name, 0) + 1
            out = func(*args, **(kwargs or {}))
            if self.track_alloc and func.namespace != "c10d" and not any(r.alias_info is not None
                                                    for r in func._schema.returns):
                for t in tensors(out):
                    if nbytes(t) > self.max_alloc:
                        self.max_alloc, self.max_alloc_op = nbytes(t), name
                    if t.dim() == 4 and nbytes(t) > self.max_alloc_4d:
                        self.max_alloc_4d = nbytes(t)
                        self.max_alloc_4d_shape = [list(t.shape), str(t.dtype).replace("torch.", "")]
            return out

    return _CommCounter


def live_storage_class():
    """A TorchDispatchMode class that names what is alive at the peak.

    Every storage an op returns (and every tensor passed to ``add``) is recorded, weakly, with
    the op's name, the shape, the dtype and ``phase`` (set by the caller: "fwd" / "bwd"). After
    each op the live total is summed; at a new maximum the list of live storages is kept.
    ``top(k)`` groups that list by (op, shape, dtype, phase): ``[(bytes, count, op, shape, dtype,
    phase), ...]`` largest first. Costs a pass over the live storages per op: diagnostics only.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    class _LiveStorages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.info = WeakIdKeyDictionary()
            self.phase = "fwd"
            self.peak = 0
            self.peak_op = None
            self.at_peak = []

        def add(self, t, what):
            st = t.untyped_storage()
            if st not in self.info:
                self.info[st] = (what, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                 st.nbytes(), self.phase)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.add(t, func._schema.name.split("::")[-1])
            total = sum(v[3] for v in self.info.values())
            if total > self.peak:
                self.peak, self.peak_op = total, func._schema.name.split("::")[-1]
                self.at_peak = list(self.info.values())
            return out

        def top(self, k=12):
            agg = {}
            for what, shape, dt, nb, ph in self.at_peak:
                a = agg.setdefault((what, shape, dt, ph), [0, 0])
                a[0] += nb
                a[1] += 1
            rows = sorted(((nb, c) + key for key, (nb, c) in agg.items()), key=lambda r: -r[0])
            return [[nb, c, what, list(shape), dt, ph] for nb, c, what, shape, dt, ph in rows[:k]]

    return _LiveStorages


# --------------------------------------------------------------------------- driver side

def run_worker(script, tag, p, cases, timeout):
    """Run ``script --worker`` for the cases of one ``p``; a result (or an error) per case."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", json.dumps({"p": p, "cases": cases})]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return [dict(c, error=f"worker for p={p} timed out after {timeout} s") for c in cases]
    got = [json.loads(line[len(tag):]) for line in proc.stdout.splitlines()
           if line.startswith(tag)]
    if len(got) < len(cases):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        err = f"worker for p={p} exited {proc.returncode}: " + " | ".join(tail)
        got += [dict(c, error=err) for c in cases[len(got):]]
    return got


def run_workers(script, tag, groups, timeout, jobs=1):
    """``groups``: ``{key: (p, cases)}``; runs one worker per key, ``jobs`` at a time."""
    results = []
    items = list(groups.values())
    if jobs > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(jobs) as ex:
            for got in ex.map(lambda pc: run_worker(script, tag, pc[0], pc[1], timeout), items):
                results += got
    else:
        for p, cs in items:
            results += run_worker(script, tag, p, cs, timeout)
    return results


def fmt(v, nd=1):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def write_out(rows, path):
    """``.csv`` → CSV (dict values as JSON), anything else → JSON."""
    if path.endswith(".csv"):
        keys = []
        for r in rows:
            for k in r:
                if k not in keys and k not in ("traceback",):
                    keys.append(k)
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
                            for k, v in r.items()})
    else:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)


def add_run_args(ap, jobs: int = 1, timeout: float = 600) -> None:
    """The output and worker-process flags every memory benchmark takes."""
    import argparse

    ap.add_argument("--out", help="also write the results: .csv for CSV, anything else JSON")
    ap.add_argument("--jobs", type=int, default=jobs,
                    help=f"worker processes at once (default {jobs})")
    ap.add_argument("--timeout", type=float, default=timeout,
                    help=f"seconds per worker (default {timeout:g})")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
