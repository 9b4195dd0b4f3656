"""The collectives the step time prices apart from the rings (tools/plan/collectives.py): stock
TP+SP's all-gathers / reduce-scatters, TP's all-reduces inside METP, and the data-parallel
gradient sync of each iteration, against hand counts; negative controls: GEMMs too short to
hide the backward's gathers expose them, a group spanning nodes goes at the inter-node rate.
Pure planner: fast."""

from dataclasses import replace

import pytest

from megatron_metp.tools import plan as P
from megatron_metp.tools.plan.collectives import grad_sync_s, tp_exposed_s
from megatron_metp.tools.plan.fastest import fastest
from megatron_metp.tools.plan.model import layout
from megatron_metp.tools.plan.step_time import step_time

LLAMA = P.PRESETS["llama3-8b"]
H100 = P.HARDWARE["H100-80GB"]
S = 131072


def _job(**kw):
    return P.Job(distributed_optimizer=True, hardware="H100-80GB", **kw)


def test_stock_tp_sp_exposes_six_collectives_per_layer_when_gemms_hide_four():
    """TP 4+SP × CP 2 at 128K: per layer the forward's 2 all-gathers + 2 reduce-scatters and the
    backward's 2 gradient all-gathers wait; the QKV / FC1 backward's input gather and gradient
    scatter hide behind their GEMMs. A recomputed layer's forward exposes 4 more."""
    m, job = LLAMA.with_seq(S), _job(tp=4, metp=2)
    lay = layout("cp", job)
    n = S // 2
    one = 3 / 4 * n * 4096 * 2 / (H100.link_gbps * 1e9)  # one collective: (t−1)/t of [n, h] bf16
    st = step_time(m, job, "cp")
    assert st["components"]["tp_exposed"] == pytest.approx(32 * 6 * one, rel=1e-12)
    assert 0.15 < st["components"]["tp_exposed"] < 0.2  # seconds per micro-batch
    full = step_time(m, replace(job, recompute="full"), "cp")
    assert full["components"]["tp_exposed"] == pytest.approx(32 * 10 * one, rel=1e-12)
    # negative control: GEMMs too short to hide anything expose all ten collectives
    assert tp_exposed_s(m, job, lay, n, 0, 0, 1e30) == pytest.approx(32 * 10 * one, rel=1e-9)
    # TP 1: nothing; a MoE layer's experts take their tokens by the dispatch instead
    assert step_time(m, _job(tp=1, metp=8), "cp")["components"]["tp_exposed"] == 0.0
    assert tp_exposed_s(m, job, lay, n, 0, 32, 1e30) == pytest.approx(32 * 5 * one)


def test_tp_inside_metp_all_reduces_are_exposed():
    """TP 2 × METP 4 (no sequence parallelism): an all-reduce (twice a gather's bytes) after the
    attention and the MLP, forward and backward: 4 per layer."""
    m, job = LLAMA.with_seq(S), _job(tp=2, metp=4, vocab_parallel=True)
    n = S // 4
    one = 1 / 2 * n * 4096 * 2 / (H100.link_gbps * 1e9)
    assert step_time(m, job, "metp")["components"]["tp_exposed"] == \
        pytest.approx(32 * 4 * 2 * one, rel=1e-12)
    assert step_time(m, _job(tp=1, metp=8, vocab_parallel=True), "metp")["components"][
        "tp_exposed"] == 0.0


def test_gradient_sync_once_per_iteration_inter_node_when_the_stage_spans_nodes():
    """METP 2 × DP 4: the METP-sharded weights (half of each matrix) reduce-scatter their fp32
    gradients and gather their bf16 parameters over DP 4: 3/4 · P · 6 bytes; counted once per
    iteration, outside ``step_s``."""
    m = LLAMA.with_seq(S)
    job = _job(metp=2, dp=4, vocab_parallel=True)
    p = P.params(m, job, "metp")
    assert p.dp_sharded == 4 and p.dp_replicated == 8
    want = (3 / 4 * p.sharded * 6 + 7 / 8 * (p.total - p.sharded) * 6) / (H100.link_gbps * 1e9)
    st = step_time(m, job, "metp")
    assert st["grad_sync_s"] == pytest.approx(want, rel=1e-12)
    assert st["iteration_s"] == pytest.approx(st["step_s"] + st["optimizer_s"] + want)
    assert st["step_s"] == pytest.approx(sum(v for k, v in st["components"].items()
                                             if k not in ("optimizer", "grad_sync_exposed")))
    # METP 8: the sharded weights have no replica; only the norms, replicated over the METP
    # ranks, reduce (over Megatron's DP × CP group of 8)
    one = _job(metp=8, vocab_parallel=True)
    r = P.params(m, one, "metp")
    assert r.dp_sharded == 1 and r.dp_replicated == 8
    assert step_time(m, one, "metp")["grad_sync_s"] == pytest.approx(
        7 / 8 * (r.total - r.sharded) * 6 / (H100.link_gbps * 1e9), rel=1e-12)
    # negative control: the same group on 32 GPUs (DP 16) crosses nodes, at the inter-node rate
    wide = _job(metp=2, dp=16, vocab_parallel=True)
    q = P.params(m, wide, "metp")
    nvlink = (15 / 16 * q.sharded * 6 + 31 / 32 * (q.total - q.sharded) * 6) / (
        H100.link_gbps * 1e9)
    assert grad_sync_s(m, wide, "metp") == pytest.approx(nvlink * H100.link_gbps /
                                                         H100.internode_gbps, rel=1e-12)


def test_fastest_stock_pays_its_collectives():
    """``--fastest`` at 128K on 8 GPUs: stock's fastest layout's time includes its TP
    collectives and gradient sync (TP 4+SP × CP 2 is no longer its fastest)."""
    res = fastest(LLAMA.with_seq(S), 8, families=("metp", "stock"))
    best = res["choices"]["stock"][0]
    mode = best.mode
    st = step_time(LLAMA.with_seq(S), best.job, mode)
    assert best.job.tp > 1 and st["components"]["tp_exposed"] > 0
    assert st["grad_sync_s"] > 0
    assert not (best.job.tp == 4 and mode == "cp" and best.job.metp == 2)
    metp = res["choices"]["metp"][0]
    assert metp.time_s < best.time_s
