"""Megatron-LM's own ``pretrain_gpt.py`` (patched, at the session's release, METP 2 on CPU ranks,
fp32) loading a tiny ``transformers`` Qwen3-MoE converted by ``megatron_metp.tools.hf import``:
the flags of the import's ``model.sh`` (``--num-experts``, ``--moe-router-topk``,
``--moe-ffn-hidden-size``, ``--moe-layer-freq [1,0,1]`` for a dense middle layer,
``--qk-layernorm``) build the model the checkpoint holds (its per-layer keys load, the experts
sharded over the METP ranks), and iteration 1 prints transformers' loss of the same mock
batch. The run's own save (experts saved from EP 2) exports back to Hugging Face, with the
import's config.json and without one (written from the saved arguments): the same tensors and a
Qwen3-MoE config transformers loads."""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.versions import canonical
from tests.harness import run_ranks
from tests.test_hf import _import_on_a_rank
from tests.test_hf_megatron_lm import GBS, TINY, _launch
from tests.test_hf_megatron_lm_families import _loss, check_iteration_1_loss

#: test_hf_megatron_lm.TINY with 3 layers, the middle one dense (mlp_only_layers), 4 experts
#: of width 32 (2 per METP rank), top-2 renormalised
MOE = dict(TINY, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
           norm_topk_prob=True, initializer_range=0.1)


def test_pretrain_gpt_loads_a_qwen3_moe_import(patched_megatron_lm, tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    torch.manual_seed(41)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, dtype="float32")).float()
    with torch.no_grad():  # random q/k norms (transformers initialises them to 1)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"metp_parallel_size": 2})
    log = _launch(os.path.join(ckpt, "model.sh"), patched_megatron_lm, METP_CPU="1",
                  PRECISION="fp32", TRANSFORMER_IMPL="local", GPUS_PER_NODE="2",
                  TRAIN_ITERS="1", CHECKPOINT_PATH=str(tmp_path / "run"), SAVE_INTERVAL="1")
    assert f"successfully loaded checkpoint from {ckpt}" in log, log[-4000:]
    for pattern in (r"num_experts \.+ 4\b", r"moe_layer_freq \.+ \[1, 0, 1\]",
                    r"expert_model_parallel_size \.+ 2\b", r"qk_layernorm \.+ True"):
        assert re.search(pattern, log), (pattern, log[-4000:])
    tokens, labels, mask, megatron_loss, _ = check_iteration_1_loss(
        log, Qwen3MoeForCausalLM, hf_dir, "qwen3_moe")
    # the run's save (iteration 1, trained one step) exported with and without a config.json
    from safetensors.torch import load_file

    run = str(tmp_path / "run")
    with_cfg, from_args = str(tmp_path / "hf-with-config"), str(tmp_path / "hf-from-args")
    assert H.main(["export", "--load", run, "--out", with_cfg, "--hf-config", hf_dir]) == 0
    assert H.main(["export", "--load", run, "--out", from_args]) == 0
    a = load_file(os.path.join(with_cfg, "model.safetensors"))
    b = load_file(os.path.join(from_args, "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(".mlp.experts." in k for k in a) == 2 * 4 * 3  # layers 0 and 2, 4 experts
    with open(os.path.join(from_args, "config.json")) as f:
        cfg = canonical(json.load(f))  # either transformers' layout (hf.versions)
    assert {k: cfg[k] for k in ("model_type", "num_experts", "num_experts_per_tok",
                                "moe_intermediate_size", "mlp_only_layers", "norm_topk_prob",
                                "intermediate_size")} == dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], norm_topk_prob=True, intermediate_size=128)
    trained = _loss(Qwen3MoeForCausalLM, from_args, tokens[:GBS], labels[:GBS], mask[:GBS])
    print(f"export of the run's iteration-1 save (from its saved arguments): first batch "
          f"{trained:.7f}")
    assert trained < megatron_loss - 0.05  # the save holds the step trained on this batch
    assert trained == _loss(Qwen3MoeForCausalLM, with_cfg, tokens[:GBS], labels[:GBS],
                            mask[:GBS])
