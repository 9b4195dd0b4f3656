"""The fast instruments (issue 31, Deliver 2): ``metp measure`` and the dry run measure fewer
layers and fewer tile passes and extrapolate; here each shortcut is checked against the full
measurement of a shrunk twin of the long configs (METP with the vocabulary ring, full recompute
as the streaming layer, host offload), with negative controls that a wrong rule is caught."""

from dataclasses import replace

import pytest

from megatron_metp.runtime import loop_sample
from megatron_metp.tools import fakerank as FR
from megatron_metp.tools import measure as M
from megatron_metp.tools import plan as P

#: a 1/32-wide Llama-3-8B-shaped twin (GQA, SwiGLU, RMSNorm, untied) of the long configs' job
TWIN = P.Model(hidden=256, layers=1, heads=4, ffn=512, vocab=512, seq=2048, query_groups=2,
               swiglu=True, tied=False, name="twin")
JOB = P.Job(tp=1, metp=2, vocab_parallel=True, recompute="full", recompute_method="uniform",
            recompute_num_layers=1, offload=True, kernel="flash")
KEYS = ("peak", "stored", "activation_peak", "sent", "metp_ring_sent", "comm_ops", "host_peak")


def test_loop_sample_plan_keeps_first_and_last_passes_and_weights_sum_to_the_loop():
    assert loop_sample.plan(3, 2, 1) == [(0, 1), (1, 1), (2, 1)]
    assert loop_sample.plan(17, 2, 1) == [(0, 1), (1, 15), (16, 1)]
    assert sum(w for _, w in loop_sample.plan(70, 2, 1)) == 70
    assert list(loop_sample.tiles("abcde")) == list(enumerate("abcde"))  # off: every pass
    with loop_sample.sampling() as st:
        got = [(i, x, loop_sample.weight()) for i, x in loop_sample.tiles("abcde")]
        nested = [loop_sample.weight() for _ in loop_sample.tiles("abcde")
                  for _ in loop_sample.tiles("abcd")]
    # the index is the one before the next pass run (what the loops prefetch: items[i + 1])
    assert got == [(0, "a", 1), (3, "b", 3), (4, "e", 1)]
    assert nested == [1, 2, 1, 3, 6, 3, 1, 2, 1] and sum(nested) == 5 * 4
    assert st["skipped"] == 2 + 2 + 3 * 1 and loop_sample.weight() == 1
    with pytest.raises(ValueError, match="first >= 1"):
        with loop_sample.sampling(first=0):
            pass
    with pytest.raises(ValueError, match="--measure-tiles 'some'"):
        FR.tile_sampling("some")


def _measure_here(model, job, tiles):
    return FR.run_isolated(lambda: M.measure_here(model, job, "metp", measure_tiles=tiles),
                           timeout=300)


def test_sampled_tile_passes_give_the_full_loops_bytes_and_traffic(monkeypatch):
    """The shrunk twin with a 1 MiB tile budget runs every loop of the streaming layer over
    several tiles (rows, query tiles, key sub-blocks); running the first two and the last pass
    of each gives the full run's peak, stored bytes, host bytes and (weighted) traffic exactly.
    Negative control: every kept pass weighted 1 (the skipped passes forgotten) undercounts the
    traffic."""
    monkeypatch.setenv("METP_TILE_BUDGET_MIB", "1")
    FR.preload_megatron()
    full = _measure_here(TWIN, JOB, "full")
    sampled = _measure_here(TWIN, JOB, "sampled")
    assert full["tiles"] == "every tile pass run"
    assert sampled["tiles"].startswith(tuple("123456789")), sampled["tiles"]
    run, of = (int(x.replace(",", "")) for x in sampled["tiles"].split(" tile")[0].split(" of "))
    assert run < of, sampled["tiles"]  # passes were skipped, so the check below means something
    assert {k: sampled[k] for k in KEYS} == {k: full[k] for k in KEYS}

    # negative controls, two wrong rules at once: every kept pass weighted 1 (the skipped
    # passes forgotten: the traffic undercounted) and the kept passes' true indices (a pass
    # before a skipped one prefetches a tile never read: the peak overcounted)
    def wrong_tiles(items):
        for i, w in loop_sample.plan(len(items), 2, 1):
            yield i, items[i]

    monkeypatch.setattr(loop_sample, "tiles", wrong_tiles)
    wrong = _measure_here(TWIN, JOB, "sampled")
    assert wrong["peak"] > full["peak"]
    assert wrong["sent"] < full["sent"] and wrong["comm_ops"] != full["comm_ops"]


