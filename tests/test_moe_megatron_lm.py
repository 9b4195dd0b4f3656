"""Mixture-of-Experts with METP through Megatron-LM's own ``pretrain_gpt.py`` on CPU ranks.

One pair of training runs is shared by the assertions (3 iterations each, checkpoints at 2):
configs/tiny-cpu-metp2-moe.sh (METP 2, Megatron's MoELayer with its 4 experts sharded over the
METP ring) and its stock twin configs/tiny-cpu-ep2-moe.sh (DP 2, expert-model-parallel 2, the
same experts on the same ranks) print the same losses from iteration 1 (compare_tp.sh's table
of them too), write the same checkpoint tensors under the same keys, and the stock twin
continues from METP's checkpoint. The refusals are checked at the launcher's preflight (no rank
started), in one process, against the flag names of the session's Megatron-LM release.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_metp import megatron_lm as hooks
from megatron_metp.megatron_lm.preflight import job_problems
from tests.test_megatron_lm_train import (REPO, _compare_tp_parse_only, _env, _iterations,
                                          _rewind, _tensors, _train)

METP_CONFIG, TWIN_CONFIG = "tiny-cpu-metp2-moe.sh", "tiny-cpu-ep2-moe.sh"
ITERS = 3


@pytest.fixture(scope="module")
def runs(patched_megatron_lm, tmp_path_factory):
    """The METP run (alltoall dispatcher) and its stock twin (allgather, the configs' default),
    3 iterations each, saving at iterations 2 and 3."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, config, dispatcher in (("metp", METP_CONFIG, "alltoall"),
                                     ("tp", TWIN_CONFIG, "allgather")):
        ck = str(root / name)
        _, log = _train(patched_megatron_lm, config, ITERS, CHECKPOINT_PATH=ck, SAVE_INTERVAL=2,
                        MOE_TOKEN_DISPATCHER=dispatcher)
        assert f"moe_token_dispatcher_type ....................... {dispatcher}" in log
        (root / f"{name}.log").write_text(log)
        out[name] = {"ckpt": ck, "log": log, "iters": _iterations(log)}
    out["root"] = root
    return out


