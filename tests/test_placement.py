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
