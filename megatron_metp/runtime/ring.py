"""Ring exchange: double-buffered neighbour send/recv inside one METP group.

Every METP schedule is a rotation: at each step a rank sends the buffer it holds to ``next`` and
receives the buffer of ``prev``, while it computes on what it holds. :class:`RingExchanger` posts
one such exchange (a ``batch_isend_irecv`` of one send and one receive); :meth:`RingExchanger.circulate`
turns it into a double-buffered loop that posts step ``t+1``'s transfer *before* handing out step
``t``'s buffer for compute, and waits only when the next buffer is needed.

Streams: on CUDA, ProcessGroupNCCL runs point-to-point work on its own internal stream, ordered
after the current stream when the transfer is posted; ``Work.wait()`` makes the current stream wait
for it, without blocking the host (no ``cuda.synchronize`` anywhere). The receive buffer is handed to
compute only after that wait, so stream ordering is correct. On gloo (CPU) the wait blocks the host
with the group's ``timeout_s``; on NCCL the process group's own timeout and watchdog apply.

Failure: a peer that does not answer within ``timeout_s`` (gloo) or whose connection breaks ends in
:class:`RingTimeoutError`/:class:`RingPeerError` naming the group, the step and the peer.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from .bounded_wait import (RingError, RingPeerError, RingTimeoutError, group_text,
                           transport_failure, wait_bounded)
from .groups import METPGroup
from .loop_sample import weight

__all__ = ["PendingExchange", "RingError", "RingExchanger", "RingPeerError", "RingTimeoutError",
           "TravellingSum"]


class PendingExchange:
    """A posted ring step. :meth:`wait` returns the receive buffer once it is valid."""

    def __init__(self, works, recv: torch.Tensor, group: METPGroup, step: int, what: str,
                 peer: Optional[int] = None):
        self._peer = group.prev_rank if peer is None else peer
        self._works = works
        self.recv = recv
        self._group = group
        self._step = step
        self._what = what
        self._done = False

    def wait(self) -> torch.Tensor:
        if self._done:
            return self.recv
        g = self._group
        peer = self._peer if isinstance(self._peer, str) else f"peer {self._peer}"
        wait_bounded(self._works, g, cuda=self.recv.is_cuda, message=lambda first: (
            f"METP ring {g.name!r} {group_text(g)}: step {self._step} of {self._what!r} failed "
            f"waiting for {peer} (ring {g.prev_rank} -> {g.rank_global} -> {g.next_rank}, "
            f"timeout {g.timeout_s:g} s): {first}. A peer rank died or stalled; check its log. "
            f"Raise METP_RING_TIMEOUT_S if the step is legitimately slow."))
        self._done = True
        return self.recv


class RingExchanger:
    """Posts neighbour exchanges on one :class:`METPGroup` and counts them in ``group.stats``."""

    def __init__(self, group: METPGroup, what: str = "shard"):
        self.group = group
        self.what = what

    def start(self, send: torch.Tensor, recv: torch.Tensor, *, step: int) -> PendingExchange:
        """Send ``send`` to ``next`` and receive ``prev``'s buffer into ``recv`` (same size).

        Returns at once; ``send`` must not be modified and ``recv`` not read until ``wait()``.
        """
        return self.exchange([send], [recv], step=step)

    def exchange(self, sends, recvs, *, step: int) -> PendingExchange:
        """One ring step moving several buffers at once: ``sends[i]`` to ``next`` and ``prev``'s
        ``i``-th buffer into ``recvs[i]`` (equal sizes and dtypes pairwise), posted as *one*
        ``batch_isend_irecv`` (one NCCL group call). ``wait()`` returns ``recvs[0]`` once every
        buffer is valid. Counted as one exchange in ``group.stats.steps``."""
        g = self.group
        if g.size == 1:
            raise RingError(f"METP ring {g.name!r} has size 1: there is nothing to exchange")
        if not sends or len(sends) != len(recvs):
            raise ValueError(f"ring exchange needs as many send as receive buffers (at least "
                             f"one), got {len(sends)} and {len(recvs)}")
        ops = []
        nbytes = 0
        for send, recv in zip(sends, recvs):
            if send.numel() != recv.numel() or send.dtype != recv.dtype:
                raise ValueError(f"ring exchange needs equal send/recv buffers, got "
                                 f"{tuple(send.shape)} {send.dtype} and {tuple(recv.shape)} "
                                 f"{recv.dtype}")
            ops.append(dist.P2POp(dist.isend, send, g.next_rank, g.group))
            ops.append(dist.P2POp(dist.irecv, recv, g.prev_rank, g.group))
            nbytes += send.numel() * send.element_size()
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001
            if not transport_failure(exc):
                raise  # this rank's own error surfacing here (bounded_wait): not the peer's
            raise RingPeerError(f"METP ring {g.name!r}: posting step {step} of {self.what!r} to "
                                f"peer {g.next_rank}/from peer {g.prev_rank} failed: {exc}") from exc
        g.stats.steps += weight()
        g.stats.bytes_sent += nbytes * weight()
        g.stats.bytes_received += nbytes * weight()
        return PendingExchange(works, recvs[0], g, step, self.what)

    def broadcast(self, tensor: torch.Tensor, src: int, *, step: int) -> PendingExchange:
        """Async broadcast of ``tensor`` from group member ``src`` (index in the group).

        Used where every rank needs the *same* shard at the same step (METP attention's head-group
        weights). Counted as ``tensor`` bytes received by each non-source rank.
        """
        g = self.group
        work = dist.broadcast(tensor, src=g.ranks[src], group=g.group, async_op=True)
        if g.rank != src:
            g.stats.steps += weight()
            g.stats.bytes_received += tensor.numel() * tensor.element_size() * weight()
        others = [r for r in g.ranks if r != g.ranks[src]]
        peer = g.ranks[src] if g.rank != src else f"the receiving peers {others}"
        return PendingExchange([work], tensor, g, step, self.what, peer=peer)

    def reduce(self, tensor: torch.Tensor, dst: int, *, step: int) -> PendingExchange:
        """Async sum of ``tensor`` over the group into member ``dst`` (index in the group).

        Used to deliver a weight shard's gradient to its owner. Counted as ``tensor`` bytes sent
        by each non-destination rank. After ``wait()`` only ``dst``'s tensor holds the sum.
        """
        g = self.group
        work = dist.reduce(tensor, dst=g.ranks[dst], op=dist.ReduceOp.SUM, group=g.group,
                           async_op=True)
        if g.rank != dst:
            g.stats.steps += weight()
            g.stats.bytes_sent += tensor.numel() * tensor.element_size() * weight()
        others = [r for r in g.ranks if r != g.ranks[dst]]
        peer = g.ranks[dst] if g.rank != dst else f"the contributing peers {others}"
        return PendingExchange([work], tensor, g, step, self.what, peer=peer)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, *,
                   step: int) -> PendingExchange:
        """Async ``out = cat(tensor of every member, in group order)`` (``out`` holds
        ``size × tensor``). Used where every rank needs every member's shard at once (METP
        attention with all head groups in one block). Counted as one step and ``(p−1)·tensor``
        bytes received (each member's shard once), ``(p−1)/p·out`` sent (ring algorithm)."""
        g = self.group
        work = dist.all_gather_into_tensor(out, tensor, group=g.group, async_op=True)
        nbytes = tensor.numel() * tensor.element_size()
        g.stats.steps += weight()
        g.stats.bytes_received += (g.size - 1) * nbytes * weight()
        g.stats.bytes_sent += (g.size - 1) * nbytes * weight()
        return PendingExchange([work], out, g, step, self.what, peer=g.next_rank)

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, *,
                       step: int) -> PendingExchange:
        """Async ``out = member r's slice of Σ_members tensor`` (``tensor`` holds ``size × out``).
        Delivers every member's shard gradient at once. Counted as one step and ``(p−1)·out``
        bytes sent and received."""
        g = self.group
        work = dist.reduce_scatter_tensor(out, tensor, op=dist.ReduceOp.SUM, group=g.group,
                                          async_op=True)
        nbytes = out.numel() * out.element_size()
        g.stats.steps += weight()
        g.stats.bytes_sent += (g.size - 1) * nbytes * weight()
        g.stats.bytes_received += (g.size - 1) * nbytes * weight()
        return PendingExchange([work], out, g, step, self.what, peer=g.next_rank)

    def circulate(self, payload: torch.Tensor, steps: Optional[int] = None,
                  spare: Optional[torch.Tensor] = None,
                  order: Optional[Iterable[int]] = None) -> Iterator[Tuple[int, torch.Tensor]]:
        """Yield ``(t, buffer)`` for ``t = 0 .. steps-1`` while the buffers rotate forward.

        At ``t = 0`` the buffer is ``payload`` (this rank's own); at step ``t`` it is the payload
        of the rank ``t`` places behind in the ring. The transfer for ``t+1`` is posted before
        ``t`` is yielded, so compute on the yielded buffer overlaps it (double buffering: two
        buffers in all). ``payload`` is consumed: it becomes one of the two buffers, so pass a
        tensor the caller no longer needs. ``steps`` defaults to the group size; ``steps - 1``
        exchanges are posted. ``spare`` (same size and dtype, no longer needed) is used as the
        second buffer instead of a new allocation. ``order``: the steps to run, increasing
        (default all; the fake instruments' sampled ring, :func:`.loop_sample.steps`: each step
        still posts the transfer of step ``t+1``, the buffer the next step run reads).
        """
        p = self.group.size
        steps = p if steps is None else steps
        if steps > p:
            raise ValueError(f"circulate: {steps} steps exceed the ring size {p}")
        current = payload
        for t in (range(steps) if order is None else order):
            pending = None
            if t + 1 < steps:
                if spare is None:
                    spare = torch.empty_like(payload)
                pending = self.start(current, spare, step=t)
            yield t, current
            if pending is not None:
                current, spare = pending.wait(), current


