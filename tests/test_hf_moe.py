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
from megatron_metp.tools import hf_layout as L
from megatron_metp.tools.hf_config import LlamaGeometry, geometry_from_hf, megatron_args
from tests.harness import assert_messages, run_ranks, value_errors
from tests.numerics import rel_err

SEQ = 12  # divisible by 2p for p = 2 and 3
BATCH = 2
TOL = 1e-5

#: shared by both families: 6 heads in 3 K/V groups (head dim 8) and 6 experts, all divisible by
#: METP 2 and 3; a vocabulary of 102 (no padding with --make-vocab-size-divisible-by 1)
COMMON = dict(vocab_size=102, hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
              head_dim=8, rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=64,
              num_experts_per_tok=2, initializer_range=0.1, tie_word_embeddings=False)
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


def _batch():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ + 1), generator=gen)


def _hf_reference(hf_dir: str, family: str, ids: torch.Tensor):
    """transformers' logits of ``ids[:, :SEQ]`` and its loss of predicting ``ids[:, 1:]``."""
    model = _hf_class(family)[1].from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(ids[:, :SEQ]).logits
        loss = model(ids, labels=ids).loss
    return logits, loss.item()


# ---------------------------------------------------------------- ranks

def _import_on_a_rank(rank, world, hf_dir, out, kwargs, swap_gate_up=False):
    """``import_hf`` in a forked process; ``swap_gate_up`` puts up before gate in every fc1
    (the experts' too): a broken re-layout on purpose."""
    if swap_gate_up:
        L.fuse_gate_up = lambda gate, up: torch.cat([up, gate], dim=0)
    return H.import_hf(hf_dir, out, log=lambda _msg: None, **kwargs).to_json()


def _moe_cpu():
    """TEMPORARY until moe-core's CPU shims land: megatron-core 0.16.1's router names
    ``te_general_gemm`` without Transformer Engine."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_metp.megatron import cpu

    cpu.enable()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _stock_forward(rank, world, ckpt, geometry: dict, ids):
    """Single-rank stock megatron-core MoE GPT (local spec, SequentialMLP, EP = 1): logits
    ``[b, s, V]`` and the mean loss."""
    from megatron_metp.megatron.training import Layout, init_parallel

    _moe_cpu()
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
