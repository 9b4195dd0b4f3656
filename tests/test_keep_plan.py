"""Kept attention in the plan (tools/plan/keep.py, partial.resolve_keep; issue 41, Deliver 1):
a METP layer that keeps its attention output O and its log-sum-exp loses its attention re-forward
(``attention_recompute`` × kept / recomputed layers, and the streaming layer's recompute passes),
and keeps ``O`` (bf16 ``[s/p, a·d]``) + LSE (fp32 ``[a, s/p]``) per rank: on the host where the
layer is offloaded, else on the device; ``--keep-attention-output`` without N keeps as many layers
as the node's host and the device hold; a config's ``--metp-keep-attention-output [N]`` maps onto
it; launch lines and written configs carry the count. Negative controls: stock modes, no
recompute, a bad N."""

import dataclasses
import os
import json

import pytest

from megatron_metp.ops.layer_reads import host_reads
from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import config as C
from megatron_metp.tools.plan.model import KEEP_AUTO
from tests.test_host_plan import JOB, LLAMA

GiB = 2 ** 30
N_TOK = 3700000 // 8  # tokens per rank of ALST's job (3.7M on METP 8)
AT_37M = LLAMA.with_seq(3700000)
KEPT = 2 * N_TOK * 4096 + 4 * N_TOK * 32  # O bf16 [n, 32·128] + LSE fp32 [32, n]


def _keep(n, **kw):
    return dataclasses.replace(JOB, keep_attention_output=n, **kw)


def test_kept_layers_drop_the_attention_recompute_proportionally():
    base = P.step_time(AT_37M, JOB, "metp")["components"]
    for n in (8, 16, 32):
        c = P.step_time(AT_37M, _keep(n), "metp")["components"]
        assert c["attention_recompute"] == pytest.approx(base["attention_recompute"] * (32 - n)
                                                         / 32)
        assert c["attention_fwd"] == base["attention_fwd"]
        assert c["attention_bwd"] == base["attention_bwd"]
    # the recompute FLOPs lose the attention core of each kept layer
    f0, f16 = P.step_cost(AT_37M, JOB, "metp"), P.step_cost(AT_37M, _keep(16), "metp")
    fa = 2 * N_TOK * AT_37M.seq * 4096
    assert f0["flops"] - f16["flops"] == pytest.approx(16 * fa)
    # block recompute of the first 8 layers: only those re-run the attention, so keep 16 = 8
    block = dict(recompute_method="block", recompute_num_layers=8)
    b8 = P.step_time(AT_37M, _keep(8, **block), "metp")["components"]
    b16 = P.step_time(AT_37M, _keep(16, **block), "metp")
    assert b16["components"]["attention_recompute"] == b8["attention_recompute"] == 0
    assert b16["kept_attention_layers"] == 8
    # negative control: stock layers keep nothing (mode ring, same job)
    ring = dict(vocab_parallel=False)
    assert P.step_time(AT_37M, _keep(16, **ring), "ring")["components"][
        "attention_recompute"] == P.step_time(AT_37M, dataclasses.replace(JOB, **ring), "ring")[
        "components"]["attention_recompute"] > 0


def test_the_streaming_passes_of_a_kept_layer():
    """A kept offloaded streaming layer runs no recompute pass: its backward reads its input
    2p + 2 times, not 2p + 3 (ops/layer_reads.host_reads), and the exposed copies are its
    table's."""
    lay = P.layout("metp", JOB)
    c = P.step_cost(AT_37M, _keep(12), "metp")
    plain, kept = c["host_passes"], c["host_passes_kept"]
    assert not any(x["pass"].startswith("recompute") for x in kept)
    host_reads_total = lambda p, kept=False: sum(host_reads(p, kept=kept).values())  # noqa: E731
    reads = lambda t: sum(x["count"] * x["x_reads"] for x in t  # noqa: E731
                          if not x["pass"].startswith("forward"))
    assert reads(plain) == host_reads_total(lay.p) == 2 * lay.p + 3
    assert reads(kept) == host_reads_total(lay.p, kept=True) == 2 * lay.p + 2
    exposed = lambda t: sum(x["count"] * x["exposed_s"] for x in t)  # noqa: E731
    assert c["host_copy_exposed_s"] == pytest.approx(20 * exposed(plain) + 12 * exposed(kept))
    assert sum(x["count"] * x["bytes"] for x in kept) < sum(x["count"] * x["bytes"]
                                                            for x in plain)


