"""MoE token tiles (:mod:`megatron_metp.megatron.moe_tiles`): Megatron's stock ``MoELayer`` with
its routed part in token tiles equals the untiled layer (≤ 1e-6: output, input gradient, every
parameter gradient, the router's aux / sequence-aux / z losses) on one rank and with the experts
sharded over forked ranks (EP 2, both dispatchers); a negative control (routing per tile) shows
the comparison can fail; the tile count (auto, env, refusals) and the routed transient."""

import math
import zlib

import pytest
import torch

from megatron_metp.megatron import moe_tiles
from tests.harness import run_ranks, unset_env

E, K, H, F = 4, 2, 16, 12  # experts, top-k, hidden, expert ffn
S, B = 5, 2  # local tokens: S·B = 10, 3 tiles of 4, 4, 2


def _layer(world, dispatcher, balance):
    """A stock-spec MoE layer (``TiledMoELayer``) with EP = ``world``, weights seeded by global
    name (so every EP layout holds the same full model)."""
    import torch.nn.functional as Fn
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron import cpu

    cpu.enable()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=world,
                                     create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(7)
    aux = {"moe_router_load_balancing_type": balance, "moe_aux_loss_coeff": 0.0}
    if balance != "none":
        aux.update(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=1e-2)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                            ffn_hidden_size=2 * H, num_moe_experts=E, moe_router_topk=K,
                            moe_ffn_hidden_size=F, expert_model_parallel_size=world,
                            moe_token_dispatcher_type=dispatcher, add_bias_linear=False,
                            gated_linear_unit=True, activation_func=Fn.silu,
                            use_cpu_initialization=True, params_dtype=torch.float32, **aux)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
    spec = moe_tiles.tiled_moe_spec(spec)  # a ModuleSpec (0.16) or a functools.partial (0.19)
    layer = spec(config=cfg, layer_number=1) if callable(spec) else \
        build_module(spec, config=cfg, layer_number=1)
    assert isinstance(layer, moe_tiles.TiledMoELayer)
    layer.set_layer_number(1)  # as TransformerLayer does: the router then tracks its aux losses
    with torch.no_grad():
        for name, p in layer.named_parameters():
            gname = _global(layer, name)
            g = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _global(layer, name):
    parts = name.split(".")
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(layer.local_expert_indices[int(parts[i])])
    return ".".join(parts)


def _tracker():
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}


def _clear():
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def _run(layer, x, dy, tiles, per_tile_routing=False):
    """Output, input and parameter gradients and the aux-loss tracker of one forward/backward."""
    layer.moe_token_tiles = tiles
    layer.zero_grad(set_to_none=True)
    _clear()
    x = x.clone().requires_grad_()
    if per_tile_routing:  # negative control: each tile routed on its own
        rows = math.ceil(x.shape[0] / tiles)
        from megatron.core.transformer.moe.moe_layer import MoELayer

        outs = [MoELayer.forward(layer, x[a:a + rows])[0] for a in range(0, x.shape[0], rows)]
        y = torch.cat(outs)
    else:
        y, _ = layer(x)
    (y * dy).sum().backward()
    grads = {_global(layer, n): p.grad.detach().clone() for n, p in layer.named_parameters()}
    aux = _tracker()
    if per_tile_routing:  # the tracker summed one value per tile: their mean, not their sum
        aux = {k: v / len(outs) for k, v in aux.items()}
    return {"y": y.detach(), "dx": x.grad.detach(), "grads": grads, "aux": aux,
            "tiles": layer.last_tiles}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compare(a, b):
    errs = {"y": _rel(a["y"], b["y"]), "dx": _rel(a["dx"], b["dx"])}
    errs.update({f"grad {n}": _rel(a["grads"][n], b["grads"][n]) for n in b["grads"]})
    for n in b["aux"]:
        errs[f"aux {n}"] = _rel(a["aux"][n], b["aux"][n])
    return errs


def tiles_vs_whole(rank, world, dispatcher, balance, tiles):
    layer = _layer(world, dispatcher, balance)
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(world * S, B, H, generator=g)  # every rank's tokens, rank r takes its own
    dys = torch.randn(world * S, B, H, generator=g)
    x, dy = xs[rank * S:(rank + 1) * S], dys[rank * S:(rank + 1) * S]
    whole = _run(layer, x, dy, 1)
    tiled = _run(layer, x, dy, tiles)
    wrong = _run(layer, x, dy, tiles, per_tile_routing=True)
    return {"errs": _compare(tiled, whole), "control": _compare(wrong, whole),
            "tiles": (whole["tiles"], tiled["tiles"]), "aux": sorted(whole["aux"])}


