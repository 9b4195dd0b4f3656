"""Hugging Face checkpoints as the installed transformers writes them (4.57.6 in .venv, 5.25.0 in
.venv-019; ``make test-019`` runs this file on the second): tiny Qwen3 with YaRN, Qwen2,
Mistral, Llama, Qwen3-MoE and Mixtral (and a top-1 Qwen3-MoE) saved with deterministic weights
(tests/hf_tiny.py) import with one expected list of flags and the same Megatron tensors in
either version, and the METP 2 logits equal that transformers' (fp32, 1e-5). The ``config.json``
both versions write (tests/data/hf_configs/) read alike in either; every key is mapped, checked
or harmless, any other refused by name before a weight is read; ``hf export`` writes the
installed version's layout (or ``--transformers-layout``'s), round trips bit-exact.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf import convert
from megatron_metp.tools.hf import versions as V
from megatron_metp.tools.hf.config import LlamaGeometry, geometry_from_hf, megatron_args
from megatron_metp.tools.hf.layout import hf_to_megatron
from tests.harness import assert_messages, run_ranks, value_errors
from tests.hf_tiny import FAMILIES, reference, save_tiny, weight
from tests.numerics import rel_err
from tests.test_hf import _import_on_a_rank, _metp_run

TOL = 1e-5
SEQ = 16  # a multiple of 2p at METP 2
#: YaRN over twice its original context (64): positions past it too
SEQ_YARN = 128
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_configs")
#: the transformers versions whose config.json files are kept
VERSIONS = sorted(os.listdir(DATA), key=lambda v: [int(x) for x in v.split(".")]
                  if v[0].isdigit() else [0])
VERSIONS = [v for v in VERSIONS if os.path.isdir(os.path.join(DATA, v))]
#: the top-1 variant: Qwen3-MoE without renormalisation (megatron-core's pre-softmax top-1)
TOP1 = dict(num_experts_per_tok=1, norm_topk_prob=False)
CASES = dict(FAMILIES, qwen3_moe_top1=None)

_DENSE = ["--num-layers", "2", "--hidden-size", "48", "--ffn-hidden-size", "96",
          "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2"]
_TAIL = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-05", "--swiglu",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--max-position-embeddings", "256", "--make-vocab-size-divisible-by", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
_UNTIE = ["--untie-embeddings-and-output-weights"]
_MOE_TAIL = ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.0"]
_QWEN3_MOE = (["--num-layers", "3"] + _DENSE[2:] + ["--qk-layernorm"] + _TAIL + _UNTIE +
              ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
               "--moe-layer-freq", "[1,0,1]"] + _MOE_TAIL)
#: family -> the Megatron-LM flags (METP 2, --make-vocab-size-divisible-by 1), whatever
#: transformers saved the model
EXPECTED = {
    "qwen3_yarn": _DENSE + ["--kv-channels", "16", "--qk-layernorm"] +
    [("yarn" if f == "rope" else f) for f in _TAIL] +
    ["--rotary-scaling-factor", "4.0", "--yarn-original-max-position-embeddings", "64",
     "--yarn-beta-fast", "32.0", "--yarn-beta-slow", "1.0", "--mscale", "1.0",
     "--mscale-all-dim", "0.0"] + _UNTIE,
    "qwen2": _DENSE + ["--add-qkv-bias"] + _TAIL + _UNTIE,
    "mistral": _DENSE + ["--kv-channels", "16"] + _TAIL + _UNTIE,
    "llama": _DENSE + _TAIL + _UNTIE,
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_moe_top1": [("1" if i > 0 and _QWEN3_MOE[i - 1] == "--moe-router-topk" else f)
                       for i, f in enumerate(_QWEN3_MOE)] + ["--moe-router-pre-softmax"],
    "mixtral": ["--num-layers", "2", "--hidden-size", "48", "--ffn-hidden-size", "24"] +
    _DENSE[6:] + _TAIL + _UNTIE +
    ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
     "--moe-layer-freq", "1"] + _MOE_TAIL,
}


def _family(case):
    return "qwen3_moe" if case == "qwen3_moe_top1" else case


def _seq(case):
    return SEQ_YARN if case == "qwen3_yarn" else SEQ


def _ids(case):
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, 102, (2, _seq(case) + 1), generator=gen)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each case saved by the installed transformers and imported for METP 2."""
    root = tmp_path_factory.mktemp("hf-versions")
    out = {"root": root}
    for case in CASES:
        hf_dir, ckpt = str(root / f"hf-{case}"), str(root / f"ckpt-{case}")
        saved = save_tiny(hf_dir, _family(case), **(TOP1 if case.endswith("top1") else {}))
        geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                             {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 2})[0]
        logits, loss = reference(hf_dir, _family(case), _ids(case), _seq(case))
        out[case] = SimpleNamespace(hf_dir=hf_dir, ckpt=ckpt, geometry=geometry, saved=saved,
                                    logits=logits, loss=loss)
    return out