def test_host_bytes_rise_by_o_and_lse_per_kept_offloaded_layer():
    mem = lambda j: P.memory(AT_37M, j, "metp")  # noqa: E731
    assert mem(_keep(11)).act.host - mem(_keep(10)).act.host == pytest.approx(KEPT)
    assert mem(_keep(10)).act.host - mem(JOB).act.host == pytest.approx(10 * KEPT)
    assert mem(_keep(10)).total == pytest.approx(mem(JOB).total)  # nothing on the device
    # offloaded layers 1-16: layers 17-20 keep O + LSE on the device, the host as with 16
    part = dict(offload_layers=16)
    m16, m20 = mem(_keep(16, **part)), mem(_keep(20, **part))
    assert (m16.act.kept_attention_host_layers, m20.act.kept_attention_host_layers) == (16, 16)
    assert m20.act.host == pytest.approx(m16.act.host)
    assert m20.act.stored - m16.act.stored == pytest.approx(4 * KEPT)
    # the last layer kept on the device: its phases' O stashes and LSEs are the kept ones,
    # counted once (4 more layers store O + LSE, the peak rises by 3)
    last = dict(offload_layers=28)
    assert mem(_keep(32, **last)).act.stored - mem(_keep(28, **last)).act.stored == \
        pytest.approx(4 * KEPT)
    assert mem(_keep(32, **last)).total - mem(_keep(28, **last)).total == pytest.approx(3 * KEPT)
    # every offloaded layer kept: the streaming layer's O stash is its kept O (no second one)
    # (a node of 1,900 GiB holds them all)
    big = dict(host_memory_gib=1900)
    assert mem(_keep(32, **big)).act.host - mem(_keep(31, **big)).act.host == pytest.approx(
        KEPT - 2 * N_TOK * 4096)


def test_auto_keeps_the_most_layers_the_host_holds():
    """ALST's job (3.7M on 8 × H100): the 2 TB node holds O + LSE of all 32 layers (1,849 GiB
    of 1,862.65: the streaming layer keeps no k/v projections on the host); a node of 1,800 GiB
    holds 29 (30 would not fit): the choice is the host's, not a constant."""
    host = lambda k, **kw: 8 * P.memory(AT_37M, _keep(k, offload_layers=32, **kw),  # noqa: E731
                                        "metp").act.host
    plan = P.plan(AT_37M, _keep(P.model.KEEP_AUTO), ["metp"])["modes"]["metp"]
    assert plan["kept_attention_layers"] == 32 and plan["keep_auto"] and plan["fits_host"]
    assert host(32) <= 2e12 and plan["host_per_node"] == pytest.approx(host(32))
    small = dict(host_memory_gib=1800)
    plan = P.plan(AT_37M, _keep(P.model.KEEP_AUTO, **small), ["metp"])["modes"]["metp"]
    n = plan["kept_attention_layers"]
    assert n == 29 and plan["fits_host"]
    assert host(n, **small) <= 1800 * GiB < host(n + 1, **small)  # negative control: n + 1
    assert plan["host_per_node"] == pytest.approx(host(n, **small))
    text = P.report(AT_37M, _keep(P.model.KEEP_AUTO, **small), ["metp"])
    assert "29 of 32 (auto)" in text and "--metp-keep-attention-output 29" in text
    # negative control: an explicit 32 does not fit the 1,800 GiB node
    assert not P.plan(AT_37M, _keep(32, offload_layers=32, **small), ["metp"])["modes"]["metp"][
        "fits_host"]


