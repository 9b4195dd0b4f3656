"""Hugging Face Qwen3, Qwen2.5 and Mistral in and out: tiny random ``transformers`` models
(no download) converted with ``megatron_metp.tools.hf`` give transformers' logits and loss at
METP = 2 and 3 (fp32, 1e-5); export → import and import → export are bit-exact; every field that
cannot convert is refused before anything is read, naming it."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf import layout as L
from megatron_metp.tools.hf.config import geometry_from_hf
from tests.harness import assert_messages, run_ranks, value_errors
from tests.hf_tiny import import_each, randomise
from tests.numerics import rel_err
from tests.test_hf import BATCH, SEQ, _batch, _import_on_a_rank, _metp_run

TOL = 1e-5
#: 12 heads, 6 K/V groups (divisible by METP 2 and 3), vocabulary 102 (no padding with
#: --make-vocab-size-divisible-by 1 at METP 2 and 3), RoPE base and epsilon off their defaults
BASE = dict(vocab_size=102, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=12, num_key_value_heads=6, rope_theta=5000.0, rms_norm_eps=1e-5,
            max_position_embeddings=64, tie_word_embeddings=False)
#: family -> (config class, model class, config fields beyond BASE)
FAMILIES = {
    # Qwen3: q/k norms, a head width (16) other than hidden / heads (8)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    # Qwen2.5: bias on q, k, v
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    # Mistral: no sliding window (v0.2+); head_dim 16 as Mistral-Nemo's 128 != 5120 / 32
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
}


def _classes(family):
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    return getattr(transformers, cfg_cls), getattr(transformers, model_cls), extra


def _make(path, family, seed, **change):
    """A random fp32 model of ``family`` saved as safetensors; norms and biases random too (so
    a swapped or dropped one shows), q/k projections sharpened (positions matter more)."""
    cfg_cls, model_cls, extra = _classes(family)
    # a copy: transformers 5 writes rope_theta into the rope_scaling dict it is given
    cfg = cfg_cls(**copy.deepcopy({**BASE, **extra, **change}), dtype="float32")
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    randomise(model, norm=0.3, qk_gain=3.0)
    model.save_pretrained(path, safe_serialization=True)
    return cfg


def _reference(hf_dir, family, ids):
    _, model_cls, _ = _classes(family)
    model = model_cls.from_pretrained(hf_dir, dtype=torch.float32,
                                      attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids[:, :SEQ]).logits, model(ids, labels=ids).loss.item()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return import_each(tmp_path_factory.mktemp("hf-families"), FAMILIES,
                       lambda d, f, seed: _make(d, f, seed=seed), _reference, _batch(),
                       seed=20, metp=2)


def test_geometries_carry_the_family_features(converted):
    q3, q2, mi = (converted[f].geometry for f in ("qwen3", "qwen2", "mistral"))
    assert (q3["family"], q3["head_dim"], q3["qk_layernorm"], q3["qkv_bias"]) == \
        ("qwen3", 16, True, False)
    assert (q2["family"], q2["head_dim"], q2["qk_layernorm"], q2["qkv_bias"]) == \
        ("qwen2", None, False, True)
    assert (mi["family"], mi["head_dim"], mi["sliding_window"]) == ("mistral", 16, None)
    with open(os.path.join(converted["qwen3"].ckpt, "megatron_args.txt")) as f:
        flags = f.read().split()
    assert "--qk-layernorm" in flags and flags[flags.index("--kv-channels") + 1] == "16"
    with open(os.path.join(converted["qwen2"].ckpt, "megatron_args.txt")) as f:
        flags = f.read().split()
    assert "--add-qkv-bias" in flags and "--disable-bias-linear" in flags
    assert "--kv-channels" not in flags


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_metp_logits_and_loss_equal_transformers(converted, family, p):
    m = converted[family]
    logits, loss = _metp_run(p, m.ckpt, m.geometry, converted["ids"])
    assert logits.shape == m.logits.shape
    err_logits, err_loss = rel_err(logits, m.logits), abs(loss - m.loss) / abs(m.loss)
    print(f"\n{family} METP={p}: logits rel. err {err_logits:.2e}, loss {loss:.8f} vs "
          f"transformers {m.loss:.8f} (rel. err {err_loss:.2e})")
    assert err_logits <= TOL and err_loss <= TOL, (err_logits, err_loss)


def _import_broken(rank, world, hf_dir, out, how):
    """The import with one family feature broken on purpose (negative controls)."""
    if how == "qk_norms_swapped":
        L._QK_NORM_RENAMES = (("self_attn.q_norm.weight", "self_attention.k_layernorm.weight"),
                              ("self_attn.k_norm.weight", "self_attention.q_layernorm.weight"))
    elif how == "bias_kv_swapped":
        fuse = L.fuse_qkv
        L.fuse_qkv = lambda q, k, v, n, g: fuse(q, v, k, n, g) if q.dim() == 1 else \
            fuse(q, k, v, n, g)
    return H.import_hf(hf_dir, out, log=lambda _msg: None, make_vocab_size_divisible_by=1,
                       metp_parallel_size=2).to_json()


@pytest.mark.parametrize("family,how", [("qwen3", "qk_norms_swapped"),
                                        ("qwen2", "bias_kv_swapped")])
def test_negative_controls_a_broken_feature_is_caught(converted, tmp_path, family, how):
    m = converted[family]
    ckpt = str(tmp_path / "broken")
    geometry = run_ranks(_import_broken, 1, m.hf_dir, ckpt, how)[0]
    logits, _ = _metp_run(2, ckpt, geometry, converted["ids"])
    err = rel_err(logits, m.logits)
    print(f"\n{family} with {how}: logits rel. err {err:.2e}")
    assert err > 1e-3, err


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trips_are_bit_exact(converted, family, tmp_path):
    m = converted[family]
    exported = str(tmp_path / "exported")
    H.export_hf(m.ckpt, exported, log=lambda _msg: None)
    src, out = _safetensors(m.hf_dir), _safetensors(exported)
    assert sorted(src) == sorted(out)
    assert not [k for k in src if not torch.equal(src[k], out[k])]
    reimport = str(tmp_path / "reimported")
    run_ranks(_import_on_a_rank, 1, exported, reimport,
              {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 2})
    a = H.read_checkpoint_tensors(H.checkpoint_dir(m.ckpt))
    b = H.read_checkpoint_tensors(H.checkpoint_dir(reimport))
    assert sorted(a) == sorted(b)
    assert not [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    feature = {"qwen3": "q_layernorm", "qwen2": "linear_qkv.bias", "mistral": "linear_qkv"}
    assert any(feature[family] in k for k in a)
    logits, _ = _reference(exported, family, converted["ids"])
    assert torch.equal(logits, _reference(m.hf_dir, family, converted["ids"])[0])


# ---------------------------------------------------------------- refusals

def _cfg(family, **change):
    cfg_cls, _, extra = _classes(family)
    cfg = cfg_cls(**{**BASE, **extra}).to_dict()
    cfg.update(change)
    return cfg


def test_family_fields_are_refused_or_accepted_naming_the_field():
    msgs = value_errors({
        "window": lambda: geometry_from_hf(_cfg("mistral", sliding_window=32)),
        "window_seq": lambda: geometry_from_hf(_cfg("mistral", sliding_window=32),
                                               seq_length=48),
        "qwen_window": lambda: geometry_from_hf(_cfg("qwen2", use_sliding_window=True,
                                                     sliding_window=16, max_window_layers=0,
                                                     layer_types=None)),
        "qwen3_bias": lambda: geometry_from_hf(_cfg("qwen3", attention_bias=True)),
        "yarn": lambda: geometry_from_hf(_cfg("qwen3", rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "truncate": "yes"})),
        "moe": lambda: geometry_from_hf(_cfg("qwen2", num_experts=8)),
        "softcap": lambda: geometry_from_hf(_cfg("mistral", final_logit_softcapping=30.0)),
        "moe_type": lambda: geometry_from_hf(_cfg("qwen2", model_type="olmoe")),
        "arch": lambda: geometry_from_hf(_cfg("qwen3", architectures=["Qwen3ForSequenceClassification"])),
        "odd_head": lambda: geometry_from_hf(_cfg("qwen3", head_dim=15)),
    })
    assert_messages(msgs, {
        "window": "sliding_window = 32", "window_seq": "--seq-length 48 is longer",
        "qwen_window": "sliding_window = 16", "qwen3_bias": "attention_bias = true",
        "yarn": "rope_scaling.truncate = 'yes'", "moe": "num_experts = 8",
        "softcap": "final_logit_softcapping = 30.0", "moe_type": "model_type 'olmoe'",
        "arch": "'Qwen3ForCausalLM'", "odd_head": "head_dim = 15"})
    # Qwen3's long-context setting converts (tests/test_hf_yarn.py)
    g = geometry_from_hf(_cfg("qwen3", max_position_embeddings=131072, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    assert g.yarn["yarn_rotary_scaling_factor"] == 4.0
    assert g.yarn["yarn_original_max_position_embeddings"] == 32768
    # a window the sequence never reaches converts; the run may then not exceed it
    g = geometry_from_hf(_cfg("mistral", sliding_window=32), seq_length=32)
    assert (g.sliding_window, g.max_position_embeddings) == (32, 32)
    assert geometry_from_hf(_cfg("mistral", sliding_window=64)).max_position_embeddings == 64
    # Qwen's own default: use_sliding_window false, so its sliding_window is not used
    g = geometry_from_hf(_cfg("qwen2", use_sliding_window=False, sliding_window=16))
    assert g.sliding_window is None and g.qkv_bias


def test_cli_refuses_before_reading_the_weights(tmp_path, capsys):
    """A refused config.json stops the import before the (absent) safetensors are looked at."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_cfg("mistral", sliding_window=32)))
    assert H.main(["import", "--hf-dir", str(d), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "sliding_window = 32" in err and "safetensors" not in err
    assert not (tmp_path / "o").exists()