def _flags(cfg, **kw):
    return megatron_args(geometry_from_hf(cfg, make_vocab_size_divisible_by=1,
                                          metp_parallel_size=2, **kw))


# ---------------------------------------------------------------- same model in any version

@pytest.mark.parametrize("case", list(CASES))
def test_flags_and_weights_are_those_of_any_version(tiny, case):
    """The import of the installed transformers' save has the expected flags (one list for
    every version) and Megatron tensors equal to the re-layout of the deterministic weights
    (which every version saves bit for bit: tests/hf_tiny.py checks that)."""
    m = tiny[case]
    g = LlamaGeometry(**m.geometry)
    assert megatron_args(g) == EXPECTED[case]
    written = open(os.path.join(m.ckpt, "megatron_args.txt")).read().split()
    assert written == EXPECTED[case]
    want = hf_to_megatron({k: weight(k, v.shape) for k, v in m.saved.items()}, g)
    got = H.megatron_params_from_checkpoint(H.checkpoint_dir(m.ckpt), g.num_layers)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("case", list(CASES))
def test_metp_logits_equal_transformers(tiny, case):
    """METP 2 on the import: the installed transformers' logits and loss (fp32, 1e-5)."""
    m = tiny[case]
    logits, loss = _metp_run(2, m.ckpt, m.geometry, _ids(case))
    err, err_loss = rel_err(logits, m.logits), abs(loss - m.loss) / abs(m.loss)
    print(f"\n{case} METP=2: logits rel. err {err:.2e}, loss {loss:.7f} vs {m.loss:.7f}")
    assert logits.shape == m.logits.shape
    assert err <= TOL and err_loss <= TOL, (err, err_loss)


def test_both_versions_config_files_read_alike(tiny):
    """The config.json that 4.57.6 and 5.25.0 wrote for each tiny model (kept in
    tests/data/hf_configs/) give the same expected flags in this transformers too; the kept
    file of the installed version is what it writes now."""
    import transformers

    assert {"4.57.6", "5.25.0"} <= set(VERSIONS)
    for family in FAMILIES:
        for version in VERSIONS:
            with open(os.path.join(DATA, version, f"{family}.json")) as f:
                cfg = json.load(f)
            assert _flags(cfg) == EXPECTED[family], (version, family)
            assert V.source_layout(cfg) == int(version.split(".")[0]), (version, family)
        if transformers.__version__ in VERSIONS:
            with open(os.path.join(DATA, transformers.__version__, f"{family}.json")) as f:
                kept = json.load(f)
            with open(os.path.join(tiny[family].hf_dir, "config.json")) as f:
                assert json.load(f) == kept, family


def test_reverted_fix_drops_yarn_negative_control(monkeypatch):
    """Negative control: read as before this fix (no 5.x layout, no key table), 5.25.0's YaRN
    Qwen3 loses YaRN and its base (--rotary-base 10000), its Mixtral the base, its Qwen3-MoE
    its experts, so the tests above would fail on that code."""
    from megatron_metp.tools.hf import keys as hf_keys

    def load(family):
        with open(os.path.join(DATA, "5.25.0", f"{family}.json")) as f:
            return json.load(f)

    monkeypatch.setattr(V, "canonical", lambda cfg: dict(cfg))
    monkeypatch.setattr(hf_keys, "check_keys", lambda *a, **k: None)
    old = _flags(load("qwen3_yarn"))
    assert old != EXPECTED["qwen3_yarn"]
    assert "yarn" not in old and old[old.index("--rotary-base") + 1] == "10000"
    mix = _flags(load("mixtral"))
    assert mix[mix.index("--rotary-base") + 1] == "10000"
    msgs = value_errors({"qwen3_moe": lambda: _flags(load("qwen3_moe"))})
    assert_messages(msgs, {"qwen3_moe": "num_experts = None"})


