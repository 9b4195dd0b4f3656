"""The METP process group: one explicit object handed to every ring, op and module.

A METP group is a set of ``p`` ranks arranged in a ring. Rank ``r`` (its index inside the group)
sends to ``next_rank`` and receives from ``prev_rank`` (both *global* ranks, as torch.distributed's
point-to-point calls want them). Nothing in this package reads a global group: whoever builds the
model builds a :class:`METPGroup` and passes it down.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from .ring_timeout import (DEFAULT_RING_TIMEOUT_S, job_timeout_s,  # noqa: F401 (re-exported)
                           ring_timeout_from_env, set_job_timeout)


@dataclass
class RingStats:
    """Counters of one group's ring traffic, summed over every exchange issued on it.

    ``steps``: exchanges posted (one exchange = one send to ``next`` + one receive from ``prev``).
    ``bytes_sent`` / ``bytes_received``: payload bytes, counted when the exchange is posted.
    ``kernels``: which attention block kernel ran, and how many ops used it.
    ``blocks``: attention block-kernel launches per kernel name, forward and backward (a block
    skipped as fully masked launches none; a packed-sequence block may launch several pieces).
    """

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    kernels: dict = field(default_factory=dict)  # attention kernel name -> calls
    blocks: dict = field(default_factory=dict)  # attention kernel name -> block launches

    def reset(self) -> None:
        self.steps = self.bytes_sent = self.bytes_received = 0
        self.kernels = {}
        self.blocks = {}

    def snapshot(self) -> dict:
        return {"steps": self.steps, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}


@dataclass
class METPGroup:
    """A METP ring: ``size`` ranks, this process at position ``rank``.

    Attributes:
        group: the torch.distributed process group (``None`` only when ``size == 1``).
        rank: this process's index in the group, ``0 <= rank < size``.
        size: the METP degree ``p``.
        prev_rank / next_rank: global ranks of the ring neighbours.
        ranks: global ranks of the group in ring order.
        timeout_s: seconds a ring step waits for its peer before raising
            :class:`megatron_metp.runtime.ring.RingTimeoutError`.
        name: a label used in error messages (e.g. ``"metp[tp=0,pp=1,dp=0]"``).
        stats: traffic counters, shared by every exchanger on this group.
        kv: a second METP group over the *same ranks in the same ring order* but its own
            process group (hence its own NCCL communicator and stream), which the attention's
            K/V ring uses (:attr:`kv_ring`), so that K/V blocks never queue behind the weight
            broadcasts and gradient reduces of this group; it shares ``stats``. ``None``: the
            K/V ring runs on this group.
        context: under METP × context parallelism, the *sequence ring*: a group of ``p·c``
            ranks (Megatron's CP group) that contains this one, over which the sequence is
            split and the attention's K/V ring runs (:attr:`sequence_ring`); built by
            :func:`megatron_metp.runtime.context.attach_context_group`. ``None`` (``c = 1``):
            the sequence is split over this group, as before.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    prev_rank: int
    next_rank: int
    ranks: tuple
    timeout_s: float = DEFAULT_RING_TIMEOUT_S
    name: str = "metp"
    stats: RingStats = field(default_factory=RingStats)
    kv: Optional["METPGroup"] = field(default=None, repr=False)
    context: Optional["METPGroup"] = field(default=None, repr=False)

    @property
    def sequence_ring(self) -> "METPGroup":
        """The group the sequence is split over and the attention's K/V ring runs on
        (:attr:`context`, else this one)."""
        return self.context if self.context is not None else self

    @property
    def kv_ring(self) -> "METPGroup":
        """The group the K/V ring runs on (:attr:`kv`, else this one)."""
        return self.kv if self.kv is not None else self

    def with_kv_group(self, kv_group: Optional[dist.ProcessGroup]) -> "METPGroup":
        """This group with ``kv_group`` (a process group of the same ranks in the same order)
        for the K/V ring; ``ValueError`` if its ranks differ. Returns ``self``."""
        if kv_group is None or self.size == 1:
            self.kv = None
            return self
        ranks = tuple(dist.get_process_group_ranks(kv_group))
        if ranks != self.ranks:
            raise ValueError(f"METPGroup {self.name!r}: the K/V ring's process group has ranks "
                             f"{list(ranks)}, not the METP ring's {list(self.ranks)} in that order")
        if kv_group is self.group:
            self.kv = None
            return self
        self.kv = METPGroup(kv_group, self.rank, self.size, self.prev_rank, self.next_rank,
                            self.ranks, self.timeout_s, f"{self.name}/kv", self.stats)
        return self

    @classmethod
    def from_process_group(cls, group: Optional[dist.ProcessGroup], *, name: str = "metp",
                           timeout_s: Optional[float] = None,
                           kv_group: Optional[dist.ProcessGroup] = None) -> "METPGroup":
        """Wrap an existing process group (``None`` or a 1-rank group gives ``size == 1``).

        ``kv_group``: optionally a second process group of the same ranks (same order) for the
        attention's K/V ring (:meth:`with_kv_group`)."""
        if timeout_s is None:
            timeout_s = job_timeout_s()  # the one timeout (METP_RING_TIMEOUT_S)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or \
                not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive, finite number of seconds, got "
                             f"{timeout_s!r}")
        if group is None:
            me = dist.get_rank() if dist.is_initialized() else 0
            return cls(None, 0, 1, me, me, (me,), timeout_s, name)
        if not dist.is_initialized():
            raise ValueError("METPGroup.from_process_group: torch.distributed is not initialized; "
                             "call torch.distributed.init_process_group first (or pass group=None "
                             "for a single-rank group)")
        ranks = tuple(dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"METPGroup {name!r}: global rank {me} is not a member of the "
                             f"process group {ranks}")
        r = ranks.index(me)
        p = len(ranks)
        out = cls(group, r, p, ranks[(r - 1) % p], ranks[(r + 1) % p], ranks, timeout_s, name)
        return out.with_kv_group(kv_group)

    @classmethod
    def single(cls, name: str = "metp") -> "METPGroup":
        """The trivial group of one rank: METP ops degrade to the plain computation."""
        return cls.from_process_group(None, name=name)

    @property
    def rank_global(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank]

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def backend(self) -> Optional[str]:
        if self.group is None:
            return None
        return dist.get_backend(self.group)

    def owner_at_step(self, step: int, offset: int = 0) -> int:
        """Index of the shard this rank holds at ``step`` of a forward rotation
        (shards move to ``next``): ``(rank - offset - step) mod size``."""
        return (self.rank - offset - step) % self.size

    def __repr__(self) -> str:  # keep process-group handles out of logs
        return (f"METPGroup(name={self.name!r}, rank={self.rank}, size={self.size}, "
                f"prev={self.prev_rank}, next={self.next_rank})")


def as_metp_group(group) -> METPGroup:
    """Accept a :class:`METPGroup`, a ``ProcessGroup`` or ``None`` (single rank)."""
    if isinstance(group, METPGroup):
        return group
    if group is None or isinstance(group, dist.ProcessGroup):
        return METPGroup.from_process_group(group)
    raise ValueError(f"group must be a METPGroup, a torch.distributed ProcessGroup or None, "
                     f"got {type(group).__name__}")
