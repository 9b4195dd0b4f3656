"""Hugging Face DeepSeek-V2 and DeepSeek-V3 in and out: tiny random ``transformers``
``DeepseekV2ForCausalLM`` (DeepSeek-V2-Lite's shape: no query latent, softmax top-2 without
renormalisation, a routed scaling factor, a leading dense layer, a shared expert; plain RoPE) and
``DeepseekV3ForCausalLM`` (query latent, sigmoid router with ``e_score_correction_bias``,
group-limited top-k, scaling 2.5, two shared experts, DeepSeek's YaRN with ``mscale`` and
``mscale_all_dim``) built in the test, converted with ``megatron_metp.tools.hf`` into METP's
multi-latent attention (the latent on the ring) and Megatron's MoE: METP 2 gives transformers'
logits and loss (fp32, 1e-5), and so does METP 3; import then export returns every tensor bit for bit, with the
printed Megatron-LM flags; negative controls (RoPE over rotate-half pairs instead of
DeepSeek's interleaved ones, YaRN without ``mscale_all_dim``) are caught; what cannot convert is
refused naming the field."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.config import LlamaGeometry, geometry_from_hf, megatron_args
from tests.harness import assert_messages, run_ranks, value_errors
from tests.hf_tiny import (import_made, model_reference, randomise, read_tensors,
                            reimport, saved_configs)
from tests.numerics import rel_err
from tests.test_hf import TINY, _batch, _import_on_a_rank, _metp_run
from tests.test_hf_moe import _check

FAMILIES = ("deepseek_v2", "deepseek_v3")
#: shared: hidden 36, 6 heads (divisible by METP 2 and 3), 3 layers with layer 0 dense (48
#: wide), 6 experts of 12, top-2; kv latent 16, no-RoPE query/key 8, RoPE 8, value 8 per head;
#: RMSNorm epsilon 1e-6 (transformers' latent norms have it whatever rms_norm_eps says)
_COMMON = dict(vocab_size=TINY["vocab_size"], hidden_size=36, intermediate_size=48,
               num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=6,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
               first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=5000.0,
               initializer_range=0.1, tie_word_embeddings=False)
#: DeepSeek-V2-Lite's shape: no query latent, greedy softmax top-2 (not renormalised) scaled by
#: 1.5, one shared expert, plain RoPE
V2 = dict(_COMMON, q_lora_rank=None, n_shared_experts=1, topk_method="greedy",
          norm_topk_prob=False, routed_scaling_factor=1.5, max_position_embeddings=64)
#: DeepSeek-V3's: query latent 24, 6 experts in 2 groups (top-2 inside the best group), scaling
#: 2.5, two shared experts, YaRN (factor 4 over DeepSeek's original 4096 positions, mscale 0.8,
#: mscale_all_dim 1.0: cos/sin times g(4, 0.8)/g(4, 1), the softmax scale times g(4, 1)^2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
V3 = dict(_COMMON, q_lora_rank=24, n_shared_experts=2, n_group=2, topk_group=1,
          norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=16384,
          rope_scaling=YARN)
BASE = {"deepseek_v2": V2, "deepseek_v3": V3}


def _q_latent_needed() -> bool:
    """megatron-core 0.19 fuses the no-query-latent form's norm into a Transformer Engine
    linear, which METP's MLA refuses (docs/mla.md): there the V2 model gets a query latent."""
    from megatron.core.transformer import multi_latent_attention as stock

    return hasattr(stock, "QKNormConfigResolver")


def _hf_class(family):
    import transformers

    return {"deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
            "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
            }[family]


def _config(family, **change):
    cfg = copy.deepcopy({**BASE[family], **change})
    if family == "deepseek_v2" and "q_lora_rank" not in change and _q_latent_needed():
        cfg["q_lora_rank"] = 24
    rs = cfg.pop("rope_scaling", None)
    from megatron_metp.tools.hf.versions import installed_layout

    if installed_layout() == 5:  # transformers 5 takes the scaling in rope_parameters only
        cfg["rope_parameters"] = dict(rs or {"rope_type": "default"},
                                      rope_theta=cfg.pop("rope_theta"))
    else:
        cfg["rope_scaling"] = rs
    return cfg