# ---------------------------------------------------------------- refusals

def _kept(family, version="5.25.0", **change):
    with open(os.path.join(DATA, version, f"{family}.json")) as f:
        cfg = json.load(f)
    cfg.update(change)
    return cfg


def test_unknown_keys_and_values_are_refused_by_name():
    rp = _kept("qwen3_yarn")["rope_parameters"]
    nested = {"full_attention": dict(rp), "sliding_attention": dict(rp, factor=2.0)}
    msgs = value_errors({
        "unknown": lambda: _flags(_kept("llama", quantization_config={"bits": 4})),
        "unknown4": lambda: _flags(_kept("mistral", "4.57.6", use_flash_norm=True)),
        "window_llama": lambda: _flags(_kept("llama", sliding_window=4096)),
        "tp": lambda: _flags(_kept("llama", pretraining_tp=2)),
        "pruned": lambda: _flags(_kept("qwen2", pruned_heads={"0": [1]})),
        "rope_key": lambda: _flags(_kept("qwen3_yarn",
                                         rope_parameters=dict(rp, low_freq_factor=1.0))),
        "rope_key4": lambda: _flags(_kept("llama", "4.57.6", rope_scaling={
            "rope_type": "default", "factor": 2.0})),
        "theta_both": lambda: _flags(_kept("qwen2", rope_theta=10000.0)),
        "scaling_both": lambda: _flags(_kept("qwen3_yarn", rope_scaling={
            "rope_type": "yarn", "factor": 2.0})),
        "per_layer": lambda: _flags(_kept("qwen3_yarn", layer_types=[
            "full_attention", "sliding_attention"], rope_parameters=nested)),
        "experts_both": lambda: _flags(_kept("qwen3_moe", num_experts=8)),
        "yarn5": lambda: _flags(_kept("qwen3_yarn", rope_parameters=dict(rp, truncate="no"))),
        "top1_norm": lambda: _flags(_kept("qwen3_moe", num_experts_per_tok=1)),
        "top1_mixtral": lambda: _flags(_kept("mixtral", num_experts_per_tok=1)),
    })
    assert_messages(msgs, {
        "unknown": "quantization_config = {'bits': 4}: not a key of a 'llama' config",
        "unknown4": "use_flash_norm = True: not a key of a 'mistral' config",
        "window_llama": "sliding_window = 4096 is not supported: it must be null",
        "tp": "pretraining_tp = 2 is not supported: it must be 1",
        "pruned": "pruned_heads = {'0': [1]} is not supported",
        "rope_key": "rope_parameters has ['low_freq_factor']",
        "rope_key4": "rope_scaling has ['factor'] besides the keys of rope_type 'default'",
        "theta_both": "rope_theta = 10000.0, rope_parameters.rope_theta = 1000000.0",
        "scaling_both": "rope_scaling = {'rope_type': 'yarn', 'factor': 2.0} and rope_parameters",
        "per_layer": "rope_parameters differs between layer types",
        "experts_both": "num_experts = 8 and num_local_experts = 4 differ",
        "yarn5": "rope_parameters.truncate = 'no'",
        "top1_norm": "num_experts_per_tok = 1 with norm_topk_prob true",
        "top1_mixtral": "num_experts_per_tok = 1 with Mixtral"})
    # the same RoPE under every layer type converts; so does a matching 4.x rope_theta
    same = {"full_attention": dict(rp)}
    assert _flags(_kept("qwen3_yarn", rope_parameters=same)) == EXPECTED["qwen3_yarn"]
    assert _flags(_kept("qwen2", rope_theta=1e6)) == EXPECTED["qwen2"]
    # Llama 3.1's scaling as 5.x writes it
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    f = _flags(_kept("llama", rope_parameters=l3, max_position_embeddings=131072))
    assert (f[f.index("--rope-scaling-factor") + 1], f[f.index("--rotary-base") + 1]) == \
        ("8.0", "500000")


