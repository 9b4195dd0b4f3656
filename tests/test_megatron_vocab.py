"""Vocabulary METP inside megatron-core's GPTModel: parity with a single rank (tied and untied),
with TP, through DDP/optimizer steps and pipeline stages; checkpoint keys match stock TP."""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, train
from tests.gpt_cases import SIZE, assemble, one_step_grads
from tests.harness import run_ranks
from tests.numerics import rel_err


def _size(tied):
    return GPTSize(**{**SIZE.__dict__, "tie_embeddings": tied})


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world,layout", [
    (3, Layout(metp=3, vocab_parallel=True)),
    (4, Layout(metp=2, tp=2, vocab_parallel=True)),
], ids=["metp3", "metp2xtp2"])
def test_gpt_vocab_metp_matches_single_rank(world, layout, tied):
    size = _size(tied)
    ref = run_ranks(one_step_grads, 1, size, Layout())[0]
    out = run_ranks(one_step_grads, world, size, layout)
    assert abs(out[0]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    full_ref = assemble([ref], size)
    grads = assemble(out, size)
    assert set(grads) == set(full_ref)
    assert ("output_layer.weight" in grads) != tied
    errs = {k: rel_err(grads[k], full_ref[k]) for k in full_ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


def _table_shapes(rank, world, size, layout):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import build_model

    cpu.enable()
    groups = init_parallel(layout, size.seq_length)
    model = build_model(size, layout, groups)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()
              if "word_embeddings" in n or "output_layer" in n}
    sd = model.sharded_state_dict()
    keys = {k: (v.global_shape, v.global_offset) for k, v in sd.items()
            if "word_embeddings" in k or k == "output_layer.weight"}
    return shapes, keys


def test_no_rank_holds_a_whole_table_and_checkpoint_keys_are_megatrons():
    size = _size(False)
    p = 3
    v = size.vocab_size // p
    for r, (shapes, keys) in enumerate(run_ranks(_table_shapes, p, size,
                                                 Layout(metp=p, vocab_parallel=True))):
        assert shapes == {"embedding.word_embeddings.weight": (v, size.hidden_size),
                          "output_layer.weight": (v, size.hidden_size)}
        for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert keys[k] == ((size.vocab_size, size.hidden_size), (r * v, 0)), (k, keys[k])
    # negative control: without the switch every METP rank holds the whole tables
    shapes, _ = run_ranks(_table_shapes, p, size, Layout(metp=p))[0]
    assert shapes["output_layer.weight"] == (size.vocab_size, size.hidden_size)


def _train(rank, world, size, layout):
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(layout, size.seq_length)
    return [(r.lm_loss, r.grad_norm) for r in train(size, layout, 3)]


TRAIN_SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
                     vocab_size=64, seq_length=16)


@pytest.mark.parametrize("world,layout,tied", [
    (2, Layout(metp=2, vocab_parallel=True), True),
    (4, Layout(metp=2, pp=2, vocab_parallel=True), False),
    (4, Layout(metp=2, pp=2, vocab_parallel=True), True),
    (4, Layout(metp=2, vocab_parallel=True, distributed_optimizer=True), False),
], ids=["metp2-tied", "metp2xpp2", "metp2xpp2-tied", "metp2xdp2-distopt"])
def test_three_training_steps_match_single_rank(world, layout, tied):
    size = GPTSize(**{**TRAIN_SIZE.__dict__, "tie_embeddings": tied})
    ref = run_ranks(_train, 1, size, Layout())[0]
    got = run_ranks(_train, world, size, layout, timeout=300)[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, ref)):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)


def _logits(rank, world, size, layout):
    from megatron.core import parallel_state as ps
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import build_model, global_batch, load_initial_weights

    cpu.enable()
    groups = init_parallel(layout, size.seq_length)
    model = build_model(size, layout, groups)
    load_initial_weights(model, groups, size)
    tokens, _ = global_batch(size, 0, 2)
    batch = {"tokens": tokens,
             "position_ids": torch.arange(size.seq_length).expand(2, -1).contiguous()}
    if layout.metp > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], None), batch["position_ids"]


def test_logits_without_labels_match_single_rank():
    size = _size(False)
    ref, _ = run_ranks(_logits, 1, size, Layout())[0]  # [b, s, V]
    for logits, pos in run_ranks(_logits, 2, size, Layout(metp=2, vocab_parallel=True)):
        assert logits.shape == (2, pos.shape[1], size.vocab_size)
        want = ref.gather(1, pos[..., None].expand(-1, -1, size.vocab_size))
        assert rel_err(logits, want) <= 1e-5
