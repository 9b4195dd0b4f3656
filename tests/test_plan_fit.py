"""``metp plan`` says how to fit (issue 32, Deliver 5): a job that does not fit prints the
cheapest flags under which it does, and planning again with those flags says it fits; the
largest single-layer transient is never negative; ``--reach`` prints each best layout's
Megatron-LM flags and writes one as a ``configs/*.sh``-style file; ``metp --help`` lists every
subcommand."""

import dataclasses
import json
import os
import re
import subprocess
import sys

from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan.textwidth import unwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the issue's job: Llama-3-8B at 1M tokens on METP 8, NO in every column as it is
JOB = ["--preset", "llama3-8b", "--seq", "1048576", "--metp", "8"]


def _plan(argv, capsys):
    """The text of ``metp plan argv``, its wrapped lines joined back (the table fits 100 columns
    in blocks of columns: :func:`_cells` reads a row across them)."""
    assert cli.main(["plan"] + argv) == 0
    return unwrap(capsys.readouterr().out)


def _cells(out, label):
    """The cells of the table row starting with ``label``, every block of columns in turn."""
    return [c for line in out.splitlines() if line.startswith(label)
            for c in line.split("|")[1:]]


def _fits_row(out):
    return [c.strip() for c in _cells(out, "fits ")]


def test_a_job_that_does_not_fit_prints_flags_under_which_it_fits(capsys, tmp_path):
    out = _plan(JOB + ["--modes", "metp", "--json", str(tmp_path / "p.json")], capsys)
    assert _fits_row(out) == ["NO"]
    m = re.search(r"^# metp: does not fit; fits with (.+?): ([\d.,]+) GiB per rank", out, re.M)
    assert m, out
    flags = m.group(1).split()
    assert "--vocab-parallel" in flags and "--recompute" in flags
    lines = out.splitlines()
    line = lines[next(i for i, x in enumerate(lines) if x.startswith(m.group(0))) + 1]
    assert "scripts/pretrain_gpt.sh --config configs/models/llama3-8b.sh" in line
    assert "METP_VOCAB_PARALLEL=1" in line and "RECOMPUTE_GRANULARITY=full" in line
    hint = json.load(open(tmp_path / "p.json"))["modes"]["metp"]["fit_hint"]
    assert hint["flags"] == flags and "--metp-vocab-parallel" in hint["megatron_lm_args"]
    # the real assertion: the plan with those flags fits, at the total the hint printed
    again = _plan(JOB + flags, capsys)
    assert _fits_row(again) == ["yes"]
    total = re.search(r"^TOTAL per rank\s+\|\s+([\d.,]+) GiB", again, re.M).group(1)
    assert total == m.group(2) and hint["total"] / P.GiB < 78
    assert "does not fit" not in again


def test_the_hint_is_the_cheapest_and_adds_offload_when_needed(capsys):
    """At 4M tokens recompute alone is not enough: the hint adds the host offload, and each
    flag is needed (dropping any one of them no longer fits)."""
    model = P.PRESETS["llama3-8b"].with_seq(4 << 20)
    job = P.Job(metp=8)
    hint = P.fit_hint(model, job, "metp")
    assert hint is not None and "--offload-activations" in hint.flags
    ok, total, _ = P.fit.fits(model, hint.job, "metp")
    assert ok and total == hint.total
    for drop in (dict(vocab_parallel=False), dict(offload=False),
                 dict(recompute="none", offload=False)):
        assert not P.fit.fits(model, dataclasses.replace(hint.job, **drop), "metp")[0], drop
    # what fits as it is gets no hint; a layout nothing rescues gets None (flags None in JSON)
    assert P.plan(model.with_seq(32768), job, ["metp"])["modes"]["metp"]["fit_hint"] is None
    assert P.fit_hint(model.with_seq(1 << 20), job, "tp") is None
    assert P.plan(model.with_seq(1 << 20), job, ["tp"])["modes"]["tp"]["fit_hint"] == \
        {"flags": None}


def test_largest_single_layer_transient_is_not_negative(capsys):
    """It was −63.03 GiB on TP 8: the head's activations (freed by the last layer's backward)
    were subtracted from the layer's own buffers."""
    out = _plan(JOB, capsys)
    cells = _cells(out, "largest single-layer")
    assert len(cells) == 5 and not any("-" in c for c in cells)
    model = P.PRESETS["llama3-8b"].with_seq(1 << 20)
    for mode in ("tp", "tp-sp", "ring", "metp", "metp+vocab"):
        act = P.memory(model, P.Job(metp=8), mode).act
        # the layer's own working set: at least the incoming gradient [s/p, h] in bf16 of the
        # ring/METP modes, and far below what the layers store
        assert act.layer_transient >= 2 * model.hidden * (1 << 20) / 8, mode
        assert act.layer_transient < act.stored_per_layer * act.layers, mode