def test_layer_extrapolation_matches_the_full_depth_and_a_wrong_rule_is_caught(monkeypatch):
    """``measure_layers="auto"`` (2 and 3 layers with the host offload, extrapolated linearly)
    equals the measurement of all 6 layers of the twin: peak, stored, traffic, host bytes.
    Negative control: the deepest measured stage taken as it is (no per-layer growth) misses
    the traffic and host bytes of the other layers."""
    model = replace(TWIN, layers=6, seq=512)
    full, auto = (M.measure(model, JOB, "metp", measure_layers=depth)[0]
                  for depth in ("full", "auto"))
    runs = M._runs
    monkeypatch.setattr(M, "_runs", lambda *a: (lambda r: (r[0], [0.0, 1.0], r[2]))(runs(*a)))
    flat = M.measure(model, JOB, "metp", measure_layers="auto")[0]
    for r in (full, auto, flat):
        assert "error" not in r, r.get("error")
    assert auto["method"].startswith("measured on 2 and 3 layers"), auto["method"]
    assert full["method"].startswith("measured on all 6 layers"), full["method"]
    for key in ("peak", "stored", "sent", "host_peak"):
        assert auto[key] == pytest.approx(full[key], rel=1e-3), key
    for key in ("sent", "host_peak"):
        assert abs(flat[key] / full[key] - 1) > 0.1, (key, flat[key], full[key])


# ----------------------------------------------------------------------------- the K/V ring

def test_ring_run_plan_keeps_the_first_step_of_each_run_of_like_steps():
    kinds = ["own"] + ["half"] * 9 + ["last"]  # a forward ring of 11 at rank 0
    assert loop_sample.run_plan(kinds) == [(0, 1), (1, 9), (10, 1)]
    mixed = ["own", "a", "a", "a", "a", "a", "b", "b", "b", "b", "b", "b", "last"]
    assert loop_sample.run_plan(mixed) == [(0, 1), (1, 5), (6, 6), (12, 1)]
    assert loop_sample.run_plan(mixed, 2, 1) == [(0, 1), (1, 1), (2, 3), (5, 1), (6, 1), (7, 4),
                                                 (11, 1), (12, 1)]
    assert list(loop_sample.steps(5, lambda t: t > 0)) == [0, 1, 2, 3, 4]  # off: every step
    with loop_sample.sampling() as st:
        seen = [(t, loop_sample.weight()) for t in loop_sample.steps(11, kinds.__getitem__)]
        plain = list(loop_sample.steps(11))  # no kinds: a ring that is not sampled
    assert seen == loop_sample.run_plan(kinds) and plain == list(range(11))
    assert (st["ring_steps"], st["ring_skipped"]) == (3, 8) and loop_sample.weight() == 1


#: fake ranks of the ring (METP·CP), local tokens, heads, head dim of the op-level ring checks
RING_P, RING_N, RING_H, RING_D = 12, 48, (4, 2), 16


def _ring_cases():
    """``{name: (layout, causal, windows, cu_seqlens)}``: the K/V ring's code paths: the
    streaming layer's windowed rings (a mirrored query tile, key tiles, a key sub-block), the
    plain ring, a non-causal one and packed sequences (blocks that differ from step to step;
    ``packed plain``: at rank 0 one of them, not next to the diagonal, holds the peak)."""
    from megatron_metp.ops.balance import kv_blocks, query_tiles

    n, s = RING_N, RING_P * RING_N
    tile = dict(q_rows=query_tiles(n, 16)[1], key_tile=16)
    return {"dual_chunk tile": ("dual_chunk", True, tile, None),
            "dual_chunk sub-block": ("dual_chunk", True,
                                     dict(tile, k_rows=kv_blocks(n, 24)[0], block_rows=n), None),
            "contiguous plain": ("contiguous", True, {}, None),
            "non-causal tile": ("dual_chunk", False, tile, None),
            "packed tile": ("dual_chunk", True, dict(key_tile=16), (0, 100, 130, 400, s)),
            "packed plain": ("dual_chunk", True, {}, (0, 24, 200, s))}


