"""METP vs stock TP side by side, from Megatron-LM training logs.

::

    python -m megatron_metp.compare --log metp=out/metp.log --log tp=out/tp.log --out out/

reads the logs ``pretrain_gpt.py`` prints (``scripts/compare_tp.sh`` runs both and calls this)
and writes, into ``--out``:

* ``compare.md``: a summary table (final and mean loss, time per iteration, throughput, peak
  memory) and the per-iteration losses and times, one column per run;
* ``iterations.csv`` (one row per iteration, the runs side by side) and ``summary.csv``;
* ``compare.png``: loss and time per iteration, and peak memory per run.

Lines read (Megatron-LM ``core_v0.16.1``, ``training_log`` and ``report_memory``):

* ``... iteration   N/  M | ... | elapsed time per iteration (ms): T | throughput per GPU
  (TFLOP/s/GPU): F | ... | lm loss: L | ... | grad norm: G | ...``
* ``[Rank R] (after N iterations) memory (MB) | allocated: A | max allocated: P | reserved: S |
  max reserved: Q``

The PNG is drawn by a small built-in rasteriser (no plotting library needed).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_FIELD = re.compile(r"\|\s*([^|:]+?):\s*([-+0-9.eE]+|nan|inf)\s*(?=\|)")
_MEMORY = re.compile(
    r"\[Rank (\d+)\]\s*\(after (\d+) iterations\) memory \(MB\)\s*\|\s*allocated:\s*([0-9.]+)"
    r"\s*\|\s*max allocated:\s*([0-9.]+)(?:\s*\|\s*reserved:\s*([0-9.]+))?"
    r"(?:\s*\|\s*max reserved:\s*([0-9.]+))?")

#: log field name -> key in :class:`Iteration`
_FIELDS = {
    "elapsed time per iteration (ms)": "elapsed_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops",
    "lm loss": "lm_loss",
    "grad norm": "grad_norm",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
}


@dataclass
class Iteration:
    iteration: int
    train_iters: int
    elapsed_ms: Optional[float] = None
    tflops: Optional[float] = None
    lm_loss: Optional[float] = None
    grad_norm: Optional[float] = None
    lr: Optional[float] = None
    global_batch_size: Optional[float] = None


@dataclass
class MemoryReport:
    rank: int
    after_iterations: int
    allocated_mb: float
    max_allocated_mb: float
    reserved_mb: Optional[float] = None
    max_reserved_mb: Optional[float] = None


@dataclass
class RunLog:
    iterations: List[Iteration] = field(default_factory=list)
    memory: List[MemoryReport] = field(default_factory=list)
    cpu: bool = False  # trained on CPU ranks (megatron_metp.megatron_lm.cpu): memory = RSS

    def peak_memory_mb(self) -> Optional[float]:
        """Largest ``max allocated`` any rank reported."""
        return max((m.max_allocated_mb for m in self.memory), default=None)

    def peak_reserved_mb(self) -> Optional[float]:
        vals = [m.max_reserved_mb for m in self.memory if m.max_reserved_mb is not None]
        return max(vals, default=None)


#: printed by ``python -m megatron_metp.megatron_lm.cpu`` (Megatron-LM on CPU ranks)
CPU_MARKER = "> METP_CPU: Megatron-LM on CPU ranks"


def parse_log(text: str) -> RunLog:
    """Training iterations and memory reports of one Megatron-LM log (any prefix per line, such
    as torchrun's or srun's rank labels, is ignored). Later lines for the same iteration (a
    restarted run) replace earlier ones."""
    run = RunLog()
    by_iter: Dict[int, Iteration] = {}
    for line in text.splitlines():
        if CPU_MARKER in line:
            run.cpu = True
        m = _ITER.search(line)
        if m and "elapsed time per iteration" in line:
            it = Iteration(iteration=int(m.group(1)), train_iters=int(m.group(2)))
            for name, value in _FIELD.findall(line[m.end() - 1:] + "|"):
                key = _FIELDS.get(name.strip())
                if key is not None:
                    setattr(it, key, float(value))
            by_iter[it.iteration] = it
            continue
        m = _MEMORY.search(line)
        if m:
            run.memory.append(MemoryReport(
                rank=int(m.group(1)), after_iterations=int(m.group(2)),
                allocated_mb=float(m.group(3)), max_allocated_mb=float(m.group(4)),
                reserved_mb=float(m.group(5)) if m.group(5) else None,
                max_reserved_mb=float(m.group(6)) if m.group(6) else None))
    run.iterations = [by_iter[k] for k in sorted(by_iter)]
    return run


def _mean(vals: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(run: RunLog, skip: int = 2) -> Dict[str, Optional[float]]:
    """Summary numbers of a run. Times and throughput average the iterations after the first
    ``skip`` (start-up, first-iteration compilation and allocation), or all but the first when
    there are too few."""
    its = run.iterations
    steady = its[skip:] if len(its) > skip else its[1:] or its
    return {
        "iterations": float(len(its)),
        "final_lm_loss": its[-1].lm_loss if its else None,
        "mean_lm_loss": _mean([i.lm_loss for i in its]),
        "mean_elapsed_ms": _mean([i.elapsed_ms for i in steady]),
        "mean_tflops_per_gpu": _mean([i.tflops for i in steady]),
        "peak_max_allocated_mb": run.peak_memory_mb(),
        "peak_max_reserved_mb": run.peak_reserved_mb(),
    }


# ------------------------------------------------------------------------------ tables

_SUMMARY_ROWS = [
    ("iterations", "iterations logged", "{:.0f}"),
    ("final_lm_loss", "final lm loss", "{:.6f}"),
    ("mean_lm_loss", "mean lm loss", "{:.6f}"),
    ("mean_elapsed_ms", "time per iteration (ms)", "{:,.1f}"),
    ("mean_tflops_per_gpu", "throughput per GPU (TFLOP/s)", "{:,.1f}"),
    ("peak_max_allocated_mb", "peak memory, max allocated (MB)", "{:,.0f}"),
    ("peak_max_reserved_mb", "peak memory, max reserved (MB)", "{:,.0f}"),
]


def _fmt(v: Optional[float], spec: str) -> str:
    return "" if v is None else spec.format(v)


def markdown(runs: Dict[str, RunLog], skip: int = 2) -> str:
    """Summary and per-iteration tables, one column per run (ratio column for two runs)."""
    names = list(runs)
    sums = {n: summarize(r, skip) for n, r in runs.items()}
    ratio = len(names) == 2
    head = ["", *names] + ([f"{names[0]} / {names[1]}"] if ratio else [])
    out = [f"## {' vs '.join(names)}", "",
           f"Times and throughput: mean over iterations after the first {skip}.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, spec in _SUMMARY_ROWS:
        row = [label] + [_fmt(sums[n][key], spec) for n in names]
        if ratio:
            a, b = sums[names[0]][key], sums[names[1]][key]
            row.append(f"{a / b:.3f}" if a is not None and b and key != "iterations" else "")
        out.append("| " + " | ".join(row) + " |")
    diffs = loss_rel_diffs(runs) if ratio else {}
    if diffs:
        worst = max(diffs.values())
        out.append(f"| max lm loss rel. difference | {worst:.2e} over {len(diffs)} "
                   f"iterations |  |  |")
    if any(r.cpu for r in runs.values()):
        out += ["", "CPU ranks (megatron_metp.megatron_lm.cpu): times are CPU times, and the "
                    "memory columns are each process's resident set size, not GPU memory."]
    out += ["", "### Per iteration", ""]
    cols = ["iteration"] + [f"{n} {c}" for n in names for c in ("lm loss", "ms", "TFLOP/s")]
    cols += ["lm loss rel. diff"] if ratio else []
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for k in _all_iterations(runs):
        row = [str(k)]
        for n in names:
            it = _iteration(runs[n], k)
            row += [_fmt(it and it.lm_loss, "{:.6E}"), _fmt(it and it.elapsed_ms, "{:,.1f}"),
                    _fmt(it and it.tflops, "{:,.1f}")]
        if ratio:
            row.append(_fmt(diffs.get(k), "{:.1e}"))
        out.append("| " + " | ".join(row) + " |")
    mem = [(n, m) for n, r in runs.items() for m in r.memory]
    if mem:
        out += ["", "### Memory reports (MB)", "",
                "| run | rank | after iterations | allocated | max allocated | reserved | max reserved |",
                "|---|---|---|---|---|---|---|"]
        for n, m in mem:
            out.append(f"| {n} | {m.rank} | {m.after_iterations} | {m.allocated_mb:,.0f} | "
                       f"{m.max_allocated_mb:,.0f} | {_fmt(m.reserved_mb, '{:,.0f}')} | "
                       f"{_fmt(m.max_reserved_mb, '{:,.0f}')} |")
    return "\n".join(out) + "\n"


def loss_rel_diffs(runs: Dict[str, RunLog]) -> Dict[int, float]:
    """``{iteration: |loss_a − loss_b| / |loss_b|}`` for two runs, at the iterations both log
    (Megatron prints the loss with 7 significant digits: differences below ~1e-7 are not
    seen)."""
    a, b = runs.values()
    out = {}
    for k in _all_iterations(runs):
        ia, ib = _iteration(a, k), _iteration(b, k)
        if ia and ib and ia.lm_loss is not None and ib.lm_loss is not None and ib.lm_loss:
            out[k] = abs(ia.lm_loss - ib.lm_loss) / abs(ib.lm_loss)
    return out


def _all_iterations(runs: Dict[str, RunLog]) -> List[int]:
    return sorted({i.iteration for r in runs.values() for i in r.iterations})


def _iteration(run: RunLog, k: int) -> Optional[Iteration]:
    for it in run.iterations:
        if it.iteration == k:
            return it
    return None


def write_csv(runs: Dict[str, RunLog], out_dir: str, skip: int = 2) -> Tuple[str, str]:
    """``iterations.csv`` (runs side by side) and ``summary.csv``; returns their paths."""
    names = list(runs)
    it_path = os.path.join(out_dir, "iterations.csv")
    with open(it_path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["iteration"] + [f"{n}_{c}" for n in names
                                    for c in ("lm_loss", "elapsed_ms", "tflops_per_gpu",
                                              "grad_norm")])
        for k in _all_iterations(runs):
            row: List = [k]
            for n in names:
                it = _iteration(runs[n], k)
                row += ["" if it is None or v is None else v
                        for v in ((it.lm_loss, it.elapsed_ms, it.tflops, it.grad_norm)
                                  if it else (None,) * 4)]
            w.writerow(row)
    sum_path = os.path.join(out_dir, "summary.csv")
    with open(sum_path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["metric"] + names)
        sums = {n: summarize(r, skip) for n, r in runs.items()}
        for key, _, _ in _SUMMARY_ROWS:
            w.writerow([key] + ["" if sums[n][key] is None else sums[n][key] for n in names])
    return it_path, sum_path


# ------------------------------------------------------------------------------ PNG

# 5x7 bitmap glyphs (rows top to bottom, '#' = ink), drawn for this module.
_GLYPHS = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "####.....#....#.###.....#....#####.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "#####.....####.....#....#....#####.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "###..#..#.#...##...##...##..#.###..",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....##..#..##...",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##...##...##...##...#", "N": "#...###..##.#.##..###...##...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    " ": "." * 35, ".": "." * 30 + "..#..", ",": "." * 25 + "..#...#...",
    "-": "." * 15 + "#####" + "." * 15, "+": "." * 5 + "..#....#..#####..#....#...." + "." * 3,
    ":": "." * 5 + "..#.." + "." * 10 + "..#.." + "." * 10,
    "/": "....#....#...#...#...#...#....#....", "(": "...#...#...#....#....#.....#.....#.",
    ")": ".#.....#.....#....#....#...#...#...", "=": "." * 10 + "#####" + "." * 5 + "#####" + "." * 10,
    "%": "##...##..#...#...#...#...#..##...##", "_": "." * 30 + "#####",
}
_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


class _Canvas:
    def __init__(self, width: int, height: int, bg=(255, 255, 255)):
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def set(self, x: int, y: int, c) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c) -> None:
        for y in range(max(0, y0), min(self.h, y1)):
            for x in range(max(0, x0), min(self.w, x1)):
                self.set(x, y, c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c, width: int = 2) -> None:
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(width):
                for oy in range(width):
                    self.set(x0 + ox, y0 + oy, c)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, c=(0, 0, 0), scale: int = 2) -> int:
        """Draw ``s`` with its top-left at (x, y); returns the x after the last glyph."""
        for ch in s.upper():
            g = _GLYPHS.get(ch, _GLYPHS[" "])
            for r in range(7):
                for col in range(5):
                    if g[r * 5 + col] == "#":
                        self.rect(x + col * scale, y + r * scale, x + (col + 1) * scale,
                                  y + (r + 1) * scale, c)
            x += 6 * scale
        return x

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w: 3 * (y + 1) * self.w])
                       for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + \
                struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h,
                                                                     8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _tick(v: float) -> str:
    a = abs(v)
    if a >= 1e4:
        return f"{v:.3g}".replace("e+0", "e").replace("e+", "e")
    if a >= 100:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _panel_lines(cv: _Canvas, x0: int, y0: int, w: int, h: int, title: str,
                 series: List[Tuple[str, List[Tuple[float, float]]]]) -> None:
    cv.text(x0 + 10, y0 + 6, title)
    left, top, right, bottom = x0 + 70, y0 + 34, x0 + w - 14, y0 + h - 34
    cv.line(left, top, left, bottom, (0, 0, 0), 1)
    cv.line(left, bottom, right, bottom, (0, 0, 0), 1)
    pts = [p for _, s in series for p in s]
    if not pts:
        cv.text(left + 10, (top + bottom) // 2, "NO DATA")
        return
    xmin, xmax = min(p[0] for p in pts), max(p[0] for p in pts)
    ymin, ymax = min(p[1] for p in pts), max(p[1] for p in pts)
    if xmax == xmin:
        xmax = xmin + 1
    if ymax == ymin:
        ymin, ymax = ymin - 0.5 * (abs(ymin) or 1), ymax + 0.5 * (abs(ymax) or 1)
    sx = lambda x: left + (x - xmin) / (xmax - xmin) * (right - left)  # noqa: E731
    sy = lambda y: bottom - (y - ymin) / (ymax - ymin) * (bottom - top)  # noqa: E731
    for frac in (0.0, 0.5, 1.0):
        yv = ymin + frac * (ymax - ymin)
        cv.line(left - 4, sy(yv), left, sy(yv), (0, 0, 0), 1)
        cv.text(x0 + 2, int(sy(yv)) - 5, _tick(yv), scale=1)
    for xv in (xmin, xmax):
        cv.text(int(sx(xv)) - 6, bottom + 6, f"{xv:.0f}", scale=1)
    cv.text((left + right) // 2 - 27, bottom + 18, "ITERATION", scale=1)
    for k, (_, s) in enumerate(series):
        c = _COLORS[k % len(_COLORS)]
        for (xa, ya), (xb, yb) in zip(s, s[1:]):
            cv.line(sx(xa), sy(ya), sx(xb), sy(yb), c)
        if len(s) == 1:
            cv.rect(int(sx(s[0][0])) - 2, int(sy(s[0][1])) - 2, int(sx(s[0][0])) + 3,
                    int(sy(s[0][1])) + 3, c)


def _panel_bars(cv: _Canvas, x0: int, y0: int, w: int, h: int, title: str,
                bars: List[Tuple[str, Optional[float]]]) -> None:
    cv.text(x0 + 10, y0 + 6, title)
    left, top, right, bottom = x0 + 70, y0 + 34, x0 + w - 14, y0 + h - 34
    cv.line(left, bottom, right, bottom, (0, 0, 0), 1)
    vals = [v for _, v in bars if v is not None]
    if not vals:
        cv.text(left + 10, (top + bottom) // 2, "NO MEMORY REPORT")
        return
    vmax = max(vals) or 1.0
    slot = (right - left) // max(1, len(bars))
    for k, (name, v) in enumerate(bars):
        bx = left + k * slot + slot // 5
        if v is not None:
            ht = int(v / vmax * (bottom - top - 14))
            cv.rect(bx, bottom - ht, bx + 3 * slot // 5, bottom, _COLORS[k % len(_COLORS)])
            cv.text(bx, bottom - ht - 10, f"{v:.0f}", scale=1)
        cv.text(bx, bottom + 6, name[:12], scale=1)


def plot_png(runs: Dict[str, RunLog], path: str, skip: int = 2) -> str:
    """``compare.png``: lm loss and time per iteration (lines; times after the first ``skip``
    iterations), peak memory (bars)."""
    W, H = 1260, 430
    cv = _Canvas(W, H)
    names = list(runs)
    loss = [(n, [(i.iteration, i.lm_loss) for i in r.iterations if i.lm_loss is not None])
            for n, r in runs.items()]
    ms = [(n, [(i.iteration, i.elapsed_ms) for i in r.iterations
               if i.elapsed_ms is not None and i.iteration > skip]) for n, r in runs.items()]
    _panel_lines(cv, 0, 30, W // 3, H - 30, "LM LOSS", loss)
    _panel_lines(cv, W // 3, 30, W // 3, H - 30, f"MS PER ITERATION (AFTER {skip})", ms)
    _panel_bars(cv, 2 * W // 3, 30, W // 3, H - 30, "PEAK MAX ALLOCATED (MB)",
                [(n, r.peak_memory_mb()) for n, r in runs.items()])
    x = 10
    for k, n in enumerate(names):
        c = _COLORS[k % len(_COLORS)]
        cv.rect(x, 10, x + 14, 24, c)
        x = cv.text(x + 20, 10, n) + 24
    with open(path, "wb") as fh:
        fh.write(cv.png())
    return path


def compare(logs: Dict[str, str], out_dir: str, skip: int = 2) -> Dict[str, str]:
    """Parse ``{name: log path}``, write ``compare.md``, the CSVs and ``compare.png`` into
    ``out_dir``; returns the written paths by kind."""
    runs = {}
    for name, path in logs.items():
        with open(path, errors="replace") as fh:
            runs[name] = parse_log(fh.read())
        if not runs[name].iterations:
            raise ValueError(f"{path}: no training iteration lines found (is it the output of "
                             f"pretrain_gpt.py with --log-interval?)")
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "compare.md")
    with open(md, "w") as fh:
        fh.write(markdown(runs, skip))
    it_csv, sum_csv = write_csv(runs, out_dir, skip)
    png = plot_png(runs, os.path.join(out_dir, "compare.png"), skip)
    return {"markdown": md, "iterations_csv": it_csv, "summary_csv": sum_csv, "png": png}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_metp.compare",
        description="Side-by-side table (markdown + CSV) and plot (PNG) of Megatron-LM training "
                    "logs, e.g. METP against stock TP of the same degree.")
    ap.add_argument("--log", action="append", required=True, metavar="NAME=PATH",
                    help="a run's log; repeat for each run (first = numerator of the ratio)")
    ap.add_argument("--out", required=True, help="directory for compare.md/.csv/.png")
    ap.add_argument("--skip", type=int, default=2,
                    help="iterations left out of the time and throughput means (default 2)")
    opts = ap.parse_args(argv)
    logs = {}
    for item in opts.log:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            ap.error(f"--log wants NAME=PATH, got {item!r}")
        if name in logs:
            ap.error(f"run name {name!r} given twice")
        logs[name] = path
    try:
        paths = compare(logs, opts.out, opts.skip)
    except (OSError, ValueError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    with open(paths["markdown"]) as fh:
        print(fh.read())
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
