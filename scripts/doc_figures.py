#!/usr/bin/env python
"""Regenerate the figures in README.md and docs/*.md that a tool prints, or check them.

::

    python scripts/doc_figures.py              # rewrite every planned figure (seconds)
    python scripts/doc_figures.py --check      # exit 1 naming the doc, block and figure that differ
    python scripts/doc_figures.py --list       # every marked figure, its class and command
    python scripts/doc_figures.py --slow [NAME ...] --megatron-lm-dir DIR   # + the measured ones

A figure lives between markers in a doc, a block of lines::

    <!-- figures: NAME (planned: COMMAND) -->
    ... what the tool prints, as the doc shows it ...
    <!-- /figures -->

or a value inside a sentence: ``<!-- figure: NAME -->31,912.75K<!-- /figure -->`` (HTML comments:
a rendered page shows only the value). :data:`FIGURES` says how each is made: class ``planned``
(``metp plan``: pure formulas, seconds; checked by ``tests/test_doc_figures.py`` and ``--check``)
or ``measured`` (a dry run or ``metp measure``: minutes, a Megatron-LM checkout; their marker
says when, where and by which command they were measured, and ``--slow`` runs that command again
and rewrites them). ``docs/results.md`` has its own generator, ``scripts/make_results.py``;
``--slow`` regenerates (``--check --slow``: compares) its planned parts (f) and (g) with it
(``--slow results-f results-g``), its measured parts stay with ``make_results.py`` itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
#: where the docs are read and written (the repository; a test points it at a doctored copy)
DOCS_ROOT = REPO

from megatron_metp.tools import plan as P  # noqa: E402

#: the docs that may hold marked figures
DOCS = ["README.md"] + sorted(os.path.join("docs", f)
                             for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
BLOCK = re.compile(r"<!-- figures: (?P<name>[\w.-]+) \((?P<note>[^\n]*?)\) -->\n(?P<body>.*?)"
                   r"<!-- /figures -->", re.S)
INLINE = re.compile(r"<!-- figure: (?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /figure -->")
#: a figure inside a text: a number with its separators, decimals and unit or suffix
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?: ?(?:GiB|MiB|K|M|×|%|s))?")


@dataclasses.dataclass
class Figure:
    """One marked figure: ``make()`` returns the text between its markers; ``command`` is what a
    user runs to see it; ``measured`` ones need ``--slow`` (minutes, a Megatron-LM checkout)."""

    name: str
    command: str
    make: Callable[..., str]
    measured: bool = False

    def note(self, when: str = "") -> str:
        if self.measured:
            return (f"measured {when}: {self.command}; python scripts/doc_figures.py --slow "
                    f"{self.name}")
        return f"planned: {self.command}; python scripts/doc_figures.py"


# --- planned figures (metp plan) ---------------------------------------------------------------

_REACH: Dict[Tuple[str, int], Dict] = {}


def reach_best(preset: str, gpus: int) -> Dict:
    """``{"metp": Candidate, "stock": Candidate}``: the best layouts ``metp plan --reach --preset
    PRESET --gpus N`` prints (H100-80GB, 2 GiB reserve, 2 TB host per node), computed once."""
    key = (preset, gpus)
    if key not in _REACH:
        res = P.reach(P.PRESETS[preset], gpus, families=("metp", "stock"))
        _REACH[key] = {f: next((c for c in cands if c.seq), None) for f, cands in res.items()}
    return _REACH[key]


def compact(c, layers: int) -> str:
    """A candidate's layout as the docs' tables write it: sizes of 1 left out, the offload split
    when partial (``METP 8, 31 of 32 layers offloaded``)."""
    j = c.job
    if c.family == "metp":
        parts = [f"TP {j.tp}" if j.tp > 1 else "", f"METP {j.metp}",
                 f"CP {j.cp}" if j.cp > 1 else ""]
    else:
        cp = j.metp if c.mode == "cp" else 1
        parts = [f"TP {j.tp}" + ("+SP" if j.tp > 1 else ""), f"CP {cp}" if cp > 1 else ""]
    parts += [f"PP {j.pp}" if j.pp > 1 else "", f"DP {j.dp}" if j.dp > 1 else "",
              f"EP {j.ep}" if j.ep else ""]
    text = " × ".join(p for p in parts if p)
    if c.offload_layers is not None:
        text += f", {c.offload_layers} of {layers} layers offloaded"
    return text


def reach_row(label: str, preset: str, gpus: int) -> str:
    b, layers = reach_best(preset, gpus), P.PRESETS[preset].layers
    m, s = b["metp"], b["stock"]
    return (f"| {label} | {gpus} | {P.fmt_tokens(m.seq)} ({compact(m, layers)}) | "
            f"{P.fmt_tokens(s.seq)} ({compact(s, layers)}) | {m.seq / s.seq:.2f}× |")


def moe_reach_table() -> str:
    rows = [reach_row(lab, pre, n) for lab, pre in (("Qwen3-30B-A3B", "qwen3-30b-a3b"),
                                                      ("Mixtral-8x7B", "mixtral-8x7b"))
            for n in (8, 32)]
    return ("| model | GPUs | METP best | stock Megatron best | ratio |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def llama_reach_lines() -> str:
    b = reach_best("llama3-8b", 32)
    m, s = b["metp"], b["stock"]
    return (f"- best METP layout: {P.fmt_tokens(m.seq)} tokens, TP {m.job.tp} × METP "
            f"{m.job.metp} × CP {m.job.cp} (exact RoPE angles past 2^24);\n"
            f"- best stock layout: {P.fmt_tokens(s.seq)} tokens (memory-bound there; the family's "
            f"line states the 2^24 cap).\n")


def seq_of(preset: str, gpus: int, family: str) -> str:
    return P.fmt_tokens(reach_best(preset, gpus)[family].seq)


def ratio_of(preset: str, gpus: int) -> str:
    b = reach_best(preset, gpus)
    return f"{b['metp'].seq / b['stock'].seq:.2f}×"


def config_total(config: str, vocab_parallel: Optional[bool] = None, digits: int = 1) -> str:
    """The planned per-rank total (GiB, the larger pipeline stage) of ``configs/CONFIG``
    (``metp plan --config``, the mode the config runs); ``vocab_parallel=False``: as with
    ``METP_VOCAB_PARALLEL=0``."""
    from megatron_metp.tools.agreement import mode_of, model_job

    path = os.path.join(REPO, "configs", config)
    model, job = model_job(path)
    mode = mode_of(job, path)
    if vocab_parallel is not None:
        job = dataclasses.replace(job, vocab_parallel=vocab_parallel)
    return f"{P.worst_total(model, job, mode) / P.GiB:,.{digits}f}"


def config_layer_transient(config: str) -> str:
    """``metp plan --config configs/CONFIG``'s row "largest single-layer transient" (GiB)."""
    from megatron_metp.tools.agreement import mode_of, model_job

    path = os.path.join(REPO, "configs", config)
    model, job = model_job(path)
    return f"{P.memory(model, job, mode_of(job, path)).act.layer_transient / P.GiB:,.2f}"


