"""One bounded wait for posted communication, shared by the ring and the agreement check.

A posted transfer (a ``batch_isend_irecv`` of a ring step, an all-gather of the agreement check)
hands back ``Work`` objects. How long a wait on them may block depends on where the tensors live:

* CUDA tensors: ``Work.wait()`` only makes the current stream wait (it does not block the host);
  the NCCL process group's own timeout and watchdog end a stalled transfer;
* CPU tensors (gloo): the wait blocks the host, bounded here by the group's ``timeout``
  (:class:`~megatron_metp.runtime.groups.METPGroup`'s ``timeout_s``).

A failed wait is re-raised as :class:`RingTimeoutError` when the transport says it timed out,
else :class:`RingPeerError` (e.g. the peer process died and closed its connection), with the
caller's message built from the transport's first line (:func:`wait_bounded`), so that every
such error names the group, this rank and what it waited for. Only a transport failure
(:func:`transport_failure`) is re-raised so: an error of this rank's own that merely surfaces
during the wait — a DataLoader worker of this rank killed, whose ``SIGCHLD`` handler raises
``DataLoader worker (pid N) is killed by signal`` at the first Python instruction after the
blocking wait returns — goes on as it is, so that it is not blamed on the peer. The error classes live here and
are re-exported by :mod:`megatron_metp.runtime.ring` (their public home).
"""

from __future__ import annotations

from typing import Callable, Iterable


class RingError(RuntimeError):
    """A ring exchange failed; the message names the group, step and peer."""


class RingTimeoutError(RingError):
    """The peer did not complete its half of a ring step within the group's timeout."""


class RingPeerError(RingError):
    """The transport reported an error (e.g. the peer process died) during a ring step."""


#: text of transport errors that mean a peer did not answer (gloo, c10d, NCCL)
TRANSPORT_TEXT = ("imed out", "imeout", "onnection closed", "onnection reset", "roken pipe",
                  "onnection refused", "NCCL communicator was aborted")


def transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the transport saying a peer did not answer (a timeout, a closed or
    reset connection, an aborted communicator): c10d's ``DistError`` family, or a
    ``RuntimeError`` with such text (gloo raises plain ``RuntimeError``). A ``RuntimeError`` of
    this rank's own (a dead DataLoader worker) is not one."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(t in text for t in TRANSPORT_TEXT)


def timed_out(exc: BaseException) -> bool:
    """Whether a transport error says it timed out (gloo: ``Timed out waiting ...``)."""
    text = str(exc)
    return "imed out" in text or "imeout" in text


def first_line(exc: BaseException) -> str:
    """The first line of the transport's message, or the exception's class name."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def group_text(group) -> str:
    """``(rank r of p, global ranks [...])`` of a METP group, as every wait error says it."""
    return f"(rank {group.rank} of {group.size}, global ranks {list(group.ranks)})"


def wait_error(exc: BaseException, message: Callable[[str], str]) -> RingError:
    """The error to raise for a failed wait (or post): :class:`RingTimeoutError` when ``exc``
    :func:`timed_out`, else :class:`RingPeerError`, with ``message(first line of exc)``. Only
    for a :func:`transport_failure`; callers re-raise any other error as it is."""
    kind = RingTimeoutError if timed_out(exc) else RingPeerError
    return kind(message(first_line(exc)))


def wait_bounded(works: Iterable, group, *, cuda: bool, message: Callable[[str], str]) -> None:
    """Wait for every ``Work`` in ``works``: stream-ordered when ``cuda`` (NCCL's watchdog owns
    the timeout), else at most ``group.timeout`` each. A failure raises :class:`RingTimeoutError`
    or :class:`RingPeerError` (see :func:`timed_out`) with ``message(first line of the
    transport's error)``, chained to the transport's exception. An error that is not a
    :func:`transport_failure` (this rank's own, surfacing here) propagates unchanged."""
    for work in works:
        try:
            if cuda:
                work.wait()
            else:
                work.wait(group.timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the group and the rank
            if not transport_failure(exc):
                raise  # this rank's own error (e.g. its DataLoader worker died): not the peer's
            raise wait_error(exc, message) from exc


__all__ = ["RingError", "RingPeerError", "RingTimeoutError", "TRANSPORT_TEXT", "first_line",
           "group_text", "timed_out", "transport_failure", "wait_bounded", "wait_error"]
