"""The demo's report on rank 0 (:mod:`.demo` runs it): the side-by-side table of stock TP and METP
(loss per step, memory, bytes sent), the agreement check of the two loss curves, and the JSON and
PNG written to the output folder."""

from __future__ import annotations

import json
import os

__all__ = ["format_table", "check", "write_outputs"]


def _mib(n) -> str:
    return f"{n / 2**20:8.3f}"


def _human(n) -> str:
    for unit, div in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def format_table(res: dict) -> str:
    names = list(res["runs"])
    a, b = names
    w = max(len(a), len(b), 12)
    lines = ["", f"loss per iteration (same weights, same batches; fp32, {res['config']['world_size']} "
             f"gloo ranks)",
             f" iter | {a:>{w}} | {b:>{w}} | abs diff"]
    for r in res["loss_table"]:
        lines.append(f" {r['iteration']:4d} | {r[a]:{w}.6f} | {r[b]:{w}.6f} | {r['abs_diff']:.2e}")
    lines.append(f" max abs diff {res['max_abs_diff']:.2e}, max rel diff {res['max_rel_diff']:.2e} "
                 f"(tolerance {res['tolerance_rel']:.0e} rel)")
    lines += ["", "peak tensor memory of one training step per rank, MiB "
              "(MemTracker; Activation = allocated in forward, Temp = in backward)"]
    cats = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Buffer")
    lines.append(f" {'run':<{w}} rank | {'peak':>8} | " + " | ".join(f"{c:>10}" for c in cats))
    for n in names:
        for m in res["memory"][n]:
            lines.append(f" {n:<{w}} {m['rank']:4d} | {_mib(m['total'])} | "
                         + " | ".join(f"{_mib(m['by_category'][c]):>10}" for c in cats))
    lines += ["", "bytes sent per rank per step (all c10d ops; ring convention for collectives)"]
    for n in names:
        for t in res["traffic"][n]:
            ops = ", ".join(f"{k.strip('_')} {_human(v)}" for k, v in t["by_op_per_step"].items()
                            if v)
            lines.append(f" {n:<{w}} rank {t['rank']}: {_human(t['bytes_sent_per_step']):>10}"
                         f"  = {ops}")
            ring = t["metp_ring_stats_per_step"]
            if ring["steps"]:
                lines.append(f" {'':<{w}}         METPGroup.stats: {ring['steps']:.0f} transfers, "
                             f"{_human(ring['bytes_sent'])} sent, "
                             f"{_human(ring['bytes_received'])} received")
    return "\n".join(lines)


def check(res: dict):
    """``(ok, message)``: the loss curves agree within ``tolerance_rel`` at every iteration."""
    a, b = list(res["runs"])
    bad = [r for r in res["loss_table"] if r["rel_diff"] > res["tolerance_rel"]]
    if not bad:
        return True, (f"demo: {a} and {b} loss curves agree at all {len(res['loss_table'])} "
                      f"iterations (max rel diff {res['max_rel_diff']:.1e} <= "
                      f"{res['tolerance_rel']:.0e})")
    r = bad[0]
    return False, (f"demo: FAILED: loss curves differ by more than {res['tolerance_rel']:.0e} "
                   f"relative at {len(bad)} iteration(s); first at iteration {r['iteration']}: "
                   f"{a} {r[a]:.8f} vs {b} {r[b]:.8f} (rel diff {r['rel_diff']:.2e})")


def write_outputs(res: dict, out_dir: str):
    """``demo.json`` and ``demo.png`` under ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, "demo.json")
    with open(jpath, "w") as f:
        json.dump(res, f, indent=1)
    ppath = os.path.join(out_dir, "demo.png")
    _plot(res, ppath)
    return jpath, ppath


def _plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["runs"])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.2),
                                        gridspec_kw={"width_ratios": [1.25, 1, 1]})
    styles = [dict(color="tab:blue", marker="o", lw=2.5, ms=6, alpha=0.6),
              dict(color="tab:red", marker="x", lw=1.2, ms=7, ls="--")]
    for n, st in zip(names, styles):
        ls = res["runs"][n]["losses"]
        ax1.plot(range(1, len(ls) + 1), ls, label=n, **st)
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("lm loss")
    ax1.set_title(f"training loss (max |diff| {res['max_abs_diff']:.1e})")
    ax1.grid(alpha=0.3)
    ax1.legend()

    cats = [("Parameter", "parameters"), ("Gradient", "gradients"), ("Optstate", "optimizer"),
            ("Activation", "activations (fwd)"), ("Temp", "backward temps"), ("Buffer", "buffers")]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    labels, xs = [], []
    x = 0
    for n in names:
        for m in res["memory"][n]:
            labels.append(f"{n}\nrank {m['rank']}")
            bottom = 0.0
            for (c, lab), col in zip(cats, colors):
                v = m["by_category"].get(c, 0) / 2**20
                if not v:
                    continue
                ax2.bar(x, v, bottom=bottom, color=col, label=lab if x == 0 else None, width=0.7)
                bottom += v
            ax2.text(x, m["total"] / 2**20, f"{m['total'] / 2**20:.2f}", ha="center", va="bottom",
                     fontsize=8)
            xs.append(x)
            x += 1
        x += 0.5
    ax2.set_xticks(xs, labels, fontsize=8)
    ax2.set_ylabel("MiB")
    ax2.set_title("peak tensor memory of one step (MemTracker)")
    top = max(m["total"] for n in names for m in res["memory"][n]) / 2**20
    ax2.set_ylim(0, top * 1.35)
    ax2.legend(fontsize=7, loc="upper right", ncol=2)
    ax2.grid(axis="y", alpha=0.3)

    ops = sorted({k for n in names for t in res["traffic"][n] for k, v in t["by_op_per_step"].items()
                  if v})
    palette = plt.get_cmap("tab10")
    x, xs, seen = 0, [], set()
    for n in names:
        for t in res["traffic"][n]:
            bottom = 0.0
            for i, op in enumerate(ops):
                v = t["by_op_per_step"].get(op, 0) / 1024
                if not v:
                    continue
                ax3.bar(x, v, bottom=bottom, color=palette(i), width=0.7,
                        label=None if op in seen else op.strip("_"))
                seen.add(op)
                bottom += v
            ax3.text(x, bottom, f"{bottom:.0f}", ha="center", va="bottom", fontsize=8)
            xs.append(x)
            x += 1
        x += 0.5
    ax3.set_xticks(xs, labels, fontsize=8)
    ax3.set_ylabel("KiB sent per rank per step")
    ax3.set_title("communication (ring convention)")
    top = max(t["bytes_sent_per_step"] for n in names for t in res["traffic"][n]) / 1024
    ax3.set_ylim(0, top * 1.35)
    ax3.legend(fontsize=7, loc="upper left", ncol=2)
    ax3.grid(axis="y", alpha=0.3)
    c = res["config"]
    fig.suptitle(f"tiny GPT, {c['layers']} layers, hidden {c['hidden']}, seq {c['seq']}, "
                 f"global batch {c['global_batch']}, {c['world_size']} gloo CPU ranks, fp32: "
                 f"stock Megatron TP vs METP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