def _check(out, balance, tiles):
    for r in out:
        assert r["tiles"] == (1, tiles)
        worst = max(r["errs"], key=r["errs"].get)
        assert r["errs"][worst] <= 1e-6, (worst, r["errs"][worst])
        assert len([k for k in r["errs"] if k.startswith("grad")]) >= 3
        if balance != "none":
            assert r["aux"], "the router tracked no aux loss"
            # negative control: routing per tile changes the aux losses and the router gradient
            bad = {k: v for k, v in r["control"].items() if k.startswith("aux")}
            assert min(bad.values()) > 1e-3, bad
            assert r["control"]["grad router.weight"] > 1e-4, r["control"]


@pytest.mark.parametrize("balance", ["aux_loss", "seq_aux_loss"])
def test_single_rank_tiles_equal_whole(balance):
    out = run_ranks(tiles_vs_whole, 1, "allgather", balance, 3)
    _check(out, balance, 3)


@pytest.mark.parametrize("dispatcher,balance", [("allgather", "aux_loss"),
                                                ("alltoall", "seq_aux_loss")])
def test_expert_parallel_tiles_equal_whole(dispatcher, balance):
    out = run_ranks(tiles_vs_whole, 2, dispatcher, balance, 3)
    _check(out, balance, 3)


def saved_bytes(rank, world, n, tiles):
    """Bytes autograd keeps (``saved_tensors_hooks``, distinct storages, parameters and the
    layer's input left out) for one forward of ``n`` tokens, whole and in ``tiles`` tiles: what
    the forward keeps, and the most one tile's re-run keeps during backward."""
    layer = _layer(1, "allgather", "aux_loss")
    params = {id(p) for p in layer.parameters()}
    run_tile, out = moe_tiles.routed_tile, {}

    def counted(*a):
        phase[0] += torch.is_grad_enabled()
        return run_tile(*a)
    moe_tiles.routed_tile = counted
    for count in (1, tiles):
        x = torch.randn(n, 1, H, requires_grad=True) * 1.0
        layer.moe_token_tiles, kept, phase = count, {}, [0]

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if id(t) not in params and ptr != x.untyped_storage().data_ptr():
                kept[(phase[0], ptr)] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, _ = layer(x)
            phase[0] = 1
            y.sum().backward()
        per = {}
        for (ph, _), v in kept.items():
            per[ph] = per.get(ph, 0) + v
        out[count] = (per.get(0, 0), max((v for ph, v in per.items() if ph > 1), default=0))
    return out


def test_routed_tokens_kept_for_backward_bounded_by_a_tile():
    n, tiles = 240, 3
    out = run_ranks(saved_bytes, 1, n, tiles)[0]
    (stock, none), (routing, tile) = out[1], out[tiles]
    assert none == 0  # one tile: stock forward, no re-run
    routed = stock - routing  # what only the stock layer keeps: the routed tokens
    # CPU fp32 keeps most of the CUDA count k·e·(2h + 6f′) per token (no fused SwiGLU copy)
    formula = n * moe_tiles.routed_row_bytes(H, F, K, elem=4)
    assert 0.8 * formula <= routed <= formula, (routed, formula)
    assert routing < 0.2 * stock  # the tiled forward keeps the [n, E] routing only
    assert tile <= 1.1 * routed / tiles, (tile, routed / tiles)  # one tile's routed tokens


def differing_counts(rank, world):
    """Rank r runs 2 + r tiles: refused on every rank before any dispatch (not a hang)."""
    from megatron_metp.runtime.agree import GroupDisagreementError

    layer = _layer(world, "alltoall", "aux_loss")
    layer.moe_token_tiles = 2 + rank
    try:
        layer(torch.randn(S, B, H))
    except GroupDisagreementError as exc:
        return str(exc)
    return None


def test_ranks_with_different_tile_counts_are_refused():
    for msg in run_ranks(differing_counts, 2):
        assert msg is not None and "moe_token_tiles" in msg, msg


# ------------------------------------------------------------------ tile count and transient