#: the job of docs/megatron-lm.md's fit-hint example (``metp plan`` ARGV, one mode that does not fit)
FIT_HINT_ARGV = ["--preset", "llama3-8b", "--seq", "1048576", "--metp", "8", "--modes", "metp"]


def fit_hint_lines(argv: List[str] = FIT_HINT_ARGV) -> str:
    """The two lines ``metp plan ARGV --wide`` prints for a mode that does not fit (the cheapest
    options under which it fits, and its launch line), as a code block."""
    from megatron_metp.tools import cli

    model, job, modes = cli.build_from_argv(argv)
    lines = P.report(model, job, modes).splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith(f"# {modes[0]}: does not fit"))
    return "```\n" + "\n".join(lines[i:i + 2]) + "\n```\n"


def fit_hint_total(argv: List[str] = FIT_HINT_ARGV) -> str:
    """``metp plan ARGV``'s "TOTAL per rank" of its one mode (GiB, two decimals)."""
    from megatron_metp.tools import cli

    model, job, modes = cli.build_from_argv(argv)
    return f"{P.worst_total(model, job, modes[0]) / P.GiB:,.2f}"


#: the job of the selective-recompute table (docs/megatron-lm.md)
SELECTIVE_ARGV = ["--preset", "llama3-8b", "--seq", "131072", "--metp", "8", "--modes", "metp",
                  "--hardware", "H100-80GB"]


