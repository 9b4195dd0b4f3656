"""``metp plan --png``: per-rank memory vs sequence length and the longest sequence per mode
(matplotlib is imported when a chart is drawn)."""

from __future__ import annotations

import os
from typing import Iterable, List, Optional, Sequence

from .job_checks import validate
from .model import GiB, MODE_NAMES, MODES, Job, Model, layout
from .rank_memory import capacity_bytes, longest_seq, seq_step, worst_total

#: one colour per mode in every chart
COLORS = {"tp": "#1f77b4", "tp-sp": "#ff7f0e", "cp": "#9467bd", "ring": "#2ca02c",
          "metp": "#d62728", "metp+vocab": "#8c564b"}


def charts(model: Model, job: Job, path: str, modes: Sequence[str] = MODES,
           seqs: Optional[Iterable[int]] = None) -> List[str]:
    """Two PNGs: per-rank memory vs sequence length (``path``) and the longest sequence per mode
    (``path`` with ``-longest`` before the extension). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validate(model, job, modes)
    cap = capacity_bytes(job)
    longest = {m: longest_seq(model, job, m) for m in modes}
    top = max(max(longest.values()), 4 * seq_step(job, "metp"))
    if seqs is None:
        seqs = sorted({int(top * f) for f in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
                                                1.0, 1.1, 1.25)})
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in modes:
        q = seq_step(job, m)
        xs = sorted({max(q, (s // q) * q) for s in seqs})
        ys = [worst_total(model, job, m, s) / GiB for s in xs]
        ax.plot([x / 1024 for x in xs], ys, marker="o", ms=3, color=COLORS[m],
                label=f"{MODE_NAMES[m]} "
                f"({layout(m, job).describe()})")
    ax.axhline(cap / GiB, color="k", ls="--", lw=1,
               label=f"{job.hardware} − {job.reserve_gib:g} GiB reserve")
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel("planned memory per rank (GiB)")
    ax.set_ylim(0, 2.5 * cap / GiB)
    ax.set_title(f"{model.name}: per-rank memory, {job.width} GPUs per stage, {job.kernel} "
                 f"attention (planned)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    root, ext = os.path.splitext(path)
    path2 = f"{root}-longest{ext or '.png'}"
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{MODE_NAMES[m]}\n{layout(m, job).describe()}" for m in modes]
    vals = [longest[m] / 1024 for m in modes]
    bars = ax.bar(names, vals, color=[COLORS[m] for m in modes])
    for bar, v in zip(bars, vals):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}K" if v else "does not fit",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("longest sequence (K tokens)")
    ax.set_title(f"{model.name}: longest sequence on {job.width}×{job.hardware} per stage "
                 f"(planned)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path2, dpi=120)
    plt.close(fig)
    return [path, path2]
