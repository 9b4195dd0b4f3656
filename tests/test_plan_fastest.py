"""``metp plan --fastest --gpus N --seq S`` (issue 41, Deliver 5): per family the fastest layout
that fits, its JSON (``fastest.{metp,stock,alst}``), block recompute with the fewest layers that
fit, nothing where nothing fits, METP ahead where stock must recompute, and ``--write-config``
planned again by ``metp plan --config``."""

import dataclasses
import json

import pytest

from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import fastest as F
from megatron_metp.tools.plan.search import node_host_bytes, rank_total
from megatron_metp.tools.plan.textwidth import unwrap

LLAMA = P.PRESETS["llama3-8b"]
#: a node's host memory too small for any activation or optimizer offload: each family keeps
#: everything on the device, so stock must recompute where its layers do not fit
SMALL_HOST_GIB = 8.0


def _fastest(argv, capsys, tmp_path):
    """``(text, JSON)`` of ``metp plan --fastest argv --json``."""
    path = tmp_path / "fastest.json"
    assert cli.main(["plan", "--fastest"] + argv + ["--json", str(path)]) == 0
    return unwrap(capsys.readouterr().out), json.loads(path.read_text())


@pytest.fixture(scope="module")
def small_host_262k():
    """The search at 262,144 tokens on 8 GPUs with a host too small to offload anything."""
    model = LLAMA.with_seq(262144)
    return model, F.fastest(model, 8, host_gib=SMALL_HOST_GIB)


def test_json_keys_and_figures(capsys, tmp_path):
    """Every family's fastest has step_s, tokens_per_s_per_gpu, layout, flags and total; tokens
    per second per GPU is the sequence over step_s and the GPUs; stock and METP carry
    Megatron-LM flags and a launch line, ALST's recipe (DeepSpeed) none; each family's fastest
    is no slower than anything else that fits in it."""
    text, js = _fastest(["--gpus", "8", "--preset", "llama3-8b", "--seq", "131072"], capsys,
                        tmp_path)
    assert set(js["fastest"]) == {"metp", "stock", "alst"}
    for fam, d in js["fastest"].items():
        for key in ("step_s", "tokens_per_s_per_gpu", "layout", "flags", "total",
                    "model_tflops_per_gpu", "host_per_node"):
            assert key in d, (fam, key)
        assert d["tokens_per_s_per_gpu"] == pytest.approx(131072 / (d["step_s"] * 8))
        assert 0 < d["total"] <= (80 - 2) * P.GiB
        assert 0 < d["model_tflops_per_gpu"] < 989  # H100's dense bf16 peak
    assert "--metp-parallel-size" in js["fastest"]["metp"]["flags"]
    assert "--metp-vocab-parallel" in js["fastest"]["metp"]["flags"]
    assert "--metp-parallel-size" not in " ".join(js["fastest"]["stock"]["flags"]).replace(
        "--metp-parallel-size 1", "")
    assert js["fastest"]["alst"]["flags"] is None
    assert js["fastest"]["alst"]["step_s"] > js["fastest"]["metp"]["step_s"]
    assert js["search_s"] > 0  # reported; a time is never asserted (a loaded CI machine)
    lines = [x for x in text.splitlines() if x.startswith("  fastest, launch: ")]
    assert len(lines) == 2 and all("scripts/pretrain_gpt.sh" in x for x in lines)


