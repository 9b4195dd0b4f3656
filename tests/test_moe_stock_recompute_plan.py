"""Stock Megatron MoE layers under full recompute (+ host offload: stock's best reach layouts),
planned against ``metp measure`` of a shrunk Qwen3-MoE (``tests/test_moe_plan.TINY``): the MLP
phases set the peak there, so the plan's MoE forward and backward steps are checked term by term
(``tools/plan/moe.py``: :func:`moe_forward`, :func:`moe_backward`), and q's reshape under the
q/k norms, a view when the rank holds one query group or a group holds one head
(``tools/plan/activation_memory.py``).

Each case: the plan within 1 % of the measured peak, and a negative control (the old term) off
by more than 3 %: the backward's dispatcher buffers summed with the experts' gradients (they
never coexist); the alltoall forward without the sent and received rows ``MoELayer.forward``
holds and without the gradient the checkpoint holds while it re-runs the forward; q's reshaped
copy counted at one query group per rank. Four fake-rank measurements, about 10 s."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import moe as PM
from megatron_metp.tools.plan.model import BF16

from .test_moe_plan import TINY

#: the same attention as TINY, no experts, one head per K/V group (A = G: q's reshape a view)
MHA = replace(TINY, name="tiny-mha", query_groups=8, experts=0, topk=0, moe_ffn=None)

CASES = {
    "allgather-ep2": (TINY, P.Job(tp=2, metp=1, ep=2, moe_dispatcher="allgather",
                                  recompute="full", offload=True)),
    "alltoall-ep2": (TINY, P.Job(tp=2, metp=1, ep=2, moe_dispatcher="alltoall",
                                 recompute="full", offload=True)),
    "allgather-ep4-one-group": (TINY, P.Job(tp=4, metp=1, ep=4, moe_dispatcher="allgather",
                                            recompute="full")),
    "mha-tp2": (MHA, P.Job(tp=2, metp=1)),
}


@pytest.fixture(scope="module")
def measured():
    from megatron_metp.tools import measure as M

    out = {}
    for key, (model, job) in CASES.items():
        res = M.measure(model, job, "tp-sp", timeout=300)[0]
        assert "error" not in res, res["error"]
        out[key] = res
    return out


def _err(key, measured) -> float:
    model, job = CASES[key]
    return P.memory(model, job, "tp-sp").measured_part / measured[key]["peak"] - 1


def _summed_backward(grads, disp, wgrad):
    """The old backward: the dispatcher's buffers and the experts' gradients all at once."""
    return dict(grads, **disp["backward"], **wgrad)


def _old_forward(model, job, ep, N):
    """The old forward: the MoE output beside the combine's buffers, nothing held."""
    return {"MoE output [tokens, h] (bf16)": BF16 * N * model.hidden,
            **PM.dispatcher(model, job, ep, N)["combine"]}


@pytest.mark.parametrize("key", ["allgather-ep2", "allgather-ep4-one-group"])
def test_moe_backward_is_the_largest_step_not_the_sum(key, measured, monkeypatch):
    err = _err(key, measured)
    print(f"{key}: measured {measured[key]['peak']:,} plan {err:+.2%}")
    assert abs(err) <= 0.01, err
    monkeypatch.setattr(PM, "moe_backward", _summed_backward)
    assert _err(key, measured) > 0.03  # negative control


def test_alltoall_forward_holds_the_dispatch_rows_beside_the_incoming_gradient(measured,
                                                                              monkeypatch):
    key = "alltoall-ep2"
    model, job = CASES[key]
    mem = P.memory(model, job, "tp-sp")
    assert mem.act.peak_phase == "MLP recompute (last layer)"
    err = _err(key, measured)
    print(f"{key}: measured {measured[key]['peak']:,} plan {err:+.2%}")
    assert abs(err) <= 0.01, err
    monkeypatch.setattr(PM, "moe_forward", _old_forward)
    assert _err(key, measured) < -0.03  # negative control


@pytest.mark.parametrize("key", ["allgather-ep4-one-group", "mha-tp2"])
def test_q_reshape_is_a_view_with_one_group_per_rank_or_one_head_per_group(key, measured):
    model, job = CASES[key]
    mem = P.memory(model, job, "tp-sp")
    assert not any(k.startswith("q norm input") for k in mem.act.stored_layer)
    err = _err(key, measured)
    assert abs(err) <= 0.01, err
    # negative control: q's reshaped copy [s, A/t·d] in every layer re-formed or stored
    n = model.seq
    copy = BF16 * n * model.heads * model.head_dim // job.tp
    layers = 1 if job.recompute == "full" else model.layers
    wrong = (mem.measured_part + layers * copy) / measured[key]["peak"] - 1
    print(f"{key}: plan {err:+.2%}, with q's copy {wrong:+.2%}")
    assert wrong > 0.03
