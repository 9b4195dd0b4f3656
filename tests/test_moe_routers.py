"""The routers of the newer MoE families (GLM-4.5, DeepSeek-V3) with METP, against single-rank
stock megatron-core from the same full weights (fp32, ≤ 1e-5), on both releases:

* sigmoid scoring (``--moe-router-score-function sigmoid``) with group-limited routing
  (``--moe-router-num-groups``, ``--moe-router-group-topk``), top-k scaling
  (``--moe-router-topk-scaling-factor``), a leading dense layer (``--moe-layer-freq
  ([0]*1+[1]*2)``) and experts with linear biases: loss and every gradient of one step at METP 2
  and 3; negative control: the same METP run against stock with the default router fails the
  comparison (the flags act);
* the aux-loss-free expert bias (``--moe-router-enable-expert-bias``): two Adam steps through
  Megatron's DDP and ``finalize_model_grads``, whose bias update sums each rank's token counts
  over TP × DP × CP: under METP the sequence (and so the tokens) is sharded over Megatron's CP
  group, which holds the METP ranks, so the counts are the whole batch's as in stock. Losses,
  grad norms, parameters and the expert bias after each run ≤ 1e-5 at METP 2 and 3. Negative
  control: the counts summed over DP only (each METP rank updating from its own tokens) give
  another expert bias, which the same comparison catches."""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize
from tests.harness import run_ranks
from tests.numerics import rel_err
from tests.test_moe import MOE, _errors, _experts, _layout, _shards, assemble, moe_one_step

#: MOE with a leading dense layer: layer 0 dense, layers 1 and 2 MoE (GLM-4.5's
#: ``--moe-layer-freq ([0]*k+[1]*(L-k))``)
LEADING_DENSE = GPTSize(**{**MOE.__dict__, "moe_layer_freq": [0, 1, 1]})

#: GLM-4.5 / DeepSeek-V3's router: sigmoid scores, 4 groups of 3 experts of which the best 2
#: groups are eligible, top-2 weights scaled by 2.5
ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
          "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5}


def _router_layout(metp=1, mode="metp", router=ROUTER, qk=True, global_batch_size=4, **kw):
    """alltoall, sequence aux loss, ``router``'s fields; q/k norms unless ``qk`` is False (with
    linear biases the k norm's bias has a gradient of zero in exact arithmetic: a constant shift
    of every key of a row leaves its softmax unchanged, so its relative error means nothing)."""
    return _layout(metp, mode=mode, dispatcher="alltoall", aux="seq_aux", qk=qk,
                   shared=dict(router), global_batch_size=global_batch_size, **kw)


def stock_step(rank, world, size, layout):
    """:func:`moe_one_step` of single-rank stock. With EP 1 an expert's ``linear_fc2`` ends in
    ``reduce_from_tensor_model_parallel_region`` over one rank, a custom Function returning its
    input as is, and ``MLP.forward`` then adds the expert bias to it in place, which autograd
    forbids (megatron-core 0.16.1 and 0.19.2, local spec; with EP > 1, METP's case, the expert
    skips that reduce). Here the one-rank reduce returns a copy: the same values."""
    from megatron.core.tensor_parallel import layers

    reduce = layers.reduce_from_tensor_model_parallel_region

    def reduce_copy(input_, *args, **kwargs):
        return reduce(input_, *args, **kwargs).clone()

    layers.reduce_from_tensor_model_parallel_region = reduce_copy
    return moe_one_step(rank, world, size, layout)


@pytest.fixture(scope="module")
def stock():
    """Single-rank stock megatron-core: ``"router"`` (the options above) or ``"default"``
    (softmax, no groups, no scaling), with or without linear biases."""
    cache = {}

    def get(which, bias):
        if (which, bias) not in cache:
            size = GPTSize(**{**LEADING_DENSE.__dict__, "bias": bias})
            router = ROUTER if which == "router" else {}
            cache[which, bias] = run_ranks(stock_step, 1, size,
                                           _router_layout(mode="tp", router=router,
                                                          qk=not bias))[0]
        return cache[which, bias]
    return get


