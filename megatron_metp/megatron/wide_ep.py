"""Expert parallelism wider than the METP group: ``EP = p·e`` (``--expert-model-parallel-size``).

Megatron's expert-model-parallel group has ``p·e`` ranks: ``e`` whole METP groups, adjacent in
Megatron's rank order (over METP × CP when ``e`` divides the outer CP factor ``c``, else over
METP × CP × DP). Megatron's ``MoELayer`` holds ``E/(p·e)`` experts per rank and dispatches over that
group; its expert data-parallel group has ``c·DP/e`` ranks. Three gradient classes then reduce
over three groups:

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
the same METP rank, which hold the same METP shards — and Megatron's expert-DP group. So the
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

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["wide_ep_groups", "sum_metp_shards_over_replicas"]


def _ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group))


def _strided(ranks: tuple, start: int, step: int) -> tuple:
    return tuple(ranks[k] for k in range(start, len(ranks), step))


def _block(ranks: tuple, me: int, p: int) -> tuple:
    i = ranks.index(me) // p
    return tuple(ranks[i * p:(i + 1) * p])


def wide_ep_groups(ps, metp_ranks: tuple, timeout_s: Optional[float] = None
                   ) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """``(METP-DP group, replica group)`` of this rank when Megatron's expert-model-parallel
    group (of initialised ``parallel_state`` ``ps``) is wider than the METP group ``metp_ranks``
    (global ranks, ring order); ``None`` for a group of one rank; ``(None, None)`` when EP is
    not wider than p (EP = p folded, or no expert groups).

    Both are made by their own ranks (:func:`.ring_groups.local_group`). ``ValueError`` when
    Megatron's groups do not nest as the layout needs (an EP group not made of whole METP
    groups, or METP-DP not the product of the replica and expert-DP groups: a non-default
    ``order``)."""
    from .ring_groups import local_group

    p, me = len(metp_ranks), dist.get_rank()
    try:
        ep = ps.get_expert_model_parallel_group(check_initialized=False)
    except TypeError:  # older signature
        ep = ps.get_expert_model_parallel_group()
    if ep is None or dist.get_world_size(ep) <= p:
        return None, None
    ep = _ranks(ep)
    fix = ("use Megatron's default rank order (tp-cp-ep-dp-pp) and "
           "--expert-model-parallel-size a multiple of --metp-parallel-size")
    if len(ep) % p or _block(ep, me, p) != tuple(metp_ranks):
        raise ValueError(f"expert-model-parallel group {list(ep)} is not made of whole METP "
                         f"groups (this rank's: {list(metp_ranks)}); {fix}")
    replicas = _strided(ep, ep.index(me) % p, p)
    dp_cp = _ranks(ps.get_data_parallel_group(with_context_parallel=True))
    if _block(dp_cp, me, p) != tuple(metp_ranks):
        raise ValueError(f"data-parallel × context-parallel group {list(dp_cp)} is not made of "
                         f"whole METP groups; {fix}")
    metp_dp = _strided(dp_cp, dp_cp.index(me) % p, p)
    edp = _ranks(ps.get_expert_data_parallel_group())
    if not (set(replicas) <= set(metp_dp) and set(edp) <= set(metp_dp)
            and len(replicas) * len(edp) == len(metp_dp)):
        raise ValueError(f"METP-DP {list(metp_dp)} is not the product of the replica group "
                         f"{list(replicas)} and Megatron's expert data-parallel group "
                         f"{list(edp)}; {fix}")
    return local_group(metp_dp, timeout_s), local_group(replicas, timeout_s)


def sum_metp_shards_over_replicas(ddp, replicas: Optional[dist.ProcessGroup]) -> int:
    """Make Megatron's ``DistributedDataParallel`` ``ddp`` sum the gradients of its METP-sharded
    parameters over ``replicas`` (the replica group of :func:`wide_ep_groups`) before each expert
    bucket group reduces over expert-DP, and mark them ``shared`` on every replica but the first
    (the grad norm counts each once). Call it before the optimizer is built. Returns how many
    parameters it covers (0 when ``replicas`` is ``None``: EP = p, nothing to do)."""
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
