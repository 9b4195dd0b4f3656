"""A death is blamed on the rank whose process (or child) stopped.

The issue's case, on two forked gloo ranks: a DataLoader worker of rank R is killed (SIGKILL)
while rank R waits in a METP ring exchange. torch's DataLoader raises ``DataLoader worker (pid
N) is killed by signal: Killed.`` from its ``SIGCHLD`` handler at the first Python instruction
after the blocking gloo wait returns — inside the ring's wait. That is rank R's own error: it
must reach rank R's caller as it is (not as a ring failure blaming its peer), and the peer,
which then waits in the next exchange for rank R, must name rank R with that error within the
timeout. Killing rank 0's worker instead names rank 0 (the attribution follows the killed
process), and the wrong variant — every error in a wait taken for the peer's silence, as before —
is caught by the same checks: rank 1 then blames rank 0. A worker that is stopped (SIGSTOP)
instead stalls its rank in the data fetch: the peer names that rank, inside the step.
"""

import subprocess
import time

import pytest

from megatron_metp.runtime.watchdog import grace_s
from tests.harness import run_ranks

TIMEOUT_S = 1.0


class _Numbers:
    """A map-style dataset of tiny tensors (the DataLoader needs nothing more)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import torch

        return torch.tensor([i])


def _killed_worker(rank, world, killed, wrong_variant):
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from megatron_metp import METPGroup, RingExchanger
    from megatron_metp.runtime import bounded_wait, watchdog

    if wrong_variant:  # as before: any error in a wait taken for the peer's silence
        bounded_wait.transport_failure = lambda exc: True
    watchdog.apply_to_process_groups(TIMEOUT_S)
    ring = RingExchanger(METPGroup.from_process_group(dist.group.WORLD, name="data-test",
                                                      timeout_s=TIMEOUT_S), "batch")
    loader = iter(DataLoader(_Numbers(), batch_size=1, num_workers=1))
    next(loader)
    dist.barrier()
    send, recv = torch.ones(4), torch.empty(4)
    t0 = time.monotonic()
    try:
        with watchdog.bounded("iteration 2 (train_step)"):
            if rank == killed:  # killed while this rank waits below for its peer's half
                subprocess.Popen(["sh", "-c", f"sleep 0.2; kill -9 {loader._workers[0].pid}"])
            else:
                time.sleep(0.6)  # posts its half only after the kill
            ring.start(send, recv, step=0).wait()  # the killed rank's error surfaces here
            ring.start(send, recv, step=1).wait()  # the peer waits here for the killed rank
            next(loader)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return (type(exc).__name__, str(exc), " ".join(getattr(exc, "__notes__", [])),
                time.monotonic() - t0, getattr(exc, "stalled", None))
    return "ok", "", "", time.monotonic() - t0, None


def _stopped_worker(rank, world):
    """Rank 1's DataLoader worker is stopped (SIGSTOP; resumed after rank 0 has reported)."""
    import os
    import signal

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from megatron_metp import METPGroup, RingExchanger
    from megatron_metp.runtime import watchdog

    watchdog.apply_to_process_groups(TIMEOUT_S)
    ring = RingExchanger(METPGroup.from_process_group(dist.group.WORLD, name="data-test",
                                                      timeout_s=TIMEOUT_S), "batch")
    loader = iter(DataLoader(_Numbers(), batch_size=1, num_workers=1, prefetch_factor=1))
    next(loader)
    dist.barrier()
    t0 = time.monotonic()
    try:
        with watchdog.bounded("iteration 2 (train_step)"):
            if rank == 1:
                pid = loader._workers[0].pid
                os.kill(pid, signal.SIGSTOP)
                subprocess.Popen(["sh", "-c", f"sleep {3 * TIMEOUT_S}; kill -CONT {pid}"])
                next(loader)
                next(loader)  # at most one batch was in flight: this one waits for the worker
            ring.start(torch.ones(4), torch.empty(4), step=0).wait()
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return type(exc).__name__, str(exc), time.monotonic() - t0, getattr(exc, "stalled", None)
    return "ok", "", time.monotonic() - t0, None


def test_a_stopped_dataloader_worker_stalls_its_own_rank_and_that_rank_is_named():
    out = run_ranks(_stopped_worker, 2, timeout=60, allow_errors=True)
    kind, msg, seconds, stalled = out[0]
    assert kind == "StalledRankError" and stalled == [1], out
    assert "rank 1 stalled or died: it is inside it (entered " in msg, msg
    assert TIMEOUT_S <= seconds < TIMEOUT_S + grace_s(TIMEOUT_S) + 0.5, (seconds, msg)
    assert out[1] is not None and out[1][0] != "ok", out  # rank 1, resumed, fails: no hang


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_dataloader_worker_is_blamed_on_its_own_rank(killed):
    out = run_ranks(_killed_worker, 2, killed, False, timeout=60, allow_errors=True)
    peer = 1 - killed
    kind, msg, notes, _, _ = out[killed]
    # the killed worker's rank: its own error, as torch raised it, not a ring failure
    assert kind == "RuntimeError", out[killed]
    assert msg.startswith("DataLoader worker (pid ") and "is killed by signal" in msg, msg
    assert f"rank {killed} failed on its own inside 'iteration 2 (train_step)'" in notes, notes
    # its peer names it, with that error, within the timeout and the grace
    kind, msg, _, seconds, stalled = out[peer]
    assert kind == "StalledRankError" and stalled == [killed], out[peer]
    assert msg.startswith(f"METP: rank {killed} failed with an error of its own during "
                          f"'iteration 2 (train_step)'"), msg
    assert f"rank {killed} failed with an error of its own in 'iteration 2 (train_step)'" in msg
    assert "DataLoader worker (pid " in msg and "is killed by signal" in msg, msg
    assert "failed waiting too" not in msg and f"rank {peer} stalled" not in msg, msg
    assert seconds < 0.6 + TIMEOUT_S + grace_s(TIMEOUT_S) + 0.5, (seconds, msg)
    print(f"\n[right rank] rank {killed}'s DataLoader worker killed: rank {peer} names it after "
          f"{seconds:.2f} s: {msg[:200]}")


def test_the_wrong_variant_blames_the_peer():
    """The negative control: with every error in a wait taken for the peer's silence (as before
    this fix), rank 1, whose own worker was killed, blames rank 0 — what the test above
    rules out."""
    out = run_ranks(_killed_worker, 2, 1, True, timeout=60, allow_errors=True)
    kind, msg, _, _, stalled = out[1]
    assert kind == "StalledRankError" and stalled == [0], out[1]
    assert msg.startswith("METP: rank 0 stalled or died during"), msg
