"""``hf export`` without ``--hf-config``: the config.json written from a checkpoint's saved
Megatron-LM arguments (:mod:`megatron_metp.tools.hf.from_args`), the inert reader of those
arguments (:mod:`megatron_metp.megatron_lm.saved_args`) and the refusal of a model with no Hugging
Face family. No training here: ``tests/test_hf_megatron_lm.py`` exports a from-scratch run and
checks transformers' loss against Megatron-LM's."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from megatron_metp.megatron_lm.saved_args import read_saved_args
from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.config import HFConfigError
from megatron_metp.tools.hf.from_args import check_against_args, hf_config_from_args

#: the saved args of configs/tiny-cpu-llama-metp2.sh (the fields export reads), as Megatron-LM
#: core_v0.16.1 saves them
LLAMA = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             num_query_groups=2, group_query_attention=True, kv_channels=16,
             normalization="RMSNorm", layernorm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
             add_qkv_bias=False, qk_layernorm=False, position_embedding_type="rope",
             rotary_base=500000, rotary_percent=1.0, rotary_interleaved=False,
             use_rope_scaling=False, rope_scaling_factor=8.0, max_position_embeddings=256,
             untie_embeddings_and_output_weights=True, padded_vocab_size=1024, window_size=None,
             num_experts=None, multi_latent_attention=False, squared_relu=False,
             layernorm_zero_centered_gamma=False, softmax_type="vanilla", bf16=False, fp16=False,
             params_dtype="torch.float32", init_method_std=0.02)
#: configs/tiny-cpu-metp2.sh's model (configs/models/tiny.sh): LayerNorm, GeLU, biases
GPT = dict(LLAMA, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
           group_query_attention=False, num_query_groups=1, ffn_hidden_size=256,
           untie_embeddings_and_output_weights=False)


def test_llama_config_from_args():
    cfg = hf_config_from_args(LLAMA)
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"],
            cfg["rms_norm_eps"], cfg["tie_word_embeddings"], cfg["rope_scaling"]) == \
        (1024, 2, 16, 500000.0, 1e-5, False, None)
    from transformers import LlamaConfig  # transformers takes it as written

    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    assert (hf.num_key_value_heads, hf.head_dim, hf.intermediate_size) == (2, 16, 128)


@pytest.mark.parametrize("extra,family,fields", [
    (dict(qk_layernorm=True, kv_channels=32), "qwen3", dict(head_dim=32)),
    (dict(add_qkv_bias=True), "qwen2", dict(use_sliding_window=False)),
    (dict(window_size=[127, 0]), "mistral", dict(sliding_window=128)),
    (dict(use_rope_scaling=True, rope_scaling_factor=32.0), "llama",
     dict(rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    (dict(position_embedding_type="yarn", rotary_scaling_factor=4.0, mscale=1.0,
          mscale_all_dim=0.0, yarn_original_max_position_embeddings=16, yarn_beta_fast=32.0,
          yarn_beta_slow=1.0, yarn_correction_range_round_to_int=True), "llama",
     dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 16, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": True})),
])
def test_family_from_args(extra, family, fields):
    cfg = hf_config_from_args(dict(LLAMA, **extra))
    assert cfg["model_type"] == family
    assert {k: cfg[k] for k in fields} == fields
    g = check_against_args(cfg, dict(LLAMA, **extra))  # the import rebuilds these flags
    assert g.family == family


def test_yarn_mscale_reaches_transformers_as_its_attention_factor():
    a = dict(LLAMA, position_embedding_type="yarn", rotary_scaling_factor=4.0, mscale=0.7,
             mscale_all_dim=0.0, yarn_original_max_position_embeddings=16, yarn_beta_fast=32.0,
             yarn_beta_slow=1.0, yarn_correction_range_round_to_int=True)
    cfg = hf_config_from_args(a)
    assert cfg["rope_scaling"]["attention_factor"] == pytest.approx(0.1 * 0.7 * 1.3862943611 + 1)
    check_against_args(cfg, a)


def test_a_config_that_does_not_rebuild_the_saved_flags_is_refused():
    cfg = hf_config_from_args(LLAMA)
    with pytest.raises(HFConfigError, match=r"--rotary-base 10000 \(saved: rotary_base = "
                                            r"500000\)"):
        check_against_args(dict(cfg, rope_theta=10000.0), LLAMA)


def test_gpt_shaped_args_are_refused_naming_every_mismatch():
    with pytest.raises(HFConfigError) as e:
        hf_config_from_args(GPT)
    msg = str(e.value)
    assert "--normalization LayerNorm: Hugging Face Llama-family models" in msg
    assert "use RMSNorm" in msg and "GeLU" in msg and "SwiGLU" in msg and "--swiglu" in msg
    assert "--disable-bias-linear" in msg and "vocab" not in msg.lower()
    for extra, flag in ((dict(qk_layernorm=True, add_qkv_bias=True), "together"),
                        (dict(num_experts=8, moe_shared_expert_intermediate_size=64),
                         "--moe-shared-expert-intermediate-size 64"),
                        (dict(position_embedding_type="learned_absolute"),
                         "--position-embedding-type learned_absolute")):
        with pytest.raises(HFConfigError, match=flag):
            hf_config_from_args(dict(LLAMA, **extra))


class _Planted:
    """Unpickling this would create ``path`` (a planted object in a checkpoint)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _fake_checkpoint(root, args: dict, planted=None):
    """A --save directory whose iter_0000002 holds a Megatron-LM style common.pt (no tensors:
    export refuses before reading any)."""
    d = os.path.join(root, "iter_0000002")
    os.makedirs(d)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    args = dict(args, params_dtype=torch.float32)
    torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": 2,
                "rng_state": [torch.zeros(3)], "planted": planted},
               os.path.join(d, "common.pt"))
    return d


def test_saved_args_are_read_without_running_the_pickle(tmp_path):
    canary = str(tmp_path / "ran")
    d = _fake_checkpoint(str(tmp_path / "run"), LLAMA, planted=_Planted(canary))
    got = read_saved_args(d)
    assert not os.path.exists(canary)
    assert {k: got[k] for k in LLAMA if k != "params_dtype"} == \
        {k: v for k, v in LLAMA.items() if k != "params_dtype"}
    assert got["params_dtype"] == "torch.float32"
    (tmp_path / "empty").mkdir()
    assert read_saved_args(str(tmp_path / "empty")) is None


def test_export_refuses_a_gpt_checkpoint_with_or_without_hf_config(tmp_path):
    run = str(tmp_path / "run")
    _fake_checkpoint(run, GPT)
    with pytest.raises(HFConfigError, match=r"--normalization LayerNorm: Hugging Face "
                                            r"Llama-family models .*GeLU"):
        H.export_hf(run, str(tmp_path / "out"))
    llama = tmp_path / "llama"  # a hand-written Llama config.json does not hide the mismatch
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(hf_config_from_args(LLAMA)))
    with pytest.raises(HFConfigError, match=r"no Hugging Face family.*--normalization "
                                            r"LayerNorm.*GeLU"):
        H.export_hf(run, str(tmp_path / "out"), hf_config=str(llama))
    assert H.main(["export", "--load", run, "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
