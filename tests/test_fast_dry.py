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
