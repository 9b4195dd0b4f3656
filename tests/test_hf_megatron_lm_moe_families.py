"""Megatron-LM's own ``pretrain_gpt.py`` (patched, at the session's release, METP 2 on CPU ranks,
fp32) loading a tiny ``transformers`` Qwen2-MoE, GLM-4.5 (``Glm4MoeForCausalLM``) and gpt-oss
converted by ``megatron_metp.tools.hf import``: the flags of the import's ``model.sh`` (the shared expert
and its gate, ``--add-qkv-bias``; GLM's ``--moe-router-score-function sigmoid``,
``--moe-router-enable-expert-bias``, ``--moe-router-topk-scaling-factor``, group-limited
routing, ``--rotary-percent``, ``--qk-layernorm``, a leading dense layer; gpt-oss's
``--add-bias-linear``, ``--softmax-type learnable``, ``--quick-geglu`` with its offset and clamp)
build the model the checkpoint holds, and iteration 1 prints transformers' loss of the same mock
batch. Each run's own save (trained one step) exports back with the import's config.json (for
gpt-oss its saved flags checked against it: biases, sinks, the clamped quick-GeGLU), and without
one (written from the run's saved arguments: the same family and tensors; gpt-oss's layers all
full attention, its window never binding here): transformers loads it and its loss of the
trained batch is lower. One launch per family."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from safetensors.torch import load_file

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.versions import installed_layout
from tests.harness import run_ranks
from tests.test_hf import _import_on_a_rank
from tests.test_hf_megatron_lm import GBS, TINY, _launch
from tests.test_hf_megatron_lm_families import _loss, check_iteration_1_loss

_MOE = dict(TINY, num_hidden_layers=3, num_experts_per_tok=2, moe_intermediate_size=32,
            initializer_range=0.1)
#: family -> (model class, config, patterns the run's printed arguments must hold)
FAMILIES = {
    # layer 1 dense; 4 experts (2 per METP rank) and a gated shared expert 64 wide
    "qwen2_moe": ("Qwen2Moe", dict(_MOE, num_experts=4, shared_expert_intermediate_size=64,
                                   mlp_only_layers=[1], norm_topk_prob=False),
                  (r"moe_shared_expert_intermediate_size \.+ 64\b",
                   r"moe_shared_expert_gate \.+ True", r"add_qkv_bias \.+ True",
                   r"moe_layer_freq \.+ \[1, 0, 1\]")),
    # layer 0 dense; 4 experts in 2 groups (top-2 inside the best group), scaling 2.5, a shared
    # expert 32 wide, q/k norms and biases, RoPE over half of each head
    "glm4_moe": ("Glm4Moe", dict(_MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=2,
                                 topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                 norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                 partial_rotary_factor=0.5),
                 (r"moe_router_score_function \.+ sigmoid",
                  r"moe_router_enable_expert_bias \.+ True",
                  r"moe_router_topk_scaling_factor \.+ 2\.5", r"moe_router_num_groups \.+ 2\b",
                  r"rotary_percent \.+ 0\.5", r"qk_layernorm \.+ True",
                  r"moe_layer_freq \.+ \[0, 1, 1\]")),
    # a sliding layer (window 256: never binds at 64 tokens) and a full one; 4 experts of 32
    # with biases and the clamped quick-GeGLU (gate/up scaled past the clamp), attention sinks,
    # plain RoPE
    "gpt_oss": ("GptOss", dict(TINY, num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=32, sliding_window=256, attention_bias=True,
                               initializer_range=0.1),
                (r"softmax_type \.+ learnable", r"quick_geglu \.+ True",
                 r"add_bias_linear \.+ True", r"activation_func_clamp_value \.+ 7\.0",
                 r"glu_linear_offset \.+ 1\.0")),
}


def _make(hf_dir, family):
    import transformers

    prefix, cfg, _ = FAMILIES[family]
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(43)
    if family == "gpt_oss":  # plain RoPE (transformers 5 takes it as rope_parameters only)
        cfg = dict(cfg, **({"rope_scaling": None} if installed_layout() == 4 else {
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]}}))
    model = model_cls(getattr(transformers, f"{prefix}Config")(**cfg, dtype="float32")).float()
    with torch.no_grad():  # random biases, norms and router bias (transformers: 0 / 1 / 0)
        for name, p in model.named_parameters():
            if name.endswith((".bias", "_proj_bias", "q_norm.weight", "k_norm.weight", "sinks")):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("experts.gate_up_proj"):
                p.mul_(30.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(hf_dir)
    return model_cls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pretrain_gpt_loads_an_import_and_prints_transformers_loss(patched_megatron_lm, tmp_path,
                                                                   family):
    hf_dir, ckpt, run = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "run")
    model_cls = _make(hf_dir, family)
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"metp_parallel_size": 2})
    log = _launch(os.path.join(ckpt, "model.sh"), patched_megatron_lm, METP_CPU="1",
                  PRECISION="fp32", TRANSFORMER_IMPL="local", GPUS_PER_NODE="2",
                  TRAIN_ITERS="1", CHECKPOINT_PATH=run, SAVE_INTERVAL="1")
    assert f"successfully loaded checkpoint from {ckpt}" in log, log[-4000:]
    for pattern in FAMILIES[family][2] + (r"expert_model_parallel_size \.+ 2\b",):
        assert re.search(pattern, log), (pattern, log[-4000:])
    tokens, labels, mask, megatron_loss, _ = check_iteration_1_loss(log, model_cls, hf_dir,
                                                                    family)
    out = str(tmp_path / "exported")
    assert H.main(["export", "--load", run, "--out", out, "--hf-config", hf_dir]) == 0
    trained = _loss(model_cls, out, tokens[:GBS], labels[:GBS], mask[:GBS])
    print(f"export of the run's iteration-1 save: first batch {trained:.7f}")
    assert trained < megatron_loss - 0.05  # the save holds the step trained on this batch
    # without a config.json: written from the run's saved arguments, the same family and model
    from_args = str(tmp_path / "from-args")
    assert H.main(["export", "--load", run, "--out", from_args]) == 0
    with open(os.path.join(from_args, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (out, from_args))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _loss(model_cls, from_args, tokens[:GBS], labels[:GBS], mask[:GBS]) == trained
