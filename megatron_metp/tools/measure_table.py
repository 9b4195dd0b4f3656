"""The text ``metp measure`` prints: the measured peak next to the plan, per mode, with its units.

By default the text fits :data:`.plan.textwidth.DEFAULT_WIDTH` (100) columns as ``metp plan``'s
does: the per-mode table in blocks of columns (each block repeating the mode), the comment lines
wrapped (:func:`.plan.textwidth.table_lines`, :func:`.plan.textwidth.wrap_lines`; ``unwrap()``
joins them back). ``width=None`` (``metp measure --wide``) prints the whole table, one line per
mode, as ``metp measure`` printed it before. Both end the table with :data:`LEGEND`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from . import plan as P
from .plan.textwidth import table_lines, wrap_lines

#: the units of every figure ``metp measure`` prints (the line under its table)
LEGEND = ("# units: MiB = 2^20 bytes, GiB = 2^30 bytes; s = the sequence length in tokens "
          "(s=131,072 is 128K, K = 1,024 tokens); figures of rank 0 (one GPU) unless a line says "
          "per node; diff = planned / measured peak - 1; sent/rank = the bytes rank 0 sends in "
          "the measured forward and backward; elapsed times in seconds (s)")

#: the table's columns after the mode
HEAD = ["layout", "measured peak", "planned", "diff", "+ optimizer (plan)", "= total",
        "stored meas/plan", "layer transient meas/plan (% of total)", "sent/rank",
        "peak at (meas)"]


def _error(r: Dict) -> str:
    """The last line of a failed measurement's traceback (at most 120 characters)."""
    return r["error"].strip().splitlines()[-1][:120]


def rows(model: "P.Model", job: "P.Job", modes: Sequence[str], results: Sequence[Dict],
         width: Optional[int]) -> List[List[str]]:
    """One row per mode: the mode, then a cell per column of :data:`HEAD`. A failed
    measurement's row names its error (``width`` given: ``ERROR (below)``, the error on a
    comment line of its own, which wraps)."""
    out = []
    for mode, r in zip(modes, results):
        lay = P.layout(mode, job).describe()
        if "error" in r:
            cell = "ERROR (below)" if width is not None else "ERROR: " + _error(r)
            out.append([mode, lay, cell] + [""] * (len(HEAD) - 2))
            continue
        mem = P.memory(model, job, mode)
        plan_b = mem.measured_part
        diff = 100 * (plan_b / r["peak"] - 1)
        opt = mem.static["optimizer"]
        stored_p = mem.act.stored + mem.act.persistent
        lt = r.get("layer_transient")
        lt_txt = "—" if lt is None else \
            (f"{P.fmt_bytes(lt)} / {P.fmt_bytes(mem.act.layer_transient)} "
             f"({100 * lt / (r['peak'] + opt):.1f} %)")
        out.append([mode, lay, P.fmt_bytes(r["peak"]), P.fmt_bytes(plan_b), f"{diff:+.2f} %",
                    P.fmt_bytes(opt), P.fmt_bytes(r["peak"] + opt),
                    f"{P.fmt_bytes(r['stored'])} / {P.fmt_bytes(stored_p)}", lt_txt,
                    P.fmt_bytes(r["sent"]), r["peak_phase"]])
    return out


def _whole_table(table: List[List[str]]) -> List[str]:
    """The table as one block, every column side by side (``--wide``: as before)."""
    head = ["mode"] + HEAD
    ws = [max(len(str(x[i])) for x in table + [head]) for i in range(len(head))]
    lines = [" | ".join(h.ljust(w) for h, w in zip(head, ws)), "-+-".join("-" * w for w in ws)]
    for r in table:
        lines.append(" | ".join(str(v).ljust(w) for v, w in zip(r, ws)))
    return lines


def measure_table(model: "P.Model", job: "P.Job", modes: Sequence[str], results: Sequence[Dict],
                  width: Optional[int] = None) -> str:
    """The table ``metp measure`` prints, measured next to planned per mode, with its heading
    comments and the units line: fitted to ``width`` columns, or whole (``width=None``)."""
    lines = [f"# measured vs planned, rank 0: {model.name} h={model.hidden} L={model.layers} "
             f"a={model.heads} ffn={model.ffn} vocab={model.vocab} s={model.seq:,} "
             f"b={job.micro_batch}, {job.kernel} attention, tp={job.tp} metp={job.metp} "
             + (f"cp={job.cp} " if job.cp > 1 else "")
             + f"pp={job.pp}" + (", METP vocabulary split" if job.vocab_parallel else ""),
             "# measured: torch fake process group + FakeTensorMode + MemTracker, one "
             "micro-batch fwd+bwd (×PP in flight) of megatron-core GPTModel, params + fp32 "
             "main_grad + activations; optimizer states are planned (not measured)"]
    table = rows(model, job, modes, results, width)
    body = _whole_table(table) if width is None else table_lines(table, HEAD, width)
    tail = [LEGEND]
    if width is not None:
        tail += [f"# {m}: ERROR: {_error(r)}" for m, r in zip(modes, results) if "error" in r]
    return "\n".join(wrap_lines(lines, width) + body + wrap_lines(tail, width))


def notes(model: "P.Model", job: "P.Job", modes: Sequence[str], results: Sequence[Dict],
          width: Optional[int] = None) -> str:
    """The comment lines under the table: each mode's measuring method and, with offloading,
    the layers offloaded and the pinned host memory (wrapped to ``width`` unless None)."""
    from .plan.host import host_report

    lines = []
    for mode, r in zip(modes, results):
        if "method" in r:
            lines.append(f"# {mode}: {r['method']}")
        if job.offload and "error" not in r:
            act = P.memory(model, job, mode).act
            lines.append(f"# {mode}: {act.offloaded_layers} of {act.layers} layers per stage "
                         f"offloaded, {act.layers - act.offloaded_layers} kept on the device"
                         + (" (as many as the node's host memory holds)"
                            if job.offload_layers is None and act.offloaded_layers < act.layers
                            else ""))
            lines.append(f"# {mode}: " + host_report(job, r.get("host_peak"), act.host))
    return "\n".join(wrap_lines(lines, width))
