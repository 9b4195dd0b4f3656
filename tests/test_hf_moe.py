"""Hugging Face mixture-of-experts in and out: tiny random ``transformers`` ``Qwen3MoeForCausalLM``
(q/k norms, renormalised top-k, dense layers from ``decoder_sparse_step`` / ``mlp_only_layers``)
and ``MixtralForCausalLM`` (top-k softmax, every layer MoE) built in the test, converted with
``megatron_metp.tools.hf`` and loaded into megatron-core's MoE GPT give transformers' logits and
loss (fp32, 1e-5; dropless routing on both sides); import then export returns the Hugging Face
tensors bit for bit; a wrong routing normalisation or swapped gate/up halves is caught; other
MoE families and unconvertible MoE fields are refused naming the field."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.config import LlamaGeometry, geometry_from_hf, megatron_args
from tests.harness import assert_messages, run_ranks, value_errors
from tests.numerics import rel_err
from tests.test_hf import SEQ, TINY, _batch, _import_on_a_rank, _metp_run

TOL = 1e-5

#: shared by both families: 12 heads in 6 K/V groups (head dim 8 ≠ hidden / heads) and 6 experts,
#: all divisible by METP 2 and 3; a vocabulary of 102 (no padding with divisible-by 1)
COMMON = dict(vocab_size=TINY["vocab_size"], hidden_size=48, num_attention_heads=12,
              num_key_value_heads=6, head_dim=8, rms_norm_eps=1e-5, rope_theta=5000.0,
              max_position_embeddings=64, num_experts_per_tok=2, initializer_range=0.1,
              tie_word_embeddings=False)
#: Qwen3-MoE: layers 0 and 2 MoE (experts 16 wide), layer 1 dense (48 wide) via mlp_only_layers
QWEN3_MOE = dict(COMMON, num_hidden_layers=3, num_experts=6, moe_intermediate_size=16,
                 intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                 norm_topk_prob=True)
#: Mixtral: every layer MoE, experts intermediate_size wide
MIXTRAL = dict(COMMON, num_hidden_layers=2, num_local_experts=6, intermediate_size=24)


def _hf_class(family):
    import transformers

    return {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
            "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[family]


def _make_hf(path: str, family: str, seed: int, **change) -> None:
    """A random fp32 model of ``family`` saved as safetensors, norms random too."""
    config_cls, model_cls = _hf_class(family)
    base = QWEN3_MOE if family == "qwen3_moe" else MIXTRAL
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**base, **change}, dtype="float32")).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)


def _hf_reference(hf_dir: str, family: str, ids: torch.Tensor):
    """transformers' logits of ``ids[:, :SEQ]`` and its loss of predicting ``ids[:, 1:]``."""
    model = _hf_class(family)[1].from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(ids[:, :SEQ]).logits
        loss = model(ids, labels=ids).loss
    return logits, loss.item()


# ---------------------------------------------------------------- ranks

def _stock_forward(rank, world, ckpt, geometry: dict, ids):
    """Single-rank stock megatron-core MoE GPT (local spec, SequentialMLP, EP = 1): logits
    ``[b, s, V]`` and the mean loss."""
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import Layout, init_parallel

    cpu.enable()  # with megatron-core's MoE shims (megatron_metp.megatron.moe_cpu)
    g = LlamaGeometry(**geometry)
    seq = ids.shape[1] - 1
    init_parallel(Layout(mode="tp"), seq)
    model = H.build_model(g).eval()
    H.load_model_weights(model, ckpt)
    tokens, labels = ids[:, :seq].contiguous(), ids[:, 1:].contiguous()
    pos = torch.arange(seq).expand(ids.shape[0], -1).contiguous()
    with torch.no_grad():
        logits = model(tokens, pos, None)
        loss = model(tokens, pos, None, labels=labels)
    return {"logits": logits, "loss": loss.double().mean().item()}


