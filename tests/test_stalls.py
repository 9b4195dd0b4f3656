"""Every wait bounded by the one job timeout, ending with the stalled rank named.

Two forked gloo ranks train the tiny METP=2 GPT with ``METP_RING_TIMEOUT_S`` = 1.5 s (which
``init_parallel`` gives every process group, the default one included). At iteration 2 rank 1
stalls (sleeps, or is stopped with SIGSTOP) or dies (``os._exit``) in the optimizer step, in a
layer's forward (inside a ring step) or just before a checkpoint save. Rank 0 must raise within
the timeout plus the grace and a slack, naming rank 1 and where it was; nothing waits gloo's 30
minutes. ``-s`` prints the times (docs/reliability.md's fault matrix).
"""

import os
import signal
import subprocess
import time

import pytest

from megatron_metp.megatron.checkpoint import CheckpointError, save_checkpoint
from megatron_metp.megatron.training import Layout, init_parallel, setup, train
from megatron_metp.watchdog import StalledRankError, grace_s
from tests.harness import run_ranks
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
    from megatron_metp import cpu

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
