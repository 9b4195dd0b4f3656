"""METP × context parallelism: the sequence ring of ``p·c`` ranks next to the METP group of ``p``.

Layout (DESIGN.md §7). Megatron's context-parallel (CP) group has ``p·c`` ranks; the METP group
is ``p`` of them (under Megatron's default rank order the ``p`` adjacent ranks that its expert
group folds onto the METP group). Per rank ``R`` of the CP group (``0 <= R < p·c``):

* the sequence is split over all ``p·c`` ranks (``layout`` as for METP alone, with ``p·c`` in
  place of ``p``: dual-chunk over ``2·p·c`` chunks, rank ``R`` holding chunks ``R`` and
  ``2pc−1−R``), so each rank holds ``s/(p·c)`` tokens;
* every weight stays sharded over the METP group only (rank ``r`` of it holds shard ``r``, the
  same shard in each of the ``c`` METP groups of the CP group); the weight ring and the
  head-group broadcasts stay inside the METP group;
* the attention's K/V ring of each head group runs over the ``p·c`` ranks of the CP group: every
  METP group runs the same head-group schedule, so at outer step ``g`` every rank of the CP group
  computes K/V of head group ``g`` for its own tokens, and the blocks passed are all of group ``g``.

Gradients: the METP ops return weight-shard gradients complete over the ``s/c`` tokens of *their*
METP group; the caller sums them over the ``c`` METP groups of the CP group (and DP), which is
Megatron's expert-DP reduction once the expert groups are folded onto the METP groups.

Build it with :func:`attach_context_group` (explicit process groups, no global state)::

    metp = METPGroup.from_process_group(metp_pg)            # p ranks
    attach_context_group(metp, cp_pg)                       # p·c ranks containing them
    y = metp_attention(x, wqkv, wo, group=metp, ...)        # x: [s/(p·c), b, h]
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .groups import METPGroup


def attach_context_group(metp: METPGroup, cp_group: Optional[dist.ProcessGroup], *,
                         kv_group: Optional[dist.ProcessGroup] = None,
                         name: Optional[str] = None) -> METPGroup:
    """Give ``metp`` its sequence ring: ``cp_group`` (a process group of ``p·c`` ranks that
    contains every rank of ``metp``, ``c >= 1``) becomes :attr:`METPGroup.context`; the CP rank
    order is the order of the sequence chunks and of the K/V ring. ``kv_group``: optionally a
    second process group of the same ranks in the same order for the K/V ring (its own
    communicator, as :meth:`METPGroup.with_kv_group`). The context group shares ``metp.stats``
    and its timeout. ``cp_group=None``, or a CP group equal to the METP group (``c = 1``), clears
    it. Returns ``metp``.

    ``ValueError`` (before any communication) when the CP group's size is not a multiple of
    ``p`` or it lacks a rank of the METP group."""
    if cp_group is None:
        metp.context = None
        return metp
    if not dist.is_initialized():
        raise ValueError("attach_context_group: torch.distributed is not initialized")
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    p, pc = metp.size, len(ranks)
    label = name or f"{metp.name}/cp"
    if pc % p:
        raise ValueError(f"context group {label!r} has {pc} ranks, not a multiple of the METP "
                         f"group size {p}: --context-parallel-size is the outer factor c, the "
                         f"CP group Megatron builds has p·c ranks")
    missing = [g for g in metp.ranks if g not in ranks]
    if missing:
        raise ValueError(f"context group {label!r} (global ranks {list(ranks)}) does not contain "
                         f"the METP group {metp.name!r}'s ranks {missing}: the METP group must "
                         f"be p ranks of the CP group (fold the expert groups onto METP inside "
                         f"the CP group)")
    if pc == p and ranks == metp.ranks:
        metp.context = None
        return metp
    me = dist.get_rank()
    R = ranks.index(me)
    ctx = METPGroup(cp_group, R, pc, ranks[(R - 1) % pc], ranks[(R + 1) % pc], ranks,
                    metp.timeout_s, label, metp.stats)
    ctx.with_kv_group(kv_group)
    metp.context = ctx
    return metp


def context_size(metp: METPGroup) -> int:
    """``c``: how many METP groups share the sequence ring (1 without a context group)."""
    return metp.sequence_ring.size // metp.size
