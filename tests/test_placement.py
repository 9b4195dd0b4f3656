"""Start-up placement check: no METP ring may span two nodes (host names faked per rank)."""

import pytest

from tests.harness import run_ranks


def _init(rank, world, p, c, hosts):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.parallel import initialize_model_parallel
    from megatron_metp.runtime.placement import METPPlacementError

    cpu.enable()
    try:
        groups = initialize_model_parallel(1, 1, p, context_parallel_size=c,
                                           create_gloo_process_groups=False,
                                           hostname=hosts[rank])
    except METPPlacementError as exc:
        return "refused", str(exc)
    return "ok", (groups.metp.ranks, groups.metp.sequence_ring.ranks)


def test_metp_rings_on_one_node_each_pass_with_cp_crossing_nodes():
    """METP 2 × CP 2 on 2 'nodes' of 2 ranks: each METP ring on its node, the CP group (K/V
    ring) across both: accepted."""
    out = run_ranks(_init, 4, 2, 2, ["n1", "n1", "n2", "n2"])
    assert [o[0] for o in out] == ["ok"] * 4
    assert out[0][1] == ((0, 1), (0, 1, 2, 3)) and out[3][1] == ((2, 3), (0, 1, 2, 3))


@pytest.mark.parametrize("hosts", [["n1", "n2", "n2", "n2"], ["n1", "n1", "n1", "n2"]])
def test_a_metp_ring_across_two_nodes_is_refused_on_every_rank_naming_the_fix(hosts):
    out = run_ranks(_init, 4, 2, 2, hosts)
    assert [o[0] for o in out] == ["refused"] * 4, out
    bad = [0, 1] if hosts[0] != hosts[1] else [2, 3]
    for _, msg in out:
        assert f"METP group of global ranks {bad} spans 2 nodes" in msg, msg
        assert "--metp-parallel-size" in msg and "--context-parallel-size" in msg
        assert "divisor of the GPUs per node" in msg


def _init_allowed(rank, world, hosts, allow):
    import os

    os.environ["METP_ALLOW_CROSS_NODE_RING"] = allow
    try:
        return _init(rank, world, 2, 2, hosts)
    except ValueError as exc:
        return "bad value", str(exc)


def test_cross_node_ring_accepted_on_purpose_with_the_variable():
    """METP_ALLOW_CROSS_NODE_RING=1 (e.g. gpt-13b-256k-metp16.sh: METP 16 over 2 nodes) turns
    the refusal into rank 0's warning line; another value is refused naming the variable."""
    out = run_ranks(_init_allowed, 4, ["n1", "n2", "n2", "n2"], "1")
    assert [o[0] for o in out] == ["ok"] * 4
    out = run_ranks(_init_allowed, 4, ["n1", "n2", "n2", "n2"], "yes")
    assert all(o[0] == "bad value" and "METP_ALLOW_CROSS_NODE_RING='yes'" in o[1] for o in out)


@pytest.mark.parametrize("world, tp, metp, per_node, spanning", [
    (4, 1, 2, 2, []),                                    # tiny-cpu-metp2(-cp2) on 2 nodes x 2
    (4, 1, 2, 1, [((0, 1), (0, 1)), ((2, 3), (2, 3))]),  # 2 ranks per METP ring, 1 per node
    (6, 1, 2, 3, [((2, 3), (0, 1))]),                    # 3 per node: the middle ring crosses
    (16, 2, 4, 8, []),                                   # TP x METP = 8 = one node
    (16, 1, 16, 8, [(tuple(range(16)), (0, 1))]),        # gpt-13b-256k-metp16.sh: 2 nodes
    (8, 2, 2, 2, [((0, 2), (0, 1)), ((1, 3), (0, 1)), ((4, 6), (2, 3)), ((5, 7), (2, 3))]),
    (8, 1, 1, 1, []),                                    # no METP
])
def test_the_launcher_finds_every_metp_ring_across_nodes_from_the_layout(world, tp, metp,
                                                                          per_node, spanning):
    """The preflight's layout check (no process group): METP groups are METP ranks of stride
    TP in blocks of TP x METP consecutive ranks, numbered node by node."""
    from megatron_metp.runtime.ring_nodes import metp_groups_across_nodes

    assert metp_groups_across_nodes(world, tp, metp, per_node) == spanning


def test_the_ranks_name_their_slurm_node(monkeypatch):
    """Under Slurm a rank's node is $SLURMD_NODENAME (several slurmd may share one host), else
    the host name."""
    import socket

    from megatron_metp.runtime.placement import node_name

    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    assert node_name() == "n2"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert node_name() == socket.gethostname()
