"""Qwen3 / Qwen2.5 / Mistral features in the METP layers against single-rank stock Megatron.

``--qk-layernorm`` (per-head norm of q and k before RoPE, replicated weights), ``--kv-channels``
other than hidden/heads and ``--add-qkv-bias`` without other biases: one forward/backward of a
tiny ``GPTModel``, loss and every full-weight gradient within 1e-5 (fp32) of stock Megatron on
one rank, at METP 2 and 3, with TP, the vocabulary ring, packed documents, full recompute and
the ring baseline; negative controls show the comparison can fail.
"""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from tests.gpt_cases import assemble, one_step_grads
from tests.harness import run_ranks
from tests.numerics import rel_err

#: 12 heads of width 4 (kv_channels 4 != hidden 24 / 12 = 2), 6 K/V groups
QWEN = dict(qk_layernorm=True, kv_channels=4, add_qkv_bias=True)


def _size(**kw):
    base = dict(num_layers=2, hidden_size=24, num_attention_heads=12, num_query_groups=6,
                ffn_hidden_size=48, vocab_size=72, seq_length=24, swiglu=True, bias=False,
                normalization="RMSNorm")
    base.update(kw)
    return GPTSize(**base)


def _sum_qk_norm_over_tp(out):
    """What finalize_model_grads does for --qk-layernorm under TP: each TP rank's q/k norm
    gradient covers its own heads; sum them (one rank per TP rank; METP already summed)."""
    names = [n for n in out[0]["grads"] if "q_layernorm" in n or "k_layernorm" in n]
    firsts = {}
    for r in out:
        firsts.setdefault(r["tp_rank"], r)
    if len(firsts) == 1:
        return out
    for n in names:
        total = sum(r["grads"][n][0] for r in firsts.values())
        for r in out:
            r["grads"][n] = (total,) + tuple(r["grads"][n][1:])
    return out


def _errors(out, ref, size):
    out = _sum_qk_norm_over_tp(out)
    full, got = assemble([ref], size), assemble(out, size)
    assert set(full) == set(got)
    errs = {k: rel_err(got[k], full[k]) for k in full}
    return abs(out[0]["loss"] - ref["loss"]) / abs(ref["loss"]), errs


def _geometry(norm, groups=6):
    return _size(normalization=norm, swiglu=norm == "RMSNorm", num_query_groups=groups)


@pytest.fixture(scope="module")
def stock():
    """Single-rank stock Megatron (local spec) for the geometries used below, computed once."""
    cache = {}

    def get(norm, groups=6):
        if (norm, groups) not in cache:
            cache[norm, groups] = run_ranks(one_step_grads, 1, _geometry(norm, groups),
                                            Layout(mode="tp", extra=QWEN))[0]
        return cache[norm, groups]
    return get


CASES = [  # (world, layout, normalization, K/V groups): each feature with each composition
    (2, Layout(metp=2, extra=QWEN), "RMSNorm", 6),
    (3, Layout(metp=3, extra=QWEN), "LayerNorm", 6),      # LayerNorm q/k norms (with bias), GeLU
    (4, Layout(tp=2, metp=2, extra=QWEN), "RMSNorm", 12),  # q/k norm grads summed over TP
    (3, Layout(metp=3, vocab_parallel=True, recompute="full", extra=QWEN), "RMSNorm", 6),
    (2, Layout(metp=2, mode="ring", extra=QWEN), "RMSNorm", 6),  # ring baseline: stock attention
    (2, Layout(metp=2, offload_activations=True, recompute="full", extra=QWEN), "RMSNorm", 6),
]


@pytest.mark.parametrize("world,layout,norm,groups", CASES,
                         ids=[f"{c[1].mode}-tp{c[1].tp}-metp{c[1].metp}-{c[2]}"
                              f"{'-vocab' if c[1].vocab_parallel else ''}"
                              f"{'-offload' if c[1].offload_activations else ''}"
                              f"{'-recompute' if c[1].recompute else ''}" for c in CASES])
def test_qwen_features_match_single_rank_stock(world, layout, norm, groups, stock):
    size = _geometry(norm, groups)
    out = run_ranks(one_step_grads, world, size, layout)
    loss_err, errs = _errors(out, stock(norm, groups), size)
    worst = max(errs, key=errs.get)
    print(f"{layout.describe()} ({norm}): loss {loss_err:.1e}, worst grad {worst} {errs[worst]:.1e}")
    assert loss_err <= 1e-5
    assert errs[worst] <= 1e-5, (worst, errs[worst])
    assert any("q_layernorm" in k for k in errs) and any("linear_qkv.bias" in k for k in errs)
    assert not any("linear_proj.bias" in k or "linear_fc1.bias" in k for k in errs)


