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
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

__all__ = ["create_metp_ring_groups", "metp_ring_group"]

#: ranks of a METP group (global, ring order) -> (the default group then, its dedicated group)
_GROUPS: dict = {}


def create_metp_ring_groups(timeout_s: Optional[float] = None):
    """This rank's dedicated METP-ring process group: one over the ranks of Megatron's
    expert-model-parallel group of this rank (= the METP group), ``None`` when that has one rank.

    Every rank of the group calls it (a group-local creation); ``timeout_s``: the group's
    timeout (default: the job timeout, :func:`megatron_metp.runtime.watchdog.job_timeout_s`),
    set when the group is first created."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_group()
    if ep is None or dist.get_world_size(ep) == 1:
        return None
    ranks = tuple(dist.get_process_group_ranks(ep))
    world, group = _GROUPS.get(ranks, (None, None))
    if world is not dist.group.WORLD:  # first call, or a new default group since
        if timeout_s is None:
            from ..runtime.watchdog import job_timeout_s

            timeout_s = job_timeout_s()
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
        _GROUPS[ranks] = (dist.group.WORLD, group)
    return group


def metp_ring_group(ranks: tuple, timeout_s: Optional[float] = None):
    """The dedicated process group of the METP group ``ranks`` (global ranks in ring order, as
    Megatron's expert-model-parallel group of this rank lists them); ``ValueError`` when they
    are not this rank's expert-model-parallel group."""
    group = create_metp_ring_groups(timeout_s)
    if group is None or tuple(dist.get_process_group_ranks(group)) != tuple(ranks):
        raise ValueError(f"no dedicated METP ring group for ranks {list(ranks)}: Megatron's "
                         f"expert-model-parallel group of this rank is not the METP group "
                         f"(initialise with megatron_metp.megatron.parallel."
                         f"initialize_model_parallel, which folds it)")
    return group
