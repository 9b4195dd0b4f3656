"""One timeout for every wait, and errors that name the rank that stalled or died.

**The one timeout.** Every process group METP creates or uses waits at most the *job timeout*:
the METP groups and their K/V groups (:class:`~megatron_metp.runtime.groups.METPGroup`), the groups
Megatron's ``initialize_model_parallel`` makes for :func:`megatron_metp.megatron.training.
init_parallel` / :func:`megatron_metp.megatron.parallel.initialize_model_parallel`, the default
group where METP initialises or configures the job (the demo, the tests, ``init_parallel``), and
the checkpoint agreements. Which setting it is:

* METP's own training loop, the demo, the tests: ``METP_RING_TIMEOUT_S`` (seconds, default 600,
  :func:`~megatron_metp.runtime.groups.ring_timeout_from_env`), or the ``timeout_s`` given to
  ``init_parallel``; :func:`set_job_timeout` records it and :func:`apply_to_process_groups` sets
  it on the process groups (torch's ``_set_pg_timeout``, as Megatron's ``update_pg_timeout``).
* Megatron-LM (``pretrain_gpt.py`` with the METP patches): ``--distributed-timeout-minutes``,
  which Megatron already gives the default group and every group it makes. The ring timeout is
  derived from it (60 × minutes); a ``--metp-ring-timeout`` / ``METP_RING_TIMEOUT_S`` above it is
  refused (the process group would end the wait first, so the setting would be a lie), one below
  it is honoured for ring steps, Megatron-LM's barriers and every op started inside its
  ``train_step`` (:func:`waits_at_most`;
  :func:`megatron_metp.megatron_lm.timeouts.megatron_lm_timeout_s`;
  :mod:`megatron_metp.megatron_lm.last_seen`).

**Naming the rank.** gloo's timeout (``Timed out waiting 1000ms for recv operation to complete``)
and its closed-connection errors name no rank, and in a collective every waiting rank waits, so
the rank a wait times out on need not be the one that stalled. Each rank therefore records in the
job's store (the default group's ``TCPStore``/``FileStore``: one ``set`` of ~100 bytes, ~10 µs)
where it is whenever it enters a bounded region (:func:`bounded`, :func:`enter`): a sequence
number and a label such as ``optimizer step of iteration 3``. A rank whose wait fails records the
failure, gives its peers a short grace to record theirs (:func:`grace_s`: a quarter of the
timeout, 0.2–2 s), reads every rank's record and raises :class:`StalledRankError` naming the
ranks that reported no failure — with where each was last seen (not yet at this point, or inside
it) and how long ago — and the ranks that failed with it. A rank that died or stalls cannot answer,
so it is exactly the one left without a failure record.

**The right rank.** A rank that fails with an error of its *own* inside a bounded region (not a
peer's silence: its DataLoader worker was killed, its data ran out, a bug) records that error
(state ``error``, :func:`record_own_error`) before it propagates, and its peers name it with
that error — it is not counted among the ranks that "failed waiting too". Only a transport
failure (:func:`~megatron_metp.runtime.bounded_wait.transport_failure`) is diagnosed as a peer's
stall: an own error that surfaces in the middle of a wait (a DataLoader worker's ``SIGCHLD``
handler raises at the first Python instruction after a blocking gloo wait) stays this rank's. The store is served by rank 0's process
(a C++ thread, so a rank 0 that stalls in Python still answers); if rank 0 died, the reading fails
and the message says so.

On NCCL the waits inside the ops are stream-ordered: the process group's timeout and watchdog end
the op (``TORCH_NCCL_*``); :func:`bounded` still names the ranks when the error reaches Python.
:func:`waits_at_most` gives every process group the job timeout for the ops started inside it
(Megatron-LM's ``train_step``: :mod:`megatron_metp.megatron_lm.last_seen`), so NCCL's watchdog
ends such an op at the one timeout, not at ``--distributed-timeout-minutes``.
"""

from __future__ import annotations

import datetime
import json
import time
from contextlib import contextmanager
from typing import List, Optional, Tuple

import torch.distributed as dist

from .bounded_wait import RingPeerError, transport_failure
from .groups import DEFAULT_RING_TIMEOUT_S, job_timeout_s, ring_timeout_from_env, set_job_timeout
from .ring import RingError, RingTimeoutError

_seq = 0
_KEY = "metp/progress/{}"


class StalledRankError(RingTimeoutError):
    """A wait on a process group failed because a rank stalled or died; ``stalled`` holds the
    global ranks that reported no failure (the suspects), ``failed`` the ranks that failed too."""

    def __init__(self, message: str, stalled=(), failed=()):
        super().__init__(message)
        self.stalled = list(stalled)
        self.failed = list(failed)


def grace_s(timeout_s: Optional[float] = None) -> float:
    """How long a failed rank waits for its peers' failure records before naming the others."""
    t = job_timeout_s() if timeout_s is None else timeout_s
    return min(2.0, max(0.2, 0.25 * t))