class TravellingSum:
    """A partial sum that travels the ring, each rank adding its contribution on the way.

    Used to deliver a shard's gradient to its owner: at every step call :meth:`buffer` (it waits
    for the partial sum arriving from ``prev``, or gives zeros at the first step), add this rank's
    contribution into it in place, then :meth:`pass_on` (posts the send to ``next`` and the
    receive of the next partial sum into the other buffer). Two buffers in all, reused; the
    transfer overlaps whatever the caller computes between :meth:`pass_on` and the next
    :meth:`buffer`. After the last step :meth:`buffer` holds the complete sum.
    """

    def __init__(self, exchanger: RingExchanger, numel: int, dtype: torch.dtype, device, *,
                 zero: bool = True):
        """``zero=False``: the first :meth:`buffer` is uninitialised (the caller writes, not
        adds, its first contribution)."""
        self._ring = exchanger
        self._bufs = [(torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device),
                      None]
        self._cur = 0
        self._pending: Optional[PendingExchange] = None
        self._step = 0

    def buffer(self) -> torch.Tensor:
        """Where this step's contribution goes (already holds the previous ranks' sum)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self._bufs[self._cur]

    def pass_on(self) -> None:
        """Send the current partial sum to ``next``; receive ``prev``'s into the other buffer."""
        send = self._bufs[self._cur]
        if self._bufs[1 - self._cur] is None:
            self._bufs[1 - self._cur] = torch.empty_like(send)
        self._pending = self._ring.start(send, self._bufs[1 - self._cur], step=self._step)
        self._cur = 1 - self._cur
        self._step += 1