def test_metp_and_its_stock_ep_twin_print_the_same_falling_losses(runs, tmp_path):
    metp, tp = runs["metp"]["iters"], runs["tp"]["iters"]
    assert sorted(metp) == sorted(tp) == list(range(1, ITERS + 1))
    for k in metp:  # same weights, same global batch, same experts per rank: same loss
        assert abs(metp[k][0] - tp[k][0]) <= 1e-5 * abs(tp[k][0]), (k, metp[k], tp[k])
        assert abs(metp[k][1] - tp[k][1]) <= 1e-3 * tp[k][1], (k, metp[k], tp[k])  # grad norm
    losses = [metp[k][0] for k in sorted(metp)]
    assert losses[-1] < losses[0] and len(set(losses)) == ITERS, losses  # it trains
    log = runs["metp"]["log"]
    assert "building GPT model with METP (weight ring + K/V ring)" in log
    assert "experts sharded over each METP ring, expert-model-parallel size 2" in log
    assert "expert_model_parallel_size ...................... 2" in log  # args -> config
    assert "expert_model_parallel_size ...................... 2" in runs["tp"]["log"]
    # compare_tp.sh pairs the two configs and tabulates these logs
    twin = subprocess.run(["bash", "-c", 'source "$1" >/dev/null; echo "$TWIN_CONFIG"', "_",
                           os.path.join(REPO, "configs", METP_CONFIG)],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert twin == TWIN_CONFIG
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    for name in ("metp", "tp"):
        (cmp_dir / f"{name}.log").write_text(runs[name]["log"])
    _compare_tp_parse_only(METP_CONFIG, cmp_dir, {**_env("unused"), "PYTHONPATH": REPO})
    assert "max lm loss rel. difference" in (cmp_dir / "compare.md").read_text()


def test_metp_checkpoint_holds_the_stock_expert_layout(runs, tmp_path):
    """The torch_dist checkpoints of both runs at iteration 2: the same model tensors under the
    same keys and shapes (the 4 experts of the MoE layer stacked by their global index, as
    stock EP saves them, from the 2 METP ranks holding 2 each), with the same values up to the
    rounding noise two Adam steps amplify (an element whose gradient is ~0 moves by
    ±lr·m/sqrt(v) on either side)."""
    metp = _tensors(os.path.join(runs["metp"]["ckpt"], "iter_0000002"), str(tmp_path))
    tp = _tensors(os.path.join(runs["tp"]["ckpt"], "iter_0000002"), str(tmp_path))
    model = {k for k in tp if not k.startswith("optimizer")}
    assert len(model) > 20 and model == {k for k in metp if not k.startswith("optimizer")}
    fc1 = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"  # layer 1: MoE, layer 2 dense
    assert tuple(metp[fc1].shape) == (4, 128, 64), metp[fc1].shape
    assert "decoder.layers.1.mlp.linear_fc1.weight" in model
    for key in model:
        a, b = metp[key].double(), tp[key].double()
        assert a.shape == b.shape, key
        assert (a - b).abs().max() <= 5e-5, (key, (a - b).abs().max())
        assert (a - b).norm() <= 1e-4 * b.norm(), (key, (a - b).norm() / b.norm())


def test_stock_ep_twin_continues_from_the_metp_checkpoint(patched_megatron_lm, runs, tmp_path):
    """METP's iteration-2 checkpoint, loaded by the stock twin (weights only: the optimizer
    state does not cross layouts, refused before any rank otherwise): iteration 3 runs the saved
    weights before any update, so it prints the uninterrupted runs' iteration-3 loss."""
    ck = str(tmp_path / "metp-to-ep")
    _rewind(runs["metp"]["ckpt"], ck, 2)
    rc, log = _train(patched_megatron_lm, TWIN_CONFIG, ITERS, check=False, CHECKPOINT_PATH=ck)
    assert rc != 0 and "--no-load-optim --no-load-rng" in log, log[-3000:]
    _, log = _train(patched_megatron_lm, TWIN_CONFIG, ITERS, "--no-load-optim", "--no-load-rng",
                    CHECKPOINT_PATH=ck)
    resumed = _iterations(log)
    assert sorted(resumed) == [3], log[-3000:]
    for name in ("metp", "tp"):
        want = runs[name]["iters"][3][0]
        assert abs(resumed[3][0] - want) <= 1e-5 * abs(want), (name, resumed[3], want)
    assert "loading distributed checkpoint" in log.lower() or "successfully loaded" in log.lower()


#: a gated shared expert of width 64 beside the 4 routed experts (Qwen2-MoE's recipe)
SHARED_ARGS = ("--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
               "--disable-bias-linear")


def test_shared_experts_train_as_the_stock_twin_and_cross_checkpoints(patched_megatron_lm, runs,
                                                                      tmp_path):
    """``--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate`` through
    ``pretrain_gpt.py``: the METP run (the shared expert as METP's MLP, sharded over the ring)
    and its stock EP twin print the same losses; the METP checkpoint holds the shared expert
    under stock's keys and full shapes (``[128, 64]`` fc1 of a SwiGLU-free width 64, the gate
    ``[1, 64]``), and the stock twin continues from it with iteration 3's loss. Negative
    control: the twin without the shared expert (the module's stock run: the same data and
    seed; the dispatcher changes no loss, as the first test shows) prints another iteration-1
    loss."""
    plain = runs["tp"]["iters"]  # the module's stock twin, without the shared expert
    twins = {}
    for name, config in (("metp", METP_CONFIG), ("tp", TWIN_CONFIG)):
        ck = str(tmp_path / name)
        _, log = _train(patched_megatron_lm, config, ITERS, *SHARED_ARGS, CHECKPOINT_PATH=ck,
                        SAVE_INTERVAL=2, MOE_TOKEN_DISPATCHER="alltoall")
        twins[name] = {"ckpt": ck, "iters": _iterations(log)}
    metp, tp = twins["metp"]["iters"], twins["tp"]["iters"]
    assert sorted(metp) == sorted(tp) == list(range(1, ITERS + 1))
    for k in metp:
        assert abs(metp[k][0] - tp[k][0]) <= 1e-5 * abs(tp[k][0]), (k, metp[k], tp[k])
    assert abs(plain[1][0] - tp[1][0]) > 1e-4 * abs(tp[1][0]), (plain, tp)  # negative control
    saved = _tensors(os.path.join(twins["metp"]["ckpt"], "iter_0000002"), str(tmp_path))
    stock = _tensors(os.path.join(twins["tp"]["ckpt"], "iter_0000002"), str(tmp_path))
    shared = sorted(k for k in stock if ".shared_experts." in k and not k.startswith("optim"))
    assert shared and shared == sorted(k for k in saved if ".shared_experts." in k
                                       and not k.startswith("optim")), shared
    for key in shared:
        assert saved[key].shape == stock[key].shape, (key, saved[key].shape)
    assert tuple(saved["decoder.layers.0.mlp.shared_experts.gate_weight"].shape) == (1, 64)
    ck = str(tmp_path / "metp-to-ep")
    _rewind(twins["metp"]["ckpt"], ck, 2)
    _, log = _train(patched_megatron_lm, TWIN_CONFIG, ITERS, *SHARED_ARGS, "--no-load-optim",
                    "--no-load-rng", CHECKPOINT_PATH=ck, MOE_TOKEN_DISPATCHER="alltoall")
    resumed = _iterations(log)
    assert sorted(resumed) == [3], log[-3000:]
    assert abs(resumed[3][0] - metp[3][0]) <= 1e-5 * abs(metp[3][0]), (resumed, metp[3])


# ------------------------------------------------------------------------------- refusals

_BASE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256",
         "--num-attention-heads", "4", "--seq-length", "256", "--attention-dropout", "0",
         "--no-persist-layer-norm", "--transformer-impl", "local", "--metp-parallel-size", "2",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
         "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"]


