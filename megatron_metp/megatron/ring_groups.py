"""The METP ring's own process groups, created once next to Megatron's.

Megatron's expert-model-parallel groups are folded onto the METP groups (:mod:`.parallel`), and
with MoE (:mod:`.moe`) Megatron's token dispatchers talk on them. The METP rings must not share
those communicators: each communicator has one stream and one order of operations, and a ring
whose messages queue behind (or interleave with) the dispatcher's all-to-alls would serialise or,
with NCCL streams running concurrently, deadlock. So every METP group gets one more process group
over its ``p`` ranks, in ring order:

* METP alone (``c = 1``): the METP ring is Megatron's context-parallel group, and the attention's
  K/V ring runs on the dedicated group (:attr:`~megatron_metp.runtime.groups.METPGroup.kv`);
* METP × CP (``c > 1``): the METP ring (weight ring, head-group broadcasts, gradient reduces)
  runs on the dedicated group, and the K/V ring on Megatron's CP group of ``p·c`` ranks.

:func:`create_metp_ring_groups` makes this rank's: the ranks of a METP group create it together
(``use_local_synchronization``: no other rank takes part, no collective over the world), right
after ``parallel_state.initialize_model_parallel`` (:func:`.parallel.initialize_model_parallel`
does; under Megatron-LM the first :meth:`.groups.METPGroups.from_parallel_state` call does, while
the model is built). A group is kept per set of ranks for the life of the process: a re-initialised
``parallel_state`` with the same METP groups gets the same communicators back (a new default
process group, new ones).

EP wider than the METP group (:mod:`.wide_ep`): :func:`wide_ep_groups` makes the METP-DP group
(the ranks holding this rank's METP shards) and the replica group (those of them in this rank's
expert-model-parallel group) the same way.
"""

from __future__ import annotations

import datetime
from typing import Optional, Tuple

import torch.distributed as dist

__all__ = ["create_metp_ring_groups", "metp_ring_group", "metp_group_ranks", "local_group",
           "wide_ep_groups"]

#: ranks of a group (global, in order) -> (the default group then, its process group)
_GROUPS: dict = {}


def local_group(ranks: tuple, timeout_s: Optional[float] = None):
    """A process group over ``ranks`` (global, in order) made by those ranks only
    (``use_local_synchronization``), kept per set of ranks for the life of the process (a new
    default process group: a new one); ``None`` for one rank. ``timeout_s``: the group's timeout
    (default: the job timeout, :func:`megatron_metp.runtime.watchdog.job_timeout_s`)."""
    ranks = tuple(ranks)
    if len(ranks) == 1:
        return None
    world, group = _GROUPS.get(ranks, (None, None))
    if world is not dist.group.WORLD:  # first call, or a new default group since
        if timeout_s is None:
            from ..runtime.watchdog import job_timeout_s

            timeout_s = job_timeout_s()
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
        _GROUPS[ranks] = (dist.group.WORLD, group)
    return group


def metp_group_ranks(p: Optional[int] = None) -> tuple:
    """Global ranks of this rank's METP group, in ring order: Megatron's expert-model-parallel
    group when it has ``p`` ranks (EP = p, folded onto the METP groups; also when ``p`` is
    ``None``), else (EP = p·e wider than the METP group, :mod:`.wide_ep`) the block of ``p``
    adjacent ranks of this rank's context-parallel group (``p·c`` ranks) that holds it."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_group()
    if ep is not None and (p is None or dist.get_world_size(ep) == p):
        return tuple(dist.get_process_group_ranks(ep))
    if p is None or p == 1:
        return (dist.get_rank(),)
    cp = dist.get_process_group_ranks(ps.get_context_parallel_group())
    if len(cp) % p:
        raise ValueError(f"Megatron's context-parallel group has {len(cp)} ranks, not a multiple "
                         f"of --metp-parallel-size {p}")
    block = cp.index(dist.get_rank()) // p
    return tuple(cp[block * p:(block + 1) * p])


def create_metp_ring_groups(timeout_s: Optional[float] = None, p: Optional[int] = None):
    """This rank's dedicated METP-ring process group: one over the ranks of its METP group
    (:func:`metp_group_ranks`), ``None`` when that has one rank.

    Every rank of the group calls it (a group-local creation); ``timeout_s``: the group's
    timeout (default: the job timeout), set when the group is first created."""
    return local_group(metp_group_ranks(p), timeout_s)


def metp_ring_group(ranks: tuple, timeout_s: Optional[float] = None):
    """The dedicated process group of the METP group ``ranks`` (global ranks in ring order, as
    :func:`metp_group_ranks` lists this rank's); ``ValueError`` when they are not this rank's
    METP group."""
    group = create_metp_ring_groups(timeout_s, p=len(ranks))
    if group is None or tuple(dist.get_process_group_ranks(group)) != tuple(ranks):
        raise ValueError(f"no dedicated METP ring group for ranks {list(ranks)}: Megatron's "
                         f"expert-model-parallel group of this rank is not the METP group "
                         f"(initialise with megatron_metp.megatron.parallel."
                         f"initialize_model_parallel, which folds it)")
    return group


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
