"""Tiny-GPT helpers for the Megatron integration tests: one forward/backward, gradients gathered."""

import torch
import torch.distributed as dist

from megatron_metp.megatron.linear import is_metp_sharded
from megatron_metp.megatron.training import (GPTSize, Layout, _global_name, build_model, full_shape,
                                             global_batch, init_parallel, load_initial_weights)

SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=12, num_query_groups=12,
               ffn_hidden_size=48, vocab_size=72, seq_length=24)


def one_step_grads(rank, world, size: GPTSize, layout: Layout):
    """Loss and full-weight gradients of one forward/backward of the raw GPTModel (no DDP).

    Replicated parameters' gradients are summed over the METP group (what DDP does over DP×CP);
    METP-sharded ones are complete already (under METP × CP, ``layout.cp > 1``: summed over the
    ``c`` METP groups of the CP group, what DDP does over Megatron's expert data-parallel group). Every rank returns its shards with their global names.
    """
    from megatron.core import parallel_state as ps
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank

    from megatron_metp.megatron import cpu

    cpu.enable()
    groups = init_parallel(layout, size.seq_length)
    model = build_model(size, layout, groups)
    load_initial_weights(model, groups, size)
    tokens, labels = global_batch(size, 0, 2)
    batch = {"tokens": tokens, "labels": labels,
             "position_ids": torch.arange(size.seq_length).expand(2, -1).contiguous()}
    if layout.metp * layout.cp > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = per_token.sum() / tokens.numel()
    loss.backward()
    total = loss.detach().clone()
    if layout.metp * layout.cp > 1:
        dist.all_reduce(total, group=ps.get_context_parallel_group())
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if layout.metp * layout.cp > 1 and not is_metp_sharded(p):
            dist.all_reduce(g, group=ps.get_context_parallel_group())
        elif layout.cp > 1 and is_metp_sharded(p):
            dist.all_reduce(g, group=groups.dp)
        grads[_global_name(model, name)] = (g, getattr(p, "tensor_model_parallel", False),
                                            getattr(p, "partition_dim", 0), is_metp_sharded(p),
                                            full_shape(p, groups))
    return {"loss": total.item(), "grads": grads, "shard": groups.shard_index,
            "tp_rank": groups.tp_rank}


def assemble(per_rank, size: GPTSize):
    """Full gradients from every rank's shards (ranks given in shard order per parameter)."""
    out = {}
    for name in per_rank[0]["grads"]:
        g0, tmp, dim, metp_sharded, shape = per_rank[0]["grads"][name]
        if list(g0.shape) == list(shape):
            out[name] = g0
            continue
        key = "shard" if metp_sharded else "tp_rank"
        pieces = {}
        for r in per_rank:
            pieces[r[key]] = r["grads"][name][0]
        parts = [pieces[i] for i in sorted(pieces)]
        if size.swiglu and "linear_fc1" in name:
            halves = [p.chunk(2, dim=dim) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out
