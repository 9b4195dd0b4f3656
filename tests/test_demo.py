"""``make demo``'s worker logic at a tiny size: stock TP=2 then METP=2 in one world, same losses."""

import copy
import json

from megatron_metp.tools.demo import DemoConfig, check, rank_main, write_outputs
from tests.harness import run_ranks

TINY = DemoConfig(iters=3, layers=2, hidden=32, heads=4, seq=32, vocab=64)


def test_demo_two_runs_agree_and_write_table(tmp_path):
    out = run_ranks(rank_main, 2, TINY, timeout=120)
    assert out[1] is None
    res = out[0]
    tp, metp = "stock TP=2", "METP=2+vocab"
    assert list(res["runs"]) == [tp, metp]
    la, lb = res["runs"][tp]["losses"], res["runs"][metp]["losses"]
    assert len(la) == len(lb) == TINY.iters
    for i, (a, b) in enumerate(zip(la, lb)):
        assert abs(a - b) <= 1e-5 * abs(a), (i, a, b)
    assert la[-1] < la[0]  # the synthetic language is learnable
    assert check(res)[0]

    for name in (tp, metp):
        for rank, m in enumerate(res["memory"][name]):
            assert m["rank"] == rank and m["total"] > 0
            assert sum(m["by_category"].values()) == m["total"]
            for cat in ("Parameter", "Gradient", "Optstate", "Activation"):
                assert m["by_category"][cat] > 0, (name, rank, cat)
    t_tp, t_metp = res["traffic"][tp][0], res["traffic"][metp][0]
    assert t_tp["by_op_per_step"]["allreduce_"] > 0  # Megatron's TP all-reduces
    assert t_tp["metp_ring_stats_per_step"]["bytes_sent"] == 0
    assert t_metp["by_op_per_step"]["send"] > 0  # METP's rings
    assert t_metp["metp_ring_stats_per_step"]["bytes_sent"] > 0
    # the agreement check (on by default) exchanges at the first calls: counted apart
    assert t_metp["agreement_check_bytes_each_step"][0] > 0
    assert t_tp["agreement_check_bytes_each_step"] == [0] * TINY.iters  # no METP op in stock TP
    for t in (t_tp, t_metp):
        assert len(set(t["bytes_sent_each_step"])) == 1  # the same traffic every step
        assert not t["uncounted_calls"]

    jpath, ppath = write_outputs(res, str(tmp_path))
    with open(jpath) as f:
        table = json.load(f)
    assert {"config", "runs", "loss_table", "max_abs_diff", "max_rel_diff", "memory", "traffic",
            "conventions", "tolerance_rel", "ok"} <= set(table)
    assert set(table["loss_table"][0]) == {"iteration", tp, metp, "abs_diff", "rel_diff"}
    assert table["ok"] is True
    with open(ppath, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # negative control: the check that sets the exit status catches diverging curves
    bad = copy.deepcopy(res)
    bad["loss_table"][1]["rel_diff"] = 2e-4
    ok, msg = check(bad)
    assert not ok and "iteration 2" in msg
