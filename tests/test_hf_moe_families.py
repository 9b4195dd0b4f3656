"""Hugging Face MoE families beyond Qwen3-MoE and Mixtral: tiny random ``transformers``
``Qwen2MoeForCausalLM`` (q/k/v biases, a shared expert behind a sigmoid gate, top-k without
renormalisation, a dense middle layer) and ``Glm4MoeForCausalLM`` (sigmoid router with
``e_score_correction_bias``, group-limited top-k, ``routed_scaling_factor``, a leading dense layer,
a shared expert, q/k norms, q/k/v biases, RoPE over half of each head) built in the test,
converted with ``megatron_metp.tools.hf`` and run in single-rank stock megatron-core and at
METP 2 and 3 give transformers' logits and loss (fp32, 1e-5); import then export returns every
tensor bit for bit with the printed Megatron-LM flags; negative controls (the shared expert's
gate negated, the router bias dropped, no top-k scaling, full RoPE) are caught; the settings
METP cannot reproduce are refused naming the feature. A gpt-oss run's saved arguments: checked
against the config.json on export (a mismatch names the flag and the field), or written as a
gpt_oss config.json."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.config import LlamaGeometry, geometry_from_hf, megatron_args
from tests.harness import assert_messages, run_ranks, value_errors
from tests.hf_tiny import (import_made, model_reference, randomise, read_tensors,
                            reimport, saved_configs)
from tests.numerics import rel_err
from tests.test_hf import _import_on_a_rank, _metp_run
from tests.test_hf_moe import COMMON, _check, _stock_run

FAMILIES = ("qwen2_moe", "glm4_moe", "gpt_oss")
#: Qwen2-MoE: hidden 96 (transformers 4.x's Qwen2-MoE takes no head_dim: 96 / 12 heads = 8);
#: layers 0 and 2 MoE (6 experts 16 wide, shared expert 24 wide with its gate), layer 1 dense
#: (48 wide); q/k/v biases (qkv_bias, the default); top-2 of the softmax, not renormalised
QWEN2_MOE = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, hidden_size=96,
                 num_hidden_layers=3, num_experts=6, moe_intermediate_size=16,
                 shared_expert_intermediate_size=24, intermediate_size=48,
                 decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)
#: GLM-4.5: layer 0 dense (first_k_dense_replace), layers 1, 2 MoE with 6 experts in 3 groups
#: (top-2 within the best group), routed_scaling_factor 2.5, a shared expert 3 x 16 wide, q/k
#: norms, q/k/v biases, RoPE over half of the 8 channels of each head
GLM4_MOE = dict(COMMON, num_hidden_layers=3, n_routed_experts=6, moe_intermediate_size=16,
                intermediate_size=48, first_k_dense_replace=1, n_group=3, topk_group=1,
                n_shared_experts=3, norm_topk_prob=True, routed_scaling_factor=2.5,
                use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
#: gpt-oss: 2 layers (sliding, full: the window of 64 never binds on 64 positions), 6 experts of
#: 16 with biases, attention sinks, q/k/v/o biases, gpt-oss's YaRN (truncate false) with an
#: original context of 16
GPT_OSS = dict(COMMON, num_hidden_layers=2, num_local_experts=6, intermediate_size=16,
               sliding_window=64, attention_bias=True, rope_scaling={
                   "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})
BASE = {"qwen2_moe": QWEN2_MOE, "glm4_moe": GLM4_MOE, "gpt_oss": GPT_OSS}


def _hf_class(family):
    import transformers

    return {"qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
            "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
            "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}[family]


def _make_hf(path: str, family: str, seed: int, **change) -> None:
    """A random fp32 model of ``family`` saved as safetensors: norms, q/k/v biases and GLM's
    router bias random too (transformers starts them at 1 / 0)."""
    config_cls, model_cls = _hf_class(family)
    torch.manual_seed(seed)
    # a copy: transformers 5 writes rope_theta into the rope_scaling dict it is given
    cfg = config_cls(**copy.deepcopy({**BASE[family], **change}), dtype="float32")
    model = model_cls(cfg).float()
    randomise(model)
    with torch.no_grad():  # gpt-oss: gate/up values past the clamp (7) and below -7
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                p.mul_(60.0)
    model.save_pretrained(path, safe_serialization=True)


def _hf_reference(hf_dir: str, family: str, ids: torch.Tensor, seq: int):
    return model_reference(_hf_class(family)[1], hf_dir, ids, seq)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny model of each family, converted with --make-vocab-size-divisible-by 1 for
    METP 3 (102 rows: no padding), with transformers' logits and loss."""
    return import_made(tmp_path_factory.mktemp("hf_moe_families"), FAMILIES, _make_hf,
                       lambda f: _hf_class(f)[1], seed=31, metp=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_megatron_core_equals_transformers(models, family):
    """The converted checkpoint in single-rank stock megatron-core (EP = 1): the conversion
    itself, before METP."""
    m = models[family]
    logits, loss = _stock_run(m.ckpt, m.geometry, models["ids"])
    _check(f"{family} stock megatron-core", logits, loss, m)


@pytest.mark.parametrize("p, dispatcher", [(2, "allgather"), (3, "alltoall")])
@pytest.mark.parametrize("family", FAMILIES)
def test_metp_logits_and_loss_equal_transformers(models, family, p, dispatcher):
    """At METP = p: METP attention (biases, partial RoPE, q/k norms), the shared expert as
    METP's MLP (weight ring), megatron-core's router and the 6 experts sharded over the METP
    ranks: transformers' logits and loss."""
    m = models[family]
    logits, loss = _metp_run(p, m.ckpt, m.geometry, models["ids"],
                             build={"moe_token_dispatcher": dispatcher})
    _check(f"{family} METP={p} {dispatcher}", logits, loss, m)


def _reimport_changed(tmp_path, m, suffix, change):
    """The model's safetensors with ``change`` applied to every tensor whose name ends with
    ``suffix``, imported: its checkpoint."""
    from safetensors.torch import save_file
    import shutil

    hf_dir, ckpt = str(tmp_path / "hf-changed"), str(tmp_path / "ckpt-changed")
    shutil.copytree(m.hf_dir, hf_dir)
    t = read_tensors(hf_dir)
    t.update({k: change(v) for k, v in t.items() if k.endswith(suffix)})
    save_file(t, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"make_vocab_size_divisible_by": 1})
    return ckpt


