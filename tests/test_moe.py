"""MoE GPT with METP inside megatron-core: METP attention around Megatron's stock ``MoELayer``
(experts sharded over the METP group, EP = p), against single-rank stock megatron-core from the
same full weights (fp32, ≤ 1e-5): loss and every gradient of one step (METP 2, 4, 2 × CP 2,
3 × CP 2; allgather and alltoall; aux / seq-aux / z losses; full recompute), three Adam steps
through Megatron's DDP and distributed optimizer; negative controls (EP left at 1 in the config,
expert gradients not reduced over expert-DP); the METP rings off Megatron's EP communicator;
refusals naming the flag."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from tests.harness import run_ranks
from tests.numerics import rel_err

#: 3 layers: MoE, dense, MoE (moe_layer_freq 2); 12 experts (divisible by 2, 3 and 4), top-2
MOE = GPTSize(num_layers=3, hidden_size=48, num_attention_heads=12, num_query_groups=12,
              ffn_hidden_size=48, vocab_size=72, seq_length=24, num_experts=12,
              moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=2, bias=False)


def _layout(metp=1, cp=1, mode="metp", dispatcher="allgather", aux=None, qk=False,
            shared=None, **kw):
    """``aux``: None (no router loss), ``"aux"`` (load-balancing 1e-2 + z-loss 1e-3) or
    ``"seq_aux"`` (sequence-level load balancing 1e-2 + z-loss 1e-3); ``qk``: per-head q/k
    norms (``--qk-layernorm``, as Qwen3-MoE)."""
    extra = {"moe_token_dispatcher_type": dispatcher, "moe_aux_loss_coeff": 0.0,
             "qk_layernorm": qk}
    if aux:
        extra.update(moe_router_load_balancing_type=f"{aux}_loss", moe_aux_loss_coeff=1e-2,
                     moe_z_loss_coeff=1e-3)
    extra.update(shared or {})  # shared experts: --moe-shared-expert-* fields
    return Layout(metp=metp, cp=cp, mode=mode, extra=extra, **kw)


def _shards(model, groups, tensors):
    """``{global name: (tensor, partition dim, METP-sharded, full shape)}`` of ``tensors``
    (``{local parameter name: tensor}``)."""
    from megatron_metp.megatron.training import _global_name, full_shape

    params = dict(model.named_parameters())
    return {_global_name(model, n): (t, getattr(params[n], "partition_dim", 0),
                                     getattr(params[n], "metp_sharded", False),
                                     full_shape(params[n], groups)) for n, t in tensors.items()}


def _rings_off_the_ep_communicator(groups) -> bool:
    """No ring of the METP group talks on Megatron's expert-model-parallel process group."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_group()
    m = groups.metp
    rings = [m, m.kv_ring, m.sequence_ring, m.sequence_ring.kv_ring]
    return m.size > 1 and all(r.group is not ep for r in rings) and \
        all(r.ranks == m.ranks for r in (m, m.kv_ring))