def test_launch_settings_round_trip_through_a_config(tmp_path):
    """``config_text`` writes the hinted job; ``metp plan --config`` of it plans the same job
    (every option, the optimizer offload through EXTRA_ARGS)."""
    model = P.PRESETS["llama3-8b"].with_seq(4 << 20)
    job = P.Job(metp=8, distributed_optimizer=True, vocab_parallel=True, recompute="full",
                offload=True, optimizer_offload=True, dp=2)
    path = tmp_path / "job.sh"
    path.write_text(P.config_text(model, job, "metp", "test"))
    text = path.read_text()
    assert ': "${GPUS_PER_NODE:=8}"' in text and ': "${NNODES:=2}"' in text
    assert ("EXTRA_ARGS=(--optimizer-cpu-offload --optimizer-offload-fraction 1.0 "
            "--use-precision-aware-optimizer)") in text
    m2, j2, _ = cli.build_from_argv(["--config", str(path)])
    for f in ("hidden", "layers", "heads", "query_groups", "ffn", "seq", "swiglu", "tied"):
        assert getattr(m2, f) == getattr(model, f), f
    for f in ("tp", "metp", "cp", "pp", "dp", "distributed_optimizer", "vocab_parallel",
              "recompute", "offload", "optimizer_offload"):
        assert getattr(j2, f) == getattr(job, f), f
    flags = P.megatron_flags(model, job, "metp")
    assert flags[flags.index("--metp-parallel-size") + 1] == "8"
    assert "--optimizer-cpu-offload" in flags and "--use-distributed-optimizer" in flags


def test_reach_prints_flags_and_writes_a_config(capsys, tmp_path):
    """Each family's best layout (METP, stock) comes with its Megatron-LM flags and a
    pretrain_gpt.sh line; --write-config writes the longer-reaching one, which metp plan
    --config plans again as the same layout and options, at the total the search found."""
    path = tmp_path / "best.sh"
    out = _plan(["--preset", "gpt-1.3b", "--reach", "--gpus", "2", "--write-config",
                 str(path)], capsys)
    flags = [x for x in out.splitlines() if x.startswith("  best, Megatron-LM flags: ")]
    launches = [x for x in out.splitlines() if x.startswith("  best, launch: ")]
    assert len(flags) == 2 and len(launches) == 2  # METP and stock, none for ALST
    assert "--metp-parallel-size 2" in flags[0] and "--metp-vocab-parallel" in flags[0]
    assert "--tensor-model-parallel-size 2" in flags[1] and "--sequence-parallel" in flags[1]
    assert launches[0].endswith("scripts/pretrain_gpt.sh --config configs/models/gpt-1.3b.sh")
    best = re.search(r"^  best +([\d.,]+K) tokens .*?: ([\d.,]+) GiB per rank", out, re.M)
    seq = int(re.search(r"--seq-length (\d+)", flags[0]).group(1))
    assert P.fmt_tokens(seq) == best.group(1)
    text = path.read_text()
    assert f': "${{SEQ_LENGTH:={seq}}}"' in text and ': "${METP:=2}"' in text
    assert 'source "${METP_DIR:?}/configs/models/gpt-1.3b.sh"' in text
    model, job, modes = cli.build_from_argv(["--config", str(path)])
    assert (model.seq, job.tp, job.metp, job.dp, modes) == (seq, 1, 2, 1, ["metp"])
    assert job.vocab_parallel and job.distributed_optimizer
    total = P.memory(model, job, "metp").total / P.GiB
    assert abs(total - float(best.group(2))) < 0.01 * total
    # --write-config belongs to --reach
    assert cli.main(["plan", "--preset", "gpt-1.3b", "--write-config", str(path)]) == 2
    assert "--write-config" in capsys.readouterr().err


def test_metp_help_lists_every_subcommand_without_the_planner():
    """``metp --help`` lists plan, measure and hf and imports neither torch nor megatron-core
    (the planner loads with a subcommand); ``metp plan`` prints no third-party warnings."""
    code = ("import sys; from megatron_metp.tools.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('loaded:', sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("plan", "measure", "hf"):
        assert re.search(rf"^\s+{name}\s", proc.stdout, re.M), (name, proc.stdout)
    assert "loaded: []" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "megatron_metp.cli", "plan", "--preset",
                           "gpt-1.3b", "--seq", "8192", "--metp", "2", "--recompute", "full"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "fits H100-80GB" in proc.stdout, proc.stderr
    assert "Warning" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr
