"""Partial host offload in the plan (tools/plan/partial.py, recompute.py): when the node's host
memory cannot hold every offloaded layer, ``metp plan`` offloads as many as it holds and keeps
the rest on the device; ``longest_seq`` and the reach search use that split; an explicit
``--offload-activations N`` is planned as given and validated; ``metp measure`` of the split
agrees with the plan."""

import dataclasses
import json

import pytest

from megatron_metp import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import search as R
from tests.test_host_plan import JOB, LLAMA

GiB = 2 ** 30
X = 2 * (LLAMA.seq // 8) * LLAMA.hidden  # one layer input [s/p, b, h], bf16: 4 GiB at 4M


def _mem(job, seq=None):
    return P.memory(LLAMA, job, "metp", seq)


def test_auto_split_offloads_the_most_layers_the_host_holds():
    small = dataclasses.replace(JOB, host_memory_gib=1000)
    mem = _mem(small)
    n = mem.act.offloaded_layers
    assert 0 < n < 32 and mem.job.offload_layers == n
    host = lambda k: 8 * _mem(dataclasses.replace(small, offload_layers=k)).act.host  # noqa: E731
    assert host(n) <= 1000 * GiB < host(n + 1)
    assert host(n) - host(n - 1) == 8 * X  # one layer input per offloaded layer and rank
    plan = P.plan(LLAMA, small, ["metp"])["modes"]["metp"]
    assert plan["fits_host"] and plan["offload_auto"] and plan["offloaded_layers"] == n
    text = P.report(LLAMA, small, ["metp"])
    assert f"{n} of 32 (auto)" in text and f"--metp-offload-activations {n}" in text
    # negative control: every layer offloaded does not fit this host (planned as given)
    assert not P.plan(LLAMA, dataclasses.replace(small, offload_layers=32),
                      ["metp"])["modes"]["metp"]["fits_host"]
    # a host that holds them all: no split
    assert _mem(JOB).job.offload_layers is None and _mem(JOB).act.offloaded_layers == 32


def test_device_bytes_of_a_split_streaming():
    """The streaming layer (full recompute, one layer per checkpoint): each kept layer keeps its
    input on the device, and nothing is prefetched (offloaded layers read their input from the
    host tile by tile), so every kept layer costs one input; the last layer kept also keeps the
    final norm's input and its head-group outputs and d(qkv) on the device in its backward."""
    dev = lambda k: _mem(dataclasses.replace(JOB, offload_layers=k))  # noqa: E731
    assert dev(24).total - dev(28).total == pytest.approx(4 * X)
    assert dev(30).total - dev(31).total == pytest.approx(X)
    assert dev(31).act.layer_transient > dev(32).act.layer_transient
    assert dev(31).total - dev(32).total > 2 * X  # its input and the final norm's
    # host: one layer input per offloaded layer, and while one runs its backward its stashes
    assert dev(32).act.host - dev(31).act.host == pytest.approx(X)


def test_device_bytes_of_a_split(monkeypatch):
    """Megatron's checkpoint path (``METP_STREAMING_LAYER=0``): each kept layer keeps its input
    on the device; with one layer kept the lowest kept layer's backward also holds the
    prefetched last offloaded one (as two kept)."""
    monkeypatch.setenv("METP_STREAMING_LAYER", "0")
    dev = lambda k, **kw: _mem(dataclasses.replace(JOB, offload_layers=k, **kw)).total  # noqa
    assert dev(24) - dev(28) == pytest.approx(4 * X)
    assert dev(31) == pytest.approx(dev(30))
    assert dev(30, offload_prefetch=False) - dev(31, offload_prefetch=False) == pytest.approx(X)
    assert dev(31) == pytest.approx(_mem(JOB).total)  # the full offload holds two inputs too
    # no recompute: a kept layer keeps everything it saves
    plain = dataclasses.replace(JOB, recompute="none", offload_layers=16)
    a = P.activations(LLAMA, plain, "metp")
    assert a.offloaded_layers == 16 and a.host > 0
    assert P.activations(LLAMA, dataclasses.replace(plain, offload_layers=8), "metp").stored > \
        a.stored


def test_longest_sequence_and_reach_use_the_split():
    small = dataclasses.replace(JOB, host_memory_gib=1000)
    auto = P.longest_seq(LLAMA, small, "metp")
    every = P.longest_seq(LLAMA, dataclasses.replace(small, offload_layers=32), "metp")
    assert auto > every  # host-bound with every layer offloaded
    mem = _mem(small, auto)
    assert 0 < mem.act.offloaded_layers < 32
    assert mem.total <= P.capacity_bytes(small) and 8 * mem.act.host <= 1000 * GiB
    llama = P.PRESETS["llama3-8b"]
    kw = dict(recompute=("full + offload",), optimizer_offload=(False,))
    split = R.candidates(llama, 8, "metp", host_gib=1000, **kw)[0]
    roomy = R.candidates(llama, 8, "metp", host_gib=100000, **kw)[0]
    assert split.offload_layers is not None and "layers per stage offloaded" in split.describe()
    assert split.host_per_node <= 1000 * GiB and split.seq > 0
    assert roomy.offload_layers is None and roomy.seq >= split.seq


def test_offload_count_is_validated_naming_the_flag(capsys, tmp_path):
    base = ["plan", "--preset", "llama3-8b", "--layers", "4", "--metp", "8", "--modes", "metp",
            "--recompute", "full"]
    assert cli.main(base + ["--offload-activations", "5"]) == 2
    assert "--offload-activations N: 5 layers offloaded, but a pipeline stage has 4 layers" in \
        capsys.readouterr().err
    assert cli.main(base + ["--offload-activations", "3", "--recompute-num-layers", "2"]) == 2
    assert "offload a multiple of 2 (2, 4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(base + ["--offload-activations", "0"])
    assert "N must be a positive number of layers" in capsys.readouterr().err
    assert cli.main(base + ["--offload-activations", "2"]) == 0
    out = capsys.readouterr().out
    assert "offloaded layers / stage" in out and "2 of 4" in out
    cfg = tmp_path / "off.sh"
    cfg.write_text(': "${METP_OFFLOAD_ACTIVATIONS:=1}" "${METP_OFFLOAD_LAYERS:=2}"\n'
                   ': "${RECOMPUTE_GRANULARITY:=full}" "${NUM_LAYERS:=4}"\n')
    assert P.from_config(str(cfg))[1]["offload_layers"] == 2
    cfg.write_text(': "${METP_OFFLOAD_ACTIVATIONS:=2}"\n')
    with pytest.raises(ValueError, match="METP_OFFLOAD_ACTIVATIONS=2 .*METP_OFFLOAD_LAYERS=N"):
        P.from_config(str(cfg))
    cfg.write_text(': "${METP_OFFLOAD_LAYERS:=2}"\n')
    with pytest.raises(ValueError, match="METP_OFFLOAD_LAYERS=2 .*without"):
        P.from_config(str(cfg))


SMALL = ["--hidden", "256", "--layers", "4", "--heads", "4", "--query-groups", "2", "--ffn",
         "512", "--vocab", "1000", "--seq", "16384", "--swiglu", "--untie", "--metp", "2",
         "--vocab-parallel", "--distributed-optimizer", "--recompute", "full", "--modes", "metp",
         "--measure-layers", "full"]


def test_measure_of_the_split_agrees_with_the_plan(tmp_path, capsys, monkeypatch):
    """``metp measure`` with a host of 0.1 GiB per node: 2 of 4 layers offloaded (80 MiB per
    node of 8), measured on the real model under the fake group: host bytes exactly the plan's,
    the device peak within 1 %. Megatron's checkpoint path (``METP_STREAMING_LAYER=0``; the
    streaming layer's split: tests/test_offload_partial.py)."""
    monkeypatch.setenv("METP_STREAMING_LAYER", "0")
    out = tmp_path / "m.json"
    rc = cli.main(["measure", *SMALL, "--offload-activations", "--host-memory-gib", "0.1",
                   "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "2 of 4 layers per stage offloaded, 2 kept on the device" in text
    res = json.loads(out.read_text())
    r = res["results"][0]
    model, job = P.Model(**res["model"]), P.Job(**res["job"])
    mem = P.memory(model, job, "metp")
    assert mem.act.offloaded_layers == 2
    assert r["host_peak"] == pytest.approx(mem.act.host, rel=0.01)
    assert r["planned_measured_part"] == pytest.approx(r["peak"], rel=0.01)
    # negative control: the plan of every layer offloaded is off on the host side
    every = P.memory(model, dataclasses.replace(job, offload_layers=4), "metp")
    assert every.act.host > 1.2 * r["host_peak"]
