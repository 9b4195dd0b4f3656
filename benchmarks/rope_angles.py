"""Exact RoPE angles against Megatron's fp32 recipe: errors at long positions, cost per
micro-batch (issue 29; the tables of ``docs/positions.md``).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/rope_angles.py [--window 4096]
        [--tokens 16384,131072,1048576] [--ranks 32]

Model: Llama-3's RoPE (base 5·10⁵, head dim 128: 64 frequencies, the highest 1 rad per
position). For each end position N (1M = 2^20, 4M, 16M = 2^24, 32M, 2^31 − 1) the window of
the ``window`` positions below N:

* **angle error**: the largest ``|θ − θ_exact|`` (wrapped into ``[−π, π]``) over the window and
  the 64 frequencies, of Megatron's recipe (``RotaryEmbedding.get_emb(window, offset=N −
  window)``: an fp32 ``arange`` plus the offset, times fp32 ``inv_freq``; what a CP rank's or a
  document's rows are built with) and of :func:`megatron_metp.ops.rope.rope_angles`.
  ``θ_exact``: :func:`~megatron_metp.ops.rope.exact_theta` (fp64, ~1e-15 rad), itself checked
  here against mpmath at 50 digits on a sample;
* **distinct positions**: how many different fp32 positions Megatron's recipe gives the
  window's ``window`` positions (fewer: neighbouring tokens share a position);
* **relative-position error**: ``|⟨q_m, k_n⟩ − ⟨q_{m+Δ}, k_{n+Δ}⟩|`` for 64 random unit vector
  pairs (d = 128), ``n = m − δ`` for ``δ`` in 1, 16, 256, window − 1, ``m = N − 1`` against the
  same pair at ``(δ, 0)`` (``Δ = N − 1 − δ``): zero for exact RoPE; scores in fp64 from the fp32
  angles' cos/sin.

Cost per micro-batch, for ``n`` tokens of one rank at positions past 2^24: time (median of 3,
this CPU, one thread) and peak bytes (MemTracker) of ``rope_angles`` and of Megatron's recipe for
the same ``n`` rows, and the whole-sequence table Megatron's ``RotaryEmbedding.forward`` builds
(and caches) under CP before slicing a rank's rows, for ``s = n × ranks``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp.ops.rope import exact_theta, megatron_angles, rope_angles  # noqa: E402

ENDS = (("1M", 1 << 20), ("4M", 1 << 22), ("16M", 1 << 24), ("32M", 1 << 25),
        ("2^31", (1 << 31) - 1))
INV_FREQ = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
MiB = 2 ** 20


def _wrap(x: torch.Tensor) -> torch.Tensor:
    return torch.remainder(x + math.pi, 2 * math.pi) - math.pi


def check_reference(pos: torch.Tensor, ref: torch.Tensor, samples: int = 64) -> float:
    """Largest |exact_theta − mpmath| (mod 2π) on ``samples`` entries: the reference's error."""
    import mpmath

    mpmath.mp.dps = 50
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, pos.shape[0], (samples,), generator=gen).tolist()
    cols = torch.randint(0, INV_FREQ.shape[0], (samples,), generator=gen).tolist()
    worst = 0.0
    for i, j in zip(rows, cols):
        t = mpmath.mpf(int(pos[i])) * mpmath.mpf(float(INV_FREQ[j]))
        d = mpmath.mpf(float(ref[i, j])) - t  # exact difference, then mod 2π into [−π, π)
        d -= 2 * mpmath.pi * mpmath.floor(d / (2 * mpmath.pi) + mpmath.mpf(1) / 2)
        worst = max(worst, abs(float(d)))
    return worst


def _scores(q, k, theta_m, theta_n):
    """⟨rot(q, θ_m), rot(k, θ_n)⟩ in fp64 for pairs ``q, k [P, 2r]`` and angles ``[r]``."""
    def rot(v, th):
        r = th.shape[-1]
        c, s = torch.cos(th), torch.sin(th)
        v1, v2 = v[..., :r], v[..., r:]
        return torch.cat([v1 * c - v2 * s, v2 * c + v1 * s], dim=-1)

    return (rot(q, theta_m) * rot(k, theta_n)).sum(-1)