def selective_table() -> str:
    """Per layer of ``metp plan SELECTIVE_ARGV --recompute none|selective|full``: what a METP
    layer keeps for backward (MiB), the attention forward run again, and the time per
    micro-batch (a markdown table)."""
    from megatron_metp.tools import cli

    rows = ["| `--recompute` | kept per layer | attention forward again | time / micro-batch |",
            "|---|---|---|---|"]
    for r in ("none", "selective", "full"):
        model, job, modes = cli.build_from_argv(SELECTIVE_ARGV + ["--recompute", r])
        kept = sum(P.activations(model, job, modes[0]).stored_layer.values())
        cost = P.step_cost(model, job, modes[0])
        again = cost["components"]["attention_recompute"] * 1e3 / model.layers
        rows.append(f"| {r} | {kept / P.MiB:,.2f} MiB | {again:.1f} ms | "
                    f"{cost['step_s']:.2f} s |")
    return "\n".join(rows) + "\n"


def _cfg(name: str, config: str, **kw) -> Figure:
    return Figure(name, f"metp plan --config configs/{config}", lambda: config_total(config, **kw))


# --- measured figures (dry run; --slow) --------------------------------------------------------

def _twin_excerpt(line: str) -> bool:
    """The lines the doc shows of the stock-TP twin's dry run: its layout, batch, parameters and
    memory breakdown."""
    return line.startswith(("layout:", "batch:", "parameters on this rank", "  "))


def _memory_excerpt(line: str) -> bool:
    """The lines the doc shows of a long job's dry run: its memory breakdown."""
    return line.startswith("  ")


def dry_run_output(config: str, megatron_lm_dir: Optional[str] = None,
                   keep: Optional[Callable[[str], bool]] = None) -> str:
    """What ``scripts/pretrain_gpt.sh --config configs/CONFIG --dry-run`` prints from its first
    report line but its ``command:`` line (or the lines ``keep`` keeps), the checkout's path
    written as ``/home/me/Megatron-LM`` (as the doc shows it)."""
    if not megatron_lm_dir:
        raise SystemExit("doc_figures.py --slow: the dry run needs --megatron-lm-dir DIR (a "
                         "patched Megatron-LM checkout, docs/megatron-lm.md section 1)")
    cmd = ["bash", "scripts/pretrain_gpt.sh", "--config", f"configs/{config}", "--dry-run"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, MEGATRON_LM_DIR=os.path.abspath(megatron_lm_dir)))
    if out.returncode:
        raise SystemExit(f"doc_figures.py --slow: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    text = out.stdout.replace(os.path.abspath(megatron_lm_dir), "/home/me/Megatron-LM")
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(("METP dry run", "layout:")))
    # the doc leaves out the pretrain_gpt.py command line ("the command line is cut here")
    keep = keep or (lambda x: not x.startswith("command: "))
    return "```\n" + "\n".join(x for x in lines[start:] if keep(x)) + "\n```\n"


def kernel_order() -> str:
    """The run-time block kernel order (``megatron_metp/ops/kernel_choice.py`` ``KERNELS``, as
    its log line prints it)."""
    from megatron_metp.ops.kernel_choice import KERNELS

    return " > ".join(KERNELS)