def _ring_bytes(rank: int, modes=("full", "sampled"), names=None):
    """Rank ``rank`` of a fake ``RING_P``-rank world runs each case's forward and backward ring
    under fake tensors, in each mode (``full``, ``sampled``): ``{mode: {case: (peak, sent,
    messages, RingStats, kernel blocks, ring steps skipped)}}``."""
    import contextlib
    import sys

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    import megatron_metp.ops.ring_attention  # noqa: F401 (the package exports the function)
    from megatron_metp.ops.attention_kernels import select_kernel
    from megatron_metp.runtime.groups import METPGroup

    RA = sys.modules["megatron_metp.ops.ring_attention"]
    FR.fake_world(RING_P, rank, dtype=torch.bfloat16, megatron=False)
    kern = select_kernel(torch.device("cpu"), torch.bfloat16, "torch_flash", head_dim=RING_D)
    out = {}
    for mode in modes:
        for name, (layout, causal, win, cu) in _ring_cases().items():
            if names is not None and name not in names:
                continue
            g = METPGroup.from_process_group(dist.group.WORLD)
            trk, cc = FR.tracker(), FR.comm_counter_class()(RING_P)
            rows = [sum(r.stop - r.start for r in win.get(key, (slice(0, RING_N),)))
                    for key in ("q_rows", "k_rows")]
            with FakeTensorMode():
                q = torch.empty(1, RING_H[0], rows[0], RING_D)
                k, v = (torch.empty(1, RING_H[1], rows[1], RING_D) for _ in "kv")
                with FR.measuring(trk, cc), (loop_sample.sampling() if mode == "sampled"
                                             else contextlib.nullcontext()) as st:
                    o, lse = RA.ring_attention_forward(q, k, v, g, causal, layout, 0.25, kern,
                                                       cu_seqlens=cu, **win)
                    grads = RA.ring_attention_backward(torch.empty_like(q), q, k, v,
                                                       o.to(q.dtype), lse, g, causal, layout,
                                                       0.25, kern, cu_seqlens=cu, **win)
                    del o, lse, grads
            out.setdefault(mode, {})[name] = (
                FR.snap(trk)["total"], cc.sent, dict(cc.ops), g.stats.snapshot(),
                dict(g.stats.blocks), st["ring_skipped"] if st else 0)
    return out


@pytest.mark.parametrize("rank", [0, 5])
def test_sampled_ring_steps_give_the_full_rings_bytes_and_traffic(rank):
    """A 12-step K/V ring (the fake ranks of METP × CP) at rank 0 (every off-diagonal block the
    same half block) and rank 5 (the blocks before and after the diagonal differ), through
    every code path of the ring (windowed, sub-block, plain, non-causal, packed): the sampled
    ring's peak, bytes and messages sent, RingStats and kernel blocks equal the full ring's,
    and steps were skipped in each."""
    got = FR.run_isolated(_ring_bytes, rank, timeout=300)
    full, sampled = got["full"], got["sampled"]
    for name in full:
        assert sampled[name][:5] == full[name][:5], name
        assert sampled[name][5] > 0, (name, sampled[name])
    assert sum(x[5] for x in sampled.values()) > len(full) * 2 * RING_P / 4  # of 2·12 a case