def error_rows(window: int):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    k = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    rows, ref_err = [], 0.0
    for name, end in ENDS:
        start = end - window
        pos = torch.arange(start, end)
        ref = exact_theta(pos, INV_FREQ)
        ref_err = max(ref_err, check_reference(pos, ref))
        recipes = {"megatron": megatron_angles(window, start, INV_FREQ)[:, 0, 0, :64].double(),
                   "exact": rope_angles(pos, INV_FREQ)[:, 0, 0, :64].double()}
        small = {"megatron": megatron_angles(window, 0, INV_FREQ)[:, 0, 0, :64].double(),
                 "exact": rope_angles(torch.arange(window), INV_FREQ)[:, 0, 0, :64].double()}
        row = {"end": name}
        fp32_pos = torch.arange(window, dtype=torch.float32) + start
        row["distinct"] = int(torch.unique(fp32_pos).numel())
        for rec, theta in recipes.items():
            row[f"{rec}_angle"] = float(_wrap(theta - ref).abs().max())
            worst = 0.0
            for d in (1, 16, 256, window - 1):
                far = _scores(q, k, theta[-1], theta[-1 - d])
                near = _scores(q, k, small[rec][d], small[rec][0])
                worst = max(worst, float((far - near).abs().max()))
            row[f"{rec}_relative"] = worst
        rows.append(row)
    return rows, ref_err


def _timed(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        del out
    return sorted(times)[len(times) // 2]


def _peak(fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        out = fn()
    del out
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def cost_rows(tokens, ranks: int):
    rows = []
    for n in tokens:
        start = (1 << 24) + 12_345
        pos = torch.arange(start, start + n)
        exact = lambda: rope_angles(pos, INV_FREQ, bounds=(start, start + n - 1))  # noqa: E731
        stock = lambda: megatron_angles(n, start, INV_FREQ)  # noqa: E731
        s = n * ranks
        rows.append({"tokens": n, "exact_s": _timed(exact), "megatron_s": _timed(stock),
                     "exact_peak": _peak(exact), "megatron_peak": _peak(stock),
                     "out_bytes": n * 128 * 4,
                     # fp32 [s, r] product, then the [s, 2r] table: both alive at the cat
                     "whole_table_bytes": s * 64 * 4 + s * 128 * 4})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--tokens", default="16384,131072,1048576",
                    help="tokens per rank of the cost table, comma-separated")
    ap.add_argument("--ranks", type=int, default=32,
                    help="sequence ring size for Megatron's whole-sequence table (s = n x ranks)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows, ref_err = error_rows(a.window)
    print(f"# errors against exact angles (Llama-3 RoPE, base 5e5, head dim 128), window of "
          f"{a.window:,} positions below N; reference (exact_theta, fp64) within {ref_err:.1e} rad of mpmath on 64 samples per N")
    print(f"| N | Megatron: distinct positions of {a.window:,} | Megatron: largest angle error (rad) | exact: largest angle "
          "error (rad) | Megatron: relative-position error | exact: relative-position error |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['end']} | {r['distinct']:,} | {r['megatron_angle']:.3g} | "
              f"{r['exact_angle']:.2g} | {r['megatron_relative']:.3g} | "
              f"{r['exact_relative']:.2g} |")
    print()
    print(f"# cost per micro-batch, n tokens of one rank past 2^24 (this CPU, 1 thread, median "
          f"of 3); Megatron's whole-sequence table for s = n x {a.ranks}")
    print("| n | exact: time | Megatron (n rows): time | exact: peak | Megatron (n rows): peak "
          "| angles kept | Megatron's whole-sequence table |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in cost_rows([int(t) for t in a.tokens.split(",")], a.ranks):
        print(f"| {r['tokens']:,} | {r['exact_s'] * 1e3:,.1f} ms | {r['megatron_s'] * 1e3:,.1f} ms "
              f"| {r['exact_peak'] / MiB:,.1f} MiB | {r['megatron_peak'] / MiB:,.1f} MiB | "
              f"{r['out_bytes'] / MiB:,.1f} MiB | {r['whole_table_bytes'] / MiB:,.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