def _problems(*extra, world=2, cpu=False):
    return job_problems(_BASE + list(extra), world, cpu=cpu)


def test_a_good_moe_job_passes_the_preflight_and_folds_ep_into_args(capsys):
    assert _problems(cpu=True) == []
    assert _problems("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                     "alltoall", "--moe-layer-freq", "2", "--expert-tensor-parallel-size",
                     "1") == []
    assert _problems("--moe-grouped-gemm") == []  # on GPU ranks: the GPU check runs it
    # validate_args' hook: the TransformerConfig built from args gets EP = p (the silent-wrong
    # trap: left at 1, expert weights would be reduced as dense ones)
    from megatron_metp.megatron_lm.preflight import parse_megatron_args

    args = parse_megatron_args(_BASE + ["--context-parallel-size", "2"], 8)
    hooks.validate_metp_args(args)
    assert (args.expert_model_parallel_size, args.context_parallel_size) == (2, 4)
    assert hooks.metp_expert_model_parallel_size(args) == 2
    hooks.validate_metp_args(args)  # again (Megatron validates twice on a load): unchanged
    assert (args.expert_model_parallel_size, args.context_parallel_size) == (2, 4)
    assert "expert-model-parallel size 2 (2 experts per rank)" in capsys.readouterr().out
    dense = parse_megatron_args([a for a in _BASE[:-6]], 2)
    hooks.validate_metp_args(dense)
    assert dense.expert_model_parallel_size == 1  # Megatron asserts --num-experts for EP > 1