FIGURES: Dict[str, Figure] = {f.name: f for f in [
    Figure("kernel-order", "METP_ATTENTION_KERNEL=auto: [METP] attention kernel: ... order ...",
           kernel_order),
    Figure("moe-reach", "metp plan --reach --preset {qwen3-30b-a3b,mixtral-8x7b} --gpus {8,32}",
           moe_reach_table),
    Figure("qwen3-30b-a3b-8-stock-best", "metp plan --reach --preset qwen3-30b-a3b --gpus 8",
           lambda: seq_of("qwen3-30b-a3b", 8, "stock")),
    Figure("llama3-8b-32-reach", "metp plan --reach --gpus 32 --preset llama3-8b",
           llama_reach_lines),
    Figure("llama3-8b-32-metp-best", "metp plan --reach --gpus 32 --preset llama3-8b",
           lambda: seq_of("llama3-8b", 32, "metp")),
    Figure("llama3-70b-32-metp-best", "metp plan --reach --gpus 32 --preset llama3-70b",
           lambda: seq_of("llama3-70b", 32, "metp")),
    Figure("llama3-70b-32-ratio", "metp plan --reach --gpus 32 --preset llama3-70b",
           lambda: ratio_of("llama3-70b", 32)),
    _cfg("plan-gpt-1.3b-32k-metp8", "gpt-1.3b-32k-metp8.sh"),
    _cfg("plan-gpt-1.3b-32k-metp8-novocab", "gpt-1.3b-32k-metp8.sh", vocab_parallel=False),
    _cfg("plan-gpt-1.3b-32k-tp8", "gpt-1.3b-32k-tp8.sh"),
    _cfg("plan-gpt-7b-128k-metp8", "gpt-7b-128k-metp8.sh"),
    _cfg("plan-gpt-7b-128k-metp8-novocab", "gpt-7b-128k-metp8.sh", vocab_parallel=False),
    _cfg("plan-gpt-7b-128k-tp8", "gpt-7b-128k-tp8.sh"),
    _cfg("plan-gpt-13b-256k-metp16", "gpt-13b-256k-metp16.sh"),
    _cfg("plan-gpt-13b-256k-metp16-novocab", "gpt-13b-256k-metp16.sh", vocab_parallel=False),
    _cfg("plan-gpt-13b-256k-tp16", "gpt-13b-256k-tp16.sh"),
    _cfg("plan-llama3-8b-16m-metp8-cp4", "llama3-8b-16m-metp8-cp4.sh"),
    _cfg("plan-qwen3-30b-a3b-1m-metp4-cp2", "qwen3-30b-a3b-1m-metp4-cp2.sh"),
    _cfg("plan-qwen3-30b-a3b-1m-tp4-cp2-ep8", "qwen3-30b-a3b-1m-tp4-cp2-ep8.sh"),
    _cfg("plan-llama3-8b-4m-metp8-2", "llama3-8b-4m-metp8.sh", digits=2),
    _cfg("plan-llama3-8b-6m-metp8-2", "llama3-8b-6m-metp8.sh", digits=2),
    _cfg("plan-llama3-8b-16m-metp8-cp4-2", "llama3-8b-16m-metp8-cp4.sh", digits=2),
    Figure("transient-llama3-8b-6m-metp8", "metp plan --config configs/llama3-8b-6m-metp8.sh",
           lambda: config_layer_transient("llama3-8b-6m-metp8.sh")),
    Figure("llama3-8b-8-metp-best", "metp plan --reach --gpus 8 --preset llama3-8b",
           lambda: seq_of("llama3-8b", 8, "metp")),
    _cfg("plan-qwen3-8b-4m-metp8-2", "qwen3-8b-4m-metp8.sh", digits=2),
    _cfg("plan-qwen3-30b-a3b-1m-metp4-cp2-2", "qwen3-30b-a3b-1m-metp4-cp2.sh", digits=2),
    _cfg("plan-qwen3-30b-a3b-1m-tp4-cp2-ep8-2", "qwen3-30b-a3b-1m-tp4-cp2-ep8.sh", digits=2),
    Figure("qwen3-30b-a3b-8-metp-best", "metp plan --reach --preset qwen3-30b-a3b --gpus 8",
           lambda: seq_of("qwen3-30b-a3b", 8, "metp")),
    Figure("selective-llama3-8b-128k-metp8",
           "metp plan " + " ".join(SELECTIVE_ARGV) + " --recompute none|selective|full",
           selective_table),
    Figure("fit-hint-llama3-8b-1m-metp8", "metp plan " + " ".join(FIT_HINT_ARGV) + " --wide",
           fit_hint_lines),
    Figure("plan-llama3-8b-1m-metp8-total", "metp plan " + " ".join(FIT_HINT_ARGV),
           fit_hint_total),
    Figure("dry-run-gpt-7b-128k-metp8",
           "scripts/pretrain_gpt.sh --config configs/gpt-7b-128k-metp8.sh --dry-run",
           lambda megatron_lm_dir=None: dry_run_output("gpt-7b-128k-metp8.sh", megatron_lm_dir),
           measured=True),
    Figure("dry-run-qwen3-8b-4m-metp8",
           "scripts/pretrain_gpt.sh --config configs/qwen3-8b-4m-metp8.sh --dry-run (memory)",
           lambda megatron_lm_dir=None: dry_run_output("qwen3-8b-4m-metp8.sh", megatron_lm_dir,
                                                       keep=_memory_excerpt),
           measured=True),
    Figure("dry-run-gpt-7b-128k-tp8",
           "scripts/pretrain_gpt.sh --config configs/gpt-7b-128k-tp8.sh --dry-run (excerpt)",
           lambda megatron_lm_dir=None: dry_run_output("gpt-7b-128k-tp8.sh", megatron_lm_dir,
                                                       keep=_twin_excerpt),
           measured=True),
]}