def _make_hf(path: str, family: str, seed: int, **change) -> None:
    """A random fp32 model of ``family`` saved as safetensors; the latent norms, layer norms
    and V3's router bias random too (transformers starts them at 1 / 0)."""
    config_cls, model_cls = _hf_class(family)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**_config(family, **change), dtype="float32")).float()
    randomise(model)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Both families' tiny models imported for METP 3 with no vocabulary padding (102 rows, and
    so for METP 2 too),
    and transformers' logits and loss of the test batch."""
    return import_made(tmp_path_factory.mktemp("hf_deepseek"), FAMILIES, _make_hf,
                       lambda f: _hf_class(f)[1], seed=51, metp=3)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_metp_logits_and_loss_equal_transformers(models, family, p):
    """At METP 2 and 3: the multi-latent attention with the latent on the ring (exact RoPE
    angles of DeepSeek's interleaved pairs; V3: YaRN with both mscales), the shared expert as
    METP's MLP, megatron-core's routers (V2: softmax top-k, scaled; V3: sigmoid with the expert
    bias, a group, scaled), the experts sharded over the ranks: transformers' logits and
    loss."""
    m = models[family]
    logits, loss = _metp_run(p, m.ckpt, m.geometry, models["ids"])
    _check(f"{family} METP={p}", logits, loss, m)


def _far(tag, logits, m):
    err = rel_err(logits, m.logits)
    print(f"{tag}: logits rel. err {err:.2e}")
    assert err > 1e-3, (tag, err)


def test_negative_controls(models, tmp_path):
    """The logits check sees the RoPE pairing and DeepSeek's mscale: the V2 import with each
    head's RoPE rows permuted from DeepSeek's interleaved pairs into rotate-half order (the
    mapping a Llama-style RoPE would need), and V3 with YaRN's softmax factor dropped
    (``mscale_all_dim`` 0)."""
    import shutil

    from safetensors.torch import save_file

    ids = models["ids"]
    m = models["deepseek_v2"]
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    shutil.copytree(m.hf_dir, hf_dir)
    t = read_tensors(hf_dir)
    g = LlamaGeometry(**m.geometry)
    dn, dr = g.qk_head_dim, g.qk_pos_emb_head_dim
    order = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])  # halves of the pairs
    for k in list(t):
        if k.endswith(("q_proj.weight", "q_b_proj.weight")):
            w = t[k].reshape(g.num_attention_heads, dn + dr, -1).clone()
            w[:, dn:] = w[:, dn:][:, order]
            t[k] = w.reshape(t[k].shape).contiguous()
        elif k.endswith("kv_a_proj_with_mqa.weight"):
            w = t[k].clone()
            w[g.kv_lora_rank:] = w[g.kv_lora_rank:][order]
            t[k] = w
    save_file(t, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"make_vocab_size_divisible_by": 1})
    logits, _ = _metp_run(2, ckpt, m.geometry, ids)
    _far("\ndeepseek_v2 RoPE rows in rotate-half order", logits, m)
    m = models["deepseek_v3"]
    y = dict(m.geometry["mla_yarn"], mscale_all_dim=0.0)
    logits, _ = _metp_run(2, m.ckpt, dict(m.geometry, mla_yarn=y), ids)
    _far("deepseek_v3 YaRN without mscale_all_dim", logits, m)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_round_trip_is_bit_exact(models, family, tmp_path):
    """Hugging Face → checkpoint → Hugging Face gives every tensor back bit for bit (the latent
    projections and norms, the router and V3's router bias in fp32, experts, shared experts, the
    dense layer), the exported config.json rebuilds the same logits in the installed
    transformers, and re-importing the export gives the same checkpoint tensors."""
    m = models[family]
    exported = str(tmp_path / "exported")
    H.export_hf(m.ckpt, exported, log=lambda _msg: None)
    src, out = read_tensors(m.hf_dir), read_tensors(exported)
    assert sorted(src) == sorted(out)
    q_latent = family == "deepseek_v3" or _q_latent_needed()
    assert sum(".self_attn." in k for k in out) == 3 * (7 if q_latent else 5)
    unequal = [k for k in src if src[k].dtype != out[k].dtype or not torch.equal(src[k], out[k])]
    assert not unequal, unequal
    logits, _ = model_reference(_hf_class(family)[1], exported, models["ids"],
                                models["ids"].shape[1] - 1)
    assert torch.equal(logits, m.logits)
    a, b = reimport(exported, m.ckpt, str(tmp_path / "reimported"))
    assert sorted(a) == sorted(b)
    assert torch.equal(a["decoder.layers.1.self_attention.linear_kv_up_proj.weight"],
                       src["model.layers.1.self_attn.kv_b_proj.weight"])
    if family == "deepseek_v3":
        assert torch.equal(a["decoder.layers.2.mlp.router.expert_bias"],
                           src["model.layers.2.mlp.gate.e_score_correction_bias"])
    unequal = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not unequal, unequal


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_flags_match_the_config(models, capsys):
    """The printed Megatron-LM flags carry the MLA shape, the RoPE type and each family's
    router."""
    assert H.main(["flags", "--hf-dir", models["deepseek_v3"].hf_dir,
                   "--make-vocab-size-divisible-by", "1", "--metp-parallel-size", "2"]) == 0
    f = capsys.readouterr().out.split()
    assert [_flag(f, k) for k in (
        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
        "--v-head-dim", "--rope-type", "--rotary-scaling-factor", "--mscale",
        "--mscale-all-dim", "--moe-layer-freq", "--moe-shared-expert-intermediate-size",
        "--moe-router-score-function", "--moe-router-num-groups", "--moe-router-group-topk",
        "--moe-router-topk-scaling-factor")] == \
        ["24", "16", "8", "8", "8", "yarn", "4.0", "0.8", "1.0", "[0,1,1]", "24", "sigmoid",
         "2", "1", "2.5"]
    assert {"--multi-latent-attention", "--qk-layernorm", "--moe-router-enable-expert-bias"} \
        <= set(f)
    assert not {"--group-query-attention", "--kv-channels", "--position-embedding-type yarn",
                "--moe-router-pre-softmax"} & set(f)
    g = megatron_args(LlamaGeometry(**models["deepseek_v2"].geometry))
    assert (_flag(g, "--rope-type"), _flag(g, "--moe-router-topk-scaling-factor"),
            _flag(g, "--moe-shared-expert-intermediate-size")) == ("rope", "1.5", "12")
    assert {"--moe-router-pre-softmax", "--no-rope-fusion"} <= set(g)
    assert ("--q-lora-rank" in g) == _q_latent_needed()
    assert "--moe-router-score-function" not in g and "--moe-router-num-groups" not in g


