"""Expert parallelism wider than the METP group: ``EP = p·e`` (``--expert-model-parallel-size``).

Megatron's expert-model-parallel group has ``p·e`` ranks: ``e`` whole METP groups, adjacent in
Megatron's rank order (over METP × CP when ``e`` divides the outer CP factor ``c``, else over
METP × CP × DP). Megatron's ``MoELayer`` holds ``E/(p·e)`` experts per rank and dispatches over
that group; its expert data-parallel group has ``c·DP/e`` ranks. Three gradient classes then
reduce over three groups:

=====================  =========================  ======================================
parameters             reduced over               in Megatron's DDP
=====================  =========================  ======================================
replicated (norms,     DP × METP × CP             dense buffers (``allreduce = True``)
router, gates)
METP-sharded           METP-DP: the ``c·DP``      expert buffers (``allreduce = False``),
                       ranks holding the shard    summed over the replica group first
experts                expert-DP (``c·DP/e``)     expert buffers, stock
=====================  =========================  ======================================

METP-DP is the product of the *replica group* — the ``e`` ranks of this rank's EP group with
the same METP rank, which hold the same METP shards — and Megatron's expert-DP group (both made
by :func:`.ring_groups.wide_ep_groups`, held by :class:`.groups.METPGroups`). So the
METP-sharded weights stay in Megatron's expert buffers, and :func:`sum_metp_shards_over_replicas`
makes each expert bucket group, right before it reduces over expert-DP (``start_grad_sync``: at
the end of the backward, or overlapped with it), sum the ``main_grad`` of its METP-sharded
parameters over the replica group: ``g ← Σ_replicas g``, then DDP's ``Σ_expert-DP``, i.e.
``Σ_METP-DP`` for those and ``Σ_expert-DP`` for the experts. DDP's scaling (``1/|DP×CP|`` before
a sum, or ``|expert-DP|/|DP×CP|`` before an average) is linear and commutes with the first sum.

Distributed optimizer: Megatron shards the expert buffers over expert-DP; the ``e`` replicas of a
METP shard hold equal gradients, equal optimizer states and make equal updates (the state of
METP-sharded weights is divided by ``c·DP/e`` ranks, not ``c·DP``). Grad norm and zero count:
Megatron sums the expert optimizer's over EP × PP (the world with the distributed optimizer), where
a METP shard would count ``e`` times; every replica but the first marks its METP-sharded
parameters ``shared`` (Megatron's mark of a parameter counted elsewhere, copied to the
distributed optimizer's main shards), so each counts once.

Checkpoints: METP-sharded weights keep their replica ids over METP-DP (:attr:`METPGroups.dp` is
the METP-DP group here); experts are Megatron's own (stock's expert layout).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["sum_metp_shards_over_replicas"]


def sum_metp_shards_over_replicas(ddp, replicas: Optional[dist.ProcessGroup]) -> int:
    """Make Megatron's ``DistributedDataParallel`` ``ddp`` sum the gradients of its METP-sharded
    parameters over ``replicas`` (the replica group of :func:`.ring_groups.wide_ep_groups`)
    before each expert bucket group reduces over expert-DP, and mark them ``shared`` on every
    replica but the first (the grad norm counts each once). Call it before the optimizer is
    built. Returns how many parameters it covers (0 when ``replicas`` is ``None``: EP = p).
    Either grad-sync mode: ``start_grad_sync`` starts a bucket group's reduce at the end of the
    backward (``overlap_grad_reduce`` off) or when its last gradient is ready (on)."""
    from .linear import is_metp_sharded

    if replicas is None:
        return 0
    first = dist.get_rank(replicas) == 0
    covered = 0
    for bucket_group in ddp.expert_parallel_bucket_groups:
        # in buffer order (a bucket's params are a set: its order differs between ranks)
        params = sorted((p for b in bucket_group.buckets for p in b.params if is_metp_sharded(p)),
                        key=lambda p: p.main_grad.data_ptr())
        if not params:
            continue
        covered += len(params)
        if not first:
            for p in params:
                p.shared = True
        bucket_group.start_grad_sync = _summing_first(bucket_group.start_grad_sync, params,
                                                      replicas)
    return covered


def _summing_first(start_grad_sync, params, group):
    """``start_grad_sync`` of a bucket group, preceded by one all-reduce (sum) over ``group`` of
    the ``main_grad`` of ``params`` (flattened together)."""

    def start(*args, **kwargs):
        grads = [p.main_grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return start_grad_sync(*args, **kwargs)

    return start
