"""MoE GPT with METP inside megatron-core: METP attention around Megatron's stock ``MoELayer``
(experts sharded over the METP group, EP = p), against single-rank stock megatron-core from the
same full weights (fp32, ≤ 1e-5): loss and every gradient of one step, three Adam steps through
Megatron's DDP and distributed optimizer; negative controls and refusals."""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from tests.harness import run_ranks
from tests.numerics import rel_err

#: 3 layers: MoE, dense, MoE (moe_layer_freq 2); 12 experts (divisible by 2, 3 and 4), top-2
MOE = GPTSize(num_layers=3, hidden_size=24, num_attention_heads=12, num_query_groups=12,
              ffn_hidden_size=48, vocab_size=72, seq_length=24, num_experts=12,
              moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=2, bias=False)


def _layout(metp=1, cp=1, mode="metp", dispatcher="allgather", aux=0.0, **kw):
    extra = {"moe_token_dispatcher_type": dispatcher, "moe_aux_loss_coeff": aux,
             **kw.pop("extra", {})}
    if aux:
        extra.update(moe_router_load_balancing_type="seq_aux_loss" if aux < 0 else "aux_loss",
                     moe_z_loss_coeff=1e-3)
        extra["moe_aux_loss_coeff"] = abs(aux)
    return Layout(metp=metp, cp=cp, mode=mode, extra=extra, **kw)


def moe_one_step(rank, world, size, layout, ep_left_at_one=False):
    """Loss and full-weight gradients of one forward/backward, reduced as Megatron's DDP does.

    Each rank's loss is the mean over its own tokens (as under Megatron's CP); a gradient is
    summed over DP×CP when its parameter is ``allreduce`` (replicated), else over the expert
    data-parallel group (experts and METP-sharded weights), then divided by ``|DP×CP|``: what
    ``DistributedDataParallel`` computes. Also returns, for the negative control, the gradients
    with the expert-DP reduction left out. Names are global (expert index included)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank
    from megatron_metp.megatron.moe import is_expert_param
    from megatron_metp.megatron.training import (_global_name, build_model, full_shape,
                                                 global_batch, init_parallel, load_initial_weights)

    cpu.enable()
    groups = init_parallel(layout, size.seq_length)
    if ep_left_at_one:  # the trap: the config keeps expert_model_parallel_size 1
        from megatron_metp.megatron import moe, moe_checks, modules

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
    # Megatron's schedule scales the router losses' backward by |CP| (each rank's main loss is
    # its own mean; DDP averages over DP×CP)
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

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
        unreduced_g = g.clone() / n_cp
        if expert and dist.get_world_size(edp) > 1:
            dist.all_reduce(g, group=edp)
        key = _global_name(model, name)
        grads[key] = (g / n_cp, getattr(p, "partition_dim", 0),
                      getattr(p, "metp_sharded", False), full_shape(p, groups))
        unreduced[key] = unreduced_g
    return {"loss": total.item() / n_cp, "grads": grads, "unreduced": unreduced,
            "shard": groups.shard_index}


def assemble(per_rank, key="grads"):
    """Full gradients: experts from the rank holding them, METP-sharded weights concatenated in
    shard order (SwiGLU's fc1 halves apart), replicated ones from rank 0."""
    out = {}
    for r in per_rank:
        for name, (g, dim, sharded, shape) in r["grads"].items():
            g = r[key][name][0] if key == "grads" else r[key][name]
            if not sharded or list(g.shape) == list(shape):
                out.setdefault(name, g)
    for name in {n for r in per_rank for n, v in r["grads"].items() if v[2]}:
        _, dim, _, shape = per_rank[0]["grads"][name]
        pieces = {r["shard"]: (r[key][name][0] if key == "grads" else r[key][name])
                  for r in per_rank}
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=dim)
    return out


def _errors(out, ref, key="grads"):
    full_ref, got = assemble([ref]), assemble(out, key)
    assert set(got) == set(full_ref), set(got) ^ set(full_ref)
    errs = {k: rel_err(got[k], full_ref[k]) for k in full_ref}
    return abs(out[0]["loss"] - ref["loss"]) / abs(ref["loss"]), errs


@pytest.fixture(scope="module")
def stock():
    """Single-rank stock megatron-core (local spec, MoE block spec), per (dispatcher, aux)."""
    cache = {}

    def get(aux=0.0, recompute=None):
        key = (aux, recompute)
        if key not in cache:
            cache[key] = run_ranks(moe_one_step, 1, MOE,
                                   _layout(mode="tp", aux=aux, recompute=recompute))[0]
        return cache[key]
    return get


@pytest.mark.parametrize("metp,cp,dispatcher,aux", [
    (2, 1, "allgather", 0.0), (2, 1, "alltoall", 0.01), (4, 1, "alltoall", 0.0),
    (2, 2, "allgather", 0.01), (3, 2, "alltoall", -0.01),
], ids=["metp2-allgather", "metp2-alltoall-aux", "metp4-alltoall", "metp2xcp2-allgather-aux",
        "metp3xcp2-alltoall-seqaux"])
def test_one_step_matches_single_rank_stock(stock, metp, cp, dispatcher, aux):
    out = run_ranks(moe_one_step, metp * cp, MOE, _layout(metp, cp, dispatcher=dispatcher, aux=aux))
    loss_err, errs = _errors(out, stock(aux))
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