def test_routed_transient_formula():
    # bf16 SwiGLU: n·k·(4h + 12f′); Qwen3-30B-A3B (h 2048, f′ 768, k 8) at 131,072 tokens: 17 GiB
    assert moe_tiles.routed_row_bytes(2048, 768, 8) == 8 * (4 * 2048 + 12 * 768)
    whole = moe_tiles.routed_transient_bytes(131072, 2048, 768, 8)
    assert whole == 131072 * 8 * (4 * 2048 + 12 * 768)
    assert round(whole / 2**30, 1) == 17.0
    tiled = moe_tiles.routed_transient_bytes(131072, 2048, 768, 8, tiles=18)
    assert tiled == math.ceil(131072 / 18) * moe_tiles.routed_row_bytes(2048, 768, 8)
    assert tiled <= 2**30 < moe_tiles.routed_transient_bytes(131072, 2048, 768, 8, tiles=17)
    assert moe_tiles.routed_row_bytes(4096, 14336, 2, gated=False, elem=4) == \
        2 * 4 * (2 * 4096 + 4 * 14336)


def test_tile_count_auto_env_and_refusals(monkeypatch):
    unset_env(monkeypatch, moe_tiles.MOE_TOKEN_TILES_ENV, "METP_TILE_BUDGET_MIB")
    row = moe_tiles.routed_row_bytes(2048, 768, 8)
    assert moe_tiles.resolve_moe_tiles(131072, row) == 18  # 7,710 tokens per 1 GiB tile
    assert moe_tiles.resolve_moe_tiles(4096, row) == 1  # fits: whole
    monkeypatch.setenv("METP_TILE_BUDGET_MIB", "4096")
    assert moe_tiles.resolve_moe_tiles(131072, row) == 5  # 30,840 tokens per tile
    monkeypatch.setenv(moe_tiles.MOE_TOKEN_TILES_ENV, "6")
    assert moe_tiles.resolve_moe_tiles(131072, row) == 6
    assert moe_tiles.resolve_moe_tiles(4, row) == 4  # never more tiles than tokens
    assert moe_tiles.resolve_moe_tiles(131072, row, tiles=2) == 2  # the layer's own wins
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv(moe_tiles.MOE_TOKEN_TILES_ENV, bad)
        with pytest.raises(ValueError, match=moe_tiles.MOE_TOKEN_TILES_ENV):
            moe_tiles.resolve_moe_tiles(100, row)
    from types import SimpleNamespace

    probs = moe_tiles.tile_problems(SimpleNamespace(moe_pad_expert_input_to_capacity=True))
    assert probs and "--moe-pad-expert-input-to-capacity" in probs[0]
    assert moe_tiles.tile_problems(SimpleNamespace()) == []


# ------------------------------------------------------------------ in the METP GPT (moe-core)


def _run_tiles(tiles):
    """In this (forked) rank: every MoE layer in ``tiles`` tiles (the env override, as
    Megatron-LM's ``--metp-moe-token-tiles`` sets it); returns the list of counts that ran."""
    import os

    os.environ[moe_tiles.MOE_TOKEN_TILES_ENV] = str(tiles)
    ran, forward = [], moe_tiles.TiledMoELayer.forward

    def counted(self, *a, **kw):
        out = forward(self, *a, **kw)
        ran.append(self.last_tiles)
        return out
    moe_tiles.TiledMoELayer.forward = counted
    return ran


def metp_step(rank, world, size, layout, tiles):
    """``tests.test_moe.moe_one_step`` with every MoE layer in ``tiles`` token tiles (the env
    override, as Megatron-LM's ``--metp-moe-token-tiles`` sets it); also the counts that ran
    and whether the block streamed under full recompute."""
    from megatron_metp.megatron import streaming
    from tests.test_moe import moe_one_step

    ran = _run_tiles(tiles)

    prepare, streamed = streaming.prepare_recompute, []
    streaming.prepare_recompute = lambda block: streamed.append(prepare(block)) or streamed[-1]
    out = moe_one_step(rank, world, size, layout)
    out["ran"], out["streamed"] = ran, streamed
    return out