def _stock_run(ckpt, geometry, ids):
    out = run_ranks(_stock_forward, 1, ckpt, geometry, ids)[0]
    return out["logits"], out["loss"]


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny Qwen3-MoE and one tiny Mixtral, converted with --make-vocab-size-divisible-by 1
    for METP 3 (102 rows: no padding), with transformers' logits and loss."""
    root = tmp_path_factory.mktemp("hf_moe")
    ids = _batch()
    out = {"ids": ids, "root": root}
    for seed, family in enumerate(("qwen3_moe", "mixtral")):
        hf_dir = str(root / f"hf-{family}")
        _make_hf(hf_dir, family, seed=7 + seed)
        ckpt = str(root / f"ckpt-{family}")
        geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                             {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 3})[0]
        logits, loss = _hf_reference(hf_dir, family, ids)
        out[family] = SimpleNamespace(hf_dir=hf_dir, ckpt=ckpt, geometry=geometry,
                                      logits=logits, loss=loss)
    return out


def _check(tag, logits, loss, m):
    err_logits = rel_err(logits, m.logits)
    err_loss = abs(loss - m.loss) / abs(m.loss)
    print(f"\n{tag}: logits rel. err {err_logits:.2e}, loss {loss:.8f} vs transformers "
          f"{m.loss:.8f} (rel. err {err_loss:.2e})")
    assert logits.shape == m.logits.shape
    assert err_logits <= TOL, err_logits
    assert err_loss <= TOL, (loss, m.loss)
    return err_logits


# ---------------------------------------------------------------- parity

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stock_megatron_core_equals_transformers(models, family):
    """The converted checkpoint in single-rank stock megatron-core (EP = 1) is transformers'
    model: the conversion itself, before METP."""
    m = models[family]
    logits, loss = _stock_run(m.ckpt, m.geometry, models["ids"])
    _check(f"{family} stock megatron-core", logits, loss, m)


@pytest.mark.parametrize("p, dispatcher", [(2, "allgather"), (3, "allgather"), (3, "alltoall")])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_metp_logits_and_loss_equal_transformers(models, family, p, dispatcher):
    """The same checkpoint at METP = p: METP attention, megatron-core's MoELayer with the 6
    experts sharded over the METP ranks (EP = p: 3 or 2 experts per rank) behind either token
    dispatcher, tokens sequence-sharded: transformers' logits and loss."""
    m = models[family]
    logits, loss = _metp_run(p, m.ckpt, m.geometry, models["ids"],
                             build={"moe_token_dispatcher": dispatcher})
    _check(f"{family} METP={p} {dispatcher}", logits, loss, m)


def _metp_experts(rank, world, ckpt, geometry: dict):
    """The checkpoint loaded at METP = world: this rank's METP rank, the config's EP size and,
    per MoE layer, {global expert index: its fc1 weight} of the experts this rank holds."""
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import Layout, init_parallel

    cpu.enable()
    g = LlamaGeometry(**geometry)
    groups = init_parallel(Layout(metp=world), SEQ)
    model = H.build_model(g, groups=groups)
    H.load_model_weights(model, ckpt)
    experts = {}
    for i, layer in enumerate(model.decoder.layers):
        if hasattr(layer.mlp, "local_expert_indices"):
            experts[i] = {int(j): e.linear_fc1.weight.detach().clone() for j, e in
                          zip(layer.mlp.local_expert_indices, layer.mlp.experts.local_experts)}
    return {"rank": groups.metp.rank, "ep": model.config.expert_model_parallel_size,
            "experts": experts}