def test_stock_picks_the_fewest_block_recompute_layers_that_fit(small_host_262k):
    """At 256K on 8 GPUs stock Megatron fits no layout without recompute; its fastest recomputes
    the first N layers (--recompute-method block) with the fewest N that fits, faster than full
    recompute of the same layout; negative control: N - 1 does not fit."""
    model, res = small_host_262k
    stock = res["choices"]["stock"]
    assert stock and all(c.job.recompute != "none" for c in stock)
    best = stock[0]
    j = best.job
    assert (j.recompute, j.recompute_method) == ("full", "block")
    n, cap = j.recompute_num_layers, P.capacity_bytes(j)
    assert 1 < n < model.layers
    assert rank_total(model, j, best.mode, model.seq) <= cap
    fewer = dataclasses.replace(j, recompute_num_layers=n - 1)
    assert rank_total(model, fewer, best.mode, model.seq) > cap  # negative control
    full = [c for c in stock if c.mode == best.mode and c.job.tp == j.tp and c.job.dp == j.dp
            and c.job.recompute_method == "uniform" and c.job.recompute_num_layers == 1
            and not c.job.optimizer_offload]
    assert full and best.time_s < full[0].time_s
    assert f"--recompute-num-layers {n}" in " ".join(
        F.choice_json(model, 8, best)["flags"])


def test_metp_beats_stock_where_stock_must_recompute(small_host_262k):
    """Where stock must recompute (256K, nothing offloaded) METP's fastest takes ≤ 0.85× of
    stock's; negative control: at 32K, where stock fits without recompute, it does not (METP's
    own per-shard re-forming and vocabulary ring cost time there)."""
    model, res = small_host_262k
    metp, stock = res["choices"]["metp"][0], res["choices"]["stock"][0]
    assert metp.job.recompute == "none"
    assert metp.time_s <= 0.85 * stock.time_s
    short = F.fastest(LLAMA.with_seq(32768), 8, host_gib=SMALL_HOST_GIB,
                      families=("metp", "stock"))["choices"]
    assert short["stock"][0].job.recompute == "none"
    assert short["metp"][0].time_s > 0.95 * short["stock"][0].time_s


def test_nothing_fits_is_null(capsys, tmp_path):
    """A device with almost nothing left (--reserve-gib 79.5 of 80) fits no family: every
    fastest.<family> is null, the text says nothing fits, --write-config writes nothing; a host
    too small for ALST's offloaded checkpoints and optimizer leaves ALST null, and with the
    host of a DGX node it fits (the control)."""
    path = tmp_path / "none.sh"
    argv = ["--gpus", "2", "--preset", "gpt-1.3b", "--seq", "32768", "--reserve-gib", "79.5"]
    text, js = _fastest(argv, capsys, tmp_path)
    assert js["fastest"] == {"metp": None, "stock": None, "alst": None}
    assert text.count("  nothing fits") == 3
    assert cli.main(["plan", "--fastest"] + argv + ["--write-config", str(path)]) == 2
    assert "nothing written" in capsys.readouterr().err and not path.exists()
    model = LLAMA.with_seq(131072)
    for host, fits in ((1.0, False), (F.DEFAULT_HOST_GIB_PER_NODE, True)):
        res = F.fastest(model, 8, host_gib=host, families=("alst",))
        alst = F.fastest_json(model, 8, res)["fastest"]["alst"]
        assert (alst is not None) == fits, host
        if fits:
            assert node_host_bytes(model, res["choices"]["alst"][0].job, "alst",
                                   model.seq) > P.GiB


def test_write_config_plans_the_same_layout(capsys, tmp_path):
    """--write-config writes the fastest of METP and stock; metp plan --config FILE plans that
    layout again: the same sizes and options, the per-rank total and the time per sequence the
    search printed (within 1 %: the config's tokenizer may pad the vocabulary by one token)."""
    path = tmp_path / "fastest.sh"
    text, js = _fastest(["--gpus", "8", "--preset", "llama3-8b", "--seq", "262144",
                         "--host-memory-gib", str(SMALL_HOST_GIB), "--write-config", str(path)],
                        capsys, tmp_path)
    best = js["fastest"]["metp"]
    assert best["step_s"] < js["fastest"]["stock"]["step_s"]  # METP is the one written
    model, job, modes = cli.build_from_argv(["--config", str(path)])
    assert modes == ["metp"] and model.seq == 262144
    par = best["parallel"]
    assert (job.tp, job.metp, job.cp, job.pp, job.dp) == (par["tp"], par["metp"], par["cp"],
                                                         par["pp"], par["dp"])
    assert job.vocab_parallel and job.distributed_optimizer
    for key in ("recompute", "offload", "optimizer_offload", "keep_attention_output"):
        assert getattr(job, key) == best[key], key
    total = P.memory(model, job, "metp").total
    assert total == pytest.approx(best["total"], rel=0.01)
    cost = P.step_cost(model, job, "metp")
    per_seq = cost["iteration_s"] / (cost["microbatches"] * job.dp)
    assert per_seq == pytest.approx(best["step_s"], rel=0.01)


