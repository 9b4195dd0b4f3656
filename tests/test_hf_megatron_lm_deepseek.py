"""Megatron-LM's own ``pretrain_gpt.py`` (patched, at the session's release, METP 2 on CPU ranks,
fp32) loading a tiny ``transformers`` DeepSeek-V3 converted by ``megatron_metp.tools.hf import``:
the flags of the import's ``model.sh`` (``--multi-latent-attention`` with its latent ranks and
head dims, MLA's YaRN ``--rope-type yarn --rotary-scaling-factor --mscale --mscale-all-dim``,
the sigmoid router with expert bias, a group, top-k scaling, a shared expert, a leading dense
layer) build METP's MLA model the checkpoint holds, and iteration 1 prints transformers' loss of
the same mock batch. The run's own save (trained one step) exports back with the import's
config.json (its saved MLA and MoE flags checked against it), and transformers' loss of the
trained batch is lower; without a config.json the export is refused naming
``--multi-latent-attention``."""

from __future__ import annotations

import os
import re

import torch

from megatron_metp.tools import hf as H
from tests.harness import run_ranks
from tests.hf_tiny import randomise
from tests.test_hf import _import_on_a_rank
from tests.test_hf_deepseek import YARN
from tests.test_hf_megatron_lm import GBS, TINY, _launch
from tests.test_hf_megatron_lm_families import _loss, check_iteration_1_loss

#: 2 layers (layer 0 dense), hidden 64, 4 heads, query latent 32, kv latent 32, no-RoPE 16,
#: RoPE 8, value 16 per head; 4 experts of 32 in 2 groups (2 per METP rank), one shared expert;
#: DeepSeek's YaRN (tests/test_hf_deepseek.py)
V3 = dict(vocab_size=TINY["vocab_size"], hidden_size=64, intermediate_size=128,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
          first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
          routed_scaling_factor=2.5, rms_norm_eps=1e-6, rope_theta=20000.0,
          max_position_embeddings=16384, initializer_range=0.1, tie_word_embeddings=False)
PATTERNS = (r"multi_latent_attention \.+ True", r"q_lora_rank \.+ 32\b",
            r"kv_lora_rank \.+ 32\b", r"rope_type \.+ yarn", r"mscale_all_dim \.+ 1\.0",
            r"moe_router_score_function \.+ sigmoid", r"moe_router_num_groups \.+ 2\b",
            r"expert_model_parallel_size \.+ 2\b", r"moe_layer_freq \.+ \[0, 1\]")


def _make(hf_dir):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from megatron_metp.tools.hf.versions import installed_layout

    cfg = dict(V3, **({"rope_scaling": dict(YARN)} if installed_layout() == 4 else
                      {"rope_parameters": dict(YARN, rope_theta=V3["rope_theta"])}))
    torch.manual_seed(61)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg, dtype="float32")).float()
    randomise(model)
    model.save_pretrained(hf_dir)
    return DeepseekV3ForCausalLM


def test_pretrain_gpt_loads_a_deepseek_v3_import(patched_megatron_lm, tmp_path, capsys):
    hf_dir, ckpt, run = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "run")
    model_cls = _make(hf_dir)
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"metp_parallel_size": 2})
    log = _launch(os.path.join(ckpt, "model.sh"), patched_megatron_lm, METP_CPU="1",
                  PRECISION="fp32", TRANSFORMER_IMPL="local", GPUS_PER_NODE="2",
                  TRAIN_ITERS="1", CHECKPOINT_PATH=run, SAVE_INTERVAL="1")
    assert f"successfully loaded checkpoint from {ckpt}" in log, log[-4000:]
    for pattern in PATTERNS:
        assert re.search(pattern, log), (pattern, log[-4000:])
    tokens, labels, mask, megatron_loss, _ = check_iteration_1_loss(log, model_cls, hf_dir,
                                                                    "deepseek_v3")
    out = str(tmp_path / "exported")
    assert H.main(["export", "--load", run, "--out", out, "--hf-config", hf_dir]) == 0
    trained = _loss(model_cls, out, tokens[:GBS], labels[:GBS], mask[:GBS])
    print(f"export of the run's iteration-1 save: first batch {trained:.7f}")
    assert trained < megatron_loss - 0.05  # the save holds the step trained on this batch
    capsys.readouterr()
    assert H.main(["export", "--load", run, "--out", str(tmp_path / "from-args")]) == 2
    assert "--multi-latent-attention True" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "from-args")