def _far(tag, logits, m):
    err = rel_err(logits, m.logits)
    print(f"{tag}: logits rel. err {err:.2e}")
    assert err > 1e-3, (tag, err)


def test_negative_controls(models, tmp_path):
    """The parity checks see each new mapping: Qwen2-MoE with its shared-expert gates negated
    (sigmoid(-x) instead of sigmoid(x)); GLM-4.5 with its router bias zeroed, without the top-k
    scaling factor, and with RoPE over whole heads; gpt-oss with its sinks negated, without
    the clamp, and without the GLU's +1."""
    ids = models["ids"]
    for family, suffix, change, what in (
            ("qwen2_moe", "shared_expert_gate.weight", torch.neg, "shared-expert gate negated"),
            ("glm4_moe", "e_score_correction_bias", torch.zeros_like, "router bias zeroed"),
            ("gpt_oss", "self_attn.sinks", torch.neg, "sinks negated")):
        m = models[family]
        logits, _ = _stock_run(_reimport_changed(tmp_path / family, m, suffix, change),
                               m.geometry, ids)
        _far(f"\n{family} {what}", logits, m)
    for family, change in (("glm4_moe", dict(moe_router_topk_scaling_factor=None)),
                           ("glm4_moe", dict(rotary_percent=1.0)),
                           ("gpt_oss", dict(activation_func_clamp_value=None)),
                           ("gpt_oss", dict(glu_linear_offset=0.0))):
        m = models[family]
        logits, _ = _stock_run(m.ckpt, {**m.geometry, **change}, ids)
        _far(f"{family} {change}", logits, m)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_round_trip_is_bit_exact(models, family, tmp_path):
    """Hugging Face → checkpoint → Hugging Face gives every tensor back bit for bit (router,
    router bias, experts, shared expert and its gate, biases, norms), and re-importing the
    export gives the same checkpoint tensors."""
    m = models[family]
    exported = str(tmp_path / "exported")
    H.export_hf(m.ckpt, exported, log=lambda _msg: None)
    src, out = read_tensors(m.hf_dir), read_tensors(exported)
    assert sorted(src) == sorted(out)
    assert sum(".shared_expert" in k for k in out) == \
        {"qwen2_moe": 2 * 4, "glm4_moe": 2 * 3, "gpt_oss": 0}[family]
    unequal = [k for k in src if src[k].dtype != out[k].dtype or not torch.equal(src[k], out[k])]
    assert not unequal, unequal
    # the exported config.json builds the same model in the installed transformers (partial
    # RoPE, router, shared expert settings kept in its layout)
    logits, _ = _hf_reference(exported, family, models["ids"], models["ids"].shape[1] - 1)
    assert torch.equal(logits, m.logits)
    a, b = reimport(exported, m.ckpt, str(tmp_path / "reimported"))
    assert sorted(a) == sorted(b)
    shared = [k for k in a if ".shared_experts." in k]
    want = [] if family == "gpt_oss" else ["linear_fc1.weight", "linear_fc2.weight"] + \
        (["gate_weight"] if family == "qwen2_moe" else [])
    assert sorted(shared) == sorted(f"decoder.layers.{i}.mlp.shared_experts.{w}"
                                    for i in ((0, 2) if family == "qwen2_moe" else (1, 2))
                                    for w in want)
    if family == "glm4_moe":
        assert torch.equal(a["decoder.layers.1.mlp.router.expert_bias"],
                           src["model.layers.1.mlp.gate.e_score_correction_bias"])
    if family == "gpt_oss":  # the sinks, and expert 1's [gate; up] from interleaved columns
        assert torch.equal(a["decoder.layers.self_attention.core_attention.softmax_offset"][1],
                           src["model.layers.1.self_attn.sinks"])
        gate_up = src["model.layers.0.mlp.experts.gate_up_proj"][1]
        assert torch.equal(a["decoder.layers.mlp.experts.experts.linear_fc1.weight"][0, 1],
                           torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1).t())
    unequal = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not unequal, unequal


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_flags_match_the_config(models, capsys):
    """The printed Megatron-LM flags carry each family's features."""
    assert H.main(["flags", "--hf-dir", models["qwen2_moe"].hf_dir,
                   "--make-vocab-size-divisible-by", "1", "--metp-parallel-size", "3"]) == 0
    q = capsys.readouterr().out.split()
    assert (_flag(q, "--num-experts"), _flag(q, "--moe-ffn-hidden-size"),
            _flag(q, "--moe-shared-expert-intermediate-size"), _flag(q, "--moe-layer-freq")) == \
        ("6", "16", "24", "[1,0,1]")
    assert {"--moe-shared-expert-gate", "--add-qkv-bias", "--moe-router-pre-softmax"} <= set(q)
    assert "--qk-layernorm" not in q and "--moe-router-score-function" not in q
    g = megatron_args(LlamaGeometry(**models["glm4_moe"].geometry))
    assert (_flag(g, "--moe-layer-freq"), _flag(g, "--moe-shared-expert-intermediate-size"),
            _flag(g, "--moe-router-score-function"), _flag(g, "--moe-router-num-groups"),
            _flag(g, "--moe-router-group-topk"), _flag(g, "--moe-router-topk-scaling-factor"),
            _flag(g, "--rotary-percent")) == ("[0,1,1]", "48", "sigmoid", "3", "1", "2.5", "0.5")
    assert {"--moe-router-enable-expert-bias", "--qk-layernorm", "--add-qkv-bias"} <= set(g)
    assert "--moe-shared-expert-gate" not in g and "--moe-router-pre-softmax" not in g