def _cfg(family, build=None, **change):
    """The family's config.json as the installed transformers writes it (``build``: more
    config arguments), ``change`` written over it."""
    import json

    config_cls, _ = _hf_class(family)
    cfg = json.loads(config_cls(**_config(family, **(build or {}))).to_json_string())
    cfg.update(change)
    return cfg


def test_unconvertible_settings_are_refused_naming_them():
    yarn = dict(YARN, original_max_position_embeddings=8192)
    msgs = value_errors({
        "interleave": lambda: geometry_from_hf(_cfg("deepseek_v3", rope_interleave=False)),
        "kv_heads": lambda: geometry_from_hf(_cfg("deepseek_v2", num_key_value_heads=2)),
        "norm": lambda: geometry_from_hf(_cfg("deepseek_v2", norm_topk_prob=True)),
        "group": lambda: geometry_from_hf(_cfg("deepseek_v2", topk_method="group_limited_greedy",
                                               n_group=2, topk_group=1)),
        "v3_group": lambda: geometry_from_hf(_cfg("deepseek_v3", num_experts_per_tok=3)),
        "orig": lambda: geometry_from_hf(_cfg("deepseek_v3", build=dict(rope_scaling=yarn))),
        "bias": lambda: geometry_from_hf(_cfg("deepseek_v3", attention_bias=True)),
        "freq": lambda: geometry_from_hf(_cfg("deepseek_v3", moe_layer_freq=2)),
        "eps": lambda: geometry_from_hf(_cfg("deepseek_v2", rms_norm_eps=1e-5)),
        "method": lambda: geometry_from_hf(_cfg("deepseek_v3", topk_method="greedy")),
        "mla_llama": lambda: geometry_from_hf(dict(
            _cfg("deepseek_v2"), model_type="llama", architectures=["LlamaForCausalLM"])),
    })
    assert_messages(msgs, {
        "interleave": "rope_interleave = False", "kv_heads": "num_key_value_heads = 2",
        "norm": "norm_topk_prob = true for deepseek_v2",
        "group": "num_experts_per_tok = 2, topk_group = 1",
        "v3_group": "best 2 experts",
        "orig": "original_max_position_embeddings = 8192",
        "bias": "attention_bias = true", "freq": "moe_layer_freq = 2",
        "eps": "rms_norm_eps = 1e-05",
        "method": "topk_method = 'greedy'",
        "mla_llama": "deepseek_v2"})
    # group-limited V2 routing converts where both score a group alike (k = topk_group)
    g = geometry_from_hf(_cfg("deepseek_v2", topk_method="group_limited_greedy", n_group=4,
                              topk_group=2, num_experts_per_tok=2, n_routed_experts=8))
    assert (g.moe_router_num_groups, g.moe_router_group_topk) == (4, 2)


