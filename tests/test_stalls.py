"""Every wait bounded by the one job timeout, ending with the stalled rank named.

Two forked gloo ranks train the tiny METP=2 GPT with ``METP_RING_TIMEOUT_S`` = 1.5 s (which
``init_parallel`` gives every process group, the default one included). At iteration 2 rank 1
stalls (sleeps, or is stopped with SIGSTOP) or dies (``os._exit``) in the optimizer step, in a
layer's forward (inside a ring step) or just before a checkpoint save. Rank 0 must raise within
the timeout plus the grace and a slack, naming rank 1 and where it was; nothing waits gloo's 30
minutes. ``-s`` prints the times (docs/reliability.md's fault matrix).
"""

import os
import re
import signal
import subprocess
import time

import pytest

from megatron_metp.megatron.checkpoint import CheckpointError, save_checkpoint
from megatron_metp.megatron.training import Layout, init_parallel, setup, train
from megatron_metp.runtime.watchdog import StalledRankError, grace_s
from tests.harness import run_ranks, unset_env
from tests.test_checkpoint import SIZE

LAYOUT, WORLD = Layout(metp=2), 2
TIMEOUT_S = 1.5
STALL_S = TIMEOUT_S + grace_s(TIMEOUT_S) + 2.0  # rank 1 comes back after rank 0 has reported