# --- reading, checking and rewriting the docs --------------------------------------------------

@dataclasses.dataclass
class Found:
    doc: str
    name: str
    body: str
    span: Tuple[int, int]   # of the body in the doc's text
    inline: bool
    note: str = ""


def find(text: str, doc: str) -> List[Found]:
    """Every marked figure of a doc's text; an unknown name is refused naming the doc."""
    out = [Found(doc, m["name"], m["body"], m.span("body"), False, m["note"])
           for m in BLOCK.finditer(text)]
    out += [Found(doc, m["name"], m["body"], m.span("body"), True) for m in INLINE.finditer(text)]
    for f in out:
        if f.name not in FIGURES:
            raise SystemExit(f"{doc}: marked figure {f.name!r} is not in scripts/doc_figures.py "
                             f"FIGURES (known: {', '.join(FIGURES)})")
    return sorted(out, key=lambda f: f.span)


def first_difference(doc_text: str, tool_text: str) -> str:
    """The figures (numbers with their units) that differ, in order, else the first line that
    does."""
    a, b = NUMBER.findall(doc_text), NUMBER.findall(tool_text)
    pairs = [(x, y) for x, y in zip(a, b) if x != y]
    if pairs:
        more = f"; and {len(pairs) - 3} more" if len(pairs) > 3 else ""
        return "; ".join(f"the doc says {x!r}, the tool prints {y!r}" for x, y in pairs[:3]) + more
    if len(a) != len(b):
        return f"the doc has {len(a)} figures, the tool prints {len(b)}"
    for i, (x, y) in enumerate(zip(doc_text.splitlines(), tool_text.splitlines())):
        if x != y:
            return f"line {i + 1}: the doc has {x!r}, the tool prints {y!r}"
    return "the text differs (line count or whitespace)"


def problems(text: str, doc: str, slow: bool = False, only: Optional[List[str]] = None,
             **kw) -> List[str]:
    """What differs between ``text`` (a doc) and the tools: one line per figure, naming the doc,
    the figure and the first differing number; measured ones only with ``slow``."""
    out = []
    for f in find(text, doc):
        fig = FIGURES[f.name]
        if (fig.measured and not slow) or (only and f.name not in only):
            continue
        want = fig.make(**kw) if fig.measured else fig.make()
        if f.body != want:
            out.append(f"{doc}: figure {f.name} ({fig.command}): {first_difference(f.body, want)}")
    return out


def rewrite(text: str, doc: str, slow: bool = False, only: Optional[List[str]] = None,
            **kw) -> str:
    """``text`` with each marked figure (measured ones only with ``slow``) as the tool prints it
    now, and each block's opening marker naming its class and command (a measured one: today's
    date and this machine once regenerated)."""
    found = find(text, doc)
    for f in reversed(found):
        fig = FIGURES[f.name]
        if (fig.measured and not slow) or (only and f.name not in only):
            continue
        body = fig.make(**kw) if fig.measured else fig.make()
        text = text[:f.span[0]] + body + text[f.span[1]:]
        if not f.inline:
            when = (f"{datetime.date.today():%Y-%m-%d}, {platform.node() or 'this machine'} "
                    f"({os.cpu_count()} CPUs){_release(kw.get('megatron_lm_dir'))}"
                    if fig.measured else "")
            start = text.rindex("<!-- figures: ", 0, f.span[0])
            end = text.index(" -->\n", start)
            text = text[:start] + f"<!-- figures: {f.name} ({fig.note(when)})" + text[end:]
    return text


