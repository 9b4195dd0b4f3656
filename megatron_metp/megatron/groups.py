"""The process groups a METP layer needs, passed to every module explicitly.

``METPGroups`` bundles the tensor-parallel group, the METP ring (Megatron's context-parallel group:
METP shards the sequence exactly like CP) and the pure data-parallel group over which METP-sharded
weights reduce their gradients.

METP × CP (``context_parallel_size = c > 1``, the *outer* factor): Megatron's CP group has
``p·c`` ranks and its expert-model-parallel group (folded to ``p``) has the METP group's ranks,
the ``p`` adjacent ranks of the CP group; the CP group is the METP group's sequence ring
(:func:`megatron_metp.runtime.context.attach_context_group`), and METP-sharded weights reduce
over Megatron's expert data-parallel group (the ``c`` METP groups of the CP group × DP). It is
built once, next to Megatron's own groups, and handed to
:func:`megatron_metp.megatron.spec.get_gpt_layer_metp_spec`.

The METP rings never talk on Megatron's expert-model-parallel communicator (MoE's token
dispatchers do, :mod:`.moe`): each METP group has a dedicated process group of its ranks
(:mod:`.ring_groups`), the K/V ring's under METP alone, the METP ring's under METP × CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..runtime.groups import METPGroup


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class METPGroups:
    """``tp``: Megatron's TP group; ``metp``: the METP ring (with ``metp.context``, the CP group
    of ``p·c`` ranks, under METP × CP); ``dp``: the group over which METP-sharded weights are
    replicated (pure data parallel; × the ``c`` outer CP replicas under METP × CP: Megatron's
    expert data-parallel group when EP = p, the METP-DP group of :mod:`.wide_ep` when EP is
    wider); ``ep_replicas``: with EP = p·e wider than the METP group, the ``e`` ranks of this
    rank's expert-model-parallel group that hold the same METP shards (their gradients are summed
    over it before Megatron's DDP reduces them over expert-DP, :mod:`.wide_ep`); ``None`` when
    EP = p."""

    tp: Optional[dist.ProcessGroup]
    metp: METPGroup
    dp: Optional[dist.ProcessGroup] = None
    ep_replicas: Optional[dist.ProcessGroup] = None

    @property
    def tp_size(self) -> int:
        return _size(self.tp)

    @property
    def tp_rank(self) -> int:
        return _rank(self.tp)

    @property
    def shards(self) -> int:
        """Shards per weight: ``TP × METP``."""
        return self.tp_size * self.metp.size

    @property
    def shard_index(self) -> int:
        """This rank's shard of a weight split over ``TP × METP``, TP-major:
        ``tp_rank · p + metp_rank`` — the index stock TP of size ``t·p`` gives the same rows."""
        return self.tp_rank * self.metp.size + self.metp.rank

    @classmethod
    def from_parallel_state(cls, timeout_s: Optional[float] = None,
                            context_parallel_size: int = 1) -> "METPGroups":
        """Groups of an initialised ``megatron.core.parallel_state`` (METP = its CP group, the
        K/V ring on the dedicated group of its ranks; with ``context_parallel_size`` ``c > 1``,
        METP = the dedicated group of its expert-model-parallel group's ranks inside the CP group
        of ``p·c`` ranks, which becomes the METP group's sequence ring). The first call after
        ``initialize_model_parallel`` creates the dedicated groups (:mod:`.ring_groups`): call it
        on every rank."""
        from megatron.core import parallel_state as ps

        if context_parallel_size > 1:
            return cls._with_context(ps, timeout_s, context_parallel_size)
        cp = ps.get_context_parallel_group()
        metp = METPGroup.from_process_group(cp if dist.get_world_size(cp) > 1 else None,
                                            name=_name(ps), timeout_s=timeout_s)
        metp.with_kv_group(kv_ring_group(ps, metp, timeout_s))
        return cls(tp=ps.get_tensor_model_parallel_group(), metp=metp,
                   dp=ps.get_data_parallel_group(with_context_parallel=False))._wide_ep(
                       ps, timeout_s)

    def _wide_ep(self, ps, timeout_s) -> "METPGroups":
        """These groups with :attr:`dp` the METP-DP group and :attr:`ep_replicas` when
        Megatron's expert-model-parallel group is wider than the METP group (:mod:`.wide_ep`,
        :func:`.ring_groups.wide_ep_groups`); unchanged otherwise."""
        if self.metp.size == 1:
            return self
        from .ring_groups import wide_ep_groups

        metp_dp, replicas = wide_ep_groups(ps, self.metp.ranks, timeout_s)
        if replicas is not None:
            self.dp, self.ep_replicas = metp_dp, replicas
        return self

    @classmethod
    def _with_context(cls, ps, timeout_s, c: int) -> "METPGroups":
        from ..runtime.context import attach_context_group

        cp = ps.get_context_parallel_group()
        pc = dist.get_world_size(cp)
        if pc % c:
            raise ValueError(f"Megatron's context-parallel group has {pc} ranks, not a multiple "
                             f"of --context-parallel-size {c} (METP × CP needs CP = METP × c)")
        p = pc // c
        if p > 1:
            ep = ps.get_expert_model_parallel_group()
            if dist.get_world_size(ep) % p:
                raise ValueError(f"METP × CP: Megatron's expert-model-parallel group has "
                                 f"{dist.get_world_size(ep)} ranks, not a multiple of the METP "
                                 f"size {p}; initialise with expert_model_parallel_size = METP "
                                 f"or a multiple of it "
                                 f"(megatron_metp.megatron.parallel.initialize_model_parallel)")
            from .ring_groups import metp_group_ranks, metp_ring_group

            # the METP ring's own communicator, not Megatron's expert group (MoE dispatches there)
            ring = metp_ring_group(metp_group_ranks(p), timeout_s)
        else:
            ring = None
        metp = METPGroup.from_process_group(ring, name=_name(ps), timeout_s=timeout_s)
        attach_context_group(metp, cp, name=f"{_name(ps)}/cp")
        dp = ps.get_expert_data_parallel_group() if p > 1 else \
            ps.get_data_parallel_group(with_context_parallel=True)
        return cls(tp=ps.get_tensor_model_parallel_group(), metp=metp, dp=dp)._wide_ep(
            ps, timeout_s)


def kv_ring_group(ps, metp: METPGroup, timeout_s: Optional[float] = None):
    """The process group of the K/V ring of METP alone (``c = 1``): the METP ring's own
    dedicated group (:mod:`.ring_groups`: same ranks in ring order, its own communicator, hence
    stream — K/V blocks never queue behind the weight broadcasts and gradient reduces of the METP
    group, nor behind the MoE token dispatchers on Megatron's expert-model-parallel group), or
    ``None`` (the K/V ring shares the METP group) when Megatron's expert groups are not folded
    onto the METP groups (a ``parallel_state`` initialised without
    :func:`megatron_metp.megatron.parallel.initialize_model_parallel`)."""
    if metp.size == 1:
        return None
    try:
        ep = ps.get_expert_model_parallel_group(check_initialized=False)
    except TypeError:  # older signature
        ep = ps.get_expert_model_parallel_group()
    if ep is None:
        return None
    try:
        ranks = tuple(dist.get_process_group_ranks(ep))
    except Exception:  # noqa: BLE001 - not a usable group on this rank
        return None
    wide = len(ranks) > metp.size and not len(ranks) % metp.size and \
        set(metp.ranks) <= set(ranks)  # EP = p·e wider than the METP group (:mod:`.wide_ep`)
    if ranks != metp.ranks and not wide:
        return None
    ranks = metp.ranks
    from .ring_groups import metp_ring_group

    return metp_ring_group(ranks, timeout_s)


def _name(ps) -> str:
    return (f"metp[tp={ps.get_tensor_model_parallel_rank()},"
            f"pp={ps.get_pipeline_model_parallel_rank()},"
            f"dp={ps.get_data_parallel_rank()}]")
