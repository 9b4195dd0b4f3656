"""MoE with expert parallelism wider than the METP group (``EP = p·e``, issue 42): the experts
over METP × CP or METP × DP, their gradients reduced over Megatron's expert-DP group, METP-sharded
weights over METP-DP (their replicas summed first, :mod:`megatron_metp.megatron.wide_ep`),
replicated ones over DP × METP × CP — all through Megatron's own ``DistributedDataParallel``.

Against single-rank stock megatron-core from the same full weights (fp32, ≤ 1e-5): loss and every
gradient of one step at METP 2 × CP 2 and METP 2 × DP 2 with EP 4, both dispatchers; three Adam
steps through the distributed optimizer (losses, grad norms, parameters). Negative controls: the
expert gradients reduced over METP-DP (the METP-sharded weights' group) instead of expert-DP, and
the METP-sharded gradients left without their replica sum, each caught by the same comparison.
Refusals of EP values that are not such a multiple, naming the valid ones."""

import pytest
import torch

from tests.harness import run_ranks
from tests.test_moe import (MOE, TRAIN_MOE, _errors, _expert_error, _experts, _layout, _shards,
                            check_training, moe_train)
from tests.test_moe import stock  # noqa: F401 - the fixture: single-rank stock, per router loss


def wide_one_step(rank, world, size, layout, replica_sum=True):
    """Loss and full-weight gradients of one forward/backward through Megatron's DDP as
    :func:`megatron_metp.megatron.training.setup` wires it (``finish_grad_sync``: each gradient
    reduced and scaled by DDP itself). DP rank ``d`` takes sequence ``d`` of the two-sequence
    batch. ``wrong_experts``: the same, with the expert gradients further summed over the replica
    group, i.e. reduced over METP-DP (negative control). ``replica_sum=False``: the wide-EP
    wiring left out (negative control)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from megatron_metp.megatron import cpu, wide_ep
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank
    from megatron_metp.megatron.linear import is_metp_sharded
    from megatron_metp.megatron.training import global_batch, init_parallel, setup

    cpu.enable()
    init_parallel(layout, size.seq_length)
    if not replica_sum:
        wide_ep.sum_metp_shards_over_replicas = lambda ddp, group: 0
    state = setup(size, layout)
    ddp, groups = state["model"], state["groups"]
    model = ddp.module
    tokens, labels = global_batch(size, 0, 2)
    per = 2 // ps.get_data_parallel_world_size()
    d = ps.get_data_parallel_rank()
    tokens, labels = tokens[d * per:(d + 1) * per], labels[d * per:(d + 1) * per]
    batch = {"tokens": tokens, "labels": labels,
             "position_ids": torch.arange(size.seq_length).expand(per, -1).contiguous()}
    cp = ps.get_context_parallel_group()
    n_cp = dist.get_world_size(cp)
    batch = get_batch_on_this_cp_rank(batch, cp_group=cp)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(n_cp)))
    ddp.zero_grad_buffer()
    per_token = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = per_token.sum() / per_token.numel()
    loss.backward()
    ddp.finish_grad_sync()
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_cp)
    grads, wrong = {}, {}
    for name, p in model.named_parameters():
        g = p.main_grad.detach().clone()
        grads[name] = g
        expert = not getattr(p, "allreduce", True) and not is_metp_sharded(p)
        if expert:  # the negative control: experts reduced over METP-DP
            g = g.clone()
            dist.all_reduce(g, group=groups.ep_replicas)
        wrong[name] = g
    layer = next(m for m in model.modules() if hasattr(m, "local_expert_indices"))
    return {"loss": total.item() / dist.get_world_size(dp_cp),
            "grads": _shards(model, groups, grads), "wrong_experts": _shards(model, groups, wrong),
            "shard": groups.shard_index, "local_experts": list(layer.local_expert_indices),
            "sizes": (dist.get_world_size(groups.ep_replicas), dist.get_world_size(groups.dp),
                      ps.get_expert_data_parallel_world_size(),
                      ps.get_expert_model_parallel_world_size())}


def _check(out, ref):
    loss_err, errs = _errors(out, ref)
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    assert len(_experts(errs)) == 2 * 2 * MOE.num_experts  # fc1, fc2 of every expert, 2 layers


@pytest.mark.parametrize("metp,cp,dispatcher", [
    (2, 2, "alltoall"), (2, 2, "allgather"), (2, 1, "alltoall"), (2, 1, "allgather"),
    (3, 2, "alltoall")],
    ids=["metp2xcp2-ep4-alltoall", "metp2xcp2-ep4-allgather", "metp2xdp2-ep4-alltoall",
         "metp2xdp2-ep4-allgather", "metp3xcp2-ep6-alltoall"])
def test_wide_ep_over_two_metp_groups_matches_single_rank_stock(stock, metp, cp, dispatcher):
    """METP p × 2 (CP or DP), EP 2p over both METP groups: rank r holds experts
    ``n·r … n·r + n − 1`` (``n = 12/(2p)``); the replica group (2 ranks) and METP-DP (2 ranks)
    are set, Megatron's expert-DP has 1 rank. Loss and every gradient, reduced by Megatron's DDP,
    equal single-rank stock within 1e-5 (under CP with the load-balancing and z losses; under
    DP, one sequence per replica, without: stock's router losses span the whole batch); p = 3
    too. Negative control: the expert gradients reduced over METP-DP, as METP-sharded weights
    are, fail the comparison."""
    aux = "aux" if cp > 1 else None
    world = 2 * metp
    out = run_ranks(wide_one_step, world, MOE, _layout(metp, cp, dispatcher=dispatcher, aux=aux,
                                                       qk=True, ep=world))
    ref = stock(aux)
    _check(out, ref)
    n = MOE.num_experts // world
    assert [r["local_experts"] for r in out] == [list(range(n * r, n * r + n))
                                                 for r in range(world)]
    assert all(r["sizes"] == (2, 2, 1, world) for r in out), [r["sizes"] for r in out]
    bad = _expert_error(out, ref, key="wrong_experts")
    assert bad > 0.1, bad


def test_negative_control_metp_shards_without_their_replica_sum(stock):
    """The wide-EP wiring left out of DDP: METP-sharded gradients reduce over expert-DP only (1
    rank here), missing the other replica's half; the comparison catches it."""
    out = run_ranks(wide_one_step, 4, MOE, _layout(2, 2, dispatcher="alltoall", aux="aux",
                                                   qk=True, ep=4), replica_sum=False)
    ref = stock("aux")
    _, errs = _errors(out, ref)
    sharded = {k: v for k, v in errs.items() if ".self_attention.linear_qkv." in k}
    assert sharded and min(sharded.values()) > 0.1, sharded


@pytest.fixture(scope="module")
def stock_training():
    return run_ranks(moe_train, 1, TRAIN_MOE, _layout(mode="tp", aux="aux"))[0]


@pytest.mark.parametrize("cp,dispatcher", [(2, "alltoall"), (1, "allgather")],
                         ids=["metp2xcp2-ep4-alltoall-distopt", "metp2xdp2-ep4-allgather-distopt"])
def test_three_adam_steps_distributed_optimizer_ep4_match_single_rank_stock(
        stock_training, cp, dispatcher):
    """Three Adam steps through Megatron's DDP and distributed optimizer with EP 4 over METP 2 ×
    CP 2 or METP 2 × DP 2: losses, grad norms (each METP shard counted once although two ranks
    hold it) and every parameter after the steps equal single-rank stock's within 1e-5."""
    layout = _layout(2, cp, dispatcher=dispatcher, aux="aux", ep=4, distributed_optimizer=True)
    check_training(run_ranks(moe_train, 4, TRAIN_MOE, layout, timeout=300), stock_training)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("kw,needle", [
    (dict(world_size=8, expert_model_parallel_size=3), "not a multiple of --metp-parallel-size 2"),
    (dict(world_size=4, expert_model_parallel_size=8), "does not divide the 4 ranks"),
    (dict(world_size=8, expert_model_parallel_size=8), "does not divide --num-experts 12"),
], ids=["not-a-multiple", "wider-than-the-ranks", "experts-not-divisible"])
def test_expert_parallel_sizes_that_are_not_whole_metp_groups_are_refused(kw, needle):
    """Before any rank starts: the refusal names the flag, why, and the valid values."""
    from megatron_metp.megatron.parallel import validate_metp_config

    with pytest.raises(ValueError, match="--expert-model-parallel-size") as err:
        validate_metp_config(metp_parallel_size=2, num_experts=12, **kw)
    msg = str(err.value)
    assert needle in msg, msg
    assert f"valid values with --metp-parallel-size 2, {kw['world_size']} ranks and " \
           f"--num-experts 12: 2, 4" in msg, msg
    assert validate_metp_config(world_size=8, metp_parallel_size=2, context_parallel_size=2,
                                num_experts=12, expert_model_parallel_size=4) == 2


def test_config_and_megatron_lm_checks_accept_multiples_of_p_only():
    """The same table for a ``TransformerConfig`` and Megatron-LM's ``args``: EP 4 at METP 2
    runs, EP 3 is refused naming the flag, EP 8 with 12 experts names the expert count; through
    Megatron-LM the layout check also names the valid values for the job's ranks."""
    from types import SimpleNamespace

    from megatron_metp.megatron.moe_checks import moe_args_problems, moe_problems
    from megatron_metp.megatron_lm.checks import _moe_problems

    def cfg(ep, e=12):
        d = {"num_moe_experts": e, "expert_model_parallel_size": ep}
        return lambda name, default: d.get(name, default)

    assert moe_problems(cfg(4), 2, on_cpu=True) == []
    assert "must be 2 or a multiple" in moe_problems(cfg(3), 2, on_cpu=True)[0]
    assert "--num-experts 12 is not divisible by --expert-model-parallel-size 8" in \
        moe_problems(cfg(8), 2, on_cpu=True)[0]
    args = SimpleNamespace(num_experts=12, expert_model_parallel_size=4, world_size=8)
    assert moe_args_problems(args, 2, on_cpu=True) == [] and _moe_problems(args, 2) == []
    args.world_size = 6
    assert any("--expert-model-parallel-size 4 does not divide the 6 ranks" in x and
               "valid values" in x for x in _moe_problems(args, 2)), _moe_problems(args, 2)
    args.expert_model_parallel_size = 3
    assert "--expert-model-parallel-size" in moe_args_problems(args, 2, on_cpu=True)[0]


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_in_stocks_expert_layout_resumes_in_other_layouts(tmp_path):
    """Saved at METP 2 × CP 2 with EP 4 after 2 of 5 Adam steps (experts in Megatron's own
    layout: global expert keys, one replica each; METP shards with their replica ids over
    METP-DP): single-rank stock megatron-core (EP 1) and METP 2 × DP 2 with EP 2 load it and
    continue the uninterrupted run's loss curve within 1e-6."""
    from tests.test_checkpoint import SAVE_AT, TOTAL, _resume, _save_and_continue

    directory = str(tmp_path / "ep4")
    layout = _layout(2, 2, dispatcher="alltoall", aux="aux", ep=4)
    uninterrupted = run_ranks(_save_and_continue, 4, layout, directory, TRAIN_MOE,
                              timeout=300)[0][0]
    for world, other in ((1, _layout(mode="tp", aux="aux")),
                         (4, _layout(2, dispatcher="allgather", aux="aux"))):
        resumed = run_ranks(_resume, world, other, directory, TRAIN_MOE, False, timeout=300)[0]
        assert len(resumed) == TOTAL - SAVE_AT
        for got, ref in zip(resumed, uninterrupted[SAVE_AT:]):
            assert abs(got - ref) <= 1e-6 * ref, (other.describe(), resumed, uninterrupted)



def _train_without_shared_marks(rank, world, size, layout):
    """:func:`moe_train` with the ``shared`` marks of the wide-EP wiring taken off again (every
    replica's METP shards counted in the grad norm)."""
    from megatron_metp.megatron import wide_ep
    from megatron_metp.megatron.linear import is_metp_sharded

    wire = wide_ep.sum_metp_shards_over_replicas

    def unmarked(ddp, group):
        out = wire(ddp, group)
        for p in ddp.module.parameters():
            if is_metp_sharded(p):
                p.shared = False
        return out

    wide_ep.sum_metp_shards_over_replicas = unmarked
    return moe_train(rank, world, size, layout)


def test_negative_control_grad_norm_without_the_shared_marks(stock_training):
    """The grad norm counts each METP shard once: with the ``shared`` marks taken off, the two
    replicas of every shard count twice and the first step's grad norm leaves stock's by far more
    than the 1e-5 the Adam test allows."""
    layout = _layout(2, 1, dispatcher="allgather", aux="aux", ep=4, distributed_optimizer=True)
    out = run_ranks(_train_without_shared_marks, 4, TRAIN_MOE, layout, timeout=300)
    norm, ref = out[0]["steps"][0][1], stock_training["steps"][0][1]
    print(f"grad norm of step 1 without the marks {norm:.4f}, stock {ref:.4f}")
    assert abs(norm - ref) > 0.05 * ref, (norm, ref)
