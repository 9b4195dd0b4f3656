"""METP's initial weights equal stock TP's of size TP×METP (same seed, same global matrices)."""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from tests.gpt_cases import SIZE, assemble
from tests.harness import run_ranks


def initial_weights(rank, world, size: GPTSize, layout: Layout, like_tp: bool, cpu_init: bool):
    """Every parameter of a freshly built model, by global name, with its shard index."""
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.init import initialize_like_tp
    from megatron_metp.megatron.linear import is_metp_sharded
    from megatron_metp.megatron.training import _global_name, build_model, full_shape, init_parallel

    cpu.enable()
    # the project's tests build with use_cpu_initialization; Megatron-LM's default is False
    layout = Layout(**{**layout.__dict__, "init_like_tp": like_tp,
                       "extra": {"use_cpu_initialization": cpu_init}})
    groups = init_parallel(layout, size.seq_length)
    model = build_model(size, layout, groups)
    did = initialize_like_tp(model, groups) if like_tp and layout.mode == "metp" else None
    weights = {}
    for name, p in model.named_parameters():
        weights[_global_name(model, name)] = (p.detach().clone(), p.tensor_model_parallel
                                              if hasattr(p, "tensor_model_parallel") else False,
                                              getattr(p, "partition_dim", 0), is_metp_sharded(p),
                                              full_shape(p, groups))
    return {"grads": weights, "shard": groups.shard_index, "tp_rank": groups.tp_rank,
            "did": did}


def _size(swiglu, tie=False):
    return GPTSize(**{**SIZE.__dict__, "swiglu": swiglu, "tie_embeddings": tie,
                      "vocab_size": 96})


def _full(layout, size, world, like_tp=True, cpu_init=False):
    out = run_ranks(initial_weights, world, size, layout, like_tp, cpu_init)
    return assemble(out, size), out


@pytest.mark.parametrize("tp,p,swiglu,vocab,tie", [
    (1, 2, True, False, False),   # untied output layer over TP only: p streams per TP rank
    (1, 3, False, False, True),   # odd METP size, tied embeddings
    (1, 2, False, True, False),   # vocabulary sharded over TP x METP
    (2, 2, True, False, False),   # TP x METP = 4
])
def test_metp_initial_weights_equal_stock_tp_of_size_tp_times_metp(tp, p, swiglu, vocab, tie):
    size = _size(swiglu, tie)
    metp, ranks = _full(Layout(tp=tp, metp=p, vocab_parallel=vocab), size, tp * p)
    assert all(r["did"] for r in ranks)
    stock, _ = _full(Layout(tp=tp * p, mode="tp"), size, tp * p)
    assert set(metp) == set(stock)
    for name in stock:
        assert metp[name].shape == stock[name].shape, name
        assert torch.equal(metp[name], stock[name]), name
    # the weights are random, not trivially equal (norm weights are ones, biases zeros)
    assert metp["decoder.layers.0.mlp.linear_fc1.weight"].std() > 0.01


def test_cpu_initialization_matches_stock_tp_too():
    size = _size(True)
    metp, ranks = _full(Layout(metp=2), size, 2, cpu_init=True)
    assert not any(r["did"] for r in ranks)  # nothing to re-draw: built that way
    stock, _ = _full(Layout(tp=2, mode="tp"), size, 2, cpu_init=True)
    for name in stock:
        assert torch.equal(metp[name], stock[name]), name


def test_negative_control_without_the_tp_streams_weights_differ():
    size = _size(True)
    metp, _ = _full(Layout(metp=2), size, 2, like_tp=False)
    stock, _ = _full(Layout(tp=2, mode="tp"), size, 2)
    differ = [n for n in stock if not torch.equal(metp[n], stock[n])]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in differ
    assert "output_layer.weight" in differ
