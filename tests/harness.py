"""Fork a few gloo ranks for one test and bring their results back.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each initialises a gloo
process group through a FileStore, calls ``fn(rank, world_size, *args)`` with one thread, and sends
the (picklable) return value back. A rank that raises makes the whole call raise with that rank's
traceback; a rank that hangs past ``timeout`` is killed and reported. Forking keeps this to about a
second per call (spawning costs ~15 s).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _child(fn, rank, world_size, store_path, queue, args, kwargs):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        try:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        except BaseException:  # noqa: BLE001 - the group never formed; the parent retries
            queue.put((rank, "init-error", traceback.format_exc()))
            return
        result = fn(rank, world_size, *args, **kwargs)
        # Plain pickle: torch's ForkingPickler would pass tensors as shared-memory handles that
        # die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
        _linger(world_size)
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # Flush the result to the parent, then exit without destroy_process_group (a peer may
        # be gone; exiting closes the sockets).
        queue.close()
        queue.join_thread()
        os._exit(0)


def _linger(world_size: int, seconds: float = 60.0) -> None:
    """Keep this rank's sockets open until every rank has finished ``fn``.

    A rank that exits as soon as it is done closes its gloo connections; a slower peer still inside
    gloo's full-mesh connect of a group created near the end of ``fn`` then fails with "Connection
    closed by peer" (seen in CI with 8 ranks). A barrier on the world group, bounded so that a
    test whose peer died on purpose does not wait, lets the slow ones finish first.
    """
    import datetime

    if world_size == 1 or not dist.is_initialized():
        return
    try:
        work = dist.barrier(async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except BaseException:  # noqa: BLE001 - a peer is gone or the group was torn down: exit anyway
        pass


def preload_megatron() -> None:
    """Import megatron-core once in the parent: every forked rank inherits it (about 3 s per rank
    otherwise). Importing patches nothing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.transformer.attention  # noqa: F401


class RankError(AssertionError):
    pass


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, allow_errors: bool = False,
              **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks.

    Returns the list of per-rank results. With ``allow_errors=True`` a failing rank's entry is
    ``("error", traceback_text)`` instead of raising, and a rank that never reports is ``None``.

    Forming the gloo group on loopback occasionally fails (a connection closed during gloo's
    full-mesh connect); such a start, in which ``fn`` never ran, is retried up to twice with a
    fresh store.
    """
    for attempt in range(3):
        results = _run_once(fn, world_size, args, kwargs, timeout)
        init_failed = [v for st, v in results.values() if st == "init-error"]
        if not init_failed:
            break
    else:
        raise RankError(f"the gloo group of {world_size} ranks failed to form 3 times:\n"
                        f"{init_failed[0]}")
    return _collect(results, world_size, timeout, allow_errors)


def _run_once(fn, world_size, args, kwargs, timeout):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="metp_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, store_path, queue, args, kwargs),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except Exception:  # queue.Empty
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[rank] = (status, value)
            if status == "init-error":
                break  # the group did not form: stop the others and retry
    finally:
        if any(st == "init-error" for st, _ in results.values()):
            for p in procs:  # the others may wait in gloo's connect: no reason to let them
                if p.is_alive():
                    p.kill()
        join_deadline = time.monotonic() + 5
        for p in procs:
            p.join(timeout=max(0.0, join_deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(store_path):
            os.unlink(store_path)
    return results


def _collect(results, world_size, timeout, allow_errors):
    out = []
    for r in range(world_size):
        status, value = results.get(r, (None, None))
        if allow_errors:
            out.append(None if status is None else
                       (pickle.loads(value) if status == "ok" else ("error", value)))
            continue
        if status is None:
            raise RankError(f"rank {r} of {world_size} did not report within {timeout:g} s")
        if status == "error":
            raise RankError(f"rank {r} of {world_size} failed:\n{value}")
        out.append(pickle.loads(value))
    return out


def value_errors(cases: dict) -> dict:
    """Call each ``cases[name]()``; map name to its ``ValueError`` message, or ``None`` if it
    raised nothing (other exceptions propagate: a bad-input check must raise ValueError)."""
    msgs = {}
    for name, call in cases.items():
        try:
            call()
            msgs[name] = None
        except ValueError as exc:
            msgs[name] = str(exc)
    return msgs


def assert_messages(msgs: dict, expect: dict) -> None:
    """Every case raised, and its message contains the expected fragment."""
    for name, needle in expect.items():
        assert msgs[name] is not None and needle in msgs[name], (name, msgs[name])
