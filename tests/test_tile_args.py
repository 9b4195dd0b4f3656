"""Tiles reach the ops as arguments (issue 40): ``get_gpt_layer_metp_spec(mlp_token_tile=N)``
gives ``N`` to every METP MLP and to the streaming layer's row passes, and
``tiled_moe_spec`` / ``get_gpt_decoder_block_metp_spec(moe_token_tiles=T)`` to every MoE layer,
with no ``METP_*`` tile variable set. The ring counters show the tile count the op ran: each tile
is one more pass of the MLP's weight ring, so the extra ring bytes over the untiled model are
``(T - 1)`` times one pass, and a different tile gives a different count (negative control)."""

import pytest
import torch

from tests.gpt_cases import SIZE
from tests.harness import run_ranks

TILE_VARS = ("METP_MLP_TOKEN_TILE", "METP_LAYER_TOKEN_TILE", "METP_MOE_TOKEN_TILES",
             "METP_TILE_BUDGET_MIB")
FULL = dict(recompute="full", recompute_method="uniform", recompute_num_layers=1)


def _ring_bytes(rank, world, layout_kw, tiles):
    """Ring bytes sent by one forward + backward of a tiny METP GPT built by the spec with
    ``mlp_token_tile=t`` for each ``t`` in ``tiles`` (no tile variable in the environment)."""
    import os

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megatron_metp.megatron import cpu, training
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank
    from megatron_metp.megatron.spec import get_gpt_layer_metp_spec
    from megatron_metp.megatron.streaming import prepare_recompute

    for name in TILE_VARS:
        os.environ.pop(name, None)
    cpu.enable()
    layout = training.Layout(metp=world, **layout_kw)
    groups = training.init_parallel(layout, SIZE.seq_length)
    cfg = training.transformer_config(SIZE, layout)
    tokens, labels = training.global_batch(SIZE, 0, 2)
    batch = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": labels,
         "position_ids": torch.arange(SIZE.seq_length).expand(2, -1).contiguous()},
        cp_group=ps.get_context_parallel_group())
    out = {}
    for tile in tiles:
        torch.manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_metp_spec(
            groups, normalization=SIZE.normalization, mlp_token_tile=tile),
            vocab_size=SIZE.vocab_size, max_sequence_length=SIZE.seq_length,
            position_embedding_type="rope")
        streaming = prepare_recompute(model.decoder)
        assert {m.mlp.token_tile for m in model.decoder.layers} == {tile}
        before = groups.metp.stats.snapshot()["bytes_sent"]
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()
        loss.backward()
        out[tile] = (groups.metp.stats.snapshot()["bytes_sent"] - before, streaming,
                     any(os.environ.get(name) for name in TILE_VARS))
    return out


@pytest.mark.parametrize("layout_kw", [{}, FULL], ids=["mlp-op", "streaming-layer"])
def test_spec_tile_argument_reaches_the_op_without_the_environment(layout_kw):
    # 2 ranks: s/p = 12 tokens x micro-batch 2 = 24 MLP rows per rank; 0 = whole (one pass),
    # 12 rows = 2 passes, 8 rows = 3 passes (the streaming layer: 6 / 4 tokens per row pass)
    for res in run_ranks(_ring_bytes, 2, layout_kw, [0, 12, 8]):
        assert {t: r[1] for t, r in res.items()} == {t: bool(layout_kw) for t in res}
        assert not any(r[2] for r in res.values())  # no tile variable was set
        whole, two, three = res[0][0], res[12][0], res[8][0]
        one_pass = two - whole
        assert one_pass > 0, res
        assert three - whole == 2 * one_pass, res  # T = 3: two more passes than whole
        assert three != two  # negative control: another tile, another count


def _moe_tiles(rank, world, tiles):
    import os

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.moe_tiles import TiledMoELayer, tiled_moe_spec

    for name in TILE_VARS:
        os.environ.pop(name, None)
    cpu.enable()
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                            ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=8, add_bias_linear=False,
                            moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                            use_cpu_initialization=True, params_dtype=torch.float32)
    out = {}
    for t in tiles:
        spec = tiled_moe_spec(get_gpt_layer_local_spec(num_experts=4).submodules.mlp,
                              moe_token_tiles=t)
        layer = spec(config=cfg, layer_number=1) if callable(spec) else \
            build_module(spec, config=cfg, layer_number=1)
        assert isinstance(layer, TiledMoELayer)
        x = torch.randn(12, 2, 16, requires_grad=True)
        y, _ = layer(x)
        y.sum().backward()
        out[t] = (layer.moe_token_tiles, layer.last_tiles)
    return out


def test_tiled_moe_spec_builds_layers_with_the_tile_count():
    res = run_ranks(_moe_tiles, 1, [3, 2, None])[0]
    # 24 local tokens: the argument is the count that ran; unset (and no variable): auto, one
    # tile (the tokens fit the budget)
    assert res == {3: (3, 3), 2: (2, 2), None: (None, 1)}, res


def test_spec_refuses_tile_arguments_it_cannot_use():
    from types import SimpleNamespace

    from megatron_metp.megatron.spec import get_gpt_layer_metp_spec

    groups = SimpleNamespace()
    with pytest.raises(ValueError, match="mlp_token_tile must be a non-negative integer"):
        get_gpt_layer_metp_spec(groups, mlp_token_tile=-1)
    with pytest.raises(ValueError, match="weight_ring=False.*drop mlp_token_tile"):
        get_gpt_layer_metp_spec(groups, weight_ring=False, mlp_token_tile=8)
    with pytest.raises(ValueError, match="moe_token_tiles tiles MoE layers.*"
                       "get_gpt_decoder_block_metp_spec"):
        get_gpt_layer_metp_spec(groups, moe_token_tiles=2)


def test_decoder_block_spec_gives_moe_layers_the_tile_count():
    """``get_gpt_decoder_block_metp_spec(moe_token_tiles=T, mlp_token_tile=N)``: the MoE layers'
    ``TiledMoELayer`` is built with ``T``, the dense layers' METP MLP with ``N``."""
    res = run_ranks(_block_spec_tiles, 1)[0]
    assert res == {"moe": 3, "dense": 8}, res


def _block_spec_tiles(rank, world):
    import functools

    import torch.nn.functional as Fn
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.groups import METPGroups
    from megatron_metp.megatron.moe import get_gpt_decoder_block_metp_spec
    from megatron_metp.megatron.moe_tiles import TiledMoELayer

    cpu.enable()
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    groups = METPGroups.from_parallel_state()
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                            ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=8, add_bias_linear=False, moe_layer_freq=[1, 0],
                            gated_linear_unit=True, activation_func=Fn.silu,
                            use_cpu_initialization=True, params_dtype=torch.float32)
    block = get_gpt_decoder_block_metp_spec(cfg, groups, moe_token_tiles=3, mlp_token_tile=8)
    out = {}
    for layer_spec in block.layer_specs:
        mlp = layer_spec.submodules.mlp
        if isinstance(mlp, functools.partial):
            kw = dict(mlp.keywords.get("params") or mlp.keywords)
            module = mlp.keywords.get("module", mlp.func)
        else:
            kw, module = dict(mlp.params or {}), mlp.module
        if isinstance(module, type) and issubclass(module, TiledMoELayer):
            out["moe"] = kw["moe_token_tiles"]
        else:
            out["dense"] = kw["token_tile"]
    return out
