"""Do the three instruments agree? The Megatron-LM dry run, ``metp plan`` and ``metp measure`` of
the same ``configs/*.sh``, per-rank totals side by side.

::

    python -m megatron_metp.tools.agreement [--megatron-lm-dir DIR] [--no-measure] \\
        [--measure-layers auto|full|N] [--json FILE] [CONFIG ...]      # default: every configs/*.sh

For each config (the mode is ``metp`` when ``METP > 1`` — the METP rank — and ``tp-sp`` or
``tp`` for a stock twin):

* **dry run**: ``scripts/pretrain_gpt.sh --config CONFIG --dry-run --json …``, i.e. the real
  Megatron-LM parser and model provider of the patched checkout under the fake-rank harness
  (:mod:`megatron_metp.tools.dry_run`); its total = parameters + gradient buffer + optimizer
  state (Megatron's settings) + measured activation peak;
* **plan**: ``metp plan --config CONFIG`` (:mod:`megatron_metp.tools.plan`), formulas only;
* **measure**: ``metp measure --config CONFIG`` (:mod:`megatron_metp.tools.measure`): the
  megatron-core model the plan describes, under the same harness; measured peak (parameters,
  fp32 gradient buffer, activations) + the planned optimizer state.

A row agrees when every pair is within ``--tolerance`` (default 3 %) of the dry run. The dry run's
notes (Transformer Engine or apex absent on this machine, and what stands in for them) are
printed under the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from . import plan as P
from .cli import mode_of, model_job
from .helptext import plain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 0.03


def dry_run(config: str, megatron_lm_dir: str, *, extra: Optional[List[str]] = None,
            env: Optional[Dict[str, str]] = None, timeout: float = 900) -> Dict:
    """The dry run's JSON report of ``config`` (``scripts/pretrain_gpt.sh ... --dry-run``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dry.json")
        cmd = ["bash", os.path.join(REPO, "scripts", "pretrain_gpt.sh"), "--config", config,
               "--dry-run", "--json", out] + list(extra or [])
        full_env = dict(os.environ, PYTHON=sys.executable, MEGATRON_LM_DIR=megatron_lm_dir,
                        OMP_NUM_THREADS="1", **(env or {}))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        if proc.returncode != 0 or not os.path.isfile(out):
            raise RuntimeError(f"dry run of {config} failed (exit {proc.returncode}):\n"
                               f"{(proc.stderr or proc.stdout)[-3000:]}")
        with open(out) as fh:
            return json.load(fh)


def compare(config: str, megatron_lm_dir: str, *, measure: bool = True,
            measure_layers: str = "auto", dry_env: Optional[Dict[str, str]] = None) -> Dict:
    """One row: the three totals (bytes) of ``config`` and their relative differences."""
    from . import measure as M

    model, job = model_job(config)
    mode = mode_of(job, config)
    mem = P.memory(model, job, mode)
    dry = dry_run(config, megatron_lm_dir, env=dry_env)
    row = {"config": os.path.basename(config), "mode": mode, "layout": P.layout(mode, job).describe(),
           "dry_run": dry["bytes"]["total"], "plan": mem.total, "notes": dry.get("notes", []),
           "dry_run_activations": dry["bytes"]["activations"],
           "plan_activations": mem.act.peak,
           # pinned host bytes per rank (offloaded activations, kept attention outputs)
           "dry_run_host": dry["bytes"].get("host", 0.0), "plan_host": mem.act.host,
           "gpus_per_node": dry.get("gpus_per_node", 8),
           "world": dry.get("world", {})}  # the dry run's parallel state (tp, cp, dp, ep, ...)
    if measure:
        res = M.measure(model, job, mode, measure_layers=measure_layers)[0]
        if "error" in res:
            raise RuntimeError(f"metp measure of {config} failed:\n{res['error']}")
        row["measure"] = res["peak"] + mem.static["optimizer"]
        row["measure_method"] = res.get("method", "")
    for key in ("plan", "measure"):
        if key in row:
            row[f"{key}_vs_dry_run"] = row[key] / row["dry_run"] - 1
    return row


def agrees(row: Dict, tolerance: float = TOLERANCE) -> bool:
    return all(abs(row[k]) <= tolerance for k in ("plan_vs_dry_run", "measure_vs_dry_run")
               if k in row)


def table(rows: List[Dict], tolerance: float = TOLERANCE) -> str:
    head = ["config", "mode", "dry run", "plan", "measure", "plan vs dry", "measure vs dry", ""]
    out = []
    for r in rows:
        m = r.get("measure")
        out.append([r["config"], r["layout"], P.fmt_bytes(r["dry_run"]), P.fmt_bytes(r["plan"]),
                    P.fmt_bytes(m) if m else "—",
                    f"{100 * r['plan_vs_dry_run']:+.2f} %",
                    f"{100 * r['measure_vs_dry_run']:+.2f} %" if m else "—",
                    "agree" if agrees(r, tolerance) else "DISAGREE"])
    ws = [max(len(str(x[i])) for x in out + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, ws)) + " |",
             "|" + "|".join("-" * (w + 2) for w in ws) + "|"]
    lines += ["| " + " | ".join(str(v).ljust(w) for v, w in zip(r, ws)) + " |" for r in out]
    hosts = [r for r in rows if r.get("dry_run_host") or r.get("plan_host")]
    if hosts:
        lines.append("host memory per node (dry run / plan): " + "; ".join(
            f"{r['config']} {P.fmt_bytes(r['dry_run_host'] * r['gpus_per_node'])} / "
            f"{P.fmt_bytes(r['plan_host'] * r['gpus_per_node'])}" for r in hosts))
    notes = sorted({n for r in rows for n in r["notes"]})
    lines += [f"dry-run note: {n}" for n in notes]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_metp.tools.agreement",
                                 description=plain(__doc__.split("\n\n")[0]))
    ap.add_argument("configs", nargs="*", help="configs/*.sh (default: all of them)")
    ap.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                    help="patched Megatron-LM checkout at core_v0.16.1 (default $MEGATRON_LM_DIR)")
    ap.add_argument("--no-measure", action="store_true", help="dry run and plan only")
    ap.add_argument("--measure-layers", default="auto", metavar="{auto,full,N}",
                    help="as the dry run's: measure N-1 and N layers and extrapolate ('auto': "
                         "full up to 4 layers, else 2)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help=f"largest relative difference that agrees (default {TOLERANCE})")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if not args.megatron_lm_dir:
        ap.error("no Megatron-LM checkout: pass --megatron-lm-dir or set MEGATRON_LM_DIR")
    configs = args.configs or sorted(glob.glob(os.path.join(REPO, "configs", "*.sh")))
    if "PRECISION" not in os.environ:  # the planner models bf16; the tiny CPU configs say fp32
        os.environ["PRECISION"] = "bf16"
        print("agreement: PRECISION=bf16 for every config (what metp plan models)",
              file=sys.stderr)
    rows = []
    for cfg in configs:
        rows.append(compare(cfg, args.megatron_lm_dir, measure=not args.no_measure,
                            measure_layers=args.measure_layers))
        print(f"{rows[-1]['config']}: done", file=sys.stderr, flush=True)
    print(table(rows, args.tolerance))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(agrees(r, args.tolerance) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