def test_metp_ranks_hold_their_global_experts(models):
    """At METP 3 rank r holds experts 2r and 2r + 1 of Qwen3-MoE's MoE layers 0 and 2 (layer 1
    is dense), and each is Hugging Face's [gate; up] of that expert (EP = p in the config)."""
    from safetensors.torch import load_file

    m = models["qwen3_moe"]
    src = load_file(os.path.join(m.hf_dir, "model.safetensors"))
    for out in run_ranks(_metp_experts, 3, m.ckpt, m.geometry):
        r = out["rank"]
        assert out["ep"] == 3 and sorted(out["experts"]) == [0, 2]
        for i, held in out["experts"].items():
            assert sorted(held) == [2 * r, 2 * r + 1], (r, i, sorted(held))
            for j, fc1 in held.items():
                e = f"model.layers.{i}.mlp.experts.{j}."
                want = torch.cat([src[e + "gate_proj.weight"], src[e + "up_proj.weight"]])
                assert torch.equal(fc1, want), (r, i, j)


def test_metp_vocabulary_ring_loss_equals_transformers(models):
    """``--metp-vocab-parallel`` (the vocabulary on the ring) around the MoE layers: METP 3's
    loss is transformers'."""
    m = models["qwen3_moe"]
    _, loss = _metp_run(3, m.ckpt, m.geometry, models["ids"], vocab_parallel=True)
    print(f"\nqwen3_moe vocabulary ring METP=3: loss rel. err {abs(loss - m.loss) / m.loss:.2e}")
    assert abs(loss - m.loss) <= TOL * abs(m.loss), (loss, m.loss)


def test_renormalisation_off_is_pre_softmax(tmp_path, models):
    """Qwen3-MoE with ``norm_topk_prob = false`` (softmax over all experts, top-k weights not
    renormalised) converts to ``--moe-router-pre-softmax`` and still equals transformers."""
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _make_hf(hf_dir, "qwen3_moe", seed=21, norm_topk_prob=False)
    geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                         {"make_vocab_size_divisible_by": 1})[0]
    assert geometry["moe_router_pre_softmax"] is True
    assert "--moe-router-pre-softmax" in open(os.path.join(ckpt, "megatron_args.txt")).read()
    ref_logits, ref_loss = _hf_reference(hf_dir, "qwen3_moe", models["ids"])
    m = SimpleNamespace(logits=ref_logits, loss=ref_loss)
    logits, loss = _stock_run(ckpt, geometry, models["ids"])
    _check("qwen3_moe norm_topk_prob=false stock", logits, loss, m)
    # the other normalisation on the same weights is far off: the flag is what makes it equal
    logits, _ = _stock_run(ckpt, {**geometry, "moe_router_pre_softmax": False}, models["ids"])
    print(f"renormalised instead: logits rel. err {rel_err(logits, ref_logits):.2e}")
    assert rel_err(logits, ref_logits) > 1e-3


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_negative_controls(models, family, tmp_path):
    """The parity check can fail: the routing normalisation flipped (pre-softmax top-k without
    renormalising, where the family renormalises), or gate and up swapped in the experts'
    fc1."""
    m = models[family]
    logits, _ = _stock_run(m.ckpt, {**m.geometry, "moe_router_pre_softmax": True}, models["ids"])
    err = rel_err(logits, m.logits)
    print(f"\n{family} routing not renormalised: logits rel. err {err:.2e}")
    assert err > 1e-3
    ckpt = str(tmp_path / "swapped")
    run_ranks(_import_on_a_rank, 1, m.hf_dir, ckpt, {"make_vocab_size_divisible_by": 1},
              "gate_up")  # every fc1 up-then-gate, the experts' too
    logits, _ = _stock_run(ckpt, m.geometry, models["ids"])
    err = rel_err(logits, m.logits)
    print(f"{family} gate/up swapped: logits rel. err {err:.2e}")
    assert err > 1e-3


# ---------------------------------------------------------------- export and round trip

