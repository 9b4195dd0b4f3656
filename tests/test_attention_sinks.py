"""Attention sinks (Megatron's ``softmax_type`` ``learnable`` / ``off-by-one``, gpt-oss) with
METP: the sink logit merged once per row into the K/V ring's log-sum-exp
(``megatron_metp/ops/sinks.py``).

* the merge and the sink's gradient against autograd through the dense softmax with the extra
  column (single device, fp64 reference; the ring's merge is fp32: ≤ 1e-6); negative control:
  the sink merged into every ring block's partial result (once per ring step) instead of once;
* a GPT with sinks against single-rank stock megatron-core from the same full weights (fp32,
  loss and every gradient ≤ 1e-5, the sinks' included) at METP 2 and 3, METP 2 × CP 2, with
  ``off-by-one``, under full recompute (Megatron's checkpoint of the METP layers; also with the
  attention outputs kept, ``--metp-keep-attention-output``: the kept O and LSE hold the sinks)
  and selective ``core_attn`` recompute (the backward re-forms O and LSE, sinks included; with
  all 3 head groups in one block, ``METP_HEAD_BLOCK=3``); negative control: the sink added once
  per rank of the ring (p times) fails the comparison."""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize
from tests.harness import run_ranks
from tests.numerics import rel_err
from tests.test_moe import _errors, _layout, moe_one_step
from tests.test_model_variants import DENSE

SINKS = GPTSize(**{**DENSE.__dict__, "rotary_percent": 1.0})


# ---------------------------------------------------------------- the merge, one device

def _dense(q, k, v, sink):
    """Causal attention with a sink column of value zero: ``[b, H, n, d]``."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    col = sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :n]
    return p @ v


def _ring_blocks(q, k, v, blocks):
    """``(out, lse)`` merged over ``blocks`` key blocks as the ring does, each block's partial
    result ``(o_j, lse_j)`` from its own keys."""
    from megatron_metp.ops import lse as lse_ops

    n = k.shape[2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    parts = []
    for cols in torch.arange(n).chunk(blocks):
        sb = s[..., cols]
        lse_b = torch.logsumexp(sb, -1)
        shift = lse_b.masked_fill(lse_b == float("-inf"), 0.0)
        parts.append((torch.exp(sb - shift.unsqueeze(-1)) @ v[:, :, cols], lse_b))
    out, lse = lse_ops.new_accumulators(q.shape, q.device)
    out, lse = out.double(), lse.double()
    for o_b, l_b in parts:
        lse_ops.merge_masked_(out, lse, o_b, l_b)
    return out, lse, parts


def test_sink_merge_and_gradient_match_the_dense_softmax():
    from megatron_metp.ops.lse import merge_masked_
    from megatron_metp.ops.sinks import add_sink_, sink_grad

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    ref = _dense(q, k, v, sink)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_dsink, = torch.autograd.grad(ref, sink, dout)
    out, lse, parts = _ring_blocks(q, k, v, 4)
    add_sink_(out, lse, sink)  # the ring's merge (lse.merge_masked_) works in fp32
    assert rel_err(out, ref) <= 1e-6, rel_err(out, ref)
    got = sink_grad(dout, out, lse, sink.detach())
    assert rel_err(got, ref_dsink) <= 1e-6, rel_err(got, ref_dsink)
    # negative control: the sink folded into each of the 4 blocks' partial results (once per
    # ring step) before they are merged
    bad, bad_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    for o_b, l_b in parts:
        o_b, l_b = o_b.clone(), l_b.clone()
        add_sink_(o_b, l_b, sink)
        merge_masked_(bad, bad_lse, o_b, l_b)
    assert rel_err(bad, ref) > 1e-2, rel_err(bad, ref)


# ---------------------------------------------------------------- GPT vs stock

def sink_step(rank, world, size, layout, sink_times=1, head_block=None):
    """:func:`moe_one_step`; ``sink_times`` > 1: the negative control, the sinks merged that
    many times (once per rank of the ring instead of once). ``head_block``: head groups per
    block of the op's outer loop (``METP_HEAD_BLOCK``, in this forked rank only; the GPU's
    choice where ``s/p`` is short, one K/V ring over several head groups' sinks)."""
    if head_block is not None:
        import os

        os.environ["METP_HEAD_BLOCK"] = str(head_block)
    if sink_times != 1:
        from megatron_metp.ops import attention

        once = attention.add_sink_

        def many(out, lse, sink):
            for _ in range(sink_times):
                once(out, lse, sink)
        attention.add_sink_ = many
    return moe_one_step(rank, world, size, layout)