@pytest.mark.parametrize("metp,bias", [(2, False), (3, True)], ids=["metp2", "metp3-bias"])
def test_sigmoid_group_limited_scaled_router_matches_single_rank_stock(stock, metp, bias):
    size = GPTSize(**{**LEADING_DENSE.__dict__, "bias": bias})
    out = run_ranks(moe_one_step, metp, size, _router_layout(metp, qk=not bias))
    ref = stock("router", bias)
    loss_err, errs = _errors(out, ref)
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    # layer 0 dense (METP's MLP), layers 1 and 2 MoE: fc1, fc2 (and their biases) per expert
    assert not any(k.startswith("decoder.layers.0.mlp.") and ".experts." in k for k in errs)
    assert len(_experts(errs)) == 2 * MOE.num_experts * (4 if bias else 2)
    # negative control: the same run against stock's default router (softmax, no groups, no
    # scaling) fails the comparison
    off, got = assemble([stock("default", bias)]), assemble(out)
    router_w = [k for k in off if k.endswith("router.weight")]
    assert router_w and min(rel_err(got[k], off[k]) for k in router_w) > 1e-2


# ---------------------------------------------------------------- expert bias, two steps

#: 6 heads (divisible by 2 and 3, head dim 8: see test_moe.TRAIN_MOE on Adam and head dim 2)
BIAS_MOE = GPTSize(**{**LEADING_DENSE.__dict__, "num_attention_heads": 6,
                      "num_query_groups": 6})
#: the aux-loss-free bias, updated fast enough that it changes the routing of the later steps
EXPERT_BIAS = {**ROUTER, "moe_router_enable_expert_bias": True,
               "moe_router_bias_update_rate": 0.05}


def _counts_over_dp_only():
    """The negative control's ``get_updated_expert_bias``: token counts summed over DP only,
    leaving the METP (CP) ranks' tokens out."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def update(tokens_per_expert, expert_bias, rate, *args, **kwargs):
        with torch.no_grad():
            dist.all_reduce(tokens_per_expert, group=ps.get_data_parallel_group())
            mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
            return expert_bias + torch.sign(mean - tokens_per_expert) * rate
    return update


def bias_train(rank, world, size, layout, counts_over_dp_only=False):
    """Two Adam steps (:func:`megatron_metp.megatron.training.train`, Megatron's DDP and
    ``finalize_model_grads``): per step (loss, grad norm), the parameters and every router's
    ``expert_bias`` after the steps."""
    import importlib

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import init_parallel, setup, train

    cpu.enable()
    if counts_over_dp_only:  # the module (the package exports the function of the same name)
        fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        fmg.get_updated_expert_bias = _counts_over_dp_only()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout)
    steps = [(r.lm_loss, r.grad_norm) for r in train(size, layout, 2, state=state)]
    model = state["model"].module
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {f"layer{layer.layer_number}": layer.mlp.router.expert_bias.detach().clone()
              for layer in model.decoder.layers if hasattr(layer.mlp, "router")}
    return {"steps": steps, "params": _shards(model, state["groups"], params),
            "shard": state["groups"].shard_index, "biases": biases}


@pytest.fixture(scope="module")
def stock_bias():
    return run_ranks(bias_train, 1, BIAS_MOE,
                     _router_layout(mode="tp", router=EXPERT_BIAS, global_batch_size=2))[0]


def _bias_error(out, ref) -> float:
    names = sorted(ref["biases"])
    assert names == ["layer2", "layer3"], names
    return max(rel_err(out[0]["biases"][k], ref["biases"][k]) for k in names)


@pytest.mark.parametrize("metp", [2, 3], ids=["metp2", "metp3"])
def test_expert_bias_two_adam_steps_match_single_rank_stock(stock_bias, metp):
    ref = stock_bias
    out = run_ranks(bias_train, metp, BIAS_MOE, _router_layout(metp, router=EXPERT_BIAS, global_batch_size=2))
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(out[0]["steps"],
                                                                    ref["steps"])):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)
    full_ref, got = assemble([ref], "params"), assemble(out, "params")
    errs = {k: rel_err(got[k], full_ref[k]) for k in full_ref}
    worst = max(errs, key=errs.get)
    assert set(got) == set(full_ref) and errs[worst] <= 1e-5, (worst, errs[worst])
    # the bias moved (two updates of 0 or ±0.05 per expert) and is the same on every rank
    assert all(ref["biases"][k].abs().max() > 0 for k in ref["biases"])
    assert all(torch.equal(r["biases"][k], out[0]["biases"][k]) for r in out
               for k in ref["biases"])
    assert _bias_error(out, ref) <= 1e-6, _bias_error(out, ref)
    if metp == 2:  # negative control: each METP rank counts its own tokens only
        bad = run_ranks(bias_train, metp, BIAS_MOE, _router_layout(metp, router=EXPERT_BIAS, global_batch_size=2),
                        counts_over_dp_only=True)
        assert _bias_error(bad, ref) > 0.1, _bias_error(bad, ref)
