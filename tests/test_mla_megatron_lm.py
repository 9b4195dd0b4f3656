"""DeepSeek-shaped multi-latent attention with METP through Megatron-LM's own ``pretrain_gpt.py``
on CPU ranks: configs/tiny-cpu-metp2-mla-moe.sh (METP 2: METP's MLA with the latent on the K/V
ring, a gated shared expert, 4 routed experts behind a sigmoid router with expert bias, over the
METP ring) and its stock twin configs/tiny-cpu-ep2-mla-moe.sh (megatron-core's MLASelfAttention,
DP 2, EP 2) print the same losses for 10 iterations, and compare_tp.sh tabulates them. The stock
twin builds on CPU ranks through shim (m) (megatron_metp/megatron/cpu_mla.py), checked here
with its refusal of widths the local core attention cannot compute."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests.test_megatron_lm_train import REPO, _compare_tp_parse_only, _env, _iterations, _train

METP_CONFIG, TWIN_CONFIG = "tiny-cpu-metp2-mla-moe.sh", "tiny-cpu-ep2-mla-moe.sh"
ITERS = 10


def test_the_mla_shim_takes_equal_widths_and_refuses_others(cpu_shims):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_metp.megatron.cpu_mla import _with_mla_channels

    assert hasattr(DotProductAttention.__init__, "__wrapped__")  # shim (m) is on
    seen = []
    init = _with_mla_channels(lambda self, config, *a, **k: seen.append(k))
    cfg = SimpleNamespace(kv_channels=24)
    init(None, cfg, 1, k_channels=24, v_channels=24, softmax_scale=0.5)  # MLA, equal widths
    init(None, cfg, 1, softmax_scale=0.5)  # a plain attention: nothing to check
    assert seen == [{"softmax_scale": 0.5}, {"softmax_scale": 0.5}]
    with pytest.raises(ValueError, match=r"--kv-channels 24.*--v-head-dim 16"):
        init(None, cfg, 1, k_channels=24, v_channels=16)  # negative control: V narrower
    assert len(seen) == 2


def test_metp_mla_moe_and_its_stock_twin_print_the_same_falling_losses(patched_megatron_lm,
                                                                       tmp_path):
    logs = {}
    for name, config in (("metp", METP_CONFIG), ("tp", TWIN_CONFIG)):
        _, logs[name] = _train(patched_megatron_lm, config, ITERS)
        (tmp_path / f"{name}.log").write_text(logs[name])
    metp, tp = _iterations(logs["metp"]), _iterations(logs["tp"])
    assert sorted(metp) == sorted(tp) == list(range(1, ITERS + 1))
    for k in metp:  # the same weights, batch and experts per rank: the same loss
        assert abs(metp[k][0] - tp[k][0]) <= 1e-5 * abs(tp[k][0]), (k, metp[k], tp[k])
        assert abs(metp[k][1] - tp[k][1]) <= 1e-3 * tp[k][1], (k, metp[k], tp[k])  # grad norm
    assert metp[ITERS][0] < metp[1][0], metp  # it trains
    for log in logs.values():
        for flag in (r"multi_latent_attention \.+ True", r"kv_lora_rank \.+ 16",
                     r"moe_shared_expert_intermediate_size \.+ 64",
                     r"moe_router_score_function \.+ sigmoid",
                     r"moe_router_enable_expert_bias \.+ True"):
            assert re.search(flag, log), flag
    assert "building GPT model with METP" in logs["metp"]
    _compare_tp_parse_only(METP_CONFIG, tmp_path, {**_env("unused"), "PYTHONPATH": REPO})
    assert "max lm loss rel. difference" in (tmp_path / "compare.md").read_text()