#: docs/results.md's planned parts, regenerated by scripts/make_results.py (--slow: 10-60 s each)
RESULTS_PARTS = {"results-f": "f", "results-g": "g"}
_STAMP = re.compile(r"^\(Part \([a-z]\) regenerated alone by .*$", re.M)


def results_part(part: str, rewrite_doc: bool) -> List[str]:
    """Part ``part`` of docs/results.md as ``make_results.py --part PART --no-measure`` writes it
    now: written in place (``rewrite_doc``), else compared on a copy (its regeneration stamp line
    aside), the differences returned naming the doc, part and figure."""
    import shutil
    import tempfile

    doc = os.path.join(DOCS_ROOT, "docs", "results.md")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "make_results.py"), "--part", part,
           "--no-measure"]
    if rewrite_doc:
        subprocess.run(cmd + ["--out", doc], check=True, env=dict(os.environ, PYTHONPATH=REPO))
        return []
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "results.md")
        shutil.copy(doc, copy)
        subprocess.run(cmd + ["--out", copy], check=True, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=REPO))
        with open(copy, encoding="utf-8") as fh:
            new = _STAMP.sub("", fh.read())
    with open(doc, encoding="utf-8") as fh:
        old = _STAMP.sub("", fh.read())
    if old == new:
        return []
    return [f"docs/results.md: part ({part}) (python scripts/make_results.py --part {part} "
            f"--no-measure): {first_difference(old, new)}"]


def _release(megatron_lm_dir: Optional[str]) -> str:
    """``, Megatron-LM <tag>`` of a checkout (its ``git describe``), or nothing."""
    if not megatron_lm_dir:
        return ""
    out = subprocess.run(["git", "-C", megatron_lm_dir, "describe", "--tags", "--always"],
                         capture_output=True, text=True)
    return f", Megatron-LM {out.stdout.strip()}" if out.returncode == 0 else ""


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each doc, figure and differing number")
    ap.add_argument("--slow", nargs="*", metavar="NAME", default=None,
                    help="also the measured figures (all, or those NAMEd): runs their dry runs "
                         "(minutes each; needs --megatron-lm-dir)")
    ap.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                    help="patched Megatron-LM checkout for --slow (default $MEGATRON_LM_DIR)")
    ap.add_argument("--list", action="store_true", help="list the marked figures and exit")
    args = ap.parse_args(argv)
    slow = args.slow is not None
    only = args.slow or None
    kw = {"megatron_lm_dir": args.megatron_lm_dir} if slow else {}
    bad, seen = [], set()
    for doc in DOCS:
        path = os.path.join(DOCS_ROOT, doc)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if args.list:
            for f in find(text, doc):
                fig = FIGURES[f.name]
                print(f"{doc}: {f.name} [{'measured' if fig.measured else 'planned'}] "
                      f"{fig.command}")
            continue
        seen.update(f.name for f in find(text, doc))
        if args.check:
            bad += problems(text, doc, slow, only, **kw)
            continue
        new = rewrite(text, doc, slow, only, **kw)
        if new != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(new)
            print(f"rewrote {doc}")
    if slow and not args.list:
        for name, part in RESULTS_PARTS.items():
            if not only or name in only:
                bad += results_part(part, rewrite_doc=not args.check)
    unused = sorted(set(FIGURES) - seen - set(only or ()))
    if unused and not args.list and not only:
        print(f"doc_figures.py: figures marked in no doc: {', '.join(unused)}", file=sys.stderr)
        return 1
    for line in bad:
        print(line, file=sys.stderr)
    if args.check:
        print(f"doc_figures.py --check: {len(bad)} figure(s) differ from the tools"
              + ("" if slow else " (measured figures not checked: --slow)"),
              file=sys.stderr if bad else sys.stdout)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