def _swapped_norms(rank, world, size, layout, how):
    """METP with the q and k norm weights swapped, or applied without their weights."""
    from megatron_metp.megatron import modules

    real = modules.head_norm_kwargs

    def wrong(attn):
        kw = real(attn)
        if kw and how == "swap":
            kw["q_norm_weight"], kw["k_norm_weight"] = kw["k_norm_weight"], kw["q_norm_weight"]
        if kw and how == "unweighted":  # still connected to the parameters (zero gradient)
            kw["q_norm_weight"] = kw["q_norm_weight"] * 0 + 1
            kw["k_norm_weight"] = kw["k_norm_weight"] * 0 + 1
        return kw

    modules.head_norm_kwargs = wrong
    return one_step_grads(rank, world, size, layout)


@pytest.mark.parametrize("how", ["swap", "unweighted"])
def test_negative_controls_norms_swapped_or_unweighted(how, stock):
    size = _size()
    out = run_ranks(_swapped_norms, 2, size, Layout(metp=2, extra=QWEN), how)
    loss_err, errs = _errors(out, stock("RMSNorm"), size)
    print(f"q/k norms {how}: loss {loss_err:.1e}, worst grad {max(errs.values()):.1e}")
    assert max(errs.values()) > 1e-3, max(errs.values())


def test_qwen_features_with_packed_documents():
    """Packed documents (EOD boundaries, per-document RoPE) at METP 2 with all three features
    against single-rank stock Megatron with its dense document mask."""
    from tests.test_packed_megatron import ENDS, _check_against, _packed_step

    size = _size(seq_length=32, num_query_groups=6)
    ref = run_ranks(_packed_step, 1, size, Layout(mode="tp", extra=QWEN), ENDS, True)[0]
    out = run_ranks(_packed_step, 2, size, Layout(metp=2, extra=QWEN), ENDS, True)
    _check_against(out, ref, size, "packed METP 2, Qwen features")
    assert any("q_layernorm" in k for k in out[0]["grads"])  # the features are in the model


def test_spec_without_norms_is_refused():
    """config.qk_layernorm with a spec that has no q/k norms would silently skip them."""
    def build(rank, world):
        from megatron_metp.megatron import cpu
        from megatron_metp.megatron import training

        cpu.enable()
        size = _size()
        layout = Layout(metp=1, extra=QWEN)
        groups = training.init_parallel(layout, size.seq_length)
        from megatron.core.models.gpt import GPTModel

        from megatron_metp.megatron.spec import get_gpt_layer_metp_spec

        cfg = training.transformer_config(size, layout)
        try:
            GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_metp_spec(
                groups, normalization="RMSNorm"), vocab_size=72, max_sequence_length=24)
        except ValueError as exc:
            return str(exc)
        return None

    msg = run_ranks(build, 1)[0]
    assert msg is not None and "qk_layernorm=True" in msg


def _train(rank, world, size, layout):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import init_parallel, train

    cpu.enable()
    init_parallel(layout, size.seq_length)
    return [(r.lm_loss, r.grad_norm) for r in train(size, layout, 3)]


def test_three_adam_steps_through_megatrons_ddp_and_finalize():
    """Megatron's DDP (replicated q/k norm weights reduced over DP x METP) and
    finalize_model_grads (summed over TP) with Adam: TP 2 x METP 2 follows single-rank stock."""
    size = _geometry("RMSNorm", 12)
    ref = run_ranks(_train, 1, size, Layout(mode="tp", extra=QWEN))[0]
    out = run_ranks(_train, 4, size, Layout(tp=2, metp=2, extra=QWEN))[0]
    for (l0, g0), (l1, g1) in zip(ref, out):
        assert abs(l1 - l0) <= 1e-5 * abs(l0) and abs(g1 - g0) <= 1e-5 * abs(g0), (ref, out)
    assert ref[0][0] != ref[-1][0]  # the steps moved the weights


def test_sliding_window_is_refused_by_the_metp_layer():
    from types import SimpleNamespace

    from megatron_metp.megatron.modules import check_config

    cfg = SimpleNamespace(sequence_parallel=False, attention_dropout=0.0, window_size=(16, 0),
                          recompute_granularity=None)
    with pytest.raises(ValueError, match=r"--window-size \(16, 0\)"):
        check_config(cfg)
    check_config(SimpleNamespace(**{**cfg.__dict__, "window_size": None}))
