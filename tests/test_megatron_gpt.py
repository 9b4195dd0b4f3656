"""METP inside megatron-core's GPTModel: parity with stock TP and a single rank, compositions."""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, train
from tests.gpt_cases import SIZE, assemble, one_step_grads
from tests.harness import run_ranks
from tests.numerics import rel_err


@pytest.fixture(scope="module")
def single_rank():
    return {sw: run_ranks(one_step_grads, 1, _size(sw), Layout())[0] for sw in (False, True)}


def _size(swiglu):
    return GPTSize(**{**SIZE.__dict__, "swiglu": swiglu})


@pytest.mark.parametrize("p", [2, 3, 4])
def test_gpt_metp_matches_stock_tp_and_single_rank(p, single_rank):
    swiglu = p != 3  # SwiGLU at p=2,4; GeLU at p=3
    size = _size(swiglu)
    ref = single_rank[swiglu]
    metp = run_ranks(one_step_grads, p, size, Layout(metp=p))
    stock = run_ranks(one_step_grads, p, size, Layout(tp=p, mode="tp"))
    full_ref = assemble([ref], size)
    for name, out in (("METP", metp), ("stock TP", stock)):
        assert abs(out[0]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (name, out[0]["loss"])
        grads = assemble(out, size)
        assert set(grads) == set(full_ref)
        errs = {k: rel_err(grads[k], full_ref[k]) for k in full_ref}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-5, (name, worst, errs[worst])


def test_negative_control_mispaired_mlp_shards_are_caught(single_rank):
    """The parity check above can fail: fc1 and fc2 shards of different owners."""
    size = _size(False)
    out = run_ranks(_mispaired_fc1, 2, size)
    assert abs(out[0]["loss"] - single_rank[False]["loss"]) > 1e-4


def _mispaired_fc1(rank, world, size):
    """Each rank loads the *other* rank's fc1 rows but its own fc2 columns."""
    from megatron_metp.megatron import training

    shard_for = training.shard_for

    def wrong(param, full, groups, gated):
        if getattr(param, "metp_sharded", False) and param.partition_dim == 0 and \
                full.shape[0] == size.ffn_hidden_size:
            return full.chunk(2, dim=0)[1 - groups.shard_index]
        return shard_for(param, full, groups, gated)

    training.shard_for = wrong
    return one_step_grads(rank, world, size, Layout(metp=2))


# ---------------------------------------------------------------- compositions, 3 optimizer steps

def _train(rank, world, size, layout):
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(layout, size.seq_length)
    return [(r.lm_loss, r.grad_norm) for r in train(size, layout, 3)]


TRAIN_SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
                     vocab_size=64, seq_length=16)


@pytest.fixture(scope="module")
def single_rank_training():
    return run_ranks(_train, 1, TRAIN_SIZE, Layout())[0]


@pytest.mark.parametrize("world,layout", [
    (4, Layout(metp=2, tp=2)),
    (4, Layout(metp=2, pp=2)),
    (4, Layout(metp=2, distributed_optimizer=True)),
    (2, Layout(metp=2, mode="ring")),
    (2, Layout(tp=2, mode="tp")),
], ids=["metp2xtp2", "metp2xpp2", "metp2xdp2-distopt", "ring2", "stock-tp2"])
def test_three_steps_match_single_rank(world, layout, single_rank_training):
    got = run_ranks(_train, world, TRAIN_SIZE, layout, timeout=300)[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, single_rank_training)):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)  # shards once


def test_gpt_metp_learned_positions_gqa_no_bias():
    """Learned absolute positions, GQA and no biases: METP=2 and stock TP=2 equal a single rank."""
    size = GPTSize(**{**SIZE.__dict__, "num_query_groups": 4, "bias": False,
                      "position_embedding_type": "learned_absolute"})
    ref = run_ranks(one_step_grads, 1, size, Layout())[0]
    full_ref = assemble([ref], size)
    for layout in (Layout(metp=2), Layout(tp=2, mode="tp"), Layout(metp=2, mode="ring")):
        out = run_ranks(one_step_grads, 2, size, layout)
        assert abs(out[0]["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], layout
        grads = assemble(out, size)
        assert not any(k.endswith("bias") for k in grads if "layernorm" not in k and "norm" not in k)
        for k in full_ref:
            assert rel_err(grads[k], full_ref[k]) <= 1e-5, (layout.mode, k)
