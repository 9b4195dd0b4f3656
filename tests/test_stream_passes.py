"""The streaming layer's host passes in the plan (tools/plan/step_time.streaming_passes) after
the K/V and d(kv) work moved into the query-tile passes (ops/layer_reads.py): at the 3.7M and
16M jobs every pass with the attention's compute hides its copies, only the two passes the
op cannot fold into one (the recompute's first K/V, before the first ring; dx, after the last)
stay copy-bound, and the exposed seconds fell; the kept-attention pass list (for layers that
keep O and the LSE) has no recompute pass and carries its own host bytes. Pure planner."""

import pytest

from megatron_metp.ops.layer_reads import host_reads
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan.rates import ATTENTION_BWD_FLOP_RATIO
from megatron_metp.tools.plan.step_time import job_rates, streaming_passes
from megatron_metp.tools.plan.streaming import streaming_host_bytes

LLAMA = P.PRESETS["llama3-8b"]
JOBS = {  # the 3.7M job (llama3-8b-4m-metp8.sh) and the 16M one (llama3-8b-16m-metp8-cp4.sh)
    "3.7M": (3700000, P.Job(tp=1, metp=8, vocab_parallel=True, distributed_optimizer=True,
                            hardware="H100-80GB", recompute="full", offload=True)),
    "16M": (16777216, P.Job(tp=1, metp=8, cp=4, vocab_parallel=True,
                            distributed_optimizer=True, hardware="H100-80GB", recompute="full",
                            offload=True)),
}


def _passes(name, kept=False):
    s, job = JOBS[name]
    model = LLAMA.with_seq(s)
    lay = P.layout("metp", job)
    n = model.seq // lay.c
    fa = 2 * n * model.seq * model.heads * model.head_dim
    r = job_rates(job)
    out = streaming_passes(model, job, lay, n, r, fa / (r.attention_fwd_tflops * 1e12),
                           ATTENTION_BWD_FLOP_RATIO * fa / (r.attention_bwd_tflops * 1e12),
                           kept=kept)
    return model, job, lay, n, out


@pytest.mark.parametrize("name", sorted(JOBS))
def test_only_the_two_unfoldable_passes_are_copy_bound(name):
    model, job, lay, n, passes = _passes(name)
    bound = [x["pass"] for x in passes if x["exposed_s"] > 0]
    assert bound == ["recompute: K/V of group 0 (before the first ring)",
                     "backward: dx (d(qkv)·Wqkv, norm1) + last d(kv)"], bound
    # the passes that form the next group's K/V and reduce the previous group's d(kv) hide
    # their copies behind the attention, with room to spare
    for x in passes:
        if "K/V[g+1]" in x["pass"]:
            assert x["count"] == lay.p and x["copy_s"] < 0.05 * x["compute_s"], x
    # the bytes: the layer's total, and one read of x per pass the op counts
    assert sum(x["count"] * x["bytes"] for x in passes) == \
        pytest.approx(streaming_host_bytes(model, job, lay, n))
    xb = 2 * n * model.hidden
    reads = sum(x["count"] for x in passes if x["bytes"] >= xb and
                not x["pass"].startswith("forward"))
    assert reads == sum(x["count"] * x["x_reads"] for x in passes)
    assert reads == sum(host_reads(lay.p).values()) == 2 * lay.p + 3
    # the exposed time per layer: ~0.2 s, down from 1.33 s (3.7M) / 1.5 s (16M) when K/V,
    # kept k/v and d(kv) had passes of their own (negative control: the old figures)
    exposed = sum(x["count"] * x["exposed_s"] for x in passes)
    assert 0.1 < exposed < 0.25, exposed


@pytest.mark.parametrize("name", sorted(JOBS))
def test_kept_attention_passes_have_no_recompute(name):
    model, job, lay, n, passes = _passes(name, kept=True)
    assert not any(x["pass"].startswith("recompute") for x in passes)
    assert [x["pass"] for x in passes if x["exposed_s"] > 0] == \
        ["backward: dx (d(qkv)·Wqkv, norm1) + last d(kv)"]
    assert sum(x["count"] * x["bytes"] for x in passes) == \
        pytest.approx(streaming_host_bytes(model, job, lay, n, kept=True))
    # x: written once, read by the MLP pass, twice per group (q, dWq), by dx
    reads = sum(x["count"] * x["x_reads"] for x in passes)
    assert reads == sum(host_reads(lay.p, kept=True).values()) == 2 * lay.p + 2
    # fewer bytes and less exposed time than the recompute's passes
    _, _, _, _, full = _passes(name)
    assert sum(x["count"] * x["bytes"] for x in passes) < \
        sum(x["count"] * x["bytes"] for x in full)
    assert sum(x["count"] * x["exposed_s"] for x in passes) < \
        sum(x["count"] * x["exposed_s"] for x in full)


def test_the_plan_reports_the_passes_and_their_exposed_seconds():
    s, job = JOBS["3.7M"]
    c = P.step_cost(LLAMA.with_seq(s), job, "metp")
    per_layer = sum(x["count"] * x["exposed_s"] for x in c["host_passes"])
    assert c["components"]["host_copies_exposed"] == pytest.approx(32 * per_layer)
    assert 5 < c["components"]["host_copies_exposed"] < 8  # 42.5 s before the fold


def test_kept_attention_phases_have_no_recompute():
    from megatron_metp.tools.plan.streaming import streaming_phases

    model, job, lay, n, _ = _passes("3.7M")
    full = streaming_phases(model, job, lay, n, host=True)
    kept = streaming_phases(model, job, lay, n, host=True, kept=True)
    assert "streaming layer recompute: attention (last layer)" in full
    assert set(full) - set(kept) == {"streaming layer recompute: attention (last layer)"}
    mlp = "streaming layer MLP backward (last layer)"
    # the kept layer's MLP backward forms group 0's K/V from norm1(x) (and the head groups'
    # weights arrive meanwhile), its log-sum-exps are on the host
    assert "row tile: norm1(x) for group 0's K/V (bf16)" in kept[mlp]
    assert not any("log-sum-exp" in k for k in kept[mlp])
    assert any("log-sum-exp" in k for k in full[mlp])