#: the published config.json fields (no download): DeepSeek-V2-Lite, and DeepSeek-V3 as a bf16
#: copy (the published one is FP8: quantization_config, refused like every quantized model)
_YARN_40 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "original_max_position_embeddings": 4096,
            "type": "yarn"}
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
    auto_map={"AutoConfig": "configuration_deepseek.DeepseekV2Config"}, attention_bias=False,
    attention_dropout=0.0, aux_loss_alpha=0.001, first_k_dense_replace=1, hidden_act="silu",
    hidden_size=2048, intermediate_size=10944, kv_lora_rank=512, max_position_embeddings=163840,
    moe_intermediate_size=1408, moe_layer_freq=1, n_group=1, n_routed_experts=64,
    n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16, num_experts_per_tok=6,
    num_hidden_layers=27, num_key_value_heads=16, pretraining_tp=1, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
    rope_scaling=dict(_YARN_40, mscale=0.707, mscale_all_dim=0.707), rope_theta=10000,
    routed_scaling_factor=1.0, scoring_func="softmax", seq_aux=True, tie_word_embeddings=False,
    topk_group=1, topk_method="greedy", torch_dtype="bfloat16", v_head_dim=128,
    vocab_size=102400)
DEEPSEEK_V3 = dict(
    {k: v for k, v in DEEPSEEK_V2_LITE.items() if k not in ("auto_map", "pretraining_tp")},
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], ep_size=1,
    first_k_dense_replace=3, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, n_group=8, n_routed_experts=256, n_shared_experts=1,
    norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61,
    num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536,
    rope_scaling=dict(_YARN_40, mscale=1.0, mscale_all_dim=1.0), routed_scaling_factor=2.5,
    scoring_func="sigmoid", topk_group=4, topk_method="noaux_tc", vocab_size=129280)


def test_flags_of_the_published_models():
    """DeepSeek-V2-Lite at METP 4 and DeepSeek-V3 at METP 8: the Megatron-LM flags of their
    latents, YaRN, routers, shared experts and leading dense layers (no weights read)."""
    v2 = " ".join(megatron_args(geometry_from_hf(DEEPSEEK_V2_LITE, metp_parallel_size=4)))
    assert v2.endswith(
        "--multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
        "--v-head-dim 128 --rope-type yarn --rotary-scaling-factor 40.0 --mscale 0.707 "
        "--mscale-all-dim 0.707 --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 "
        "--moe-layer-freq [0" + ",1" * 26 + "] --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 0.0 --moe-router-pre-softmax "
        "--moe-shared-expert-intermediate-size 2816"), v2
    assert "--q-lora-rank" not in v2 and "--ffn-hidden-size 10944" in v2
    v3 = " ".join(megatron_args(geometry_from_hf(DEEPSEEK_V3, metp_parallel_size=8)))
    assert v3.endswith(
        "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 128 --rope-type yarn --rotary-scaling-factor 40.0 "
        "--mscale 1.0 --mscale-all-dim 1.0 --num-experts 256 --moe-router-topk 8 "
        "--moe-ffn-hidden-size 2048 --moe-layer-freq [0,0,0" + ",1" * 58 + "] "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.0 "
        "--moe-shared-expert-intermediate-size 2048 --moe-router-score-function sigmoid "
        "--moe-router-enable-expert-bias --moe-router-num-groups 8 --moe-router-group-topk 4 "
        "--moe-router-topk-scaling-factor 2.5"), v3
    with pytest.raises(ValueError, match="quantization_config"):
        geometry_from_hf(dict(DEEPSEEK_V3, quantization_config={"quant_method": "fp8"}))


def test_multi_token_prediction_tensors_are_refused_naming_them(models, tmp_path):
    """A DeepSeek-V3 checkpoint with its MTP layer (``model.layers.<num_hidden_layers>.*``, as
    the published one) is refused naming num_nextn_predict_layers; nothing is written."""
    import shutil

    from safetensors.torch import save_file

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    shutil.copytree(models["deepseek_v3"].hf_dir, hf_dir)
    t = read_tensors(hf_dir)
    t["model.layers.3.enorm.weight"] = torch.ones(36)
    save_file(t, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        H.import_hf(hf_dir, ckpt, log=lambda _msg: None)
    assert not os.path.exists(ckpt)


def test_export_checks_the_runs_mla_flags_against_the_config():
    """Exporting a Megatron-LM save with a DeepSeek config.json: the run's saved MLA flags must
    be the config's (from_args.mla_args_problems), each difference named; a run without MLA is
    refused too."""
    from megatron_metp.tools.hf.from_args import mla_args_problems

    cfg = _cfg("deepseek_v3")
    saved = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                 qk_pos_emb_head_dim=8, v_head_dim=8, qk_layernorm=True, rope_type="yarn",
                 rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=1.0)
    assert mla_args_problems(cfg, saved) == []
    bad = mla_args_problems(cfg, dict(saved, kv_lora_rank=32, rope_type="rope", mscale=1.0))
    assert [b.split(":")[0] for b in bad] == ["--rope-type", "--kv-lora-rank", "--mscale"], bad
    assert mla_args_problems(cfg, dict(saved, multi_latent_attention=False))[0].startswith(
        "--multi-latent-attention: the run has none")


