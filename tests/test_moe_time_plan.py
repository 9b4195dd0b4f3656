"""MoE in the step time and the searches (issue 42, deliver 5; tools/plan/moe_time.py): the
dispatch bytes against a hand count of a tiny routing, the link an EP group spans (a wrong link
caught), the expert GEMMs' shape rate (sequential and grouped) against the published GEMM rate,
the routing imbalance on the busiest rank, EP as a free factor of ``--reach``, and the presets
``glm-4.5-air`` and ``gpt-oss-120b``. Pure planner: a few seconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import moe_time as MT
from megatron_metp.tools.plan import search as R

QWEN = P.PRESETS["qwen3-30b-a3b"]
#: a tiny MoE: h 8, 4 experts, top-2
TINY = P.Model(name="tiny", hidden=8, layers=2, heads=2, ffn=16, vocab=64, seq=12,
               swiglu=True, experts=4, topk=2, moe_ffn=16)


def _routes(rank: int, tokens: int, experts: int, k: int):
    """A balanced routing of ``tokens`` tokens of ``rank``: token i to experts k·i, k·i + 1, ...
    (mod E), every expert chosen equally often."""
    return [[(rank + k * i + j) % experts for j in range(k)] for i in range(tokens)]


def test_dispatch_bytes_equal_a_hand_count_of_a_tiny_routing():
    """EP 2 (experts 0, 1 on rank 0; 2, 3 on rank 1), 6 tokens per rank, top-2: the rows rank 0
    sends to rank 1, each with its bf16 token (16 B), the combine's row back (16 B) and its
    bf16 probability (2 B), counted from the routing itself."""
    ep, N, h = 2, 6, TINY.hidden
    local = TINY.experts // ep
    rows_out = sum(1 for r in _routes(0, N, TINY.experts, TINY.topk) for e in r
                   if e // local != 0)
    assert rows_out == 6  # half of the 12 routed rows leave the rank
    hand = rows_out * (2 * h + 2 * h + 2)
    got = MT.dispatch_bytes(TINY, "alltoall", ep, N)
    assert got == {"forward": hand, "backward": hand} == {"forward": 204, "backward": 204}
    # allgather: the rank's map (bool), probabilities (bf16) and tokens go to the other rank,
    # and the combine's reduce-scatter sends it the other half of [N·ep, h] (bf16)
    fwd = N * TINY.experts * (1 + 2) + N * h * 2 + N * h * 2
    bwd = N * TINY.experts * 2 + N * h * 2 + N * h * 2
    assert MT.dispatch_bytes(TINY, "allgather", ep, N) == {"forward": fwd, "backward": bwd}
    assert MT.dispatch_bytes(TINY, "alltoall", 1, N) == {"forward": 0.0, "backward": 0.0}
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type"):
        MT.dispatch_bytes(TINY, "flex", ep, N)


def test_the_link_the_ep_group_spans_and_a_wrong_link_is_caught():
    """EP 8 of one node: NVLink (450 GB/s); EP 16 over two nodes: 8 of its 15 peers are on the
    other node, their rows on the inter-node link (50 GB/s per GPU). Negative control: the
    NVLink link for the EP-16 group misses the hand figure."""
    job = P.Job(hardware="H100-80GB")
    nbytes = 15e9
    inside, across = MT.ep_link(job, 8), MT.ep_link(job, 16)
    assert (inside["crosses"], across["crosses"], across["on_node"]) == (0, 1, 8)
    assert MT.dispatch_s(nbytes, "alltoall", 8, inside) == pytest.approx(nbytes / 450e9)
    hand = nbytes * 8 / 15 / 50e9
    assert MT.dispatch_s(nbytes, "alltoall", 16, across) == pytest.approx(hand)
    wrong = MT.dispatch_s(nbytes, "alltoall", 16, inside)
    assert wrong != pytest.approx(hand) and wrong < hand / 4
    # a ring (allgather) across nodes lasts as long as its inter-node hop
    assert MT.dispatch_s(nbytes, "allgather", 16, across) == pytest.approx(nbytes / 50e9)
    # EP 6 does not divide a node of 8: some groups straddle two nodes
    assert MT.ep_link(job, 6)["crosses"] == 1


def test_expert_gemms_at_the_published_rate_for_large_shapes_and_slower_when_small():
    """A large GEMM runs at the table's 708 TFLOP/s within its last wave (4096 tiles on 132 SMs:
    32 waves for 31.03); 32 experts of 100 rows: each sequential GEMM one wave of 12 tiles,
    grouped 3 waves for all 384 (memory-bound there); both never faster than the table rate."""
    rate, hbm, sms = 708.0, 3350.0, 132
    ideal = 2 * 8192 ** 3 / (rate * 1e12)
    big = MT.gemm_s(8192, 8192, 8192, 1, False, rate, hbm, sms)
    assert big == pytest.approx(ideal * 32 / (4096 / 132))
    wave = 2 * 128 * 128 * 2048 * sms / (rate * 1e12)
    seq = MT.gemm_s(100, 1536, 2048, 32, False, rate, hbm, sms)
    grp = MT.gemm_s(100, 1536, 2048, 32, True, rate, hbm, sms)
    assert seq == pytest.approx(32 * wave)
    mem = 32 * 2 * (100 * 2048 + 2048 * 1536 + 100 * 1536) / (hbm * 1e9)
    assert grp == pytest.approx(max(3 * wave, mem))
    floor = 32 * 2 * 100 * 1536 * 2048 / (rate * 1e12)
    assert floor < grp < seq / 4


def test_step_time_has_the_experts_and_the_dispatch_and_the_imbalance_slows_the_busiest_rank():
    job = P.Job(metp=4, cp=2, vocab_parallel=True, recompute="full", offload=True,
                optimizer_offload=True, distributed_optimizer=True, moe_dispatcher="alltoall")
    base = P.step_cost(QWEN, job, "metp")
    c = base["components"]
    assert c["moe_experts"] > 0 and c["moe_dispatch_exposed"] > 0
    m = base["moe"]
    assert (m["ep"], m["link"]["crosses"], m["forward_passes"]) == (4, 0, 3 * 48)
    # the dispatch: 48 layers × (3 forward passes + the backward) of the hand formula
    N = QWEN.seq // 8
    one = 3 / 4 * N * 8 * (4 * QWEN.hidden + 2)
    assert base["sent_by_moe_dispatch"] == pytest.approx(48 * 4 * one)
    assert c["moe_dispatch_exposed"] == pytest.approx(48 * 4 * one / 450e9, rel=1e-3)
    skew = P.step_cost(QWEN, replace(job, moe_imbalance=1.5), "metp")["components"]
    assert skew["moe_experts"] > 1.2 * c["moe_experts"]  # (partial waves fill up)
    assert skew["moe_dispatch_exposed"] == pytest.approx(1.5 * c["moe_dispatch_exposed"])
    assert skew["attention_fwd"] == c["attention_fwd"]
    # grouped GEMM: never slower than SequentialMLP on the same rows
    grouped = P.step_cost(QWEN, replace(job, moe_grouped_gemm=True), "metp")["components"]
    assert grouped["moe_experts"] <= c["moe_experts"]
    # the stock layout by the same formulas: TP 4+SP × CP 2, EP 8, its tokens s/(t·c)
    stock = P.step_cost(QWEN, P.Job(tp=4, metp=2, ep=8, moe_dispatcher="alltoall",
                                    recompute="full", distributed_optimizer=True), "cp")
    assert stock["moe"]["rows"] == QWEN.seq // 8 * 8 and stock["moe"]["tiles"] == 1


def test_reach_searches_ep_and_picks_ep_wider_than_metp_where_it_reaches_further():
    """Qwen3-30B-A3B on 8 GPUs: EP 8 over METP 4 × CP 2 reaches further than EP 4 (the
    experts' gradients and states halve); the report prints the EP and each family's time."""
    cands = R.candidates(QWEN, 8, "metp", recompute=("full + offload",),
                         optimizer_offload=(True,))
    best = next(c for c in cands if c.seq)
    assert best.job.ep == 8 > best.job.metp == 4 and "EP 8" in best.describe()
    at_p = next(c for c in cands if c.seq and c.job.ep == c.job.metp)
    assert at_p.seq < best.seq  # negative control: EP = p reaches less
    stock = R.candidates(QWEN, 8, "stock", recompute=("full + offload",),
                         optimizer_offload=(True,))
    text = R.reach_report(QWEN, 8, res={"metp": cands, "stock": stock}, width=None)
    assert "s per sequence (TP 1 × METP 4 × CP 2 × PP 1 × DP 1 × EP 8" in text
    assert "# best stock Megatron: 487K tokens in " in text


def test_glm_and_gpt_oss_presets():
    glm, oss = P.PRESETS["glm-4.5-air"], P.PRESETS["gpt-oss-120b"]
    # parameters against the published totals (106B for GLM-4.5-Air, its MTP layer aside;
    # 116.8B for gpt-oss-120b, OpenAI's model card)
    assert P.params(glm, P.Job(tp=1, metp=1), "tp-sp").total == pytest.approx(106e9, rel=0.01)
    assert P.params(oss, P.Job(tp=1, metp=1), "tp-sp").total == pytest.approx(116.8e9, rel=1e-3)
    flags = P.moe.moe_layer_flags(glm)
    assert flags[0] is False and all(flags[1:]) and len(flags) == 46
    line = " ".join(P.launch.moe_flags(glm, P.Job(metp=8, ep=8), "metp"))
    assert "--moe-layer-freq ([0]*1+[1]*45)" in line and \
        "--moe-shared-expert-intermediate-size 1408" in line
    # the shared expert is a dense MLP of 1408 beside the experts: its FLOPs in the MoE layers
    job = P.Job(metp=8, vocab_parallel=True, moe_dispatcher="alltoall",
                distributed_optimizer=True, recompute="full")
    with_shared = P.step_cost(glm, job, "metp")["components"]["gemm"]
    without = P.step_cost(replace(glm, moe_shared_ffn=0), job, "metp")["components"]["gemm"]
    assert with_shared > without
    res = P.plan(oss, P.Job(metp=8, vocab_parallel=True, moe_dispatcher="alltoall"), ["metp"])
    text = P.report(oss, P.Job(metp=8, vocab_parallel=True, moe_dispatcher="alltoall"),
                    ["metp"])
    assert res["modes"]["metp"]["cost"]["moe"]["ep"] == 8
    assert "planned as full causal attention" in text and "MoE time: EP 8 over NVLink" in text


def test_measure_builds_the_leading_dense_layer_and_the_shared_expert_the_plan_counts():
    """A tiny GLM-shaped model (layer 0 dense, a shared expert of 128) measured at METP 2: the
    parameters equal the plan's, the peak within 3 %. Negative control: the plan without the
    leading dense layer or without the shared expert counts other parameters."""
    from megatron_metp.tools import measure as M

    glm = P.Model(name="tiny-glm", hidden=256, layers=3, heads=8, query_groups=4,
                  kv_channels=64, ffn=512, vocab=1000, seq=2048, swiglu=True, tied=False,
                  experts=8, topk=2, moe_ffn=128, moe_first_dense=1, moe_shared_ffn=128)
    job = P.Job(tp=1, metp=2, moe_dispatcher="alltoall", distributed_optimizer=True)
    res = M.measure(glm, job, "metp", timeout=300)[0]
    assert "error" not in res, res["error"]
    plan = P.memory(glm, job, "metp")
    assert res["params"] == plan.static["params"]
    assert abs(plan.measured_part / res["peak"] - 1) <= 0.03
    for wrong in (replace(glm, moe_first_dense=0), replace(glm, moe_shared_ffn=0)):
        assert P.memory(wrong, job, "metp").static["params"] != res["params"]