def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_import_export_round_trip_is_bit_exact(models, family, tmp_path):
    """Hugging Face → checkpoint → Hugging Face gives every tensor back bit for bit (router,
    every expert's gate/up/down, the dense layer's MLP, q/k norms), and re-importing the export
    gives the same checkpoint tensors (Qwen3-MoE's dense-and-MoE mix is saved per layer,
    Mixtral's stacked over layers)."""
    m = models[family]
    exported = str(tmp_path / "exported")
    H.export_hf(m.ckpt, exported, log=lambda _msg: None)
    src, out = _safetensors(m.hf_dir), _safetensors(exported)
    assert sorted(src) == sorted(out)
    assert sum(".experts." in k for k in out) == 3 * 6 * (2 if family == "qwen3_moe" else 2)
    unequal = [k for k in src if not torch.equal(src[k], out[k])]
    assert not unequal, unequal
    reimport = str(tmp_path / "reimported")
    run_ranks(_import_on_a_rank, 1, exported, reimport, {"make_vocab_size_divisible_by": 1})
    a = H.read_checkpoint_tensors(H.checkpoint_dir(m.ckpt))
    b = H.read_checkpoint_tensors(H.checkpoint_dir(reimport))
    assert sorted(a) == sorted(b)
    experts = [k for k in a if k.endswith("mlp.experts.experts.linear_fc1.weight")]
    if family == "mixtral":
        assert experts == ["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        assert tuple(a[experts[0]].shape) == (2, 6, 48, 48)
    else:
        assert sorted(experts) == [f"decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight"
                                   for i in (0, 2)]
        assert "decoder.layers.1.mlp.linear_fc1.weight" in a
    unequal = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not unequal, unequal


# ---------------------------------------------------------------- flags and refusals

def _cfg(family, **change):
    import json

    config_cls, _ = _hf_class(family)
    base = QWEN3_MOE if family == "qwen3_moe" else MIXTRAL
    cfg = json.loads(config_cls(**base).to_json_string())
    cfg.update(change)
    return cfg


def _experts_key():
    return "num_local_experts" if "num_local_experts" in _cfg("qwen3_moe") else "num_experts"


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_flags_match_the_config(models, capsys):
    """The printed Megatron-LM flags carry each family's MoE: experts, top-k, expert width,
    which layers are MoE (as Megatron's --moe-layer-freq list where not every layer is) and the
    routing (renormalised top-k: no --moe-router-pre-softmax)."""
    assert H.main(["flags", "--hf-dir", models["qwen3_moe"].hf_dir,
                   "--make-vocab-size-divisible-by", "1", "--metp-parallel-size", "3"]) == 0
    q = capsys.readouterr().out.split()
    assert (_flag(q, "--num-experts"), _flag(q, "--moe-router-topk"),
            _flag(q, "--moe-ffn-hidden-size"), _flag(q, "--ffn-hidden-size"),
            _flag(q, "--moe-layer-freq")) == ("6", "2", "16", "48", "[1,0,1]")
    assert "--qk-layernorm" in q and "--moe-router-pre-softmax" not in q
    assert _flag(q, "--moe-aux-loss-coeff") == "0.0"  # output_router_logits false
    mix = megatron_args(LlamaGeometry(**models["mixtral"].geometry))
    assert (_flag(mix, "--num-experts"), _flag(mix, "--moe-ffn-hidden-size"),
            _flag(mix, "--ffn-hidden-size"), _flag(mix, "--moe-layer-freq")) == \
        ("6", "24", "24", "1")
    assert "--qk-layernorm" not in mix and "--moe-router-pre-softmax" not in mix
    # transformers' rule for Qwen3-MoE's MoE layers: (i + 1) % decoder_sparse_step == 0, minus
    # mlp_only_layers; Megatron's --moe-layer-freq 2 would be layers 0, 2, ... instead
    g = geometry_from_hf(_cfg("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                              mlp_only_layers=[5], output_router_logits=True,
                              router_aux_loss_coef=0.01), make_vocab_size_divisible_by=1)
    assert g.moe_layers == (0, 1, 0, 1, 0, 0)
    flags = megatron_args(g)
    assert _flag(flags, "--moe-layer-freq") == "[0,1,0,1,0,0]"
    assert _flag(flags, "--moe-aux-loss-coeff") == "0.01"


def test_bad_moe_configs_are_refused_naming_the_field():
    msgs = value_errors({
        "olmoe": lambda: geometry_from_hf({**_cfg("qwen3_moe"), "model_type": "olmoe"}),
        "dense_with_experts": lambda: geometry_from_hf({**_cfg("qwen3_moe"),
                                                        "model_type": "qwen3"}),
        "jitter": lambda: geometry_from_hf(_cfg("mixtral", router_jitter_noise=0.1)),
        "ep": lambda: geometry_from_hf(_cfg("mixtral"), metp_parallel_size=4),
        "tp": lambda: geometry_from_hf(_cfg("qwen3_moe"), tensor_model_parallel_size=2),
        "topk": lambda: geometry_from_hf(_cfg("qwen3_moe", num_experts_per_tok=7)),
        "no_moe_layer": lambda: geometry_from_hf(_cfg("qwen3_moe", mlp_only_layers=[0, 1, 2])),
        "bad_layer": lambda: geometry_from_hf(_cfg("qwen3_moe", mlp_only_layers=[3])),
        "norm": lambda: geometry_from_hf(_cfg("qwen3_moe", norm_topk_prob="yes")),
        "arch": lambda: geometry_from_hf(_cfg("mixtral", architectures=["MistralForCausalLM"])),
    })
    assert_messages(msgs, {
        "olmoe": "mixture-of-experts families only 'qwen3_moe', 'mixtral', 'qwen2_moe', "
                 "'glm4_moe', 'gpt_oss', 'deepseek_v2', 'deepseek_v3' convert",
        # the experts' key as the installed transformers writes it (5.x: num_local_experts)
        "dense_with_experts": f"{_experts_key()} = 6 is not supported",
        "jitter": "router_jitter_noise = 0.1", "ep": "--metp-parallel-size 4",
        "tp": "--tensor-model-parallel-size 2", "topk": "num_experts_per_tok 7",
        "no_moe_layer": "leave no MoE layer", "bad_layer": "mlp_only_layers [3]",
        "norm": "norm_topk_prob = 'yes'", "arch": "has no 'MixtralForCausalLM'"})


def test_export_checks_the_saved_moe_arguments():
    """Exporting a Megatron-LM MoE checkpoint with a config.json: every MoE flag the run saved
    must match it (which layers are MoE from either form of --moe-layer-freq)."""
    from megatron_metp.tools.hf.from_args import moe_args_problems

    cfg = _cfg("qwen3_moe")
    ok = dict(num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=16,
              moe_layer_freq=[1, 0, 1], moe_router_pre_softmax=False)
    assert moe_args_problems(cfg, ok) == []
    assert moe_args_problems(cfg, {**ok, "moe_layer_freq": 2}) == []  # layers 0 and 2 too
    bad = moe_args_problems(cfg, {**ok, "moe_layer_freq": 1, "moe_router_pre_softmax": True})
    assert [p.split(":")[0] for p in bad] == ["--moe-layer-freq", "--moe-router-pre-softmax"]
    assert moe_args_problems(cfg, {})[0].startswith("--num-experts: the run has no experts")


#: a Megatron-LM MoE run's saved arguments (the fields export reads): Qwen3-MoE-like
SAVED = dict(num_layers=3, hidden_size=48, ffn_hidden_size=48, num_attention_heads=12,
             num_query_groups=6, group_query_attention=True, kv_channels=8,
             normalization="RMSNorm", layernorm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
             add_qkv_bias=False, qk_layernorm=True, position_embedding_type="rope",
             rotary_base=5000, max_position_embeddings=64, padded_vocab_size=102,
             untie_embeddings_and_output_weights=True, window_size=None, num_experts=6,
             moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[1, 0, 1],
             moe_router_pre_softmax=False, moe_aux_loss_coeff=0.0, bf16=False, fp16=False)


def test_config_from_saved_moe_arguments():
    """A MoE run trained from scratch exports without --hf-config: --qk-layernorm makes it a
    Qwen3-MoE (dense layers as mlp_only_layers, --moe-router-pre-softmax as norm_topk_prob
    false), without it a Mixtral (every layer MoE); the written config imports back to the saved
    flags; what neither family has is refused naming the flag."""
    from megatron_metp.tools.hf.from_args import hf_config_from_args

    q = hf_config_from_args(SAVED)
    assert (q["model_type"], q["num_experts"], q["moe_intermediate_size"], q["mlp_only_layers"],
            q["norm_topk_prob"], q["intermediate_size"]) == ("qwen3_moe", 6, 16, [1], True, 48)
    assert geometry_from_hf(q, make_vocab_size_divisible_by=1).moe_layers == (1, 0, 1)
    assert hf_config_from_args({**SAVED, "moe_router_pre_softmax": True})["norm_topk_prob"] \
        is False
    mix = dict(SAVED, qk_layernorm=False, moe_layer_freq=1, ffn_hidden_size=192,
               moe_aux_loss_coeff=0.01)
    m = hf_config_from_args(mix)
    assert (m["model_type"], m["num_local_experts"], m["intermediate_size"],
            m["output_router_logits"], m["router_aux_loss_coef"]) == \
        ("mixtral", 6, 16, True, 0.01)
    import transformers  # transformers takes both as written

    transformers.Qwen3MoeConfig(**{k: v for k, v in q.items() if k != "model_type"})
    transformers.MixtralConfig(**{k: v for k, v in m.items() if k != "model_type"})
    for change, needle in (
            (dict(qk_layernorm=False), "--moe-layer-freq [1, 0, 1] without --qk-layernorm"),
            (dict(moe_shared_expert_intermediate_size=32),
             "--moe-shared-expert-intermediate-size 32"),
            (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function"),
            (dict(add_qkv_bias=True), "--add-qkv-bias with --num-experts")):
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            hf_config_from_args({**SAVED, **change})


#: the published config.json fields that matter here (no download): Qwen3-30B-A3B, Mixtral-8x7B
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    output_router_logits=False, router_aux_loss_coef=0.001, rope_theta=1000000.0,
    rope_scaling=None, max_position_embeddings=40960, use_sliding_window=False,
    sliding_window=None, max_window_layers=48, rms_norm_eps=1e-6, hidden_act="silu",
    attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
    torch_dtype="bfloat16")
MIXTRAL_8X7B = dict(
    model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0,
    max_position_embeddings=32768, sliding_window=None, rms_norm_eps=1e-5, hidden_act="silu",
    router_aux_loss_coef=0.02, output_router_logits=False, router_jitter_noise=0.0,
    attention_dropout=0.0, tie_word_embeddings=False, torch_dtype="bfloat16")


def test_flags_of_the_published_models():
    """Qwen3-30B-A3B at METP 4 and Mixtral-8x7B at METP 8: the Megatron-LM flags of their MoE."""
    q = megatron_args(geometry_from_hf(QWEN3_30B_A3B, metp_parallel_size=4))
    assert " ".join(q).endswith(
        "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-layer-freq 1 "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.0")
    assert (_flag(q, "--kv-channels"), _flag(q, "--num-query-groups")) == ("128", "4")
    assert "--qk-layernorm" in q
    m = megatron_args(geometry_from_hf(MIXTRAL_8X7B, metp_parallel_size=8))
    assert (_flag(m, "--num-experts"), _flag(m, "--moe-router-topk"),
            _flag(m, "--moe-ffn-hidden-size"), _flag(m, "--moe-layer-freq")) == \
        ("8", "2", "14336", "1")
    assert "--moe-router-pre-softmax" not in m and "--qk-layernorm" not in m
    msgs = value_errors({"ep": lambda: geometry_from_hf(MIXTRAL_8X7B, metp_parallel_size=16)})
    assert_messages(msgs, {"ep": "8 experts are not divisible by --metp-parallel-size 16"})