@pytest.mark.parametrize("extra,needles", [
    (["--expert-tensor-parallel-size", "2"], ["--expert-tensor-parallel-size 2"]),
    (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size 2", "--num-experts"]),
    (["--expert-model-parallel-size", "4"], ["--expert-model-parallel-size", "4", "docs/"]),
    (["--num-experts", "3"], ["--num-experts 3 is not divisible by --metp-parallel-size 2"]),
    (["--moe-token-dispatcher-type", "flex"], ["--moe-token-dispatcher-type flex", "alltoall"]),
    (["--moe-enable-deepep"], ["flex"]),
    (["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap",
      "--disable-bias-linear"], ["--moe-shared-expert-overlap"]),
    (["--moe-shared-expert-intermediate-size", "64"], ["--disable-bias-linear"]),
    (["--moe-latent-size", "16"], ["--moe-latent-size"]),
    (["--overlap-moe-expert-parallel-comm"], ["--overlap-moe-expert-parallel-comm"]),
    (["--delay-wgrad-compute"], ["--delay-wgrad-compute"]),
    (["--ep-overlap-early-attn-memory-release"], ["--ep-overlap-early-attn-memory-release"]),
    (["--cuda-graph-impl", "local"], ["--cuda-graph-impl local"]),
    (["--enable-cuda-graph"], ["CUDA graphs"]),
    (["--moe-use-upcycling"], ["--moe-use-upcycling"]),
])
def test_unsupported_moe_flags_are_refused_before_any_rank(extra, needles):
    world = 4 if "--tensor-model-parallel-size" in extra else 2
    problems = _problems(*extra, world=world)
    text = "; ".join(problems)
    assert problems, extra
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize("flag", ["--moe-grouped-gemm", "--moe-permute-fusion",
                                  "--moe-router-fusion"])
def test_gpu_only_moe_kernels_are_refused_on_cpu_ranks(flag):
    for extra in ([], ["--metp-parallel-size", "1", "--expert-model-parallel-size", "2"]):
        text = "; ".join(_problems(flag, *extra, cpu=True))  # METP and the stock twin
        assert f"on CPU ranks (METP_CPU=1): {flag}" in text, (flag, extra, text)


def test_the_launcher_refuses_a_moe_flag_without_starting_a_rank(patched_megatron_lm):
    rc, log = _train(patched_megatron_lm, METP_CONFIG, 1, "--moe-token-dispatcher-type", "flex",
                     check=False)
    assert rc != 0 and "no rank was started" in log, log[-3000:]
    assert "--moe-token-dispatcher-type flex" in log and "iteration" not in log


_LIST_FLAGS = r"""
import argparse, json, sys
sys.path.insert(0, sys.argv[1])
from megatron_metp.megatron_lm.cpu import stub_batch_invariant_kernels
stub_batch_invariant_kernels()
from megatron.training.arguments import add_megatron_arguments
parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
print(json.dumps({o: a.dest for a in parser._actions for o in a.option_strings}))
"""


def test_every_moe_flag_checked_exists_in_the_release(megatron_lm_checkout):
    """The flags the MoE checks (and the model-variant checks, ``variant_checks``) read, with
    the destinations the checks read them by, are Megatron-LM's own in this release (or named
    as the other release's only)."""
    from megatron_metp.megatron.variant_checks import add_variant_preflight_flags
    from megatron_metp.megatron_lm.moe_args import RELEASE_ONLY, add_moe_preflight_flags
    from tests.megatron_lm_release import RELEASE

    proc = subprocess.run([sys.executable, "-c", _LIST_FLAGS, megatron_lm_checkout],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    megatron = json.loads(proc.stdout.strip().splitlines()[-1])
    import argparse

    ours = argparse.ArgumentParser()
    add_moe_preflight_flags(ours)
    add_variant_preflight_flags(ours)
    checked = {o: a.dest for a in ours._actions for o in a.option_strings if o != "-h"
               and o != "--help"}
    assert len(checked) > 15
    for opt, dest in checked.items():
        other = RELEASE_ONLY.get(opt)
        if other is not None and other != RELEASE.tag:
            assert opt not in megatron, (opt, "is in this release after all")
            continue
        assert megatron.get(opt) == dest, (opt, dest, megatron.get(opt), RELEASE.tag)
