"""``metp measure`` fits a 100-column terminal and says its units, as ``metp plan`` does (issue 39,
Deliver 6): every line of its default output is at most 100 characters, a ``# units:`` line
defines MiB/GiB and the rest, and ``--wide`` prints the whole table (one line per mode) with the
same cells; the wrapped comment lines join back to the whole ones. One real measurement (a
1-layer, h=128 model, TP+SP and METP over 2 ranks: seconds), shown both ways."""

from megatron_metp.tools import cli
from megatron_metp.tools import measure as M
from megatron_metp.tools import measure_table as T
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan.textwidth import DEFAULT_WIDTH, unwrap

TINY = ["--hidden", "128", "--layers", "1", "--heads", "2", "--query-groups", "2", "--ffn", "256",
        "--vocab", "512", "--seq", "1024", "--swiglu", "--untie", "--metp", "2",
        "--modes", "tp-sp", "metp", "--measure-layers", "full"]


def too_long(text, width=DEFAULT_WIDTH):
    return [line for line in text.splitlines() if len(line) > width]


def _table(text):
    """``(columns, {mode: [cells]})`` of the table, the cells of every block of columns in turn
    (a header: the first cell blank, the default, or ``mode``, the whole table)."""
    cols, rows = [], {}
    for line in text.splitlines():
        if " | " not in line or line.startswith("#"):
            continue
        label, *cells = [c.strip() for c in line.split(" | ")]
        if label in ("", "mode"):
            cols += cells
        else:
            rows.setdefault(label, []).extend(cells)
    return cols, rows


def test_default_output_fits_100_columns_and_states_its_units(capsys, monkeypatch):
    got = []

    def once(*a, **kw):  # measure once for real; --wide prints the same measurements
        if not got:
            got.append(measure(*a, **kw))
        return got[0]

    measure = M.measure
    monkeypatch.setattr(M, "measure", once)
    assert cli.main(["measure", *TINY]) == 0
    text = capsys.readouterr().out
    assert cli.main(["measure", *TINY, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert too_long(text) == []
    assert too_long(wide)  # negative control: the whole table does not fit
    for out in (text, wide):
        flat = " ".join(out.split())
        assert "# units: MiB = 2^20 bytes, GiB = 2^30 bytes" in flat
        assert "s = the sequence length in tokens" in flat
    cols, rows = _table(text)
    wcols, wrows = _table(wide)
    assert cols == wcols == T.HEAD and rows == wrows and list(rows) == ["tp-sp", "metp"]
    assert all(len(r) == len(T.HEAD) for r in rows.values())
    assert rows["metp"][0] == "METP=2" and rows["metp"][2] != rows["metp"][1]
    headers = [x for x in text.splitlines() if " | " in x and not x.split(" | ")[0].strip()]
    assert len(headers) > 1  # in blocks of columns
    whole = [x for x in wide.splitlines() if x.startswith("mode ")]
    assert len(whole) == 1 and [c.strip() for c in whole[0].split(" | ")[1:]] == T.HEAD
    notes = [x for x in wide.splitlines() if x.startswith("#")]
    assert [x for x in unwrap(text).splitlines() if x.startswith("#")] == notes
    assert "# metp: measured on all 1 layers" in wide


def test_a_failed_measurement_fits_too():
    """A failed mode's row says ERROR; fitted, the error (up to 120 characters) goes on a
    comment line of its own that wraps; whole, it is the row's cell."""
    model, job, modes = cli.build_from_argv(TINY[:-2])
    msg = "RuntimeError: the fake rank ran out of " + "words to say " * 8  # 143 characters
    err = {"mode": "metp", "error": "Traceback ...\n" + msg}
    text = T.measure_table(model, job, ["metp"], [err], width=DEFAULT_WIDTH)
    wide = T.measure_table(model, job, ["metp"], [err])
    assert too_long(text) == [] and too_long(wide)
    assert "ERROR (below)" in text and f"# metp: ERROR: {msg[:120]}" in unwrap(text)
    assert _table(wide)[1]["metp"][1]== "ERROR: " + msg[:120].strip()
    assert P.layout("metp", job).describe() == _table(text)[1]["metp"][0]
