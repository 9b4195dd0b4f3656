"""The figures README.md and docs/*.md quote from ``metp plan`` equal what it prints now
(``scripts/doc_figures.py``, issue 39 Deliver 6); a doctored figure is caught naming the doc, the
figure and the number; ``--check`` fails the same way; the measured figures (dry runs) carry
their date, machine and command and are left to ``--slow``."""

import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def D():
    spec = importlib.util.spec_from_file_location("doc_figures",
                                                  os.path.join(ROOT, "scripts", "doc_figures.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["doc_figures"] = mod  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("doc_figures", None)


@pytest.fixture(scope="module")
def tool_figures(D):
    """Every planned figure as the planner prints it now, computed once (the reach searches of
    five models: about 20 s of CPU; tests/markers.py SLOW_FIXTURES)."""
    return {name: fig.make() for name, fig in D.FIGURES.items() if not fig.measured}


def _text(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        return fh.read()


def test_every_planned_figure_in_the_docs_is_what_metp_plan_prints(D, tool_figures):
    found = set()
    for doc in D.DOCS:
        text = _text(doc)
        found |= {f.name for f in D.find(text, doc)}
        assert D.problems(text, doc) == [], doc
    assert found == set(D.FIGURES)  # every figure of the script is marked in some doc
    # the figures are among them
    assert {"moe-reach", "llama3-8b-32-metp-best", "plan-gpt-7b-128k-metp8"} <= found
    assert tool_figures["moe-reach"].count("\n| ") == 4


def test_a_doctored_figure_is_caught_named_and_rewritten(D, tool_figures):
    """Negative control: the old (wrong) figures put back into a copy of the doc are each named
    with the doc and the figure; rewriting the copy gives the doc back."""
    doc = "docs/megatron-lm.md"
    text = _text(doc)
    bad = text.replace("| 487K (TP 4+SP × CP 2 × EP 8) | 13.89× |",
                       "| 498.25K (TP 4+SP × CP 2 × EP 8) | 8.62× |", 1)
    bad = bad.replace("<!-- figure: plan-gpt-7b-128k-metp8 -->35.3<",
                      "<!-- figure: plan-gpt-7b-128k-metp8 -->59.9<", 1)
    assert bad.count("498.25K") == 1 and "-->59.9<" in bad
    found = D.problems(bad, doc)
    assert len(found) == 2, found
    assert found[0].startswith(f"{doc}: figure plan-gpt-7b-128k-metp8") or \
        found[1].startswith(f"{doc}: figure plan-gpt-7b-128k-metp8")
    moe = next(x for x in found if "figure moe-reach" in x)
    assert "the doc says '498.25K', the tool prints '487K'" in moe
    assert "the doc says '8.62×', the tool prints '13.89×'" in moe
    assert "'59.9', the tool prints '35.3'" in next(x for x in found if "gpt-7b" in x)
    assert D.rewrite(bad, doc) == text


def test_check_exits_1_on_a_doctored_doc(D, tool_figures, tmp_path, monkeypatch, capsys):
    """``doc_figures.py --check`` on a tree whose doc is doctored: exit 1, the doc and figure on
    stderr; the real docs: exit 0."""
    doc = "docs/positions.md"
    os.makedirs(tmp_path / "docs")
    for name in D.DOCS:
        text = _text(name)
        if name == doc:
            text = text.replace("32,356.50K tokens, TP 1", "22.3M tokens, TP 1", 1)
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.setattr(D, "DOCS_ROOT", str(tmp_path))
    assert D.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"docs/positions.md: figure llama3-8b-32-reach .*the doc says '22.3M', the "
                     r"tool prints '32,356.50K'", err), err
    monkeypatch.setattr(D, "DOCS_ROOT", ROOT)
    assert D.main(["--check"]) == 0


def test_measured_figures_name_date_machine_and_command_and_wait_for_slow(D):
    doc = "docs/megatron-lm.md"
    text = _text(doc)
    measured = [f for f in D.find(text, doc) if D.FIGURES[f.name].measured]
    assert [f.name for f in measured] == ["dry-run-gpt-7b-128k-metp8", "dry-run-gpt-7b-128k-tp8",
                                          "dry-run-qwen3-8b-4m-metp8"]
    for f in measured:
        assert re.match(r"measured \d{4}-\d\d-\d\d, ", f.note), f.note
    # each sample's total is the configs table's planned figure (the issue: 59.9 next to 35.3)
    found = {f.name: f.body for f in D.find(text, doc)}
    for config in ("gpt-7b-128k-metp8", "gpt-7b-128k-tp8"):
        total = re.search(r"= ([\d.]+) GiB", found[f"dry-run-{config}"]).group(1)
        assert found[f"plan-{config}"] == total, config
    # the Qwen3-8B 4M dry run (its memory report) and the plan's total agree within 1 %
    qwen = float(re.search(r"= ([\d.]+) GiB", found["dry-run-qwen3-8b-4m-metp8"]).group(1))
    assert abs(qwen / float(found["plan-qwen3-8b-4m-metp8-2"]) - 1) < 0.01, qwen
    assert re.match(r"measured \d{4}-\d\d-\d\d, .*: scripts/pretrain_gpt.sh --config "
                    r"configs/gpt-7b-128k-metp8.sh --dry-run; python scripts/doc_figures.py "
                    r"--slow dry-run-gpt-7b-128k-metp8$", measured[0].note), measured[0].note
    # its sample output and the planned column agree (the issue: 59.9 next to a sample of 35.3)
    assert "= 35.3 GiB" in measured[0].body
    # not re-run without --slow: a changed measured figure is no error of --check
    doctored = text.replace("= 35.3 GiB", "= 35.9 GiB")
    assert D.problems(doctored, doc, only=["dry-run-gpt-7b-128k-metp8"]) == []


def test_the_kernel_order_is_stated_as_the_run_time_choice_takes_it(D, capsys):
    """One order everywhere (ops/kernel_choice.py KERNELS): the docs' marked statements, the
    planner's table (its names through KERNEL_ALIASES), its docstring and ``metp plan --help``;
    a doctored order is caught."""
    from megatron_metp.ops.kernel_choice import KERNELS
    from megatron_metp.tools import cli
    from megatron_metp.tools.plan import rates

    order = " > ".join(KERNELS)
    names = {v: k for k, v in rates.KERNEL_ALIASES.items()}
    assert tuple(names.get(k, k) for k in rates.KERNELS) == KERNELS
    assert order in " ".join(rates.__doc__.split())
    for doc in ("README.md", "docs/megatron-lm.md"):
        text = _text(doc)
        assert [f.body for f in D.find(text, doc) if f.name == "kernel-order"] == [order], doc
        assert D.problems(text, doc, only=["kernel-order"]) == []
        bad = text.replace(order, "cudnn > flash_attn > flash_attn_3 > torch_flash > reference")
        assert D.problems(bad, doc, only=["kernel-order"]) == [
            f"{doc}: figure kernel-order ({D.FIGURES['kernel-order'].command}): line 1: the doc "
            f"has 'cudnn > flash_attn > flash_attn_3 > torch_flash > reference', the tool prints "
            f"'{order}'"]
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert order in flat and "cudnn > fa3 > fa2 > torch_flash > unfused" in flat


def test_slow_rewrites_a_measured_block_and_dates_its_marker(D, monkeypatch):
    """``--slow``: the measured block gets what its command printed (here a generator standing in
    for the dry run's minutes) and its marker today's date and this machine; ``--check --slow``
    names it while it differs. Without ``--slow`` it is left as it is."""
    import datetime

    doc = "docs/megatron-lm.md"
    text = _text(doc)
    fig = D.FIGURES["dry-run-gpt-7b-128k-metp8"]
    monkeypatch.setattr(fig, "make", lambda megatron_lm_dir=None: "```\ntotal 1 MiB\n```\n")
    only = ["dry-run-gpt-7b-128k-metp8"]
    assert D.rewrite(text, doc, only=only) == text
    (line,) = D.problems(text, doc, slow=True, only=only)
    assert line.startswith(f"{doc}: figure dry-run-gpt-7b-128k-metp8 ({fig.command}): the doc "
                           f"says '8', the tool prints '1 MiB'"), line
    new = D.rewrite(text, doc, slow=True, only=only)
    (found,) = [f for f in D.find(new, doc) if f.name == only[0]]
    assert found.body == "```\ntotal 1 MiB\n```\n"
    assert found.note.startswith(f"measured {datetime.date.today():%Y-%m-%d}, ")
    assert D.problems(new, doc, slow=True, only=only) == []
