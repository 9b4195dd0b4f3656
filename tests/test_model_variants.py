"""Attention and MLP variants of the newer families with METP (``megatron/variant_checks.py``),
against single-rank stock megatron-core from the same full weights (fp32, ≤ 1e-5), both
releases:

* gpt-oss's experts: a clamped quick-GeGLU with a GLU offset (``activation_func_clamp_value``,
  ``glu_linear_offset``) and linear biases, every layer a MoE layer, with attention sinks
  (``softmax_type learnable``): Megatron's own experts apply them; loss and every gradient at METP 2 and 3; negative control: stock without the
  clamp and offset fails the comparison;
* partial RoPE (``--rotary-percent 0.5``): METP rotates the first half of each head's channels
  as stock does; loss and every gradient at METP 2 and 3; negative control: stock with the whole
  head rotated fails the comparison;
* refused before any work, naming the flag: attention sinks with TP > 1
  (``--softmax-type``; the sinks themselves: ``tests/test_attention_sinks.py``), alternating
  sliding windows (``--window-attn-skip-freq``), the GLU offset / clamp where METP's MLP runs
  (dense layers, shared experts), through a ``TransformerConfig``, Megatron-LM ``args`` and the
  launcher's preflight (whose flags are both releases' own: ``tests/test_moe_megatron_lm.py``)."""

from types import SimpleNamespace

import pytest

from megatron_metp.megatron.training import GPTSize
from tests.harness import run_ranks
from tests.numerics import rel_err
from tests.test_moe import MOE, _errors, _experts, _layout, assemble, moe_one_step
from tests.test_moe_routers import stock_step

#: every layer a MoE layer (gpt-oss), linear biases, no q/k norms
ALL_MOE = GPTSize(**{**MOE.__dict__, "moe_layer_freq": 1, "num_layers": 2, "bias": True})
#: the clamp bites at these scales (fc1 outputs reach about ±0.5)
CLAMPED = {"glu_linear_offset": 1.0, "activation_func_clamp_value": 0.2}


def quick_gelu(x):
    """gpt-oss's ``x·σ(1.702·x)``, eager (megatron-core's is ``torch.compile``d: compiling it in
    every forked rank costs ~10 s; the GLU, clamp and offset around it are the same code)."""
    import torch

    return x * torch.sigmoid(1.702 * x)


def _glu_layout(metp=1, mode="metp", variant=CLAMPED):
    """gpt-oss's layer: attention sinks, experts with a (clamped) quick-GeGLU and biases."""
    extra = {"gated_linear_unit": True, "activation_func": quick_gelu,
             "softmax_type": "learnable", **variant}
    return _layout(metp, mode=mode, dispatcher="alltoall", aux="aux", shared=extra)


@pytest.fixture(scope="module")
def stock_glu():
    cache = {}

    def get(clamped):
        if clamped not in cache:
            cache[clamped] = run_ranks(stock_step, 1, ALL_MOE,
                                       _glu_layout(mode="tp", variant=CLAMPED if clamped else {}))[0]
        return cache[clamped]
    return get


@pytest.mark.parametrize("metp", [2, 3], ids=["metp2", "metp3"])
def test_clamped_glu_experts_with_biases_match_single_rank_stock(stock_glu, metp):
    out = run_ranks(moe_one_step, metp, ALL_MOE, _glu_layout(metp))
    ref = stock_glu(True)
    loss_err, errs = _errors(out, ref)
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    assert len(_experts(errs)) == 2 * MOE.num_experts * 4  # fc1, fc2 and their biases
    # negative control: stock's unclamped GLU without the offset
    off, got = assemble([stock_glu(False)]), assemble(out)
    fc1 = [k for k in off if ".experts." in k and k.endswith("linear_fc1.weight")]
    assert fc1 and rel_err(*(torch_cat(d, fc1) for d in (got, off))) > 1e-2


def torch_cat(tensors, names):
    import torch

    return torch.cat([tensors[k].flatten() for k in names])


# ---------------------------------------------------------------- partial RoPE

#: a dense GPT (heads of 8 channels, the first 4 rotated; GeLU: the test assembles METP's MLP
#: shards by concatenation, which a SwiGLU fc1's [gate_r | up_r] shards would not take)
DENSE = GPTSize(num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=6,
                ffn_hidden_size=48, vocab_size=72, seq_length=24, swiglu=False, bias=False,
                normalization="RMSNorm", rotary_percent=0.5)


@pytest.fixture(scope="module")
def stock_rope():
    cache = {}

    def get(percent):
        if percent not in cache:
            size = GPTSize(**{**DENSE.__dict__, "rotary_percent": percent})
            cache[percent] = run_ranks(moe_one_step, 1, size, _layout(mode="tp"))[0]
        return cache[percent]
    return get


