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
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _child(fn, rank, world_size, store_path, queue, args, kwargs):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron_metp.tools.fakerank import compile_in_this_process

    compile_in_this_process()  # the parent's inductor worker threads did not survive the fork
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


def free_port() -> int:
    """A TCP port free on this host now, for a launch's ``MASTER_PORT``: the kernel picks it, so
    concurrent test workers (``pytest -n``) do not collide on a fixed range."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unset_env(monkeypatch, *names: str) -> None:
    """Remove ``names`` from the environment for one test and restore each afterwards, set or
    not. ``monkeypatch.delenv(name, raising=False)`` records nothing for an unset variable, so a
    value the code under test then sets would outlive the test and reach later tests in the same
    process."""
    for name in names:
        monkeypatch.setenv(name, "")  # recorded: undone (removed again) after the test
        monkeypatch.delenv(name)


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

    Forming a gloo group on loopback occasionally fails (a connection closed during gloo's
    full-mesh connect, seen in CI with 4 and 8 ranks): a run in which the world group did not
    form, or in which a rank failed *only* because a subgroup's full-mesh connect failed inside
    ``fn`` (``new_group``, e.g. in Megatron's ``initialize_model_parallel``), is run again from
    scratch, up to twice, with a note on stderr. Any other failure is reported at once.
    """
    for attempt in range(3):
        results = _run_once(fn, world_size, args, kwargs, timeout)
        flaky = [v for st, v in results.values() if _transport_failure(st, v)]
        others = [v for st, v in results.values() if st == "error" and not _transport_failure(st, v)]
        if not flaky or others:
            break
        sys.stderr.write(f"tests.harness: gloo's full-mesh connect failed (attempt {attempt + 1}"
                         f" of 3), running {getattr(fn, '__name__', fn)} again\n")
    else:
        raise RankError(f"the gloo groups of {world_size} ranks failed to connect 3 times:\n"
                        f"{flaky[0]}")
    return _collect(results, world_size, timeout, allow_errors)


#: gloo's message when a group's full-mesh connect fails (a transport hiccup, not a test failure)
_GLOO_MESH_FAILURE = "Gloo connectFullMesh failed"


def _transport_failure(status, value) -> bool:
    return status == "init-error" or (status == "error" and _GLOO_MESH_FAILURE in value)


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
            if _transport_failure(status, value):
                # a group did not form: give the others a moment to report a real error, then
                # stop them (run_ranks runs it again)
                deadline = min(deadline, time.monotonic() + 3.0)
    finally:
        if any(_transport_failure(st, v) for st, v in results.values()):
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


def flag_values(argv) -> dict:
    """A Megatron argv -> ``{flag: [values]}`` (the last occurrence wins, as argparse does;
    values before the first flag are left out)."""
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []
        elif key is not None:
            out[key].append(a)
    return out