def _sink_layout(metp=1, cp=1, mode="metp", kind="learnable", recompute=None):
    """``recompute``: None, ``"full"``, ``"keep"`` (full, with the attention outputs kept:
    ``--metp-keep-attention-output``) or ``"selective"`` (``core_attn``)."""
    sel = {"recompute_modules": ["core_attn"]} if recompute == "selective" else {}
    if recompute == "keep":
        recompute, sel = "full", {"keep_attention_output": True}
    return _layout(metp, cp, mode=mode, shared={"softmax_type": kind}, recompute=recompute, **sel)


@pytest.fixture(scope="module")
def stock():
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = run_ranks(moe_one_step, 1, SINKS, _sink_layout(mode="tp", kind=kind))[0]
        return cache[kind]
    return get


@pytest.mark.parametrize("metp,cp,kind,recompute,kb", [
    (2, 1, "learnable", None, None), (3, 1, "learnable", None, None),
    (2, 2, "learnable", None, None), (2, 1, "off-by-one", None, None),
    (2, 1, "learnable", "full", None), (2, 1, "learnable", "keep", None),
    (3, 1, "learnable", "selective", 3),
], ids=["metp2", "metp3", "metp2xcp2", "metp2-off-by-one", "metp2-full-recompute",
        "metp2-full-recompute-kept-output", "metp3-selective-core-attn-head-block3"])
def test_sinks_match_single_rank_stock(stock, metp, cp, kind, recompute, kb):
    out = run_ranks(sink_step, metp * cp, SINKS, _sink_layout(metp, cp, kind=kind,
                                                              recompute=recompute),
                    head_block=kb)
    loss_err, errs = _errors(out, stock(kind))
    worst = max(errs, key=errs.get)
    assert loss_err <= 1e-5 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])
    sinks = [k for k in errs if k.endswith("core_attention.softmax_offset")]
    assert len(sinks) == (SINKS.num_layers if kind == "learnable" else 0), sinks
    if (metp, cp, kind, recompute) == (2, 1, "learnable", None):  # negative control: the sink added per rank
        bad = run_ranks(sink_step, metp, SINKS, _sink_layout(metp, kind=kind), sink_times=metp)
        bad_loss, _ = _errors(bad, stock(kind))
        assert bad_loss > 1e-4, bad_loss


def test_sinks_refused_with_tp_and_the_ring_baseline():
    from types import SimpleNamespace

    from megatron_metp.megatron.modules import attention_sinks
    from megatron_metp.megatron.variant_checks import variant_problems

    cfg = SimpleNamespace(softmax_type="learnable", tensor_model_parallel_size=2,
                          num_moe_experts=None, glu_linear_offset=0.0,
                          activation_func_clamp_value=None)
    problems = variant_problems(lambda n, d: getattr(cfg, n, d))
    assert len(problems) == 1 and "--softmax-type learnable (attention sinks) with " \
        "--tensor-model-parallel-size 2" in problems[0], problems
    cfg.tensor_model_parallel_size = 1
    assert variant_problems(lambda n, d: getattr(cfg, n, d)) == []
    with pytest.raises(ValueError, match="--metp-disable-weight-ring"):
        attention_sinks(cfg, None, ring_baseline=True)