def _halt(how):
    """Rank 1's fault, when it is reached."""
    if how == "exit":
        os._exit(17)
    if how == "sleep":
        time.sleep(STALL_S)
    elif how == "sigstop":  # frozen whole (its gloo threads too); a helper resumes it later
        subprocess.Popen(["sh", "-c", f"sleep {STALL_S}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(how)


def _run(rank, world, where, how, save_dir):
    os.environ["METP_RING_TIMEOUT_S"] = str(TIMEOUT_S)  # read by init_parallel: every group
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(LAYOUT, SIZE.seq_length)
    state = setup(SIZE, LAYOUT)
    train(SIZE, LAYOUT, 1, state=state)
    if rank == 1 and where == "optimizer":
        opt = state["optimizer"]
        step = opt.step

        def stalling_step(*a, **k):
            _halt(how)
            return step(*a, **k)

        opt.step = stalling_step
    elif rank == 1 and where == "forward":  # inside layer 2's forward: rank 0 waits in a ring
        layer = state["model"].module.decoder.layers[-1]
        layer.register_forward_pre_hook(lambda *_: _halt(how))

    def checkpoint(step, st):
        if where == "save":
            if rank == 1:
                _halt(how)
            save_checkpoint(save_dir, st, step)

    t0 = time.monotonic()
    try:
        train(SIZE, LAYOUT, 1, state=state, start_step=1, checkpoint_fn=checkpoint)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return type(exc).__name__, str(exc), time.monotonic() - t0, getattr(exc, "stalled", None)
    return "ok", "", time.monotonic() - t0, None


CASES = [  # where rank 1 stalls or dies, how, the error rank 0 must raise
    ("optimizer", "sleep", StalledRankError),
    ("optimizer", "sigstop", StalledRankError),
    ("optimizer", "exit", StalledRankError),
    ("forward", "sigstop", StalledRankError),
    ("forward", "exit", StalledRankError),
    ("save", "sleep", CheckpointError),
    ("save", "exit", CheckpointError),
]


@pytest.mark.parametrize("where,how,error", CASES, ids=[f"{w}-{h}" for w, h, _ in CASES])
def test_a_stalled_or_dead_rank_is_named_within_the_timeout(tmp_path, where, how, error):
    out = run_ranks(_run, WORLD, where, how, str(tmp_path / "save"), timeout=60,
                    allow_errors=True)
    kind, msg, seconds, stalled = out[0]
    assert kind == error.__name__, out
    assert "rank 1" in msg and "iteration 2" in msg, msg
    if error is StalledRankError:
        assert stalled == [1], out
        assert msg.startswith("METP: rank 1 stalled or died during"), msg
    else:
        assert "rank 1 did not answer" in msg, msg
    # what rank 1 was last seen doing is named (where it is / where it was last)
    assert ("is inside it" in msg or "has not reached it" in msg), msg
    bound = (TIMEOUT_S if how != "exit" else 0.0) + grace_s(TIMEOUT_S) + 1.5  # + the step itself
    assert seconds < bound, (seconds, bound, msg)
    if how != "exit":
        assert seconds >= TIMEOUT_S, (seconds, msg)  # it waited the timeout, not gloo's 30 min
        # the stalled rank, once back, ends with an error too (its peer is gone), never a hang
        assert out[1] is not None and out[1][0] != "ok", out
    else:
        assert out[1] is None, out  # it died
    print(f"\n[fault] rank 1 {how} in {where} at iteration 2: rank 0 {kind} after "
          f"{seconds:.2f} s: {msg[:400]}")


def test_under_megatron_lm_the_distributed_timeout_is_the_one_setting(monkeypatch):
    """--distributed-timeout-minutes wins: the ring timeout derives from it; a ring timeout above
    it (the process group would end the wait first) is refused naming both settings."""
    from types import SimpleNamespace

    from megatron_metp import megatron_lm
    from megatron_metp.megatron_lm.timeouts import megatron_lm_timeout_s

    unset_env(monkeypatch, "METP_RING_TIMEOUT_S")
    args = SimpleNamespace(distributed_timeout_minutes=2, metp_ring_timeout=None)
    assert megatron_lm_timeout_s(args) == 120.0
    assert megatron_lm_timeout_s(SimpleNamespace()) == 1800.0  # Megatron's default, 30 minutes
    assert megatron_lm_timeout_s(SimpleNamespace(distributed_timeout_minutes=2,
                                                 metp_ring_timeout=30.0)) == 30.0  # ring only
    with pytest.raises(ValueError, match=r"--metp-ring-timeout 600 s is longer than "
                                         r"--distributed-timeout-minutes 2 \(120 s\)"):
        megatron_lm_timeout_s(SimpleNamespace(distributed_timeout_minutes=2,
                                              metp_ring_timeout=600.0))
    monkeypatch.setenv("METP_RING_TIMEOUT_S", "300")
    with pytest.raises(ValueError, match="METP_RING_TIMEOUT_S 300 s is longer"):
        megatron_lm_timeout_s(args)
    # refused in validate_metp_args too, before any rank starts work
    from tests.test_megatron_lm import _args

    with pytest.raises(ValueError, match="METP_RING_TIMEOUT_S 300 s is longer"):
        megatron_lm.validate_metp_args(_args(metp_parallel_size=2, distributed_timeout_minutes=2))


def _init_timeouts(rank, world):
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_metp.runtime import watchdog

    from megatron_metp.megatron import cpu

    cpu.enable()
    os.environ["METP_RING_TIMEOUT_S"] = "7.5"
    groups = init_parallel(LAYOUT, SIZE.seq_length)
    seen = {}
    for name, g in (("default", None), ("cp", ps.get_context_parallel_group()),
                    ("dp-cp", ps.get_data_parallel_group(with_context_parallel=True)),
                    ("tp", ps.get_tensor_model_parallel_group()),
                    ("mp", ps.get_model_parallel_group())):
        backend = (g or dist.distributed_c10d._get_default_group())._get_backend(
            __import__("torch").device("cpu"))
        seen[name] = backend.options._timeout
    return ({k: v.total_seconds() if isinstance(v, datetime.timedelta) else v
             for k, v in seen.items()}, groups.metp.timeout_s, groups.metp.kv_ring.timeout_s,
            watchdog.job_timeout_s())


def test_init_parallel_gives_every_group_the_one_timeout():
    for timeouts, ring, kv, job in run_ranks(_init_timeouts, WORLD):
        assert ring == kv == job == 7.5
        assert all(v == 7.5 for v in timeouts.values()), timeouts  # gloo's own default: 1800


def _barrier_stall(rank, world):
    """Megatron-LM's barrier as megatron_metp.megatron_lm.last_seen wraps it, timeout 1.5 s:
    first every rank meets (passes), then rank 1 stays in its dataset build."""
    import torch.distributed as dist

    from megatron_metp.megatron_lm.last_seen import _bounded_barrier
    from megatron_metp.runtime import watchdog

    watchdog.set_job_timeout(TIMEOUT_S)
    barrier = _bounded_barrier(dist.barrier, TIMEOUT_S)
    barrier()  # everyone arrives: no error
    watchdog.enter("building datasets")
    if rank == 1:
        time.sleep(STALL_S)
        return "slept", "", 0.0, None
    t0 = time.monotonic()
    try:
        barrier()
    except StalledRankError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, exc.stalled
    return "ok", "", time.monotonic() - t0, None


def test_megatron_lm_barrier_names_the_rank_and_its_last_label():
    out = run_ranks(_barrier_stall, WORLD, timeout=60)
    kind, msg, seconds, stalled = out[0]
    assert kind == "StalledRankError" and stalled == [1], out
    assert msg.startswith("METP: rank 1 stalled or died during 'barrier in _barrier_stall "
                          "(test_stalls.py:"), msg
    assert "has not reached it: last seen entering 'building datasets'" in msg, msg
    assert TIMEOUT_S <= seconds < TIMEOUT_S + grace_s(TIMEOUT_S) + 1.0, (seconds, msg)
    assert re.search(r"after waiting 1\.[5-9]\d s: Timed out waiting 1500ms", msg), msg
