"""Table and output helpers of the memory benchmarks (``mlp_memory.py``, ``attention_memory.py``,
``vocab_memory.py``). The fake-rank harness itself (fake world, MemTracker, message counter,
forked workers) is :mod:`megatron_metp.tools.fakerank`, shared with ``metp measure`` and the
Megatron-LM dry run.
"""

from __future__ import annotations

import csv
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
MiB = 2 ** 20


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
    ap.add_argument("--out", help="also write the results: .csv for CSV, anything else JSON")
    ap.add_argument("--jobs", type=int, default=jobs,
                    help=f"worker processes at once (default {jobs})")
    ap.add_argument("--timeout", type=float, default=timeout,
                    help=f"seconds per worker (default {timeout:g})")
