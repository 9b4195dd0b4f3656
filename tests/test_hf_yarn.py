"""YaRN (``rope_scaling`` type ``yarn``) through the converter and METP: a tiny random
``transformers`` Qwen3 with YaRN (original context 64, factor 4; no download), imported and run at
METP = 2 and 3 on sequences of 256 (258 at METP 3, a multiple of 2p), gives transformers' logits
at every position (fp32, 1e-5), past the original context too, with METP's exact angles of
YaRN's scaled frequencies (exact past 2^24 positions too); without YaRN's attention factor or
without its frequency scaling the logits visibly differ. Megatron's YaRN frequencies and
attention factor equal transformers' for each way ``rope_scaling`` can set them; export writes
``rope_scaling`` back unchanged and every tensor bit-exactly; the flags are printed."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.config import geometry_from_hf, megatron_args
from megatron_metp.tools.hf.versions import canonical
from tests.harness import run_ranks
from tests.test_hf import _gather, _import_on_a_rank, _metp_forward
from tests.test_hf_families import _make

TOL = 1e-5
ORIGINAL = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
#: METP p -> sequence length (256, or the next multiple of 2p)
SEQS = {2: 256, 3: 258}


def _ids():
    gen = torch.Generator().manual_seed(29)
    return torch.randint(0, 102, (1, max(SEQS.values()) + 1), generator=gen)


def _exact_forward(rank, world, *args):
    """:func:`_metp_forward`, checking that the model's YaRN angles are METP's exact ones."""
    build = H.build_model

    def checked(*a, **k):
        model = build(*a, **k)
        assert type(model.rotary_pos_emb).__name__ == "ExactYarnRotaryEmbedding"
        return model

    H.build_model = checked
    return _metp_forward(rank, world, *args)


def _ring_forward(rank, world, *args):
    """:func:`_exact_forward` of the ring self-attention baseline (replicated weights, Megatron's
    own ``SelfAttention`` applying YaRN's attention factor to q and k, the K/V ring)."""
    import functools

    build = functools.partial(H.build_model, weight_ring=False)

    def checked(*a, **k):
        model = build(*a, **k)
        attn = model.decoder.layers[0].self_attention
        assert (type(attn).__name__, type(attn.core_attention).__name__) == \
            ("SelfAttention", "METPRingCoreAttention")
        return model

    H.build_model = checked
    return _exact_forward(rank, world, *args)


def _without_mscale(rank, world, *args):
    """:func:`_metp_forward` with METP's attention ignoring YaRN's attention factor."""
    from megatron_metp.megatron import modules

    modules.metp_softmax_scale = lambda config: config.softmax_scale
    return _metp_forward(rank, world, *args)


def _run(p, m, geometry=None, fn=_exact_forward):
    ids = m.ids[:, :SEQS[p] + 1]
    outs = run_ranks(fn, p, m.ckpt, geometry or m.geometry, ids)
    return _gather(outs, "logits"), _gather(outs, "loss").double().mean().item()


def _per_position_err(logits, ref):
    """Relative error of each position's logits ``[s]`` (batch 1)."""
    num = (logits.double() - ref.double()).norm(dim=-1)
    return (num / ref.double().norm(dim=-1))[0]


@pytest.fixture(scope="module")
def qwen3_yarn(tmp_path_factory):
    root = tmp_path_factory.mktemp("yarn")
    hf_dir = str(root / "hf")
    _make(hf_dir, "qwen3", seed=7, max_position_embeddings=4 * ORIGINAL, rope_scaling=dict(YARN))
    ckpt = str(root / "ckpt")
    geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                         {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 3})[0]
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    assert model.model.rotary_emb.rope_type == "yarn"
    ids = _ids()
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
        loss = {p: model(ids[:, :SEQS[p] + 1], labels=ids[:, :SEQS[p] + 1]).loss.item()
                for p in SEQS}
    return SimpleNamespace(hf_dir=hf_dir, ckpt=ckpt, geometry=geometry, ids=ids, logits=logits,
                           loss=loss, root=root)


@pytest.mark.parametrize("p", [2, 3])
def test_metp_logits_equal_transformers_at_every_position(qwen3_yarn, p):
    m = qwen3_yarn
    assert m.geometry["yarn"]["yarn_rotary_scaling_factor"] == 4.0
    logits, loss = _run(p, m)
    ref = m.logits[:, :SEQS[p]]
    assert logits.shape == ref.shape
    err = _per_position_err(logits, ref)
    print(f"\nYaRN METP={p}: largest per-position logits rel. err {err.max():.2e} (positions "
          f"< {ORIGINAL}: {err[:ORIGINAL].max():.2e}, >= {ORIGINAL}: {err[ORIGINAL:].max():.2e}),"
          f" loss {loss:.8f} vs transformers {m.loss[p]:.8f}")
    assert err.max() <= TOL, (err.argmax().item(), err.max().item())
    assert abs(loss - m.loss[p]) <= TOL * abs(m.loss[p])


