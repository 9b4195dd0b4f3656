"""Ring exchanger: rotation order, byte/step counters, and failures that end with a message."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup, RingExchanger, RingPeerError, RingTimeoutError
from tests.harness import RankError, run_ranks


def _rotate(rank, world, numel):
    g = METPGroup.from_process_group(dist.group.WORLD, name="test-ring")
    ring = RingExchanger(g)
    seen = []
    payload = torch.full((numel,), float(rank))
    for t, buf in ring.circulate(payload):
        seen.append(int(buf[0].item()))
        assert bool((buf == buf[0]).all())
    return seen, g.stats.snapshot(), (g.prev_rank, g.next_rank)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_circulate_visits_shards_in_ring_order_and_counts_bytes(p):
    numel = 5
    out = run_ranks(_rotate, p, numel)
    for r, (seen, stats, (prev, nxt)) in enumerate(out):
        assert seen == [(r - t) % p for t in range(p)]
        assert (prev, nxt) == ((r - 1) % p, (r + 1) % p)
        # closed form: p-1 exchanges of numel fp32 each way
        assert stats == {"steps": p - 1, "bytes_sent": (p - 1) * numel * 4,
                         "bytes_received": (p - 1) * numel * 4}


def _subgroups(rank, world):
    # two rings {0,2} and {1,3} inside a world of 4: neighbours are global ranks of the subgroup
    pgs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pgs[rank % 2]
    g = METPGroup.from_process_group(mine, name=f"ring{rank % 2}")
    seen = [int(b[0].item()) for _, b in RingExchanger(g).circulate(torch.full((3,), float(rank)))]
    return g.ranks, seen


def test_rings_inside_subgroups_use_global_neighbour_ranks():
    out = run_ranks(_subgroups, 4)
    assert out[0] == ((0, 2), [0, 2]) and out[2] == ((0, 2), [2, 0])
    assert out[1] == ((1, 3), [1, 3]) and out[3] == ((1, 3), [3, 1])


def _stalled_peer(rank, world, mode):
    g = METPGroup.from_process_group(dist.group.WORLD, name="stall-test", timeout_s=1.5)
    if rank == 1:
        if mode == "die":
            os._exit(3)
        time.sleep(6)  # never posts its half of the exchange
        return "slept"
    t0 = time.monotonic()
    try:
        for _ in RingExchanger(g, "probe").circulate(torch.zeros(4)):
            pass
    except (RingTimeoutError, RingPeerError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error"


@pytest.mark.parametrize("mode", ["stall", "die"])
def test_peer_that_never_answers_fails_with_group_step_and_peer(mode):
    out = run_ranks(_stalled_peer, 2, mode, allow_errors=True, timeout=30)
    kind, msg, elapsed = out[0]
    assert kind in ("RingTimeoutError", "RingPeerError")
    assert "stall-test" in msg and "step 0" in msg and "peer 1" in msg and "probe" in msg
    assert elapsed < 5.0
    print(f"\n[fault] ring step, peer {mode}s (timeout 1.5 s): {kind} after {elapsed:.2f} s: "
          f"{msg[:160]}")


def test_single_rank_group_has_nothing_to_exchange():
    g = METPGroup.single()
    assert (g.size, g.rank) == (1, 0)
    steps = list(RingExchanger(g).circulate(torch.ones(2)))
    assert len(steps) == 1 and g.stats.steps == 0


def _world_size(rank, world):
    return dist.get_world_size()


def test_harness_retries_a_group_that_failed_to_form(monkeypatch, tmp_path):
    """The first start's rendezvous fails (as gloo's mesh connect occasionally does on loopback):
    run_ranks starts the group again; a failure inside the test function is never retried."""
    import tests.harness as harness

    marker = tmp_path / "failed-once"
    real_init = dist.init_process_group

    def flaky_init(*args, **kwargs):
        if kwargs.get("rank") == 1 and not marker.exists():
            marker.write_text("x")
            raise RuntimeError("Gloo connectFullMesh failed (injected)")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(harness.dist, "init_process_group", flaky_init)
    assert run_ranks(_world_size, 2) == [2, 2]
    assert marker.exists()


def _subgroup_mesh_fails_once(rank, world, marker):
    """Rank 1 fails the way gloo does when a subgroup's full-mesh connect breaks, once."""
    import os

    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by "
                           "peer (injected)")
    dist.new_group([0, 1])
    return rank


def _mesh_failure_and_a_real_error(rank, world):
    if rank == 1:
        raise RuntimeError("Gloo connectFullMesh failed (injected)")
    raise ValueError("a real failure")


def test_harness_reruns_a_test_whose_subgroup_failed_to_connect(tmp_path):
    assert run_ranks(_subgroup_mesh_fails_once, 3, str(tmp_path / "m"), timeout=30) == [0, 1, 2]
    # negative control: a real error next to the transport failure is reported, not rerun
    with pytest.raises(RankError, match="a real failure"):
        run_ranks(_mesh_failure_and_a_real_error, 2, timeout=30)


def test_bounded_wait_names_the_kind_and_keeps_the_callers_message():
    """runtime.bounded_wait, the wait the ring and the agreement check share: a CPU wait passes
    the group's timeout, a CUDA one none; the transport's first line goes into the caller's
    message; a timeout is a RingTimeoutError, anything else a RingPeerError (negative control:
    a work that completes raises nothing)."""
    from types import SimpleNamespace

    from megatron_metp.runtime.bounded_wait import wait_bounded

    group = SimpleNamespace(timeout="T", rank=0, size=2, ranks=[0, 1])
    seen = []

    class Work:
        def __init__(self, error=None):
            self.error = error

        def wait(self, *timeout):
            seen.append(timeout)
            if self.error:
                raise RuntimeError(self.error)

    msg = lambda first: f"waiting for peer 1: {first}"  # noqa: E731
    wait_bounded([Work(), Work()], group, cuda=False, message=msg)
    wait_bounded([Work()], group, cuda=True, message=msg)
    assert seen == [("T",), ("T",), ()]
    with pytest.raises(RingTimeoutError, match=r"^waiting for peer 1: \[x.cc:1\] Timed out "
                                               r"waiting 1000ms$"):
        wait_bounded([Work("[x.cc:1] Timed out waiting 1000ms\nmore")], group, cuda=False,
                     message=msg)
    with pytest.raises(RingPeerError, match="Connection closed by peer") as err:
        wait_bounded([Work("Connection closed by peer")], group, cuda=False, message=msg)
    assert not isinstance(err.value, RingTimeoutError)