def test_auto_keeps_the_most_layers_the_device_holds():
    """Without offload the kept O + LSE stay on the device: as many layers as fit in 78 GiB."""
    job = _keep(P.model.KEEP_AUTO, offload=False)
    m = LLAMA.with_seq(1048576)
    n = P.memory(m, job, "metp").act.kept_attention_layers
    total = lambda k: P.memory(m, _keep(k, offload=False), "metp").total  # noqa: E731
    cap = P.capacity_bytes(job)
    assert n == 23 and total(n) <= cap < total(n + 1)
    assert total(n) - total(0) == pytest.approx(23 * (2 * 131072 * 4096 + 4 * 131072 * 32))
    # negative control: a sequence whose job does not fit without kept attention keeps none
    assert P.memory(LLAMA.with_seq(2097152), job, "metp").act.kept_attention_layers == 0


def test_config_flag_maps_and_the_cli_wins(tmp_path):
    def cfg(extra):
        p = tmp_path / "k.sh"
        p.write_text('source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"\n'
                     ': "${METP:=8}" "${TP:=1}"\n: "${RECOMPUTE_GRANULARITY:=full}"\n'
                     f'EXTRA_ARGS=({extra} ${{EXTRA_ARGS[@]+"${{EXTRA_ARGS[@]}}"}})\n')
        (tmp_path / "models").mkdir(exist_ok=True)
        (tmp_path / "models" / "llama3-8b.sh").write_text(
            open("configs/models/llama3-8b.sh").read())
        return str(p)

    job = lambda *a: cli.build_from_argv(list(a))[1]  # noqa: E731
    assert job("--config", cfg("--metp-keep-attention-output 12")).keep_attention_output == 12
    assert job("--config", cfg("--metp-keep-attention-output=7")).keep_attention_output == 7
    assert job("--config", cfg("--metp-keep-attention-output")).keep_attention_output == 32
    assert job("--config", cfg("--metp-keep-attention-output"), "--keep-attention-output",
               "5").keep_attention_output == 5
    assert job("--config", cfg("--metp-keep-attention-output 12"),
               "--keep-attention-output").keep_attention_output == P.model.KEEP_AUTO
    # negative controls: no flag, no keep; a bad N named
    assert job("--config", cfg("--log-interval 1")).keep_attention_output is None
    with pytest.raises(ValueError, match="--metp-keep-attention-output 'x'"):
        job("--config", cfg("--metp-keep-attention-output=x"))
    assert C.keep_flag(["--metp-keep-attention-output", "--bf16"], 32) == 32


def test_refusals_name_the_flag(capsys):
    with pytest.raises(ValueError, match="--keep-attention-output with --recompute none"):
        P.validate(LLAMA, _keep(4, recompute="none", offload=False), ["metp"])
    with pytest.raises(ValueError, match="METP layers only"):
        P.validate(LLAMA, _keep(4, vocab_parallel=False), ["tp-sp"])
    with pytest.raises(ValueError, match="positive number of layers"):
        P.validate(LLAMA, _keep(-3), ["metp"])
    with pytest.raises(SystemExit):  # argparse: the type check of N
        cli.main(["plan", "--preset", "llama3-8b", "--keep-attention-output", "0"])
    assert "N must be a positive number" in capsys.readouterr().err
    assert cli.main(["plan", "--reach", "--gpus", "8", "--preset", "llama3-8b",
                     "--keep-attention-output"]) == 2
    assert "--keep-attention-output: --reach" in capsys.readouterr().err


def test_launch_line_and_written_config_carry_the_count(tmp_path):
    m = LLAMA.with_seq(3700000)
    flags = P.megatron_flags(m, _keep(P.model.KEEP_AUTO, host_memory_gib=1800), "metp")
    i = flags.index("--metp-keep-attention-output")
    assert flags[i + 1] == "29"  # the count the plan resolves (test above), not "auto"
    text = P.config_text(m, _keep(12, optimizer_offload=True), "metp", "t")
    assert text.count("EXTRA_ARGS=") == 1 and "--metp-keep-attention-output 12" in text
    assert "--optimizer-cpu-offload" in text
    path = tmp_path / "w.sh"
    path.write_text(text)
    back = cli.build_from_argv(["--config", str(path)])[1]
    assert back.keep_attention_output == 12 and back.optimizer_offload
    # negative control: a stock mode's launch carries no METP flag
    assert "--metp-keep-attention-output" not in P.megatron_flags(
        m, _keep(12, vocab_parallel=False), "tp-sp")