def _cfg(family, build=None, **change):
    """The family's config.json as the installed transformers writes it (``build``: more
    config arguments), with ``change`` written over it."""
    import json

    config_cls, _ = _hf_class(family)
    cfg = json.loads(config_cls(**copy.deepcopy({**BASE[family], **(build or {})}))
                     .to_json_string())
    cfg.update(change)
    return cfg


#: a gpt-oss config.json with the published sliding window (128) and no --seq-length
GPT_OSS_WINDOW = dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts=4,
    num_experts_per_tok=2, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, vocab_size=102,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"],
    attention_bias=True, swiglu_limit=7.0)


def test_unconvertible_settings_are_refused_naming_them():
    msgs = value_errors({
        "gpt_oss_window": lambda: geometry_from_hf(GPT_OSS_WINDOW),
        "gpt_oss_bias": lambda: geometry_from_hf(_cfg("gpt_oss", attention_bias=False)),
        "gpt_oss_alpha": lambda: geometry_from_hf(_cfg("gpt_oss", swiglu_alpha=1.5)),
        "group_score": lambda: geometry_from_hf(_cfg("glm4_moe", num_experts_per_tok=4,
                                                     n_group=3, topk_group=1)),
        "norm": lambda: geometry_from_hf(_cfg("glm4_moe", norm_topk_prob=False)),
        "groups": lambda: geometry_from_hf(_cfg("glm4_moe", n_group=4)),
        "odd_rope": lambda: geometry_from_hf(_cfg("glm4_moe", build=dict(partial_rotary_factor=0.375))),
        "prf_qwen2_moe": lambda: geometry_from_hf(_cfg("qwen2_moe", build=dict(partial_rotary_factor=0.5))),
        "ep": lambda: geometry_from_hf(_cfg("qwen2_moe"), metp_parallel_size=4),
        "shared": lambda: geometry_from_hf(_cfg("glm4_moe", n_shared_experts=1),
                                           metp_parallel_size=3),
        "window": lambda: geometry_from_hf(_cfg("qwen2_moe", use_sliding_window=True,
                                                sliding_window=16, layer_types=None)),
    })
    assert_messages(msgs, {
        "gpt_oss_window": "sliding_window = 128 is shorter than max_position_embeddings",
        "gpt_oss_bias": "attention_bias = False", "gpt_oss_alpha": "swiglu_alpha = 1.5",
        "group_score": "best 2 experts",
        "norm": "norm_topk_prob = false", "groups": "n_group = 4",
        "odd_rope": "is 3 channels", "prf_qwen2_moe": "partial RoPE converts for glm4_moe",
        "ep": "--metp-parallel-size 4",
        "shared": "n_shared_experts x moe_intermediate_size = 16", "window": "sliding_window = 16"})
    # the same window converts for sequences it never limits (--seq-length 128)
    g = geometry_from_hf(GPT_OSS_WINDOW, seq_length=128)
    assert (g.sliding_window, g.max_position_embeddings) == (128, 128)


