"""``metp plan`` fits a 100-column terminal and says its units (issue 39, Deliver 6): every line
of its default output is at most 100 characters for dense, MoE, METP × CP with offload and
``--reach``; a legend defines K, MiB/GiB and the rest; ``--wide`` prints the full table (every
mode's column side by side, lines whole) with the same cells; the wrapped lines join back to the
whole ones."""

import pytest

from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan.textwidth import DEFAULT_WIDTH, unwrap

CASES = {
    "gpt-7b, five modes": ["--preset", "gpt-7b", "--seq", "131072", "--metp", "8"],
    "llama3-8b 16M, METP × CP, offload": [
        "--preset", "llama3-8b", "--seq", "16777216", "--metp", "8", "--cp", "4",
        "--vocab-parallel", "--distributed-optimizer", "--recompute", "full",
        "--offload-activations"],
    "qwen3-30b-a3b config (MoE)": ["--config", "configs/qwen3-30b-a3b-1m-metp4-cp2.sh"],
}


def _plan(argv, capsys):
    assert cli.main(["plan"] + argv) == 0
    return capsys.readouterr().out


def too_long(text, width=DEFAULT_WIDTH):
    return [line for line in text.splitlines() if len(line) > width]


def _table(text):
    """``{label: [cells]}`` of the per-mode table, the cells of every block of columns in turn,
    and the mode names of the header(s)."""
    rows, modes = {}, []
    for line in text.splitlines():
        if " | " not in line or line.startswith("#"):
            continue
        label, *cells = [c.strip() for c in line.split(" | ")]
        if not label:
            modes += cells
        else:
            rows.setdefault(label, []).extend(cells)
    return modes, rows


@pytest.mark.parametrize("case", list(CASES))
def test_default_output_fits_100_columns_and_states_its_units(case, capsys):
    text = _plan(CASES[case], capsys)
    assert too_long(text) == [], case
    flat = " ".join(text.split())
    assert "K = 1,024 tokens" in flat and "GiB = 2^30 bytes" in flat and "MiB = 2^20" in flat
    wide = _plan(CASES[case] + ["--wide"], capsys)
    # negative control: the full output does not fit (the check above is not vacuous)
    assert too_long(wide), case
    modes, rows = _table(text)
    wmodes, wrows = _table(wide)
    assert modes == wmodes and rows == wrows  # the same cells, split into blocks or not
    assert len(modes) == len(set(modes))
    # --wide: one header with every mode, each row one line with a cell per mode
    header = [x for x in wide.splitlines() if " | " in x and not x.split(" | ")[0].strip()]
    assert len(header) == 1 and [c.strip() for c in header[0].split(" | ")[1:]] == modes
    default_headers = [x for x in text.splitlines() if " | " in x and not x.split(" | ")[0].strip()]
    assert len(default_headers) > 1 or len(modes) == 1
    notes = [x for x in wide.splitlines() if x.startswith("#")]
    assert [x for x in unwrap(text).splitlines() if x.startswith("#")] == notes


def test_reach_fits_100_columns_and_joins_back():
    """``--reach`` (gpt-1.3b on 2 GPUs, searched once): its best layouts' Megatron-LM flags and
    launch lines wrap to 100 columns and join back to the whole lines ``--wide`` prints."""
    model = P.PRESETS["gpt-1.3b"]
    res = P.reach(model, 2, families=("metp", "stock"))
    text = P.reach_report(model, 2, top=1, res=res, width=DEFAULT_WIDTH)
    wide = P.reach_report(model, 2, top=1, res=res)
    assert too_long(text) == [] and too_long(wide)  # (negative control: the whole lines do not)
    assert unwrap(text) == wide
    assert "K = 1,024 tokens" in " ".join(text.split())
