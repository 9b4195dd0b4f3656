"""The METP process group: one explicit object handed to every ring, op and module.

A METP group is a set of ``p`` ranks arranged in a ring. Rank ``r`` (its index inside the group)
sends to ``next_rank`` and receives from ``prev_rank`` (both *global* ranks, as torch.distributed's
point-to-point calls want them). Nothing in this package reads a global group: whoever builds the
model builds a :class:`METPGroup` and passes it down.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

#: Default time a ring step may wait for its peer before the op fails with a message.
#: Overridable per group or with the ``METP_RING_TIMEOUT_S`` environment variable (seconds).
DEFAULT_RING_TIMEOUT_S = 600.0


def ring_timeout_from_env() -> float:
    """``METP_RING_TIMEOUT_S`` (seconds; default :data:`DEFAULT_RING_TIMEOUT_S`): a positive,
    finite number, else ``ValueError`` naming the variable."""
    raw = os.environ.get("METP_RING_TIMEOUT_S", "").strip()
    if not raw:
        return float(DEFAULT_RING_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"METP_RING_TIMEOUT_S={raw!r}: must be a positive, finite number of "
                         f"seconds (e.g. 600); unset it for the default "
                         f"{DEFAULT_RING_TIMEOUT_S:g}")
    return value


@dataclass
class RingStats:
    """Counters of one group's ring traffic, summed over every exchange issued on it.

    ``steps``: exchanges posted (one exchange = one send to ``next`` + one receive from ``prev``).
    ``bytes_sent`` / ``bytes_received``: payload bytes, counted when the exchange is posted.
    ``kernels``: which attention block kernel ran, and how many ops used it.
    """

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    kernels: dict = field(default_factory=dict)  # attention kernel name -> calls

    def reset(self) -> None:
        self.steps = self.bytes_sent = self.bytes_received = 0
        self.kernels = {}

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
            :class:`megatron_metp.ring.RingTimeoutError`.
        name: a label used in error messages (e.g. ``"metp[tp=0,pp=1,dp=0]"``).
        stats: traffic counters, shared by every exchanger on this group.
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

    @classmethod
    def from_process_group(cls, group: Optional[dist.ProcessGroup], *, name: str = "metp",
                           timeout_s: Optional[float] = None) -> "METPGroup":
        """Wrap an existing process group (``None`` or a 1-rank group gives ``size == 1``)."""
        if timeout_s is None:
            timeout_s = ring_timeout_from_env()
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
        return cls(group, r, p, ranks[(r - 1) % p], ranks[(r + 1) % p], ranks, timeout_s, name)

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