def test_config_from_saved_arguments():
    """A run trained from scratch exports without --hf-config: a gated shared expert makes it a
    Qwen2-MoE, the sigmoid router with expert bias a GLM-4.5 (dense layers leading, shared
    expert a multiple of the expert width, partial RoPE); the written config imports back to
    the saved flags and transformers takes it; what neither has is refused naming the flag."""
    import transformers
    from megatron_metp.tools.hf.from_args import hf_config_from_args
    from tests.test_hf_moe import SAVED

    qwen2 = dict(SAVED, qk_layernorm=False, add_qkv_bias=True,
                 moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    q = hf_config_from_args(qwen2)
    assert (q["model_type"], q["shared_expert_intermediate_size"], q["qkv_bias"],
            q["mlp_only_layers"], q["norm_topk_prob"]) == ("qwen2_moe", 24, True, [1], True)
    transformers.Qwen2MoeConfig(**{k: v for k, v in q.items() if k != "model_type"})
    glm = dict(SAVED, add_qkv_bias=True, moe_layer_freq=[0, 1, 1], rotary_percent=0.5,
               moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_num_groups=3,
               moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)
    g = hf_config_from_args(glm)
    assert (g["model_type"], g["n_shared_experts"], g["first_k_dense_replace"], g["n_group"],
            g["topk_group"], g["routed_scaling_factor"], g["partial_rotary_factor"],
            g["use_qk_norm"], g["attention_bias"]) == \
        ("glm4_moe", 2, 1, 3, 1, 2.5, 0.5, True, True)
    transformers.Glm4MoeConfig(**{k: v for k, v in g.items() if k != "model_type"})
    for base, change, needle in (
            (qwen2, dict(moe_shared_expert_gate=False), "without --moe-shared-expert-gate"),
            (qwen2, dict(qk_layernorm=True), "Qwen2-MoE has no q/k norms"),
            (glm, dict(moe_router_enable_expert_bias=False), "GLM-4.5's router has the bias"),
            (glm, dict(moe_layer_freq=[1, 0, 1]), "dense layers are the first ones"),
            (glm, dict(moe_shared_expert_intermediate_size=24), "n_shared_experts x"),
            (glm, dict(moe_shared_expert_gate=True), "shared expert has no gate"),
            (dict(SAVED, add_qkv_bias=True), {}, "--add-qkv-bias with --num-experts and no "
                                                 "shared expert")):
        with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
            hf_config_from_args({**base, **change})


#: the published config.json fields that matter here (no download): Qwen1.5-MoE-A2.7B, GLM-4.5-Air
QWEN15_MOE_A27B = dict(
    model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=151936,
    hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, decoder_sparse_step=1,
    norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001,
    rope_theta=1000000.0, max_position_embeddings=8192, use_sliding_window=False,
    sliding_window=32768, max_window_layers=21, rms_norm_eps=1e-6, hidden_act="silu",
    attention_dropout=0.0, tie_word_embeddings=False, torch_dtype="bfloat16")
GLM45_AIR = dict(
    model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552,
    hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
    n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1,
    topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, partial_rotary_factor=0.5,
    use_qk_norm=False, attention_bias=True, rope_theta=1000000.0,
    max_position_embeddings=131072, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
    hidden_act="silu", attention_dropout=0.0, tie_word_embeddings=False,
    torch_dtype="bfloat16")


def test_flags_of_the_published_models():
    """Qwen1.5-MoE-A2.7B at METP 4 and GLM-4.5-Air at METP 8: the Megatron-LM flags of their
    shared experts, routers and dense layers (no weights read)."""
    q = " ".join(megatron_args(geometry_from_hf(QWEN15_MOE_A27B, metp_parallel_size=4)))
    assert q.endswith(
        "--num-experts 60 --moe-router-topk 4 --moe-ffn-hidden-size 1408 --moe-layer-freq 1 "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.0 "
        "--moe-router-pre-softmax --moe-shared-expert-intermediate-size 5632 "
        "--moe-shared-expert-gate"), q
    assert "--add-qkv-bias" in q and "--qk-layernorm" not in q
    g = megatron_args(geometry_from_hf(GLM45_AIR, metp_parallel_size=8))
    assert " ".join(g).endswith(
        "--moe-layer-freq [0" + ",1" * 45 + "] --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 0.0 --moe-shared-expert-intermediate-size 1408 "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias"), g
    assert (_flag(g, "--rotary-percent"), _flag(g, "--kv-channels"),
            _flag(g, "--ffn-hidden-size")) == ("0.5", "128", "10944")
    assert "--add-qkv-bias" in g and "--moe-router-num-groups" not in g


def test_both_versions_config_files_read_alike():
    """The config.json that transformers 4.57.6 and 5.25.0 wrote for these tiny models (kept in
    tests/data/hf_configs/, make_fixtures.py) give the same Megatron-LM flags in the installed
    transformers, equal to those of the config it writes now; each is in its version's layout
    (5.x: rope_parameters holding GLM's partial_rotary_factor)."""
    for family in FAMILIES:
        want = megatron_args(geometry_from_hf(_cfg(family), metp_parallel_size=3))
        for version, cfg in saved_configs(family).items():
            assert megatron_args(geometry_from_hf(cfg, metp_parallel_size=3)) == want, \
                (version, family)
        if family == "glm4_moe":
            assert "--rotary-percent" in want and "partial_rotary_factor" not in cfg


#: the saved Megatron-LM arguments (the fields export reads) of a run of GPT_OSS's import: its
#: model.sh's flags as Megatron-LM saves them (add_qkv_bias follows --add-bias-linear)
GPT_OSS_SAVED = dict(
    num_layers=2, hidden_size=48, ffn_hidden_size=16, num_attention_heads=12,
    group_query_attention=True, num_query_groups=6, kv_channels=8, normalization="RMSNorm",
    layernorm_epsilon=1e-5, swiglu=False, squared_relu=False, quick_geglu=True,
    glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable",
    add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False, position_embedding_type="yarn",
    rotary_base=5000, rotary_percent=1.0, rotary_scaling_factor=4.0,
    yarn_original_max_position_embeddings=16, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    mscale=1.0, mscale_all_dim=0.0, yarn_correction_range_round_to_int=False,
    use_rope_scaling=False, max_position_embeddings=64, window_size=None,
    untie_embeddings_and_output_weights=True, padded_vocab_size=128, num_experts=6,
    moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=1, moe_router_pre_softmax=False,
    moe_aux_loss_coeff=0.0, bf16=False, fp16=False)


def test_export_checks_a_gpt_oss_runs_flags_against_the_config(tmp_path):
    """Export of a Megatron-LM gpt-oss run's save with --hf-config: each saved model flag the
    gpt_oss config.json implies must be its value (from_args.gpt_oss_args_problems), a mismatch
    refused naming the flag and the field before any tensor is read; the matching arguments
    pass every check, through export too (negative control), and a Mixtral config.json does not
    hide the gpt-oss flags."""
    import json

    from megatron_metp.tools.hf.from_args import (family_problems, gpt_oss_args_problems,
                                                  moe_args_problems)
    from tests.test_hf_from_args import _fake_checkpoint

    cfg, ok = _cfg("gpt_oss"), GPT_OSS_SAVED
    assert (family_problems(ok, "gpt_oss"), gpt_oss_args_problems(cfg, ok),
            moe_args_problems(cfg, ok)) == ([], [], [])
    bad = gpt_oss_args_problems(cfg, dict(
        ok, activation_func_clamp_value=5.0, softmax_type="vanilla", glu_linear_offset=0.0,
        add_bias_linear=False, yarn_correction_range_round_to_int=True, qk_layernorm=True))
    assert bad == [  # in the order of the import's flags
        "--glu-linear-offset 1.0 (config.json the experts' (up + 1)): saved "
        "glu_linear_offset = 0.0",
        "--activation-func-clamp-value 7.0 (config.json swiglu_limit): saved "
        "activation_func_clamp_value = 5.0",
        "--softmax-type learnable (config.json self_attn.sinks): saved softmax_type = 'vanilla'",
        "--add-bias-linear (config.json attention_bias (and the experts' and router's "
        "biases)): saved add_bias_linear = False",
        "--no-yarn-correction-range-round-to-int (config.json rope_scaling.truncate): saved "
        "yarn_correction_range_round_to_int = True",
        "--qk-layernorm True: config.json (gpt_oss) has none"], bad
    assert any("--softmax-type 'learnable'" in p for p in family_problems(ok, "mixtral"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(cfg))
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    _fake_checkpoint(run, dict(ok, activation_func_clamp_value=5.0))
    with pytest.raises(ValueError, match=r"--activation-func-clamp-value 7\.0 \(config\.json "
                                         r"swiglu_limit\): saved activation_func_clamp_value = "
                                         r"5\.0"):
        H.export_hf(run, out, hf_config=str(hf))
    assert not os.path.exists(out)
    ok_run = str(tmp_path / "ok-run")  # the matching arguments pass every config check and
    _fake_checkpoint(ok_run, ok)       # reach the tensors (none in this fake save)
    with pytest.raises(ValueError, match=r"has no \.metadata: not a torch_dist checkpoint"):
        H.export_hf(ok_run, out, hf_config=str(hf))


def test_gpt_oss_config_from_saved_arguments():
    """Without --hf-config a run with --quick-geglu / --softmax-type learnable is written as
    gpt_oss: every layer full attention (METP's), swiglu_limit the clamp, YaRN as trained; it
    imports to the flags of the config the run came from, and transformers takes it. What
    gpt-oss lacks is refused naming the flag."""
    import transformers
    from megatron_metp.tools.hf.from_args import hf_config_from_args
    from megatron_metp.tools.hf.versions import export_layout

    c = hf_config_from_args(GPT_OSS_SAVED)
    assert (c["model_type"], c["num_local_experts"], c["intermediate_size"], c["swiglu_limit"],
            c["layer_types"], c["rope_scaling"]["truncate"]) == \
        ("gpt_oss", 6, 16, 7.0, ["full_attention"] * 2, False)
    assert megatron_args(geometry_from_hf(c)) == megatron_args(geometry_from_hf(_cfg("gpt_oss")))
    t = transformers.GptOssConfig(**{k: v for k, v in export_layout(dict(c))[0].items()
                                     if k != "model_type"})
    assert t.layer_types == ["full_attention"] * 2 and t.num_local_experts == 6
    for change, needle in ((dict(add_bias_linear=False), "--add-bias-linear False: gpt-oss"),
                           (dict(quick_geglu=False), "--quick-geglu False"),
                           (dict(activation_func_clamp_value=None),
                            "--activation-func-clamp-value None"),
                           (dict(moe_layer_freq=[1, 0]), "experts in every layer"),
                           (dict(window_size=[15, 0]), "--window-size"),
                           (dict(moe_shared_expert_intermediate_size=16),
                            "--moe-shared-expert-intermediate-size 16")):
        with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
            hf_config_from_args({**GPT_OSS_SAVED, **change})
