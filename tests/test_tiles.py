"""Token tiles of the METP MLP (ops/tiles.py): tiled equals untiled, and the single-device
reference, at METP 1, 2 and 3, tile-outer and tile-inner; ring bytes times the tile count."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import metp_mlp
from megatron_metp.ops import tiles as tiling
from tests.harness import run_ranks, unset_env
from tests.mlp_cases import full_mlp_params, reference_mlp, shard_params, unshard_grads
from tests.numerics import rel_err

S, B, H, FFN = 18, 2, 8, 12  # 6·B = 12 rows per rank at p=3: tiles of 5 give 3 uneven tiles


def _rank(rank, p, activation, bias, tile, order="outer", keep=False, wrong_tile=False):
    import os

    os.environ[tiling.TILE_ORDER_ENV] = order
    full = full_mlp_params(S, B, H, FFN, activation, bias)
    sh = shard_params(full, FFN, activation, rank, p)
    n = S // p
    x = full["x"][rank * n:(rank + 1) * n].clone().requires_grad_()
    params = {k: (None if v is None else v.requires_grad_()) for k, v in sh.items()}
    g = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="tiles-test")
    y = metp_mlp(x, params["w1"], params["w2"], group=g, activation=activation,
                 fc1_bias=params["b1"], fc2_bias=params["b2"], ffn_hidden_size=FFN,
                 keep_intermediate=keep, token_tile=tile)
    if wrong_tile:  # negative control: the last tile's rows dropped from the output
        y = y.clone()
        y.view(-1, H)[-1].zero_()
    fwd = g.stats.snapshot()
    y.backward(full["gy"][rank * n:(rank + 1) * n])
    return {"y": y.detach(), "dx": x.grad,
            "grads": {k: (None if v is None else v.grad) for k, v in params.items()},
            "fwd": fwd, "total": g.stats.snapshot()}


def _gather(out, activation, full):
    dw1, db1, dw2 = unshard_grads([o["grads"] for o in out], FFN, activation, full)
    return {"y": torch.cat([o["y"] for o in out]), "dx": torch.cat([o["dx"] for o in out]),
            "dw1": dw1, "db1": db1, "dw2": dw2,
            "db2": None if full["b2"] is None else sum(o["grads"]["b2"] for o in out)}


def _max_err(a, b):
    return max(rel_err(a[k], b[k]) for k in a if a[k] is not None)


@pytest.mark.parametrize("p,activation,order,keep", [
    (2, "swiglu", "outer", False), (3, "swiglu", "outer", False), (3, "gelu", "outer", True),
    (3, "swiglu", "inner", False), (2, "gelu", "inner", True), (1, "swiglu", "outer", False)])
def test_tiled_equals_untiled_and_reference(p, activation, order, keep):
    full = full_mlp_params(S, B, H, FFN, activation, True)
    ref = reference_mlp(full, activation)
    whole = _gather(run_ranks(_rank, p, activation, True, 0, order, keep), activation, full)
    tiled = _gather(run_ranks(_rank, p, activation, True, 5, order, keep), activation, full)
    assert _max_err(tiled, whole) <= 1e-6, {k: rel_err(tiled[k], whole[k]) for k in whole
                                            if whole[k] is not None}
    assert _max_err(tiled, ref) <= 1e-5


def test_negative_control_a_wrong_tile_is_caught():
    p, activation = 3, "swiglu"
    full = full_mlp_params(S, B, H, FFN, activation, True)
    whole = _gather(run_ranks(_rank, p, activation, True, 0), activation, full)
    bad = _gather(run_ranks(_rank, p, activation, True, 5, "outer", False, True), activation,
                  full)
    assert rel_err(bad["y"], whole["y"]) > 1e-2


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_ring_bytes_times_the_tile_count(order):
    p, activation = 3, "swiglu"
    out = run_ranks(_rank, p, activation, True, 5, order)
    k, f = 2, FFN // p
    shard = (k * f * H + k * f + H * f) * 4
    passes = 3 if order == "outer" else 1  # 12 rows per rank in tiles of <= 5: 3 tiles
    for o in out:
        assert o["fwd"]["bytes_sent"] == passes * (p - 1) * shard
        assert o["total"]["bytes_sent"] == 3 * passes * (p - 1) * shard


def test_tile_policy():
    assert tiling.tile_slices(12, 5) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert tiling.tile_slices(12, 12) == [slice(0, 12)]
    assert tiling.resolve_rows(0, 100, 8) == 100  # 0 = whole
    assert tiling.resolve_rows(None, 100, 1 << 30) == 1  # auto: 1 GiB per row -> 1 row
    assert tiling.resolve_rows(None, 100, 8) == 100  # fits: whole
    with pytest.raises(ValueError, match="token_tile"):
        tiling.resolve_rows(-1, 100, 8)


def test_env_override_and_refusal(monkeypatch):
    monkeypatch.setenv(tiling.MLP_TOKEN_TILE_ENV, "7")
    assert tiling.resolve_rows(None, 100, 8) == 7
    monkeypatch.setenv(tiling.MLP_TOKEN_TILE_ENV, "seven")
    with pytest.raises(ValueError, match="METP_MLP_TOKEN_TILE"):
        tiling.resolve_rows(None, 100, 8)
    monkeypatch.setenv(tiling.TILE_ORDER_ENV, "sideways")
    with pytest.raises(ValueError, match="METP_MLP_TILE_ORDER"):
        tiling.tile_order()


def _disagree(rank, p):
    full = full_mlp_params(S, B, H, FFN, "gelu", False)
    sh = shard_params(full, FFN, "gelu", rank, p)
    n = S // p
    g = METPGroup.from_process_group(dist.group.WORLD, name="tiles-test")
    try:
        metp_mlp(full["x"][rank * n:(rank + 1) * n], sh["w1"], sh["w2"], group=g,
                 token_tile=5 if rank == 0 else 0)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def test_ranks_with_different_tile_counts_are_refused():
    out = run_ranks(_disagree, 2)
    assert all(o and "GroupDisagreementError" in o and "token_tiles" in o for o in out), out


def test_plan_matches_measurement_in_tiles(monkeypatch):
    """``metp plan`` models the tiles as the op runs them: planned = measured within 5 % with
    8 tiles per rank, and the tiles lower the measured peak (they are what the plan models)."""
    from megatron_metp.tools import measure as M
    from megatron_metp.tools import plan as P

    model = P.Model(hidden=256, layers=2, heads=8, ffn=8192, vocab=512, seq=4096, swiglu=True)
    job = P.Job(tp=1, metp=2)
    peaks = {}
    for tile in ("0", "256"):
        monkeypatch.setenv(tiling.MLP_TOKEN_TILE_ENV, tile)
        (res,) = M.measure(model, job, ["metp"], jobs=1, timeout=300)
        assert "error" not in res, res["error"]
        planned = P.memory(model, job, "metp").measured_part
        assert abs(planned / res["peak"] - 1) <= 0.05, (tile, planned, res["peak"])
        peaks[tile] = res["peak"]
    assert peaks["256"] < 0.8 * peaks["0"], peaks


def test_megatron_lm_flag_sets_the_tile_or_is_refused(monkeypatch):
    import argparse

    from megatron_metp import megatron_lm as hooks
    from tests.test_megatron_lm import _args

    parser = hooks.add_metp_args(argparse.ArgumentParser())
    assert parser.parse_args(["--metp-mlp-token-tile", "4096"]).metp_mlp_token_tile == 4096
    assert parser.parse_args([]).metp_mlp_token_tile is None
    unset_env(monkeypatch, tiling.MLP_TOKEN_TILE_ENV)
    args = hooks.validate_metp_args(_args(metp_parallel_size=8, metp_mlp_token_tile=4096))
    import os

    from megatron_metp.megatron_lm.tiles import tile_kwargs

    # the flag reaches the spec as an argument (no longer through the environment)
    assert tile_kwargs(args)["mlp_token_tile"] == 4096
    assert tiling.MLP_TOKEN_TILE_ENV not in os.environ
    # what the METP MLP then uses (the spec gives it to METPMLP, which gives it to the op)
    assert tiling.resolve_rows(tile_kwargs(args)["mlp_token_tile"], 100_000, 8) == 4096
    for kw, needle in ((dict(metp_parallel_size=1), "needs --metp-parallel-size > 1"),
                       (dict(metp_parallel_size=8, metp_disable_weight_ring=True),
                        "--metp-disable-weight-ring"),
                       (dict(metp_parallel_size=8), "must be >= 0")):
        rows = -1 if needle == "must be >= 0" else 64
        with pytest.raises(ValueError, match=needle):
            hooks.validate_metp_args(_args(metp_mlp_token_tile=rows, **kw))
