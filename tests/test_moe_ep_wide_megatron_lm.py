"""EP wider than the METP group through Megatron-LM's own ``pretrain_gpt.py`` on 4 CPU ranks
(issue 42): configs/tiny-cpu-metp2-ep4-moe.sh (METP 2 × DP 2, ``--expert-model-parallel-size 4``
= 2p: one of the 4 experts per rank, the METP-sharded gradients summed over their 2 replicas by
the patched ``setup_model_and_optimizer``'s ``wire_ddp``) and its stock twin
configs/tiny-cpu-ep4-moe.sh (DP 4, EP 4) print the same losses and grad norms (compare_tp.sh's
table of them too) and save the same checkpoint tensors under stock's keys (the experts stacked
by their global index); the stock twin continues from METP's checkpoint (weights only, as for
EP = p in tests/test_moe_megatron_lm.py) with the uninterrupted runs' iteration-3 loss."""

import os

import pytest

from tests.test_megatron_lm_train import (REPO, _compare_tp_parse_only, _env, _iterations,
                                          _rewind, _tensors, _train)

METP_CONFIG, TWIN_CONFIG = "tiny-cpu-metp2-ep4-moe.sh", "tiny-cpu-ep4-moe.sh"
ITERS = 3


@pytest.fixture(scope="module")
def runs(patched_megatron_lm, tmp_path_factory):
    """Both runs, 3 iterations each, saving at iterations 2 and 3."""
    root = tmp_path_factory.mktemp("wide-ep")
    out = {"root": root}
    for name, config in (("metp", METP_CONFIG), ("tp", TWIN_CONFIG)):
        ck = str(root / name)
        _, log = _train(patched_megatron_lm, config, ITERS, CHECKPOINT_PATH=ck, SAVE_INTERVAL=2)
        (root / f"{name}.log").write_text(log)
        out[name] = {"ckpt": ck, "log": log, "iters": _iterations(log)}
    return out


def test_ep_2p_and_its_stock_twin_print_the_same_losses_and_checkpoints(runs, tmp_path):
    metp, tp = runs["metp"]["iters"], runs["tp"]["iters"]
    assert sorted(metp) == sorted(tp) == list(range(1, ITERS + 1))
    for k in metp:  # the same weights, global batch and expert per rank: the same step
        assert abs(metp[k][0] - tp[k][0]) <= 1e-5 * abs(tp[k][0]), (k, metp[k], tp[k])
        assert abs(metp[k][1] - tp[k][1]) <= 1e-3 * tp[k][1], (k, metp[k], tp[k])  # grad norm
    losses = [metp[k][0] for k in sorted(metp)]
    assert losses[-1] < losses[0], losses  # it trains
    log = runs["metp"]["log"]
    assert "experts sharded over 2 METP rings (--expert-model-parallel-size 4" in log
    assert "expert_model_parallel_size ...................... 4" in log  # args -> config
    # compare_tp.sh pairs the two configs and tabulates these logs
    for name in ("metp", "tp"):
        (tmp_path / f"{name}.log").write_text(runs[name]["log"])
    _compare_tp_parse_only(METP_CONFIG, tmp_path, {**_env("unused"), "PYTHONPATH": REPO})
    assert "max lm loss rel. difference" in (tmp_path / "compare.md").read_text()
    # stock's expert layout: the same model tensors under the same keys and shapes
    got = _tensors(os.path.join(runs["metp"]["ckpt"], "iter_0000002"), str(tmp_path))
    want = _tensors(os.path.join(runs["tp"]["ckpt"], "iter_0000002"), str(tmp_path))
    model = {k for k in want if not k.startswith("optimizer")}
    assert len(model) > 20 and model == {k for k in got if not k.startswith("optimizer")}
    fc1 = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
    assert tuple(got[fc1].shape) == (4, 128, 64), got[fc1].shape
    for key in model:
        a, b = got[key].double(), want[key].double()
        assert a.shape == b.shape, key
        assert (a - b).norm() <= 1e-4 * b.norm(), (key, (a - b).norm() / b.norm())


def test_stock_ep_twin_continues_from_the_wide_ep_checkpoint(patched_megatron_lm, runs,
                                                              tmp_path):
    """METP's iteration-2 checkpoint (EP 4 over METP 2 × DP 2), loaded by the stock twin
    (weights only, as for EP = p): iteration 3 runs the saved weights before any update, so it
    prints the uninterrupted runs' iteration-3 loss."""
    ck = str(tmp_path / "metp-to-ep")
    _rewind(runs["metp"]["ckpt"], ck, 2)
    _, log = _train(patched_megatron_lm, TWIN_CONFIG, ITERS, "--no-load-optim", "--no-load-rng",
                    CHECKPOINT_PATH=ck)
    resumed = _iterations(log)
    assert sorted(resumed) == [3], log[-3000:]
    want = runs["metp"]["iters"][3][0]
    assert abs(resumed[3][0] - want) <= 1e-5 * abs(want), (resumed[3], want)