def test_both_versions_config_files_read_alike():
    """The config.json that transformers 4.57.6 and 5.25.0 wrote for these tiny models (kept in
    tests/data/hf_configs/, make_fixtures.py; V2 without a query latent) give the same
    Megatron-LM flags, equal to those of the config the installed transformers writes now; each
    is in its version's layout (5.x: V3's YaRN with mscale and mscale_all_dim in
    rope_parameters)."""
    for family in FAMILIES:
        build = dict(q_lora_rank=BASE[family]["q_lora_rank"])
        want = megatron_args(geometry_from_hf(_cfg(family, build=build), metp_parallel_size=3))
        for version, cfg in saved_configs(family).items():
            assert megatron_args(geometry_from_hf(cfg, metp_parallel_size=3)) == want, \
                (version, family)
            if family == "deepseek_v3":
                rs = cfg["rope_scaling" if version[0] == "4" else "rope_parameters"]
                assert (rs["mscale"], rs["mscale_all_dim"]) == (0.8, 1.0)
        assert ("--mscale" in want) == (family == "deepseek_v3")


def test_v2_yarn_follows_deepseek_and_transformers_5(tmp_path):
    """DeepSeek-V2 with DeepSeek's YaRN (mscale = mscale_all_dim = 0.707, factor 4): the import
    multiplies the softmax scale by g(f, 0.707)^2 as DeepSeek's code, transformers 5 and
    Megatron's MLA do, and METP 2 gives transformers 5's logits. transformers 4.x's DeepSeek-V2
    leaves that factor out: its logits are the geometry's with both mscales 0 (no factor on
    cos/sin or softmax), and the import's differ from them (docs/huggingface.md)."""
    from megatron_metp.tools.hf.versions import installed_layout

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _make_hf(hf_dir, "deepseek_v2", 71,
             rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707))
    geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                         {"make_vocab_size_divisible_by": 1})[0]
    assert geometry["mla_yarn"] == {"rotary_scaling_factor": 4.0, "mscale": 0.707,
                                    "mscale_all_dim": 0.707}
    ids = _batch()
    logits, loss = model_reference(_hf_class("deepseek_v2")[1], hf_dir, ids, ids.shape[1] - 1)
    m = SimpleNamespace(logits=logits, loss=loss)
    got, got_loss = _metp_run(2, ckpt, geometry, ids)
    if installed_layout() == 5:
        _check("deepseek_v2 YaRN METP=2 (transformers 5)", got, got_loss, m)
        return
    _far("deepseek_v2 YaRN, transformers 4.x without the softmax factor", got, m)
    unscaled = dict(geometry, mla_yarn=dict(geometry["mla_yarn"], mscale=0.0,
                                            mscale_all_dim=0.0))
    _check("deepseek_v2 YaRN as transformers 4.x computes it", *_metp_run(2, ckpt, unscaled, ids),
           m)


def test_no_query_latent_converts_where_megatron_core_builds_it(tmp_path):
    """DeepSeek-V2-Lite's form (q_lora_rank null): megatron-core 0.16.1's MLA applies no query
    norm there and takes it (the V2 model of the logits tests above); 0.19's puts a query
    RMSNorm on it under --qk-layernorm, so the import refuses it naming q_lora_rank and the
    release, before any weight is read (the folder holds config.json only)."""
    import json

    from megatron_metp.tools.hf.convert import check_release

    cfg = _cfg("deepseek_v2", build=dict(q_lora_rank=None))
    g = geometry_from_hf(cfg)
    assert g.q_lora_rank is None
    if not _q_latent_needed():
        check_release(g)
        return
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="q_lora_rank = null .* megatron-core 0.16"):
        H.import_hf(str(hf_dir), str(tmp_path / "ckpt"), log=lambda _msg: None)
    assert not os.path.exists(tmp_path / "ckpt")