def test_ring_baseline_logits_equal_transformers(qwen3_yarn):
    """The ring self-attention baseline at p = 3 takes the same exact YaRN angles; Megatron's
    attention applies the attention factor (nothing is folded there)."""
    m = qwen3_yarn
    logits, _ = _run(3, m, fn=_ring_forward)
    err = _per_position_err(logits, m.logits[:, :SEQS[3]])
    print(f"\nYaRN ring baseline p=3: largest per-position logits rel. err {err.max():.2e}")
    assert err.max() <= TOL


def test_negative_controls_without_mscale_or_scaling(qwen3_yarn):
    """Dropping YaRN's attention factor from METP's softmax scale, or YaRN's frequency scaling
    (plain RoPE on the same weights), gives a visible mismatch; the latter past the original
    context."""
    m = qwen3_yarn
    ref = m.logits[:, :SEQS[2]]
    no_mscale, _ = _run(2, m, fn=_without_mscale)
    no_scaling, _ = _run(2, m, {**m.geometry, "yarn": None}, fn=_metp_forward)
    e1, e2 = _per_position_err(no_mscale, ref), _per_position_err(no_scaling, ref)
    print(f"\nwithout mscale: largest rel. err {e1.max():.2e}; without the scaling: "
          f"{e2[ORIGINAL:].max():.2e} past position {ORIGINAL}")
    assert e1.max() > 100 * TOL
    assert e2[ORIGINAL:].max() > 100 * TOL


# ---------------------------------------------------------------- the mapping