def test_unknown_key_is_refused_before_any_weight_is_read(tiny, tmp_path, capsys,
                                                         monkeypatch):
    """``hf import`` of a real save with one unknown key: exit 2 naming it, nothing written,
    the safetensors never read (the reader is replaced by one that records a call)."""
    import shutil

    d = str(tmp_path / "hf")
    shutil.copytree(tiny["llama"].hf_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["attn_temperature"] = 0.7
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    reads = []
    # hf import reads its weights through weights_check.read_checked_safetensors, looked up in
    # hf.convert (patching the package's name would not reach import_hf)
    monkeypatch.setattr(convert, "read_checked_safetensors", lambda *a, **k: reads.append(a) or {})
    assert H.main(["import", "--hf-dir", d, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "attn_temperature = 0.7: not a key of a 'llama' config" in err
    assert reads == [] and not (tmp_path / "o").exists()
    # control: without the key the same import reaches the reader
    del cfg["attn_temperature"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert H.main(["import", "--hf-dir", d, "--out", str(tmp_path / "o")]) == 2
    assert len(reads) == 1


def test_top1_routing_converts_only_as_megatron_core_takes_it(tiny):
    """The top-1 Qwen3-MoE (norm_topk_prob false) gives megatron-core's own argument check a
    pre-softmax top-1 router (its logits: test_metp_logits_equal_transformers)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_metp.tools.hf.config import transformer_config_kwargs

    g = LlamaGeometry(**tiny["qwen3_moe_top1"].geometry)
    assert (g.moe_router_topk, g.moe_router_pre_softmax) == (1, True)
    TransformerConfig(**transformer_config_kwargs(g))  # megatron-core accepts it
    msgs = value_errors({"renormalised": lambda: TransformerConfig(**transformer_config_kwargs(
        LlamaGeometry(**dict(tiny["qwen3_moe_top1"].geometry, moe_router_pre_softmax=False))))})
    assert_messages(msgs, {"renormalised": "--moe-router-pre-softmax when topk is 1"})


# ---------------------------------------------------------------- export

def _st(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("case", ["qwen3_yarn", "qwen3_moe"])
def test_export_writes_the_installed_layout_bit_exact(tiny, case, tmp_path):
    """Export in the installed transformers' layout by default, or the stated one: the same
    tensors bit for bit, the same model (canonical config) and, in the default layout,
    transformers' logits bit for bit."""
    m = tiny[case]
    major = V.installed_layout()
    src = _st(m.hf_dir)
    with open(os.path.join(m.hf_dir, "config.json")) as f:
        src_cfg = V.canonical(json.load(f))
    for layout in (None, 4, 5):
        out = str(tmp_path / f"out-{layout}")
        args = [] if layout is None else ["--transformers-layout", str(layout)]
        assert H.main(["export", "--load", m.ckpt, "--out", out] + args) == 0
        got = _st(out)
        assert sorted(got) == sorted(src) and all(torch.equal(got[k], src[k]) for k in src)
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        assert V.source_layout(cfg) == (layout or major), (layout, sorted(cfg))
        assert ("rope_parameters" in cfg) == ((layout or major) == 5)
        assert V.canonical(cfg) == {**src_cfg, "_rope_source": V.canonical(cfg)["_rope_source"]}
        assert _flags(cfg) == EXPECTED[case]
    logits, loss = reference(str(tmp_path / "out-None"), _family(case), _ids(case), _seq(case))
    assert torch.equal(logits, m.logits) and loss == m.loss


def test_the_docs_key_table_is_current():
    """docs/huggingface.md prints the key table as megatron_metp/tools/hf/keys.py holds it."""
    from megatron_metp.tools.hf.keys import markdown_table

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "huggingface.md")) as f:
        doc = f.read()
    table = markdown_table()
    assert table in doc
    assert table.replace("| `use_cache` | harmless", "| `use_cache` | mapped") not in doc