@pytest.mark.parametrize("metp", [2, 3], ids=["metp2", "metp3"])
def test_partial_rope_matches_single_rank_stock(stock_rope, metp):
    out = run_ranks(moe_one_step, metp, DENSE, _layout(metp))
    loss_err, errs = _errors(out, stock_rope(0.5))
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    # negative control: stock rotating the whole head
    off, got = assemble([stock_rope(1.0)]), assemble(out)
    qkv = [k for k in off if k.endswith("linear_qkv.weight")]
    assert qkv and min(rel_err(got[k], off[k]) for k in qkv) > 1e-2


# ---------------------------------------------------------------- refusals

def _moe_cfg(**kw):
    base = dict(num_moe_experts=8, moe_layer_freq=1, moe_shared_expert_intermediate_size=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,needle", [
    (dict(softmax_type="learnable", tensor_model_parallel_size=2),
     "--softmax-type learnable (attention sinks) with --tensor-model-parallel-size 2"),
    (dict(softmax_type="off-by-one", reset_attention_mask=True),
     "--softmax-type off-by-one (attention sinks) with packed documents"),
    (dict(softmax_type="learnable", metp_disable_weight_ring=True),
     "--softmax-type learnable (attention sinks) with --metp-disable-weight-ring"),
    (dict(window_attn_skip_freq=2), "--window-attn-skip-freq 2"),
    (dict(glu_linear_offset=1.0, moe_layer_freq=[0, 1]), "--glu-linear-offset 1.0"),
    (dict(activation_func_clamp_value=7.0, moe_shared_expert_intermediate_size=16),
     "--activation-func-clamp-value 7.0"),
    (dict(glu_linear_offset=1.0, num_moe_experts=None), "--glu-linear-offset 1.0"),
    (dict(quick_geglu=True, moe_layer_freq=2), "--quick-geglu"),
    (dict(use_grouped_gemm_for_shared_expert=True, moe_shared_expert_intermediate_size=16),
     "--use-grouped-gemm-for-shared-expert"),
    (dict(moe_shared_expert_glu_interleave_size=8, moe_shared_expert_intermediate_size=16),
     "--moe-shared-expert-glu-interleave-size 8"),
], ids=["sinks-with-tp", "sinks-with-packed-documents", "sinks-with-the-ring-baseline",
        "window-pattern", "glu-offset-dense-layer",
        "clamp-shared-expert", "glu-offset-dense-model", "quick-geglu-dense-layer",
        "grouped-gemm-shared-expert", "interleaved-shared-expert"])
def test_variants_are_refused_naming_the_flag(kw, needle):
    from megatron_metp.megatron.variant_checks import variant_args_problems, variant_problems

    problems = variant_problems(lambda n, d: getattr(_moe_cfg(**kw), n, d))
    assert len(problems) == 1 and needle in problems[0], problems
    args = SimpleNamespace(**{("num_experts" if k == "num_moe_experts" else k): v
                              for k, v in {**_moe_cfg().__dict__, **kw}.items()})
    assert variant_args_problems(args) == problems
    # the controls: stock settings; the GLU offset and clamp on routed experts only
    assert variant_problems(lambda n, d: getattr(_moe_cfg(), n, d)) == []
    assert variant_problems(lambda n, d: getattr(_moe_cfg(**CLAMPED, quick_geglu=True), n,
                                                 d)) == []


def test_a_config_with_a_window_pattern_is_refused_before_the_model_is_built():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron.modules import check_config

    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2,
                            window_attn_skip_freq=2)
    with pytest.raises(ValueError, match="--window-attn-skip-freq 2"):
        check_config(cfg)


def test_preflight_refuses_the_variants_and_reads_layer_patterns():
    from megatron_metp.megatron.variant_checks import layer_pattern
    from megatron_metp.megatron_lm.checks import metp_arg_problems
    from megatron_metp.megatron_lm.preflight import parse_megatron_args

    assert layer_pattern("([0]*1+[1]*3)") == [0, 1, 1, 1] and layer_pattern("2") == 2
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        layer_pattern("[__import__('os')]")
    base = ["--metp-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--num-experts", "4"]

    def problems(*extra):
        args = parse_megatron_args(base + list(extra), 2)
        return " ".join(metp_arg_problems(args))

    assert "--glu-linear-offset" not in problems("--glu-linear-offset", "1.0")
    assert "--glu-linear-offset 1.0" in problems("--glu-linear-offset", "1.0",
                                                 "--moe-layer-freq", "([0]*1+[1]*3)")
    assert "--softmax-type" not in problems("--softmax-type", "learnable")  # sinks run
    assert "--window-attn-skip-freq [1, 0]" in problems("--window-attn-skip-freq", "([1]+[0])")
