"""The plan and ``metp measure`` of MoE with expert parallelism wider than the METP group
(``EP = p·e``, issue 42; the training side: tests/test_moe_ep_wide.py): the experts' bytes divide
by EP, the METP-sharded weights' optimizer state by expert-DP; Qwen3-30B-A3B at 1M tokens on 8 ×
H100 with EP 8 over METP 4 × CP 2 within 36 GiB per rank; the measured real model of EP 4 over
METP 2 × CP 2 within 3 % of the plan."""

import pytest


def test_plan_divides_experts_by_ep_and_qwen3_1m_fits_36_gib_with_ep8():
    """``metp plan`` of configs/qwen3-30b-a3b-1m-metp4-cp2-ep8.sh against the EP 4 config
    (Qwen3-30B-A3B, 1M tokens, 8 × H100, METP 4 × CP 2): the
    experts' weights, gradients and optimizer state divide by EP = 8, not p = 4, and the
    METP-sharded weights' distributed-optimizer state by expert-DP (1); per rank ≤ 36 GiB (EP 4:
    over 50 GiB). ``--ep`` values that are not whole METP groups are refused naming the valid
    ones."""
    import os

    from megatron_metp.tools import cli
    from megatron_metp.tools import plan as P

    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    config = os.path.join(configs, "qwen3-30b-a3b-1m-metp4-cp2-ep8.sh")
    m, j4, _ = cli.build_from_argv(["--config", os.path.join(configs,
                                                             "qwen3-30b-a3b-1m-metp4-cp2.sh")])
    m8, j8, _ = cli.build_from_argv(["--config", config])
    assert (m8.experts, m8.layers, m8.seq) == (m.experts, m.layers, m.seq) == (128, 48, 1048576)
    assert (j4.ep, j8.ep) == (0, 8) and (j8.metp, j8.cp, j4.metp, j4.cp) == (4, 2, 4, 2)
    p4, p8 = P.params(m, j4, "metp"), P.params(m, j8, "metp")
    assert p8.expert * 2 == p4.expert and (p4.dp_expert, p8.dp_expert) == (2, 1)
    assert (p4.dp_sharded, p8.dp_sharded) == (2, 1) and p8.sharded == p4.sharded
    before, after = P.memory(m, j4, "metp").total, P.memory(m, j8, "metp").total
    print(f"Qwen3-30B-A3B 1M, METP 4 x CP 2: EP 4 {before / P.GiB:.2f} GiB, EP 8 "
          f"{after / P.GiB:.2f} GiB per rank")
    assert before > 50 * P.GiB and after <= 36 * P.GiB
    flags = P.megatron_flags(m8, j8, "metp")
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "8"
    with pytest.raises(ValueError, match=r"--ep 12: .*valid: 4, 8"):
        cli.build_from_argv(["--config", config, "--ep", "12"])


def test_measure_of_ep4_over_metp2_x_cp2_matches_the_plan(monkeypatch):
    """``metp measure`` builds the real MoE model with EP 4 over METP 2 × CP 2 under the fake
    group: its parameter bytes equal the plan's and its peak is within 3 %; negative control:
    the plan of EP 2 counts other parameter bytes."""
    from dataclasses import replace

    from megatron_metp.tools import measure as M
    from megatron_metp.tools import plan as P
    from tests.test_moe_plan import TINY

    monkeypatch.setenv("METP_MOE_TOKEN_TILES", "4")
    job = P.Job(tp=1, metp=2, cp=2, ep=4, vocab_parallel=True, distributed_optimizer=True,
                recompute="full", offload=True, moe_dispatcher="alltoall")
    res = M.measure(TINY, job, "metp", timeout=300)[0]
    assert "error" not in res, res["error"]
    plan = P.memory(TINY, job, "metp")
    assert res["params"] == plan.static["params"]
    err = plan.measured_part / res["peak"] - 1
    print(f"EP 4: measured {res['peak']:,} B, plan {plan.measured_part:,.0f} B ({err:+.2%})")
    assert abs(err) <= 0.03, err
    assert P.memory(TINY, replace(job, ep=2), "metp").static["params"] != res["params"]
