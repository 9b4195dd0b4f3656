"""``metp plan`` against ``metp measure`` for a MoE layer's shared expert
(``--moe-shared-expert-intermediate-size``) and the allgather dispatcher's global buffer
(tools/plan/moe.py: :func:`shared_stored`, :func:`shared_phases`, :func:`mpu_buffer`).

The shrunk Qwen3-MoE of tests/test_moe_plan.py with a shared expert, rank 0 under the fake
group: stock TP 2 + SP × EP 2 (Megatron's ``SharedExpertMLP`` keeps fc1's output and fc2's
input, ``[n, 3·F_s/t]`` bf16 per MoE layer) and METP 2 (the METP MLP op keeps nothing beyond the
norm output it reads; its backward, after the routed experts', sets the peak with ``F_s`` 16 h).
What the forward stores (with Megatron's persistent global buffer, which holds the allgather
dispatcher's ``[N·ep, h]`` tokens) agrees within 0.5 %, the peak within 1 % (METP) and 3 %
(stock); each negative control (the plan without the shared expert's stored tensors, with the
stock ones under METP, without the global buffer, without the shared expert's phases) misses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import activation_memory as AM
from megatron_metp.tools.plan import moe as PM
from tests.test_moe_plan import TINY

#: (model, job, mode) of each measurement: a shared expert of 2h (stock), of 16h (METP: its
#: backward is the rank's peak); the allgather dispatcher over EP 2 in both
CASES = {"stock": (replace(TINY, moe_shared_ffn=512),
                   P.Job(tp=2, metp=1, ep=2, moe_dispatcher="allgather"), "tp-sp"),
         "metp": (replace(TINY, moe_shared_ffn=4096),
                  P.Job(tp=1, metp=2, moe_dispatcher="allgather"), "metp")}


@pytest.fixture(scope="module")
def measured():
    """Rank 0 of both cases measured in forked children (~3 s each)."""
    from megatron_metp.tools import measure as M

    out = {}
    for key, (model, job, mode) in CASES.items():
        res = M.measure(model, job, mode, timeout=300)[0]
        assert "error" not in res, res["error"]
        out[key] = res
    return out


def _stored(key) -> float:
    """The plan's bytes of what the forward leaves: stored activations + persistent buffer."""
    model, job, mode = CASES[key]
    act = P.memory(model, job, mode).act
    return act.stored + act.persistent


def _err(plan, measured) -> float:
    return plan / measured - 1


def test_stock_shared_expert_stored_tensors_are_planned(measured, monkeypatch):
    res = measured["stock"]
    model, job, mode = CASES["stock"]
    per_layer = sum(PM.shared_stored(model, P.layout(mode, job), model.seq // job.tp).values())
    assert per_layer == 2 * model.seq * 3 * model.moe_shared_ffn // job.tp  # [n, 3·F_s/t] bf16
    err = _err(_stored("stock"), res["stored"])
    peak = _err(P.memory(model, job, mode).measured_part, res["peak"])
    print(f"stock: stored {res['stored']:,} ({err:+.3%}), peak {res['peak']:,} ({peak:+.2%}); "
          f"shared expert {per_layer:,} B per layer")
    assert abs(err) <= 0.005 and abs(peak) <= 0.03
    # negative control: the plan without the shared expert's tensors
    monkeypatch.setattr(PM, "shared_stored", lambda *a: {})
    assert _err(_stored("stock"), res["stored"]) < -0.005


def test_metp_shared_expert_keeps_nothing_more_and_its_backward_sets_the_peak(measured,
                                                                            monkeypatch):
    res = measured["metp"]
    model, job, mode = CASES["metp"]
    plan = P.memory(model, job, mode)
    err, peak = _err(_stored("metp"), res["stored"]), _err(plan.measured_part, res["peak"])
    print(f"metp: stored {res['stored']:,} ({err:+.3%}), peak {res['peak']:,} ({peak:+.2%}) in "
          f"{plan.act.peak_phase}")
    assert abs(err) <= 0.005 and abs(peak) <= 0.01
    assert plan.act.peak_phase == "MLP shared expert backward (last layer)"
    # negative controls: the global buffer left out; stock's shared-expert tensors counted
    with monkeypatch.context() as mp:
        mp.setattr(AM, "mpu_buffer", lambda *a: 0.0)
        assert _err(_stored("metp"), res["stored"]) < -0.005
    with monkeypatch.context() as mp:
        stock_lay = P.layout("tp-sp", P.Job(tp=1, metp=1))
        shared = PM.shared_stored
        mp.setattr(PM, "shared_stored", lambda m, lay, N: shared(m, stock_lay, N))
        assert _err(_stored("metp"), res["stored"]) > 0.005
    # ... and the shared expert's phases left out
    monkeypatch.setattr(PM, "shared_phases", lambda *a: {})
    assert _err(P.memory(model, job, mode).measured_part, res["peak"]) < -0.03
