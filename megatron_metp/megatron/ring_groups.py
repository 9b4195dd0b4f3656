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

:func:`create_metp_ring_groups` makes them: every rank calls it at the same point, right after
``parallel_state.initialize_model_parallel`` (:func:`.parallel.initialize_model_parallel` does;
under Megatron-LM the first :meth:`.groups.METPGroups.from_parallel_state` call does, on every
rank while the model is built). The result is cached per Megatron expert group, so later calls
return the same groups, and a re-initialised ``parallel_state`` gets new ones.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

__all__ = ["create_metp_ring_groups", "metp_ring_group"]

#: (Megatron's expert-model-parallel group of this rank, the dedicated group of its ranks)
_CACHE: list = []


def create_metp_ring_groups(timeout_s: Optional[float] = None):
    """This rank's dedicated METP-ring process group (``None`` when the METP size is 1).

    Collective over the whole world the first time after each ``initialize_model_parallel``:
    the ranks exchange their expert-model-parallel (= METP) groups and every rank creates one
    process group per METP group, in the same order. ``timeout_s``: the groups' timeout
    (default: the job timeout, :func:`megatron_metp.runtime.watchdog.job_timeout_s`)."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_group()
    if _CACHE and _CACHE[0][0] is ep:
        return _CACHE[0][1]
    if ep is None or dist.get_world_size(ep) == 1:  # the same on every rank: no collective
        _CACHE[:] = [(ep, None)]
        return None
    if timeout_s is None:
        from ..runtime.watchdog import job_timeout_s

        timeout_s = job_timeout_s()
    mine = tuple(dist.get_process_group_ranks(ep))
    everyone = [None] * dist.get_world_size()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # a model built under FakeTensorMode (the dry run): the
        dist.all_gather_object(everyone, mine)  # objects travel as real byte tensors
    own = None
    for ranks in sorted({r for r in everyone if r}):
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
        if ranks == mine:
            own = group
    _CACHE[:] = [(ep, own)]
    return own


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
