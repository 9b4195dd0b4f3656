"""The planner and positions past 2^24 (issue 29): layouts on Megatron's fp32 RoPE recipe
(stock Megatron) stop at 2^24 tokens in the reach search and are named as refused by
``metp plan`` past it; METP's exact angles go further."""

from __future__ import annotations

from megatron_metp import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import positions
from megatron_metp.tools.plan import search as R
from megatron_metp.tools.plan.textwidth import unwrap

SMALL = P.Model(name="small", hidden=256, layers=2, heads=4, query_groups=2, ffn=512,
                vocab=1000, seq=4096, swiglu=True, tied=False)
CAP = positions.FP32_EXACT_POSITIONS
FAST = dict(recompute=("full",), optimizer_offload=(False,))


def test_predicate():
    assert all(positions.exact_positions(m) for m in ("metp", "metp+vocab", "ring"))
    assert not any(positions.exact_positions(m) for m in ("tp", "tp-sp", "cp", "alst"))
    assert positions.position_cap("cp") == CAP and positions.position_cap("metp") is None
    assert positions.refused_modes(["tp-sp", "metp"], None, CAP) == []
    assert positions.refused_modes(["tp-sp", "metp"], None, CAP + 1) == ["tp-sp"]


def test_reach_caps_stock_at_2_24_and_metp_goes_past(monkeypatch):
    stock = R.candidates(SMALL, 4, "stock", **FAST)
    metp = R.candidates(SMALL, 4, "metp", **FAST)
    assert stock[0].seq == CAP and stock[0].capped
    assert all(c.seq <= CAP for c in stock)
    assert metp[0].seq > CAP and not any(c.capped for c in metp)
    # negative control: without the cap the same stock layouts fit past 2^24 by memory alone
    monkeypatch.setattr(R, "position_cap", lambda mode, job: None)
    free = R.candidates(SMALL, 4, "stock", **FAST)
    assert free[0].seq > CAP and not free[0].capped


def test_cli_reach_llama3_8b_32_gpus(capsys):
    """The issue's command: its best layout past 2^24 is METP's (exact angles); the stock
    family carries the line saying why it is capped."""
    assert cli.main(["plan", "--reach", "--gpus", "32", "--preset", "llama3-8b",
                     "--reach-top", "1"]) == 0
    out = unwrap(capsys.readouterr().out)  # its lines whole (wrapped to 100 columns)
    metp, stock = out.split("## stock Megatron")
    best = next(line for line in metp.splitlines() if line.strip().startswith("best"))
    assert "(exact RoPE angles past 2^24)" in best and "METP 8" in best
    assert "capped at 2^24 tokens" in stock and "fp32 RoPE recipe" in stock
    assert "exact RoPE angles past 2^24" not in stock


def test_plan_names_the_modes_refused_past_2_24(capsys):
    args = ["plan", "--preset", "llama3-8b", "--metp", "8", "--modes", "tp-sp", "metp"]
    assert cli.main(args + ["--seq", str(2 * CAP)]) == 0
    out = capsys.readouterr().out
    assert "# tp-sp: REFUSED at s = 33,554,432 (positions reach 2^24)" in out
    assert cli.main(args + ["--seq", str(CAP)]) == 0
    assert "REFUSED" not in capsys.readouterr().out