def test_refuses_what_it_searches(capsys):
    """A flag --fastest searches itself, a missing --seq or --gpus, or --reach next to it: a
    clear error naming the flag, before any search."""
    base = ["plan", "--fastest", "--preset", "llama3-8b"]
    for extra, word in ((["--gpus", "8", "--seq", "131072", "--tp", "2"], "--tp"),
                        (["--gpus", "8", "--seq", "131072", "--recompute", "full"],
                         "--recompute"),
                        (["--gpus", "8"], "--seq"), (["--seq", "131072"], "--gpus"),
                        (["--gpus", "8", "--seq", "131072", "--reach"], "--reach")):
        assert cli.main(base + extra) == 2
        assert word in capsys.readouterr().err


def test_a_config_gives_the_model_and_its_launch_sources_the_model_file(capsys, tmp_path):
    """--config FILE: the model of the config; the launch lines source the model file the
    config sources and name the tokenizer's vocabulary (the model file's, no VOCAB_SIZE); a
    key=value file that sources none launches with every geometry value set (the control)."""
    argv = ["--gpus", "2", "--seq", "32768", "--reach-top", "1"]
    text, js = _fastest(argv + ["--config", "configs/gpt-1.3b-32k-metp8.sh"], capsys, tmp_path)
    for fam in ("metp", "stock"):
        launch = js["fastest"][fam]["launch"]
        assert launch.endswith("--config configs/models/gpt-1.3b.sh"), launch
        assert "VOCAB_SIZE=" not in launch and "HIDDEN_SIZE=" not in launch
    kv = tmp_path / "model.cfg"
    kv.write_text("hidden=2048\nlayers=24\nheads=16\nffn=8192\nvocab=32000\n")
    text, js = _fastest(argv + ["--config", str(kv)], capsys, tmp_path)
    launch = js["fastest"]["metp"]["launch"]
    assert "HIDDEN_SIZE=2048" in launch and "VOCAB_SIZE=32000" in launch


def test_stock_offloads_the_fewest_layers_where_its_copies_outlast_the_forward():
    """At 128K stock TP+SP saves more per layer (4.7 GiB at TP 4) than the host link moves during
    one layer's forward (77 ms of compute), so offloading a layer costs time (.step_time: each
    direction against its own phase): the search also tries the fewest offloaded layers that fit,
    and stock's fastest offloads fewer than all; negative controls: one fewer offloaded layer
    does not fit, and offloading every layer of the same layout is slower."""
    model = LLAMA.with_seq(131072)
    stock = F.fastest(model, 8, families=("stock",))["choices"]["stock"]
    best = stock[0]
    j = best.job
    assert j.recompute == "none" and j.offload and 1 < j.offload_layers < model.layers
    assert f"offload ({j.offload_layers} layers per stage)" in best.describe()
    cap = P.capacity_bytes(j)
    assert rank_total(model, j, best.mode, model.seq) <= cap
    fewer = dataclasses.replace(j, offload_layers=j.offload_layers - 1)
    assert rank_total(model, fewer, best.mode, model.seq) > cap
    every = dataclasses.replace(j, offload_layers=None)
    assert P.step_cost(model, every, best.mode)["step_s"] > \
        P.step_cost(model, j, best.mode)["step_s"]