def test_a_wrong_ring_sampling_rule_is_caught(monkeypatch):
    """Negative controls of the ring's sampling rule at rank 0 (each against the full ring):
    every kept step weighted 1 (the skipped steps forgotten) undercounts bytes and messages;
    one run over the whole ring (the steps' roles ignored) counts the step before the own
    block, which sends only the dK/dV sum, as a steady one; the roles without the block shapes
    skip the packed block that holds the peak."""
    cases = ("contiguous plain", "packed plain")
    full = FR.run_isolated(_ring_bytes, 0, ("full",), cases, timeout=120)["full"]
    real = loop_sample.run_plan
    rules = {"unweighted": lambda kinds: [(t, 1) for t, _ in real(kinds)],
             "one run": lambda kinds: loop_sample.plan(len(kinds), 2, 1),
             "roles only": lambda kinds: real([k[:-1] for k in kinds])}
    got = {}
    for rule, fn in rules.items():
        monkeypatch.setattr(loop_sample, "run_plan", fn)
        got[rule] = FR.run_isolated(_ring_bytes, 0, ("sampled",), cases,
                                    timeout=120)["sampled"]
    case = "contiguous plain"
    assert got["unweighted"][case][1] < full[case][1]
    assert got["unweighted"][case][2]["send"] < full[case][2]["send"]
    assert got["one run"][case][1] != full[case][1]
    assert got["roles only"]["packed plain"][0] < full["packed plain"][0]
    assert got["roles only"][case][:2] == full[case][:2]  # the shapes matter only there


def test_sampled_ring_in_the_measured_twin_gives_the_full_measurement():
    """The twin at METP 2 × CP 4 (an 8-step K/V ring per query tile): ``metp measure`` with the
    ring's steps sampled equals the full measurement (peak, stored, traffic, host bytes)."""
    FR.preload_megatron()
    job = replace(JOB, cp=4)
    full = _measure_here(TWIN, job, "full")
    sampled = _measure_here(TWIN, job, "sampled")
    assert "K/V ring steps run" in sampled["tiles"], sampled["tiles"]
    assert {k: sampled[k] for k in KEYS} == {k: full[k] for k in KEYS}


#: a shrunk Qwen3-MoE twin (8 experts of 64, top-2, q/k norms) whose routed part runs in 8 MoE
#: token tiles (METP_MOE_TOKEN_TILES), on the job of configs/qwen3-30b-a3b-1m-metp4-cp2.sh
MOE_TWIN = P.Model(name="moe-twin", hidden=64, layers=1, heads=4, query_groups=2, kv_channels=16,
                   ffn=128, vocab=256, seq=2048, swiglu=True, tied=False, qk_layernorm=True,
                   experts=8, topk=2, moe_ffn=64)
MOE_JOB = P.Job(tp=1, metp=2, cp=2, vocab_parallel=True, distributed_optimizer=True,
                recompute="full", offload=True, moe_dispatcher="alltoall")


def test_sampled_moe_token_tiles_give_the_full_loops_bytes_and_traffic(monkeypatch):
    """The MoE token-tile loop (:func:`~megatron_metp.megatron.moe_tiles.routed_tiles`: the
    forward, its recompute, and the per-tile re-run in the backward) over 8 tiles: running the
    first two and the last tile gives the full loop's peak, stored bytes and traffic (the
    dispatch / combine all-to-alls weighted by the tiles skipped) within 1e-3. Negative control:
    the MoE tiles' kept passes weighted 1 undercount the all-to-all traffic."""
    import types

    from megatron_metp.megatron import moe_tiles

    monkeypatch.setenv("METP_MOE_TOKEN_TILES", "8")
    FR.preload_megatron()
    full = _measure_here(MOE_TWIN, MOE_JOB, "full")
    sampled = _measure_here(MOE_TWIN, MOE_JOB, "sampled")
    assert "error" not in full and "error" not in sampled
    assert full["tiles"] == "every tile pass run"
    assert sampled["tiles"].startswith(tuple("123456789")), sampled["tiles"]
    assert full["comm_bytes"].get("alltoall_base_", 0) > 0, full["comm_ops"]  # dispatch, combine
    for key in ("peak", "stored", "activation_peak", "sent", "host_peak"):
        assert sampled[key] == pytest.approx(full[key], rel=1e-3), key
    assert sampled["comm_ops"] == full["comm_ops"]

    def unweighted_tiles(items):
        for i, _ in loop_sample.plan(len(items), 2, 1):
            yield i, items[i]

    monkeypatch.setattr(moe_tiles, "loop_sample", types.SimpleNamespace(tiles=unweighted_tiles))
    wrong = _measure_here(MOE_TWIN, MOE_JOB, "full")
    assert wrong["sent"] < full["sent"] * (1 - 1e-2), (wrong["sent"], full["sent"])
    assert wrong["comm_ops"]["alltoall_base_"] < full["comm_ops"]["alltoall_base_"]