@pytest.mark.parametrize("metp,dispatcher,aux,recompute", [  # whole: no recompute
    (2, "allgather", 0.01, None), (2, "alltoall", -0.01, "full"), (3, "alltoall", 0.01, None),
])
def test_metp_gpt_tiles_equal_whole(metp, dispatcher, aux, recompute):
    from tests.test_moe import MOE, _layout, assemble

    whole = run_ranks(metp_step, metp, MOE, _layout(metp, dispatcher=dispatcher, aux=aux), 1)
    tiled = run_ranks(metp_step, metp, MOE,
                      _layout(metp, dispatcher=dispatcher, aux=aux, recompute=recompute), 3)
    moe_layers = 2  # MOE: layers 1 and 3 of 3 have experts
    for w, t in zip(whole, tiled):
        # full recompute: the dense layer streams, the MoE layers are checkpointed one by one
        assert t["streamed"] == [bool(recompute)], t["streamed"]
        # the forward (and, under full recompute, its re-run) of every MoE layer
        assert set(w["ran"]) == {1} and set(t["ran"]) == {3}, (w["ran"], t["ran"])
        assert len(t["ran"]) == moe_layers * (2 if recompute else 1)
        assert abs(w["loss"] - t["loss"]) <= 1e-6 * abs(w["loss"])
    gw, gt = assemble(whole), assemble(tiled)
    assert set(gw) == set(gt) and any(".experts." in n for n in gw)
    errs = {n: _rel(gt[n], gw[n]) for n in gw}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-6, (worst, errs[worst])


def metp_train(rank, world, size, layout, tiles):
    """``tests.test_moe.moe_train`` (three Adam steps through Megatron's DDP and distributed
    optimizer) with every MoE layer in ``tiles`` token tiles."""
    from tests.test_moe import moe_train

    ran = _run_tiles(tiles)
    return {**moe_train(rank, world, size, layout), "ran": ran}


def test_three_adam_steps_with_tiles_match_single_rank_stock():
    """METP 2 × DP 2, alltoall, aux + z losses, distributed optimizer: the tiles' expert
    gradients (returned once per layer) reach Megatron's DDP buffers and the optimizer as stock's
    do (parameters after 3 steps, losses and grad norms within 1e-5 of single-rank stock)."""
    from tests.numerics import rel_err
    from tests.test_moe import TRAIN_MOE, _layout, assemble, moe_train

    ref = run_ranks(moe_train, 1, TRAIN_MOE, _layout(mode="tp", aux="aux"))[0]
    layout = _layout(2, 1, dispatcher="alltoall", aux="aux", distributed_optimizer=True)
    out = run_ranks(metp_train, 4, TRAIN_MOE, layout, 3, timeout=300)
    assert set(out[0]["ran"]) == {3}, out[0]["ran"]
    for (loss, norm), (ref_loss, ref_norm) in zip(out[0]["steps"], ref["steps"]):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(norm - ref_norm) <= 1e-5 * ref_norm
    full_ref, got = assemble([ref], "params"), assemble(out, "params")
    errs = {k: rel_err(got[k], full_ref[k]) for k in full_ref}
    worst = max(errs, key=errs.get)
    assert set(got) == set(full_ref) and errs[worst] <= 1e-5, (worst, errs[worst])


def test_megatron_lm_flag_sets_the_count_or_is_refused(monkeypatch):
    import argparse
    import os
    from types import SimpleNamespace

    from megatron_metp import megatron_lm as hooks
    from megatron_metp.megatron_lm import tiles

    parser = hooks.add_metp_args(argparse.ArgumentParser())
    assert parser.parse_args(["--metp-moe-token-tiles", "4"]).metp_moe_token_tiles == 4
    assert parser.parse_args([]).metp_moe_token_tiles is None
    unset_env(monkeypatch, moe_tiles.MOE_TOKEN_TILES_ENV)
    args = SimpleNamespace(metp_moe_token_tiles=4, num_experts=8)
    tiles.map_tile_args(args, True)
    # the flag reaches the spec as an argument (no longer through the environment)
    assert tiles.tile_kwargs(args)["moe_token_tiles"] == 4
    assert moe_tiles.MOE_TOKEN_TILES_ENV not in os.environ
    # what every TiledMoELayer then runs (the spec builds it with moe_token_tiles)
    assert moe_tiles.resolve_moe_tiles(1000, 10, tiles.tile_kwargs(args)["moe_token_tiles"]) == 4
    for kw, metp, needle in ((dict(num_experts=None), True, "needs --num-experts"),
                             (dict(num_experts=8), False, "needs --metp-parallel-size > 1"),
                             (dict(num_experts=8, metp_moe_token_tiles=0), True, ">= 1")):
        args = SimpleNamespace(**{"metp_moe_token_tiles": 4, **kw})
        with pytest.raises(ValueError, match="--metp-moe-token-tiles") as err:
            tiles.map_tile_args(args, metp)
        assert needle in str(err.value)