def moe_one_step(rank, world, size, layout, ep_left_at_one=False):
    """Loss and full-weight gradients of one forward/backward, reduced as Megatron's DDP does.

    Each rank's loss is the mean over its own tokens (as under Megatron's CP, whose schedule
    scales the router losses' backward by ``|CP|``); a gradient is summed over DP×CP when its
    parameter is ``allreduce`` (replicated), else over the expert data-parallel group (experts
    and METP-sharded weights), then divided by ``|DP×CP|``: what ``DistributedDataParallel``
    computes. ``unreduced``: the same with the expert-DP reduction left out (negative control).
    ``ep_left_at_one``: the config keeps ``expert_model_parallel_size = 1`` (the trap), with the
    check that refuses it switched off."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank
    from megatron_metp.megatron.moe import is_expert_param
    from megatron_metp.megatron.training import (build_model, global_batch, init_parallel,
                                                 load_initial_weights)

    cpu.enable()
    groups = init_parallel(layout, size.seq_length)
    if ep_left_at_one:
        from megatron_metp.megatron import modules, moe, moe_checks

        fields = moe.moe_config_fields
        moe.moe_config_fields = lambda **kw: {**fields(**kw), "expert_model_parallel_size": 1}
        moe_checks.check_moe_config = modules.check_moe_config = lambda *a, **k: None
    model = build_model(size, layout, groups)
    load_initial_weights(model, groups, size)
    tokens, labels = global_batch(size, 0, 2)
    batch = {"tokens": tokens, "labels": labels,
             "position_ids": torch.arange(size.seq_length).expand(2, -1).contiguous()}
    cp = ps.get_context_parallel_group()
    n_cp = dist.get_world_size(cp)
    if n_cp > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=cp)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(n_cp)))
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = per_token.sum() / per_token.numel()
    loss.backward()
    total = loss.detach().clone()
    if n_cp > 1:
        dist.all_reduce(total, group=cp)
    edp = ps.get_expert_data_parallel_group()
    grads, unreduced = {}, {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        expert = is_expert_param(p)
        if n_cp > 1 and not expert:
            dist.all_reduce(g, group=cp)
        unreduced[name] = g.clone() / n_cp
        if expert and dist.get_world_size(edp) > 1:
            dist.all_reduce(g, group=edp)
        grads[name] = g / n_cp
    return {"loss": total.item() / n_cp, "grads": _shards(model, groups, grads),
            "unreduced": _shards(model, groups, unreduced), "shard": groups.shard_index,
            "rings_apart": _rings_off_the_ep_communicator(groups)}


def assemble(per_rank, key="grads"):
    """Full tensors from every rank's ``key`` entries: experts from the rank holding them,
    METP-sharded weights concatenated in shard order, replicated ones from rank 0."""
    out, pieces = {}, {}
    for r in per_rank:
        for name, (t, dim, sharded, shape) in r[key].items():
            if sharded and list(t.shape) != list(shape):
                pieces.setdefault(name, (dim, {}))[1][r["shard"]] = t
            else:
                out.setdefault(name, t)
    for name, (dim, by_shard) in pieces.items():
        out[name] = torch.cat([by_shard[i] for i in sorted(by_shard)], dim=dim)
    return out


def _errors(out, ref, key="grads"):
    """Relative loss error and every tensor's relative error against the single-rank ``ref``."""
    full_ref, got = assemble([ref]), assemble(out, key)
    assert set(got) == set(full_ref), set(got) ^ set(full_ref)
    errs = {k: rel_err(got[k], full_ref[k]) for k in full_ref}
    return abs(out[0]["loss"] - ref["loss"]) / abs(ref["loss"]), errs


def _experts(errs):
    return {k: v for k, v in errs.items() if ".experts." in k}


def _expert_error(out, ref, key="grads") -> float:
    """Relative error of all expert tensors together (an expert no token reached has zero
    gradients on both sides)."""
    full_ref, got = assemble([ref]), assemble(out, key)
    names = sorted(_experts(full_ref))
    return rel_err(torch.cat([got[k].flatten() for k in names]),
                   torch.cat([full_ref[k].flatten() for k in names]))


@pytest.fixture(scope="module")
def stock():
    """Single-rank stock megatron-core (local MoE block spec, EP 1, q/k norms), one run per
    router loss."""
    cache = {}

    def get(aux=None):
        if aux not in cache:
            cache[aux] = run_ranks(moe_one_step, 1, MOE, _layout(mode="tp", aux=aux, qk=True))[0]
        return cache[aux]
    return get


@pytest.mark.parametrize("metp,cp,dispatcher,aux,recompute", [
    (2, 1, "allgather", None, None), (2, 1, "alltoall", "aux", None),
    (4, 1, "alltoall", None, None), (2, 2, "allgather", "aux", None),
    (2, 2, "alltoall", "aux", "full"), (3, 2, "alltoall", "seq_aux", None),
    (2, 1, "alltoall", "aux", "selective"),
], ids=["metp2-allgather", "metp2-alltoall-aux", "metp4-alltoall", "metp2xcp2-allgather-aux",
        "metp2xcp2-alltoall-aux-recompute", "metp3xcp2-alltoall-seqaux",
        "metp2-alltoall-aux-selective"])
def test_one_step_matches_single_rank_stock(stock, metp, cp, dispatcher, aux, recompute):
    # selective: core_attn and layernorm (megatron/selective.py), in the dense and MoE layers
    sel = {"recompute_modules": ["core_attn", "layernorm"]} if recompute == "selective" else {}
    out = run_ranks(moe_one_step, metp * cp, MOE,
                    _layout(metp, cp, dispatcher=dispatcher, aux=aux, recompute=recompute,
                            qk=True, **sel))
    ref = stock(aux)
    loss_err, errs = _errors(out, ref)
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    assert len(_experts(errs)) == 2 * 2 * MOE.num_experts  # fc1, fc2 of every expert, 2 layers
    assert all(r["rings_apart"] for r in out)
    if cp > 1:  # negative control: expert gradients not summed over expert-DP (the c rings)
        bad = _expert_error(out, ref, key="unreduced")
        assert bad > 0.1, bad


#: a shared expert of width 24 (divisible by 2 and 3) beside the routed ones, gated or not
SHARED = {"moe_shared_expert_intermediate_size": 24}