def test_keeping_attention_on_alsts_job(tmp_path):
    """3.7M tokens on 8 x H100, every layer offloaded: ``--keep-attention-output`` keeps all 32
    layers (the node's 2 TB) and METP takes <= 0.5 x ALST's measured 6,455 s; the JSON names the
    kept layers and the host per node (within the node's)."""
    out = tmp_path / "f.json"
    assert cli.main(["plan", "--preset", "llama3-8b", "--seq", "3700000", "--metp", "8",
                     "--vocab-parallel", "--distributed-optimizer", "--recompute", "full",
                     "--offload-activations", "--hardware", "H100-80GB", "--modes", "metp",
                     "alst", "--keep-attention-output", "--json", str(out)]) == 0
    d = json.loads(out.read_text())["modes"]
    m = d["metp"]
    assert m["cost"]["step_s"] <= 0.5 * 6455 and m["kept_attention_layers"] == 32
    assert m["host_per_node"] <= m["host_capacity_per_node"]
    assert d["alst"]["kept_attention_layers"] == 0


def _plan_json(tmp_path, *argv):
    out = tmp_path / "p.json"
    assert cli.main(["plan", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())["modes"]


def test_done_when_the_4m_config_keeps_attention(tmp_path):
    """Issue 41's done-when on configs/llama3-8b-4m-metp8.sh at ALST's 3.7M tokens: METP with the
    config's kept attention (every layer; the first 28 offloaded) <= 0.5 x ALST's measured
    6,455 s with published rates, and with ALST's kernel (fa2) <= 0.8 x the alst mode's time; the
    host per node within the node's. Negative control: the same config without the kept
    attention misses the first bound."""
    cfg = "configs/llama3-8b-4m-metp8.sh"
    job = cli.build_from_argv(["--config", cfg])[1]
    assert (job.keep_attention_output, job.offload_layers) == (32, 28)
    args = ["--seq", "3700000", "--hardware", "H100-80GB", "--modes", "metp+vocab", "alst"]
    d = _plan_json(tmp_path, "--config", cfg, *args)
    m = d["metp+vocab"]
    assert m["cost"]["step_s"] <= 0.5 * 6455 and m["kept_attention_layers"] == 32
    assert m["host_per_node"] <= m["host_capacity_per_node"] and m["fits_host"]
    f = _plan_json(tmp_path, "--config", cfg, *args, "--kernel", "fa2")
    assert f["metp+vocab"]["cost"]["step_s"] <= 0.8 * f["alst"]["cost"]["step_s"]
    plain = tmp_path / "plain.sh"
    plain.write_text(f'source "{os.path.abspath(cfg)}"\nEXTRA_ARGS=()\n')
    p = _plan_json(tmp_path, "--config", str(plain), *args)["metp+vocab"]
    assert p["kept_attention_layers"] == 0 and p["cost"]["step_s"] > 0.5 * 6455


def test_a_planner_job_keeps_what_megatron_lms_flag_keeps(monkeypatch):
    """``settings_for`` passes the count the plan prices into ``METPSettings``: a planner job
    with ``keep_attention_output = N`` gives the value Megatron-LM's
    ``--metp-keep-attention-output N`` gives; a whole stage (a config's bare flag) is the bare
    flag's ``True``; no N is the count ``resolve_keep`` chooses. Negative controls: another N,
    a stock mode, the flag dropped."""
    from megatron_metp.megatron_lm.settings_args import metp_settings
    from megatron_metp.tools.plan.settings import settings_for
    from tests.harness import unset_env
    from tests.test_settings import _megatron_args, _same

    unset_env(monkeypatch, "METP_ROPE_RECIPE")
    model = P.Model(hidden=256, layers=8, heads=4, ffn=512, vocab=1000, seq=16384)
    job = P.Job(metp=2, recompute="full", keep_attention_output=3)

    def megatron(*flags):
        return _same(metp_settings(_megatron_args("--metp-parallel-size", "2", *flags)))

    def planner(j, mode="metp"):
        return _same(settings_for(mode, j, model=model).replace(offload_prefetch=None))

    assert planner(job) == megatron("--metp-keep-attention-output", "3")
    assert planner(job).keep_attention_output == 3
    every = dataclasses.replace(job, keep_attention_output=8)  # a config's bare flag: 8 layers
    assert planner(every) == megatron("--metp-keep-attention-output")
    assert planner(every).keep_attention_output is True
    pp2 = dataclasses.replace(job, pp=2)  # 4 layers per stage: 3 is a count, 4 the bare flag
    assert _same(settings_for("metp", pp2, model=model)) == _same(metp_settings(_megatron_args(
        "--metp-parallel-size", "2", "--metp-keep-attention-output", "3",
        pipeline_model_parallel_size=2)))
    assert planner(dataclasses.replace(pp2, keep_attention_output=4)).keep_attention_output \
        is True
    # no N: the count the plan prices (here the host of 0.5 GiB per node binds)
    auto = dataclasses.replace(job, keep_attention_output=KEEP_AUTO, offload=True,
                               host_memory_gib=0.5)
    chosen = P.memory(model, auto, "metp").act.kept_attention_layers
    assert 0 < chosen < 8
    assert planner(auto) == megatron("--metp-keep-attention-output", str(chosen),
                                     "--metp-offload-activations") \
        .replace(offload_activations=True)
    # negative controls
    assert planner(job) != megatron("--metp-keep-attention-output", "2")
    assert planner(job) != megatron()
    assert settings_for("ring", job, model=model).keep_attention_output is None
    with pytest.raises(ValueError, match="needs the model"):
        settings_for("metp", job)


def _measure_keep(tmp_path, capsys, name, *flags):
    out = tmp_path / f"{name}.json"
    rc = cli.main(["measure", *KEEP_SMALL, *flags, "--json", str(out)])
    capsys.readouterr()
    res = json.loads(out.read_text())
    assert rc == 0, res
    model, job = P.Model(**res["model"]), P.Job(**res["job"])
    return model, job, res["results"][0]


KEEP_SMALL = ["--hidden", "256", "--layers", "4", "--heads", "4", "--query-groups", "2", "--ffn",
              "512", "--vocab", "1000", "--seq", "16384", "--swiglu", "--untie", "--metp", "2",
              "--vocab-parallel", "--distributed-optimizer", "--recompute", "full", "--modes",
              "metp", "--measure-layers", "full"]


def test_measure_builds_kept_attention_as_the_plan_prices_it(tmp_path, capsys, monkeypatch):
    """``metp measure --keep-attention-output`` builds the kept attention (the model builder's
    ``METPSettings.keep_attention_output``, as a Megatron-LM run's): the streaming layer keeping
    the first 2 of 4 layers' O + LSE on the host (every layer offloaded) and Megatron's
    checkpoint path keeping every layer's on the device; the measured host bytes are the plan's,
    the device peak within 3 %. Negative controls: the plan without the kept attention is off."""
    model, job, r = _measure_keep(tmp_path, capsys, "host", "--offload-activations",
                                  "--keep-attention-output", "2")
    mem = P.memory(model, job, "metp")
    assert mem.act.kept_attention_host_layers == 2 and mem.act.offloaded_layers == 4
    assert r["host_peak"] == pytest.approx(mem.act.host, rel=0.01)
    assert r["planned_measured_part"] == pytest.approx(r["peak"], rel=0.03)
    off = P.memory(model, dataclasses.replace(job, keep_attention_output=None), "metp")
    assert r["host_peak"] > 1.1 * off.act.host  # negative control: the kept O + LSE are there

    monkeypatch.setenv("METP_STREAMING_LAYER", "0")
    model, job, r = _measure_keep(tmp_path, capsys, "device", "--keep-attention-output")
    mem = P.memory(model, job, "metp")
    assert mem.act.kept_attention_layers == 4 and mem.act.kept_attention_host_layers == 0
    assert r["planned_measured_part"] == pytest.approx(r["peak"], rel=0.03)
    off = P.memory(model, dataclasses.replace(job, keep_attention_output=None), "metp")
    assert abs(off.act.peak / r["activation_peak"] - 1) > 0.03  # negative control


def test_layer_extrapolation_of_a_partial_keep_matches_the_full_depth(monkeypatch):
    """``metp measure`` (and the dry run, through the same ``fakerank.partial_keep_points``) of a
    stage whose first 3 of 6 layers keep their attention output, every layer offloaded: 2 and 3
    layers keeping one and 3 keeping two, combined linearly, equal the measurement of all 6
    layers (peak, stored, host bytes). Negative control: without the slope in kept layers the
    host bytes miss 2 kept O + LSE."""
    from megatron_metp.tools import fakerank as FR
    from megatron_metp.tools import measure as M

    model = P.Model(hidden=256, layers=6, heads=4, ffn=512, vocab=512, seq=512, query_groups=2,
                    swiglu=True, tied=False)
    job = P.Job(tp=1, metp=2, vocab_parallel=True, recompute="full", offload=True,
                keep_attention_output=3)
    full, auto = (M.measure(model, job, "metp", measure_layers=depth)[0]
                  for depth in ("full", "auto"))
    for r in (full, auto):
        assert "error" not in r, r.get("error")
    assert auto["method"].startswith("measured on 2 layers (1 keeping attention), 3 layers (1 "
                                     "keeping attention), 3 layers (2 keeping attention)"), \
        auto["method"]
    for key in ("peak", "stored", "host_peak"):
        assert auto[key] == pytest.approx(full[key], rel=1e-3), key
    assert full["host_peak"] == pytest.approx(P.memory(model, job, "metp").act.host, rel=1e-3)
    real = FR.partial_keep_points
    monkeypatch.setattr(FR, "partial_keep_points", lambda *a: (
        lambda pts, coef: (pts[:2], [coef[0], coef[1] + coef[2]]))(*real(*a)))
    flat = M.measure(model, job, "metp", measure_layers="auto")[0]
    assert full["host_peak"] - flat["host_peak"] == pytest.approx(
        2 * (2 * 512 // 2 * 256 + 4 * 4 * 512 // 2), rel=1e-3)


def test_kept_layers_send_no_k_v_ring_again():
    """What full recompute sends again (``cost.sent_by_recompute``): a kept layer of the
    separate ops re-runs its weight rings but not its K/V ring; a kept streaming layer runs no
    recompute step (nothing again). Negative control: without keeping, every recomputed layer
    sends its K/V ring's forward share again."""
    from megatron_metp.tools.plan.traffic import traffic_per_layer

    model = LLAMA.with_seq(131072)
    sep = P.Job(metp=8, vocab_parallel=True, distributed_optimizer=True, recompute="full",
                hardware="H100-80GB", keep_intermediate=True)  # the separate ops
    L = model.layers
    full = P.step_cost(model, sep, "metp")["sent_by_recompute"]
    kept4 = P.step_cost(model, dataclasses.replace(sep, keep_attention_output=4),
                        "metp")["sent_by_recompute"]
    ring = traffic_per_layer(model, sep, "metp")["attention K/V ring (every head group)"] / 4
    assert ring > 0 and full == pytest.approx(L * P.forward_traffic_per_layer(model, sep, "metp"))
    assert full - kept4 == pytest.approx(4 * ring)
    assert kept4 > 0  # the weight rings of the kept layers still run again
    # the streaming layer (every layer offloaded at 3.7M): keeping every layer sends nothing again
    stream = dataclasses.replace(JOB, keep_attention_output=None)
    assert P.step_cost(AT_37M, stream, "metp")["sent_by_recompute"] > 0
    assert P.step_cost(AT_37M, _keep(8), "metp")["sent_by_recompute"] == pytest.approx(
        P.step_cost(AT_37M, stream, "metp")["sent_by_recompute"] * (L - 8) / L)
    assert P.step_cost(AT_37M, _keep(L), "metp")["sent_by_recompute"] == 0.0
