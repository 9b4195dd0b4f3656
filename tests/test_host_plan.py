"""Host memory as a planned constraint (tools/plan/host.py): presets' host RAM per node,
--host-memory-gib, "fits" and the longest sequence bounded by the pinned host bytes per node."""

import dataclasses

import pytest

from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import host as H
from megatron_metp.tools.plan.rank_memory import seq_step

LLAMA = P.Model(hidden=4096, layers=32, heads=32, query_groups=8, ffn=14336, vocab=128257,
                seq=4194304, swiglu=True, tied=False)
JOB = P.Job(tp=1, metp=8, vocab_parallel=True, distributed_optimizer=True, recompute="full",
            offload=True, hardware="H100-80GB")


def test_presets_have_host_memory_with_sources():
    for name in P.HARDWARE:
        assert H.HOST_MEMORY_GIB[name] == pytest.approx(1862.645, abs=1e-3)  # 2 TB
        assert "2 TB" in H.HOST_MEMORY_SOURCES[name]
    assert H.host_capacity_bytes(JOB) == 2e12
    assert H.host_capacity_bytes(dataclasses.replace(JOB, host_memory_gib=100)) == 100 * 2 ** 30


def test_host_binds_the_longest_sequence():
    host = lambda job, s: P.memory(dataclasses.replace(LLAMA, seq=s), job, "metp").act.host  # noqa: E731
    at_4m = host(JOB, LLAMA.seq)
    # per rank: the 32 layer inputs [s/8, h] (bf16, 4 GiB each) and, while one layer runs its
    # backward, the streaming layer's host stashes of that layer (every head group's output
    # [s/8, A·d] and dq [s/8, A·d], the d(kv) stashes [s/8, 2G·d] filling only as the output
    # stashes empty, group by group: ops/layer_reads.py: 8 GiB): 1,088 GiB per node of 8 (1,104
    # while the recompute kept the k/v projections too)
    n, h, d = LLAMA.seq // 8, LLAMA.hidden, LLAMA.hidden // LLAMA.heads
    per_rank = 32 * n * h * 2 + n * (2 * LLAMA.heads) * d * 2
    assert 8 * at_4m == per_rank * 8 and 8 * at_4m / 2 ** 30 == pytest.approx(1088.0, abs=0.5)
    plan = P.plan(LLAMA, JOB, ["metp"])["modes"]["metp"]
    assert plan["fits_host"] and plan["host_per_node"] == pytest.approx(8 * at_4m)
    # every layer offloaded (--offload-activations 32): the host binds
    small = dataclasses.replace(JOB, host_memory_gib=1000, offload_layers=32)
    assert not P.plan(LLAMA, small, ["metp"])["modes"]["metp"]["fits_host"]
    free = P.longest_seq(LLAMA, JOB, "metp")
    bound = P.longest_seq(LLAMA, small, "metp")
    assert bound < free
    q = seq_step(small, "metp")
    assert 8 * host(small, bound) <= 1000 * 2 ** 30 < 8 * host(small, bound + q)
    # negative control: without offload nothing is pinned and the host does not bind
    dev = dataclasses.replace(JOB, offload=False)
    assert P.plan(LLAMA, dev, ["metp"])["modes"]["metp"]["fits_host"]


def test_host_memory_flag_refused_without_offload_and_when_not_positive():
    with pytest.raises(ValueError, match="--host-memory-gib.*--offload-activations"):
        P.validate(LLAMA, dataclasses.replace(JOB, offload=False, host_memory_gib=500))
    with pytest.raises(ValueError, match="--host-memory-gib must be a positive"):
        P.validate(LLAMA, dataclasses.replace(JOB, host_memory_gib=0))


def test_report_shows_both_sides():
    text = P.report(LLAMA, dataclasses.replace(JOB, host_memory_gib=1000, offload_layers=32),
                    ["metp"])
    assert "host memory per node" in text and "fits host memory" in text and " NO" in text
    assert "32 of 32" in text and "(auto)" not in text
    line = H.host_report(JOB, 132.25 * 2 ** 30, 132.25 * 2 ** 30)
    assert "1,058 GiB per node" in line and "1,863 GiB per node: fits" in line


def test_dry_run_report_shows_host_memory_per_node_against_the_node():
    from megatron_metp.tools import dry_run
    from tests.test_scripts import _report

    r = _report(70)
    r["bytes"]["host"] = 198.375 * 2 ** 30  # Llama-3-8B at 6M tokens, per rank
    text = dry_run.format_report(r, gpu_memory_gib=80)
    assert "1,587 GiB per node of 8" in text
    assert "fits in 1,863 GiB of host memory per node (a DGX node's 2 TB" in text
    assert "DOES NOT FIT in 1,000 GiB of host memory per node" in \
        dry_run.format_report(r, gpu_memory_gib=80, host_memory_gib=1000)


def test_no_prefetch_plans_one_layer_input_less_and_its_exposed_copies(monkeypatch):
    """Megatron's checkpoint path (METP_STREAMING_LAYER=0): the prefetched layer input. The
    streaming layer reads its input from the host tile by tile and has none to prefetch."""
    from megatron_metp.tools.plan.cost import step_cost

    streaming = P.memory(dataclasses.replace(LLAMA, seq=6291456), JOB, "metp").total
    assert streaming == P.memory(dataclasses.replace(LLAMA, seq=6291456),
                                 dataclasses.replace(JOB, offload_prefetch=False), "metp").total
    monkeypatch.setenv("METP_STREAMING_LAYER", "0")

    six = dataclasses.replace(LLAMA, seq=6291456)
    nop = dataclasses.replace(JOB, offload_prefetch=False)
    a, b = P.memory(six, JOB, "metp"), P.memory(six, nop, "metp")
    x = 2 * (6291456 // 8) * 4096  # one layer input, bf16
    assert a.total - b.total == pytest.approx(x)
    assert a.total / 2 ** 30 > 76 > b.total / 2 ** 30  # 77.41 vs 71.41 GiB
    ca, cb = step_cost(six, JOB, "metp"), step_cost(six, nop, "metp")
    assert ca["offload_hidden"] and not cb["offload_hidden"]
    from megatron_metp.tools.plan.host_link import host_copy_gbps

    assert cb["step_s"] - ca["step_s"] == pytest.approx(b.act.host /
                                                        (host_copy_gbps("H100-80GB") * 1e9))
    with pytest.raises(ValueError, match="--no-offload-prefetch"):
        P.validate(six, dataclasses.replace(nop, offload=False))