@pytest.fixture(scope="module")
def stock_shared():
    """Single-rank stock megatron-core with a shared expert (``SharedExpertMLP``), gated or
    not, alltoall with the load-balancing and z losses."""
    cache = {}

    def get(gate):
        if gate not in cache:
            extra = {**SHARED, "moe_shared_expert_gate": gate}
            cache[gate] = run_ranks(moe_one_step, 1, MOE,
                                    _layout(mode="tp", dispatcher="alltoall", aux="aux", qk=True,
                                            **_with_extra(extra)))[0]
        return cache[gate]
    return get


def _with_extra(extra):
    return {"shared": extra}


@pytest.mark.parametrize("metp,cp,gate", [(2, 1, False), (3, 1, True), (2, 2, True)],
                         ids=["metp2", "metp3-gate", "metp2xcp2-gate"])
def test_shared_experts_match_single_rank_stock(stock_shared, metp, cp, gate):
    """``--moe-shared-expert-intermediate-size`` (and ``--moe-shared-expert-gate``): the shared
    expert runs as METP's MLP (weight ring over the METP group, its shards ``[k·F_s/p, h]`` /
    ``[h, F_s/p]``), the gate replicated; loss and every gradient equal single-rank stock's
    within 1e-5 at METP 2, 3 and 2 × CP 2; the shared expert's weights are METP-sharded (a
    replicated copy on every rank would hold p times the bytes). Negative control: a gated
    run compared with stock without the gate fails the same comparison (the flag acts)."""
    out = run_ranks(moe_one_step, metp * cp, MOE,
                    _layout(metp, cp, dispatcher="alltoall", aux="aux", qk=True,
                            **_with_extra({**SHARED, "moe_shared_expert_gate": gate})))
    ref = stock_shared(gate)
    loss_err, errs = _errors(out, ref)
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    shared = {k: v for k, v in errs.items() if ".shared_experts." in k}
    assert len(shared) == 2 * (2 + gate), shared  # fc1, fc2 (and the gate) of 2 MoE layers
    for r in out:
        for name, (t, _dim, sharded, shape) in r["grads"].items():
            if ".shared_experts.linear_fc" in name:
                assert sharded and t.numel() * metp == math.prod(shape), (name, t.shape, shape)
            if name.endswith("shared_experts.gate_weight"):
                assert not sharded and list(t.shape) == [1, MOE.hidden_size]
    if gate:  # negative control: the same run against stock without the gate differs
        off, got = assemble([stock_shared(False)]), assemble(out)
        fc = [k for k in off if ".shared_experts.linear_fc" in k]
        assert fc and min(rel_err(got[k], off[k]) for k in fc) > 1e-2


def test_negative_control_expert_parallel_size_left_at_one_in_the_config(stock):
    """The trap: with ``expert_model_parallel_size`` 1 in the TransformerConfig (EP = p in
    parallel_state), Megatron marks expert weights as replicated, so they are summed over
    DP×CP with the other METP ranks' experts: large errors, no exception. The check refuses it."""
    out = run_ranks(moe_one_step, 2, MOE, _layout(2, qk=True), ep_left_at_one=True)
    _, errs = _errors(out, stock(None))
    assert _expert_error(out, stock(None)) > 0.5, _expert_error(out, stock(None))
    assert max(v for k, v in errs.items() if ".experts." not in k) <= 1e-5
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron.moe_checks import check_moe_config

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                            num_moe_experts=4, context_parallel_size=2)
    with pytest.raises(ValueError, match="expert_model_parallel_size 1 .*must be 2"):
        check_moe_config(cfg, 2)


# ---------------------------------------------------------------- three Adam steps

def moe_train(rank, world, size, layout):
    """Three Adam steps through Megatron's DDP, optimizer and grad clipping: per step (loss,
    grad norm), and the parameters after the steps."""
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import init_parallel, setup, train

    cpu.enable()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout)
    steps = [(r.lm_loss, r.grad_norm) for r in train(size, layout, 3, state=state)]
    model = state["model"].module
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"steps": steps, "params": _shards(model, state["groups"], params),
            "shard": state["groups"].shard_index, "loss": steps[-1][0]}


#: head dim 6: with head dim 2 some attention gradients are so small that Adam's first steps
#: (``g / (|g| + eps)``) turn their last-bit differences into 1e-5 parameter differences;
#: 4 layers (MoE, dense, MoE, dense) for two pipeline stages
TRAIN_MOE = GPTSize(**{**MOE.__dict__, "num_attention_heads": 4, "num_query_groups": 4,
                       "num_layers": 4})


@pytest.fixture(scope="module")
def stock_training():
    return run_ranks(moe_train, 1, TRAIN_MOE, _layout(mode="tp", aux="aux"))[0]


@pytest.mark.parametrize("cp,pp,dispatcher", [(1, 1, "alltoall"), (2, 1, "allgather"),
                                              (1, 2, "alltoall")],
                         ids=["metp2xdp2-alltoall-distopt", "metp2xcp2-allgather-distopt",
                              "metp2xpp2-alltoall"])
