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
  it is honoured for ring steps and Megatron-LM's barriers only (:func:`megatron_lm_timeout_s`;
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
so it is exactly the one left without a failure record. The store is served by rank 0's process
(a C++ thread, so a rank 0 that stalls in Python still answers); if rank 0 died, the reading fails
and the message says so.

On NCCL the waits inside the ops are stream-ordered: the process group's timeout and watchdog end
the job (``TORCH_NCCL_*``); :func:`bounded` still names the ranks when the error reaches Python.
"""

from __future__ import annotations

import datetime
import json
import time
from contextlib import contextmanager
from typing import List, Optional, Tuple

import torch.distributed as dist

from .groups import DEFAULT_RING_TIMEOUT_S, ring_timeout_from_env
from .ring import RingError, RingTimeoutError

_job_timeout_s: Optional[float] = None
_seq = 0
_KEY = "metp/progress/{}"

#: text of transport errors that mean a peer did not answer (gloo, c10d)
_TRANSPORT = ("imed out", "imeout", "onnection closed", "onnection reset", "roken pipe",
              "onnection refused", "NCCL communicator was aborted")


class StalledRankError(RingTimeoutError):
    """A wait on a process group failed because a rank stalled or died; ``stalled`` holds the
    global ranks that reported no failure (the suspects), ``failed`` the ranks that failed too."""

    def __init__(self, message: str, stalled=(), failed=()):
        super().__init__(message)
        self.stalled = list(stalled)
        self.failed = list(failed)


def set_job_timeout(seconds: Optional[float]) -> None:
    """Record the job timeout (``None``: back to ``METP_RING_TIMEOUT_S``)."""
    global _job_timeout_s
    _job_timeout_s = None if seconds is None else float(seconds)


def job_timeout_s() -> float:
    """The one timeout: what :func:`set_job_timeout` recorded, else ``METP_RING_TIMEOUT_S``."""
    return _job_timeout_s if _job_timeout_s is not None else ring_timeout_from_env()


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


def megatron_lm_timeout_s(args) -> float:
    """The ring timeout under Megatron-LM: ``--distributed-timeout-minutes`` × 60 (Megatron's
    default 30 minutes), or a ``--metp-ring-timeout`` / ``METP_RING_TIMEOUT_S`` at most that;
    ``ValueError`` naming both settings when one is larger (contradictory)."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    minutes = 30 if minutes is None else minutes
    pg_s = float(minutes) * 60.0
    from . import overrides

    given = [("--metp-ring-timeout", getattr(args, "metp_ring_timeout", None))]
    if overrides.is_set("METP_RING_TIMEOUT_S"):
        given.append(("METP_RING_TIMEOUT_S", ring_timeout_from_env()))
    for name, value in given:
        if value is not None and value > pg_s:
            raise ValueError(
                f"{name} {value:g} s is longer than --distributed-timeout-minutes {minutes:g} "
                f"({pg_s:g} s): under Megatron-LM every process group waits at most "
                f"--distributed-timeout-minutes, so a ring step could never wait that long. Set "
                f"--distributed-timeout-minutes (the one timeout; the ring timeout defaults to "
                f"it) and drop {name}, or give {name} at most {pg_s:g}")
    for _, value in given:
        if value is not None:
            return float(value)
    return pg_s


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


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if text.startswith("[") and "] " in text:  # gloo's "[path/file.cc:78] Timed out ..."
        text = text.split("] ", 1)[1]
    if not isinstance(exc, RingError):  # gloo's advice and emoji after the first sentence
        text = text.split(". ")[0]
    return text[:300]


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer did not answer (a timeout, a closed connection). An exception
    whose class sets ``names_ranks = True`` (the checkpoint errors of the layers above, which
    already name the ranks) is not diagnosed again."""
    if getattr(exc, "names_ranks", False):
        return False
    if isinstance(exc, RingError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(t in text for t in _TRANSPORT)


def diagnose(what: str, exc: BaseException, *,
             timeout_s: Optional[float] = None) -> Tuple[str, List[int], List[int]]:
    """After a failed wait in ``what`` (of ``timeout_s``, default the job timeout): record the
    failure, wait :func:`grace_s` for the peers' records, and describe every other rank.
    Returns ``(text, stalled, failed)`` (global ranks)."""
    store = _store()
    if store is None:
        return "", [], []
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
        while True:
            for r in others:
                if records.get(r, {}).get("state") != "failed" and \
                        store.check([_KEY.format(r)]):
                    records[r] = json.loads(store.get(_KEY.format(r)))
            if all(records.get(r, {}).get("state") == "failed" for r in others) or \
                    time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    except Exception as store_exc:  # noqa: BLE001
        return (f"The ranks' progress records could not be read ({_first_line(store_exc)}): "
                f"rank 0, which serves the job's store, may have died.", [], [])
    now = time.time()
    stalled, failed, parts = [], [], []
    for r in others:
        rec = records.get(r)
        if rec is None:
            stalled.append(r)
            parts.append(f"rank {r} never recorded any progress (died or stalled before its "
                         f"first bounded step)")
        elif rec.get("state") == "failed":
            failed.append(r)
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
    return "; ".join(parts) + ".", stalled, failed


def explain(what: str, exc: BaseException, *, timeout_s: Optional[float] = None,
            waited_s: Optional[float] = None) -> StalledRankError:
    """The :class:`StalledRankError` for a failed wait ``exc`` in ``what`` (see :func:`diagnose`);
    ``waited_s``, when given, is how long this rank waited (named in the message)."""
    text, stalled, failed = diagnose(what, exc, timeout_s=timeout_s)
    t = job_timeout_s() if timeout_s is None else timeout_s
    me = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if stalled:
        head = (f"METP: rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))} "
                f"stalled or died during {what!r}")
    else:
        head = f"METP: {what!r} failed on every rank"
    return StalledRankError(
        f"{head} (seen by rank {me} of {world}"
        f"{f' after waiting {waited_s:.2f} s' if waited_s is not None else ''}: "
        f"{_first_line(exc)}; every wait is bounded by "
        f"the job timeout, {t:g} s: METP_RING_TIMEOUT_S; under Megatron-LM 60 x "
        f"--distributed-timeout-minutes, or a shorter --metp-ring-timeout / "
        f"METP_RING_TIMEOUT_S). {text} Read the log of the stalled rank first.",
        stalled, failed)


@contextmanager
def bounded(what: str):
    """Mark this rank as entering ``what``; a transport error inside (a timed-out or broken
    wait on any process group) becomes :class:`StalledRankError` naming the stalled ranks."""
    enter(what)
    try:
        yield
    except StalledRankError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised as is unless a peer did not answer
        if not is_transport_error(exc) or not dist.is_initialized():
            raise
        raise explain(what, exc) from exc


__all__ = ["StalledRankError", "apply_to_process_groups", "bounded", "diagnose", "enter",
           "explain", "grace_s", "is_transport_error", "job_timeout_s", "megatron_lm_timeout_s",
           "set_job_timeout", "DEFAULT_RING_TIMEOUT_S"]