CASES = {
    "default": dict(YARN),
    "type_key": {"type": "yarn", "factor": 4.0},  # original context from max_position_embeddings
    "betas": {**YARN, "beta_fast": 16.0, "beta_slow": 2.0},
    "no_truncate": {**YARN, "truncate": False},
    "mscale_pair": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.5},
    "mscale_alone": {**YARN, "mscale": 0.707},  # transformers ignores it without mscale_all_dim
    "attention_factor": {**YARN, "attention_factor": 1.25},
    "factor_below_one": {**YARN, "factor": 0.5},
}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_yarn_equals_transformers(case, cpu_shims):
    """For each way ``rope_scaling`` sets YaRN, megatron-core's ``YarnRotaryEmbedding`` built
    from the converted settings has transformers' frequencies (fp32, within 1 ulp) and attention
    factor (1e-12), and :func:`~megatron_metp.megatron.yarn.yarn_inv_freq` is its own."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_metp.megatron.yarn import metp_softmax_scale, yarn_inv_freq

    cfg = Qwen3Config(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16,
                      rope_theta=5000.0, max_position_embeddings=256, rope_scaling=CASES[case])
    ref_inv_freq, ref_a = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    g = geometry_from_hf({**cfg.to_dict(), "rope_scaling": CASES[case]})
    y = g.yarn
    rot = YarnRotaryEmbedding(
        kv_channels=16, rotary_base=g.rotary_base, use_cpu_initialization=True,
        scaling_factor=y["yarn_rotary_scaling_factor"],
        original_max_position_embeddings=y["yarn_original_max_position_embeddings"],
        beta_fast=y["yarn_beta_fast"], beta_slow=y["yarn_beta_slow"], mscale=y["yarn_mscale"],
        mscale_all_dim=y["yarn_mscale_all_dim"],
        correction_range_round_to_int=y["yarn_correction_range_round_to_int"])
    emb, a = rot(8, 3)
    inv_freq = yarn_inv_freq(rot)
    assert torch.equal(emb[:, 0, 0, :8], torch.outer(torch.arange(3, 11.0), inv_freq))
    assert torch.allclose(inv_freq, ref_inv_freq, rtol=2 ** -23, atol=0)
    assert abs(a - ref_a) <= 1e-12 * ref_a, (a, ref_a)
    config = SimpleNamespace(softmax_scale=None, kv_channels=16, **y)
    scale = metp_softmax_scale(config)  # None: the op's 1/sqrt(d)
    assert abs((scale or 0.25) - ref_a ** 2 / 4.0) <= 1e-12
    if case == "mscale_alone":
        assert a == pytest.approx(1 + 0.1 * math.log(4.0), abs=1e-15)


def test_export_writes_rope_scaling_back_and_prints_flags(qwen3_yarn, tmp_path, capsys):
    m = qwen3_yarn
    exported = str(tmp_path / "exported")
    H.export_hf(m.ckpt, exported, log=lambda _msg: None)
    with open(os.path.join(m.hf_dir, "config.json")) as f:
        src = canonical(json.load(f))  # either transformers' layout (hf.versions)
    with open(os.path.join(exported, "config.json")) as f:
        out = canonical(json.load(f))
    assert out["rope_scaling"] == src["rope_scaling"] and out["rope_scaling"]["factor"] == 4.0
    from safetensors.torch import load_file

    a = load_file(os.path.join(m.hf_dir, "model.safetensors"))
    b = load_file(os.path.join(exported, "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    flags = open(os.path.join(m.ckpt, "megatron_args.txt")).read().split()

    def val(flag):
        return flags[flags.index(flag) + 1]

    assert val("--position-embedding-type") == "yarn" and val("--rotary-base") == "5000"
    assert float(val("--rotary-scaling-factor")) == 4.0
    assert val("--yarn-original-max-position-embeddings") == str(ORIGINAL)
    assert (float(val("--mscale")), float(val("--mscale-all-dim"))) == (1.0, 0.0)
    assert "--no-yarn-correction-range-round-to-int" not in flags
    from megatron_metp.tools import cli

    capsys.readouterr()
    assert cli.main(["hf", "flags", "--hf-dir", m.hf_dir, "--make-vocab-size-divisible-by",
                     "1", "--metp-parallel-size", "3"]) == 0
    assert capsys.readouterr().out.split() == flags
    sh = open(os.path.join(m.ckpt, "model.sh")).read()
    assert '"${POSITION_EMBEDDING_TYPE:=yarn}"' in sh and "--rotary-scaling-factor 4.0" in sh
    g = geometry_from_hf({**src, "rope_scaling": {**YARN, "truncate": False}})
    assert "--no-yarn-correction-range-round-to-int" in megatron_args(g)


def test_exact_yarn_angles_past_2_24(cpu_shims):
    """METP's YaRN module (what ``use_exact_angles`` makes of Megatron's) gives angles whose
    cos/sin are within 1e-6 of a float64 reference of YaRN's own frequencies at positions past
    2^24, with Megatron's attention factor; Megatron's fp32 table there does not."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    from megatron_metp.megatron.rope import use_exact_angles
    from megatron_metp.megatron.yarn import yarn_inv_freq

    model = torch.nn.Module()
    model.rotary_pos_emb = YarnRotaryEmbedding(
        kv_channels=16, rotary_base=5000, use_cpu_initialization=True, scaling_factor=4.0,
        original_max_position_embeddings=ORIGINAL)
    offset, n = (1 << 24) - 3, 8
    stock, stock_a = model.rotary_pos_emb.get_emb(n, offset)
    assert use_exact_angles(model) == "exact"
    emb, a = model.rotary_pos_emb(n, offset)
    assert a == stock_a == pytest.approx(1 + 0.1 * math.log(4.0))
    pos = torch.arange(offset, offset + n, dtype=torch.float64)
    theta = torch.outer(pos, yarn_inv_freq(model.rotary_pos_emb).double())
    ref = torch.cat([theta, theta], dim=-1)[:, None, None, :]
    for f in (torch.cos, torch.sin):
        assert (f(emb.double()) - f(ref)).abs().max() <= 1e-6
    assert max((f(stock.double()) - f(ref)).abs().max() for f in (torch.cos, torch.sin)) > 1e-2


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_family_takes_yarn(family):
    """``rope_scaling`` type ``yarn`` converts for each family the converter takes: geometry and
    flags from the same mapping (the numerics are the families' shared RoPE, tested above)."""
    import transformers

    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "qwen3": "Qwen3Config"}[family]
    cfg = getattr(transformers, cls)(hidden_size=96, num_attention_heads=12,
                                     num_key_value_heads=6, intermediate_size=192,
                                     max_position_embeddings=1024, rope_theta=10000.0,
                                     sliding_window=None).to_dict()
    cfg["rope_scaling"] = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                           "beta_fast": 16.0}
    g = geometry_from_hf(cfg)
    assert g.family == family and g.yarn["yarn_beta_fast"] == 16.0
    flags = megatron_args(g)
    assert flags[flags.index("--position-embedding-type") + 1] == "yarn"
    assert flags[flags.index("--rotary-scaling-factor") + 1] == "8.0"