def test_three_adam_steps_ddp_distributed_optimizer_match_single_rank_stock(
        stock_training, cp, pp, dispatcher):
    """4 ranks. Experts and METP-sharded weights reduce over expert-DP (DP 2, or the c = 2
    rings), their optimizer states shard over it, the grad norm counts every parameter once;
    aux + z losses; two pipeline stages."""
    world, metp = 4, 2
    layout = _layout(metp, cp, dispatcher=dispatcher, aux="aux", pp=pp,
                     distributed_optimizer=pp == 1)
    check_training(run_ranks(moe_train, world, TRAIN_MOE, layout, timeout=300), stock_training)


def check_training(out, ref):
    """Per step loss and grad norm, and every parameter after the steps, of the ranks' ``out``
    (:func:`moe_train`) equal single-rank ``ref``'s within 1e-5."""
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(out[0]["steps"],
                                                                    ref["steps"])):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)
    full_ref, got = assemble([ref], "params"), assemble(out, "params")
    assert set(got) == set(full_ref)
    errs = {k: rel_err(got[k], full_ref[k]) for k in full_ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


# ---------------------------------------------------------------- refusals

def _cfg(**kw):
    base = dict(num_moe_experts=8, expert_model_parallel_size=2, tensor_model_parallel_size=1,
                expert_tensor_parallel_size=1, moe_token_dispatcher_type="alltoall")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,needle", [
    (dict(expert_model_parallel_size=3), "--expert-model-parallel-size"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4), "--num-experts 6 is not divisible"),
    (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size 2 with --num-experts"),
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size 2"),
    (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type flex"),
    (dict(moe_shared_expert_overlap=True), "--moe-shared-expert-overlap"),
    (dict(moe_latent_size=16), "--moe-latent-size"),
    (dict(overlap_moe_expert_parallel_comm=True), "--overlap-moe-expert-parallel-comm"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine"),
    (dict(moe_use_upcycling=True), "--moe-use-upcycling"),
    (dict(moe_grouped_gemm=True), "--moe-grouped-gemm runs on GPU only"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_unsupported_moe_settings_are_refused_naming_the_flag(kw, needle):
    from megatron_metp.megatron.moe_checks import check_moe_config, moe_args_problems

    p = 4 if kw.get("expert_model_parallel_size") == 4 and "num_moe_experts" in kw else 2
    with pytest.raises(ValueError, match="with MoE does not support") as err:
        check_moe_config(_cfg(**kw), p, on_cpu=True)
    assert needle in str(err.value), str(err.value)
    assert check_moe_config(_cfg(), 2, on_cpu=True) is None
    assert check_moe_config(_cfg(moe_grouped_gemm=True), 2, on_cpu=False) is None  # GPU: runs


def test_megatron_lm_args_leave_expert_parallel_size_to_the_hooks():
    """Megatron-LM's ``args``: ``--expert-model-parallel-size`` left at 1 is fine (the hooks set
    the config's to p); a value that is not a multiple of p is refused, as are the same
    unsupported flags."""
    from megatron_metp.megatron.moe_checks import moe_args_problems

    def args(**kw):
        return SimpleNamespace(**{"num_experts": 8, "expert_model_parallel_size": 1, **kw})

    assert moe_args_problems(args(), 2, on_cpu=True) == []
    assert moe_args_problems(args(expert_model_parallel_size=2), 2, on_cpu=True) == []
    assert "--expert-model-parallel-size" in moe_args_problems(
        args(expert_model_parallel_size=3), 2, on_cpu=True)[0]
    assert "--moe-use-upcycling" in moe_args_problems(args(moe_use_upcycling=True), 2,
                                                      on_cpu=True)[0]
    assert moe_args_problems(SimpleNamespace(num_experts=None), 2) == []


def test_config_from_args_gets_expert_parallel_size_p():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron.moe import fold_expert_parallel_into_config

    def cfg(ep):
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                 num_moe_experts=4, expert_model_parallel_size=ep)

    assert fold_expert_parallel_into_config(cfg(1), 2).expert_model_parallel_size == 2
    assert fold_expert_parallel_into_config(cfg(2), 2).expert_model_parallel_size == 2
    assert fold_expert_parallel_into_config(cfg(4), 2).expert_model_parallel_size == 4  # wide
    with pytest.raises(ValueError, match="expert_model_parallel_size 3"):
        fold_expert_parallel_into_config(cfg(3), 2)
    with pytest.raises(ValueError, match="--metp-disable-weight-ring"):
        from megatron_metp.megatron.moe import get_gpt_decoder_block_metp_spec

        get_gpt_decoder_block_metp_spec(cfg(2), SimpleNamespace(metp=SimpleNamespace(size=2)),
                                        weight_ring=False)
