"""METP × context parallelism inside megatron-core: Megatron's CP group of p·c ranks, the METP
group its expert group of p adjacent ranks (``Layout(metp=p, cp=c)``), against single-rank stock
Megatron from the same full weights (fp32, ≤ 1e-5): loss and every gradient of one step (with and
without the vocabulary ring, full recompute, host offload of saved activations), three optimizer steps through Megatron's DDP and
distributed optimizer, packed documents; negative control."""

import pytest

from megatron_metp.megatron.training import GPTSize, Layout
from tests.gpt_cases import SIZE, assemble, one_step_grads
from tests.harness import run_ranks
from tests.numerics import rel_err
from tests.test_megatron_gpt import TRAIN_SIZE, _train

GLU = GPTSize(**{**SIZE.__dict__, "swiglu": True, "num_query_groups": 4})  # GQA, SwiGLU


@pytest.fixture(scope="module")
def single_rank():
    return run_ranks(one_step_grads, 1, GLU, Layout())[0]


def _worst(out, ref):
    full_ref = assemble([ref], GLU)
    grads = assemble(out, GLU)
    assert set(grads) == set(full_ref)
    errs = {k: rel_err(grads[k], full_ref[k]) for k in full_ref}
    worst = max(errs, key=errs.get)
    return abs(out[0]["loss"] - ref["loss"]) / abs(ref["loss"]), worst, errs[worst]


@pytest.mark.parametrize("layout", [
    Layout(metp=2, cp=2), Layout(metp=2, cp=2, vocab_parallel=True),
    Layout(metp=2, cp=2, recompute="full"),
    Layout(metp=2, cp=2, recompute="full", offload_activations=True), Layout(metp=1, cp=4),
    Layout(metp=2, cp=2, recompute="selective", recompute_modules=["core_attn", "layernorm"])],
    ids=["metp2xcp2", "metp2xcp2-vocab", "metp2xcp2-recompute", "metp2xcp2-recompute-offload",
         "metp1xcp4", "metp2xcp2-selective"])
def test_one_step_loss_and_every_gradient_match_single_rank(layout, single_rank):
    out = run_ranks(one_step_grads, 4, GLU, layout)
    loss_err, worst, err = _worst(out, single_rank)
    assert loss_err <= 1e-5 and err <= 1e-5, (layout.describe(), loss_err, worst, err)


def test_odd_metp_three_times_cp_two_one_step_matches_single_rank():
    """The odd case: METP 3 × CP 2 on 6 ranks (GeLU, 12 heads, vocabulary ring)."""
    ref = run_ranks(one_step_grads, 1, SIZE, Layout())[0]
    out = run_ranks(one_step_grads, 6, SIZE, Layout(metp=3, cp=2, vocab_parallel=True))
    full_ref, grads = assemble([ref], SIZE), assemble(out, SIZE)
    errs = {k: rel_err(grads[k], full_ref[k]) for k in full_ref}
    worst = max(errs, key=errs.get)
    assert abs(out[0]["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (out[0]["loss"], ref["loss"])
    assert errs[worst] <= 1e-5, (worst, errs[worst])


def _no_context(rank, world, size, layout):
    """The same layout with the CP group not attached: each METP group's K/V ring sees only its
    own p ranks' tokens."""
    from megatron_metp.runtime import context

    context.attach_context_group = lambda metp, *a, **k: metp
    return one_step_grads(rank, world, size, layout)


def test_negative_control_kv_ring_inside_the_metp_group_only(single_rank):
    out = run_ranks(_no_context, 4, GLU, Layout(metp=2, cp=2))
    loss_err, worst, err = _worst(out, single_rank)
    assert loss_err > 1e-4 and err > 1e-2, (loss_err, worst, err)


@pytest.fixture(scope="module")
def single_rank_training():
    return run_ranks(_train, 1, TRAIN_SIZE, Layout())[0]


@pytest.mark.parametrize("world", [4, 8], ids=["dp1", "dp2"])
def test_three_steps_ddp_distributed_optimizer_vocab_ring_match_single_rank(
        single_rank_training, world):
    """DDP (METP-sharded weights over Megatron's expert-DP group = the c METP groups × DP,
    replicated ones over DP×CP), the distributed optimizer (sharded weights' states split over
    expert-DP), the vocabulary ring, Megatron's grad-norm clipping: three Adam steps, at DP 1
    (4 ranks) and DP 2 (8 ranks: TP 1 × METP 2 × CP 2 × DP 2)."""
    layout = Layout(metp=2, cp=2, distributed_optimizer=True, vocab_parallel=True)
    got = run_ranks(_train, world, TRAIN_SIZE, layout, timeout=300)[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, single_rank_training)):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)


def test_packed_documents_train_as_single_rank_stock():
    """Packed documents (EOD boundaries derived over the whole CP group, document-masked K/V
    ring over p·c ranks, per-token loss) with the vocabulary ring and full recompute: four
    Adam steps equal single-rank stock Megatron with its dense document mask."""
    from tests.test_packed_megatron import _train_packed

    common = dict(micro_batch_size=2, global_batch_size=4, lr=3e-3, packed_eod=127)
    ref = run_ranks(_train_packed, 1, Layout(mode="tp", **common), 4)[0]
    got = run_ranks(_train_packed, 4, Layout(metp=2, cp=2, vocab_parallel=True,
                                             recompute="full", **common), 4, timeout=300)[0]
    assert max(abs(a - b) / a for a, b in zip(ref, got)) <= 1e-5, (ref, got)
    assert ref[-1] < ref[0]


def test_cp_outer_factor_validation_names_the_flags():
    from megatron_metp.megatron.parallel import validate_metp_config

    assert validate_metp_config(world_size=32, metp_parallel_size=8, context_parallel_size=4,
                                seq_length=16 * 2 ** 20) == 1
    with pytest.raises(ValueError, match="TP×METP×CP×PP"):
        validate_metp_config(world_size=24, metp_parallel_size=8, context_parallel_size=4)
    with pytest.raises(ValueError, match="2×METP×CP = 64"):
        validate_metp_config(world_size=32, metp_parallel_size=8, context_parallel_size=4,
                             seq_length=32 * 1000 + 32)
    with pytest.raises(ValueError, match="mode='metp'"):
        Layout(metp=2, cp=2, mode="ring")


def test_checkpoint_saved_under_cp_resumes_exactly_and_in_metp_alone(tmp_path):
    """A checkpoint saved at METP 2 × CP 2 with the vocabulary ring (METP-sharded tensors unique
    per METP rank, replicas over the c rings) resumes bit-exactly in the same layout and
    continues the loss curve as METP 2 alone on 2 ranks."""
    from tests.test_checkpoint import SAVE_AT, SIZE, _resume, _save_and_continue

    layout = Layout(metp=2, cp=2, vocab_parallel=True)
    directory = str(tmp_path / "cp")
    uninterrupted = run_ranks(_save_and_continue, 4, layout, directory, timeout=300)[0][0]
    same = run_ranks(_resume, 4, layout, directory, timeout=300)[0]
    assert same == uninterrupted[SAVE_AT:]
    alone = run_ranks(_resume, 2, Layout(metp=2, vocab_parallel=True), directory, SIZE, False,
                      timeout=300)[0]
    for got, ref in zip(alone, uninterrupted[SAVE_AT:]):
        assert abs(got - ref) <= 1e-6 * ref, (alone, uninterrupted)