def apply_to_process_groups(timeout_s: float, groups=()) -> None:
    """Give the default group and ``groups`` (process groups; ``None`` entries skipped) the
    timeout ``timeout_s``, and record it as the job timeout."""
    set_job_timeout(timeout_s)
    if not dist.is_initialized():
        return
    td = datetime.timedelta(seconds=timeout_s)
    seen = set()
    for g in (None, *groups):
        key = id(g)
        if key in seen or (g is not None and g == dist.GroupMember.NON_GROUP_MEMBER):
            continue
        seen.add(key)
        try:
            dist.distributed_c10d._set_pg_timeout(td, g)
        except (AttributeError, ValueError):  # older torch / the fake backend / not a member
            pass


def _timeout_of(group):
    """The timeout ``group``'s backend gives new ops (``None`` where it cannot be read)."""
    try:
        for backend in {group._get_backend(d) for d in group._device_types}:
            return backend.options._timeout
    except Exception:  # noqa: BLE001 - the fake backend, an older torch: left as it is
        return None
    return None


@contextmanager
def waits_at_most(timeout_s: float):
    """Every process group of the job gives the ops started inside this block at most
    ``timeout_s`` (gloo: each wait; NCCL: the watchdog's deadline for the op); each group's own
    timeout is back on exit. A group already shorter keeps its own. No-op without
    ``torch.distributed``. Cost: a few µs per group, twice."""
    if not dist.is_initialized():
        yield
        return
    td = datetime.timedelta(seconds=timeout_s)
    changed = []
    for pg in list(getattr(dist.distributed_c10d._world, "pg_map", {})):
        old = _timeout_of(pg)
        if old is None or old <= td:
            continue
        try:
            dist.distributed_c10d._set_pg_timeout(td, pg)
            changed.append((pg, old))
        except (AttributeError, ValueError, RuntimeError):  # not a member / destroyed
            pass
    try:
        yield
    finally:
        for pg, old in changed:
            try:
                dist.distributed_c10d._set_pg_timeout(old, pg)
            except (AttributeError, ValueError, RuntimeError):
                pass


# ---------------------------------------------------------------- progress records

def _store():
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        if dist.get_backend() == "fake":
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: nothing to record
        return None


def enter(what: str) -> None:
    """Record that this rank has reached ``what`` (no-op on one rank / without a store)."""
    global _seq
    store = _store()
    if store is None:
        return
    _seq += 1
    try:
        store.set(_KEY.format(dist.get_rank()),
                  json.dumps({"seq": _seq, "what": what, "state": "in", "t": time.time()}))
    except Exception:  # noqa: BLE001 - the store is gone (rank 0 died): the wait will say so
        pass


def record_own_error(what: str, exc: BaseException) -> None:
    """Record that this rank failed inside ``what`` with an error of its own (``exc``, not a
    peer's silence), so that its waiting peers name it with that error; once per exception
    (nested regions). A note on ``exc`` says so in this rank's own traceback."""
    if getattr(exc, "_metp_recorded", False) or getattr(exc, "names_ranks", False):
        return  # recorded already; or an error that names the ranks itself (not this rank's)
    store = _store()
    if store is None:
        return
    try:
        exc._metp_recorded = True
        store.set(_KEY.format(dist.get_rank()),
                  json.dumps({"seq": _seq, "what": what, "state": "error",
                              "error": _first_line(exc), "t": time.time()}))
        exc.add_note(f"METP: rank {dist.get_rank()} failed on its own inside {what!r}; its "
                     f"peers name it with this error")
    except Exception:  # noqa: BLE001 - the store is gone, or exc takes no attribute: as it is
        pass


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if text.startswith("[") and "] " in text:  # gloo's "[path/file.cc:78] Timed out ..."
        text = text.split("] ", 1)[1]
    if not isinstance(exc, RingError):  # gloo's advice and emoji after the first sentence
        text = text.split(". ")[0]
    return text[:300]


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer did not answer (a timeout, a closed connection; not an error
    of this rank's own, e.g. its DataLoader worker killed). An exception whose class sets
    ``names_ranks = True`` (the checkpoint errors of the layers above, which
    already name the ranks) is not diagnosed again."""
    if getattr(exc, "names_ranks", False):
        return False
    if isinstance(exc, (RingTimeoutError, RingPeerError)):  # raised for transport failures only
        return True
    return transport_failure(exc)


def diagnose(what: str, exc: BaseException, *,
             timeout_s: Optional[float] = None) -> Tuple[str, List[int], List[int]]:
    """After a failed wait in ``what`` (of ``timeout_s``, default the job timeout): record the
    failure, wait :func:`grace_s` for the peers' records, and describe every other rank.
    Returns ``(text, stalled, failed)`` (global ranks; ``stalled``: the ranks to blame, those
    that recorded an error of their own included)."""
    return _diagnose(what, exc, timeout_s)[:3]


def _diagnose(what: str, exc: BaseException,
              timeout_s: Optional[float]) -> Tuple[str, List[int], List[int], List[int]]:
    """:func:`diagnose`, plus the ranks that recorded an error of their own (a subset of
    ``stalled``)."""
    store = _store()
    if store is None:
        return "", [], [], []
    me, world = dist.get_rank(), dist.get_world_size()
    error = _first_line(exc)
    try:
        store.set(_KEY.format(me), json.dumps({"seq": _seq, "what": what, "state": "failed",
                                               "error": error, "t": time.time()}))
        others = [r for r in range(world) if r != me]
        records: dict = {}
        # a timeout: the peers time out at about the same moment; a closed connection: at once
        timed_out = "imed out" in str(exc) or "imeout" in str(exc)
        grace = grace_s(timeout_s)
        deadline = time.monotonic() + (grace if timed_out else min(grace, 0.2))
        final = ("failed", "error")  # a failed wait; an own error (record_own_error)
        while True:
            for r in others:
                if records.get(r, {}).get("state") not in final and \
                        store.check([_KEY.format(r)]):
                    records[r] = json.loads(store.get(_KEY.format(r)))
            if all(records.get(r, {}).get("state") in final for r in others) or \
                    time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    except Exception as store_exc:  # noqa: BLE001
        return (f"The ranks' progress records could not be read ({_first_line(store_exc)}): "
                f"rank 0, which serves the job's store, may have died.", [], [], [])
    now = time.time()
    stalled, failed, crashed, parts = [], [], [], []
    for r in others:
        rec = records.get(r)
        if rec is None:
            stalled.append(r)
            parts.append(f"rank {r} never recorded any progress (died or stalled before its "
                         f"first bounded step)")
        elif rec.get("state") == "failed":
            failed.append(r)
        elif rec.get("state") == "error":
            stalled.append(r)
            crashed.append(r)
            ago = now - float(rec.get("t", now))
            parts.append(f"rank {r} failed with an error of its own in {rec.get('what')!r} "
                         f"{ago:.2f} s ago: {str(rec.get('error', '?')).rstrip('. ')}")
        else:
            stalled.append(r)
            ago = now - float(rec.get("t", now))
            seq = int(rec.get("seq", 0))
            where = (f"has not reached it: last seen entering {rec.get('what')!r} {ago:.2f} s ago"
                     if seq < _seq else
                     f"is inside it (entered {ago:.2f} s ago)" if seq == _seq and
                     rec.get("what") == what else
                     f"is inside {rec.get('what')!r} (entered {ago:.2f} s ago)" if seq == _seq else
                     f"is past it, entering {rec.get('what')!r} {ago:.2f} s ago")
            parts.append(f"rank {r} stalled or died: it {where}, and reported no error")
    if failed:
        parts.append(f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                     f"failed waiting too ({records[failed[0]].get('error', '?')})")
    return "; ".join(parts) + ".", stalled, failed, crashed


def explain(what: str, exc: BaseException, *, timeout_s: Optional[float] = None,
            waited_s: Optional[float] = None) -> StalledRankError:
    """The :class:`StalledRankError` for a failed wait ``exc`` in ``what`` (see :func:`diagnose`);
    ``waited_s``, when given, is how long this rank waited (named in the message)."""
    text, stalled, failed, crashed = _diagnose(what, exc, timeout_s)
    t = job_timeout_s() if timeout_s is None else timeout_s
    me = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks = f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}"
    if stalled and crashed == stalled:
        head = f"METP: {ranks} failed with an error of {'their' if len(stalled) > 1 else 'its'} " \
               f"own during {what!r}"
    elif stalled:
        head = f"METP: {ranks} stalled or died during {what!r}"
    else:
        head = f"METP: {what!r} failed on every rank"
    return StalledRankError(
        f"{head} (seen by rank {me} of {world}"
        f"{f' after waiting {waited_s:.2f} s' if waited_s is not None else ''}: "
        f"{_first_line(exc)}; every wait is bounded by "
        f"the job timeout, {t:g} s: METP_RING_TIMEOUT_S; under Megatron-LM 60 x "
        f"--distributed-timeout-minutes, or a shorter --metp-ring-timeout / "
        f"METP_RING_TIMEOUT_S). {text} Read the log of the "
        f"{'failed' if stalled and crashed == stalled else 'stalled'} rank first.",
        stalled, failed)


@contextmanager
def bounded(what: str):
    """Mark this rank as entering ``what``; a transport error inside (a timed-out or broken
    wait on any process group) becomes :class:`StalledRankError` naming the stalled ranks; any
    other error is this rank's own: recorded (:func:`record_own_error`) and re-raised as is."""
    enter(what)
    try:
        yield
    except StalledRankError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised as is unless a peer did not answer
        if not dist.is_initialized():
            raise
        if not is_transport_error(exc):
            record_own_error(what, exc)  # this rank's own failure: its peers name it
            raise
        raise explain(what, exc) from exc


__all__ = ["StalledRankError", "apply_to_process_groups", "bounded", "diagnose", "enter",
           "explain", "grace_s", "is_transport_error", "job_timeout_s", "record_own_error",
           "waits_at_most",
           "set_job_timeout", "DEFAULT_RING_TIMEOUT_S"]
