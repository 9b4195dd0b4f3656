"""Property-based parity: random geometries for the METP ops and a one-layer METP GPT.

Hypothesis draws geometries — group size 1–4, MHA/GQA/MQA heads and query groups, head dim,
sequence length, batch, GeLU/SwiGLU, causal or not, both token layouts, fp32/bf16, biases, RoPE
(none, whole-sequence table, Megatron's CP slice), block kernel — and every op is checked against
its single-device reference (``tests/mlp_cases.py``, ``tests/megatron_ref.py``,
``tests/test_ring_attention.reference_attention``); the one-layer METP GPT is checked against
stock Megatron TP of the same size (``tests/gpt_cases.py``). Geometries the ops must refuse are
drawn too: each must raise ``ValueError`` naming the offending argument before anything is sent
(``group.stats.steps == 0``).

Forking ranks is the expensive part, so one Hypothesis example is a *batch* of geometries for every
group size, and one ``run_ranks`` call per group size evaluates the whole batch.

Budget: by default every test runs a small sample from a fixed seed (``derandomize``; Hypothesis'
own heuristics may still vary later examples between runs, so every tolerance holds for any
geometry, not for a chosen few) without shrinking, and the file takes about 30 s on 2 cores.
``METP_FULL_PROPERTIES=1`` draws fresh random examples, 12–24x as many, and shrinks a failure to
a minimal geometry (about 5 minutes on 2 cores)::

    METP_FULL_PROPERTIES=1 .venv/bin/python -m pytest -q tests/test_properties.py

A failure prints the geometry (the dataclasses below); to replay it, add it as an ``@example``.
``test_every_fault_kind_is_refused`` complements the drawn refusals with every fault kind at p=2, 3.

Tolerances (norm-wise relative error, ``tests.numerics.rel_err``): fp32 ``1e-5`` against the fp32
reference (measured worst over several hundred geometries: 2.6e-6 for tiny head dims, typically
< 1e-6); the one-layer GPT ``1e-5`` against stock TP (measured worst 1.3e-6). bf16: see
``BF16_RATIO`` below — against the fp32 reference from the same bf16-rounded inputs, no more than
twice as far off as single-device bf16, and the replicated-bias gradient partials one rounding each.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from megatron_metp import METPGroup
from megatron_metp.megatron.training import GPTSize, Layout
from megatron_metp.ops import (metp_attention, metp_mlp, ring_attention, shard_sequence,
                               unshard_sequence)
from tests.gpt_cases import assemble, one_step_grads
from tests.harness import run_ranks
from tests.megatron_ref import full_attention_params, reference_self_attention
from tests.mlp_cases import full_mlp_params, reference_mlp, shard_params
from tests.numerics import rel_err
from tests.test_attention import _shard as shard_attention
from tests.test_mlp import _gather_metp as gather_mlp
from tests.test_ring_attention import reference_attention

FULL = os.environ.get("METP_FULL_PROPERTIES", "") not in ("", "0")

FP32_TOL = 1e-5
# bf16 (unit roundoff 2^-8 ≈ 3.9e-3) against the fp32 reference from the same bf16 inputs. The
# yardstick is the larger error of two single-device bf16 computations: plain PyTorch autograd,
# and the same op on one rank (the same block kernel, no ring). METP over p ranks may be at most
# BF16_RATIO times as far off, or within BF16_FLOOR (≈ 2.5 unit roundoffs) when both are tiny, and
# never beyond BF16_SANITY. (Why the op's own single-rank error: its attention backward takes
# rowsum(dO·O) from the bf16-rounded O, as FlashAttention does; on tiny heads that alone costs up to
# 6x the plain autograd error in dQ/dK, e.g. 1.0e-2 vs 2.5e-3 at s=6, d=3.)
BF16_RATIO = 2.0
BF16_FLOOR = 1e-2
BF16_SANITY = 0.1
# The replicated output bias (MLP fc2, attention proj) gets each rank's token partial of its
# gradient, cast to the bias dtype (as with TP + sequence parallelism); DDP sums the partials. In
# bf16 each partial is rounded once, so it is checked per rank against the exact partial: one
# rounding, at most the unit roundoff. (The summed partials can be further off than a plain bf16
# sum when they cancel: measured up to 8x, 1.0e-2, at p=4.)
BF16_PARTIAL_TOL = 2.0 ** -8 * 1.001
GPT_TOL = 1e-5          # METP GPT vs stock TP, loss and every gradient (fp32)
RING_TIMEOUT_S = 30.0   # a geometry that desynchronises the ring ends in an error, not a hang
GROUP_SIZES = (1, 2, 3, 4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _settings(default: int, full: int):
    """Bounded example counts; ``METP_FULL_PROPERTIES=1`` raises them and turns on shrinking."""
    return settings(
        max_examples=full if FULL else default, deadline=None, database=None,
        derandomize=not FULL, print_blob=True,
        phases=(Phase.explicit, Phase.generate, Phase.shrink) if FULL
        else (Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _group(p: int, name: str) -> METPGroup:
    return METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name=name,
                                        timeout_s=RING_TIMEOUT_S)


def _local(t, noncontig, grad=True):
    """A leaf copy of ``t`` ``[n, b, ...]``; with ``noncontig`` a view with batch-major strides
    (as a ``[b, s, h]`` tensor transposed to ``[s, b, h]`` arrives)."""
    t = t.transpose(0, 1).contiguous().transpose(0, 1) if noncontig else t.clone()
    return t.detach().requires_grad_(grad)


def _by_size(cases):
    """One fork per group size: ``{p: [case, ...]}``."""
    grouped = defaultdict(list)
    for c in cases:
        grouped[c.p].append(c)
    return dict(sorted(grouped.items()))


def _errors(got, ref):
    return {k: rel_err(got[k], ref[k]) for k in ref if ref[k] is not None}


def _check_errors(case, errs, yard=None, tol=FP32_TOL):
    """fp32: every error <= tol. bf16: <= max(BF16_RATIO · yardstick, BF16_FLOOR) and
    <= BF16_SANITY."""
    assert errs, case
    if yard is None:
        bad = {k: e for k, e in errs.items() if not e <= tol}
    else:
        bad = {k: (e, yard[k]) for k, e in errs.items()
               if not e <= min(max(BF16_RATIO * yard[k], BF16_FLOOR), BF16_SANITY)}
    assert not bad, f"{case}: {bad} (all errors {errs}, bf16 yardstick {yard})"


def _yardstick(plain, single):
    """bf16: the larger error of the two single-device bf16 computations, per quantity."""
    return {k: max(plain[k], single[k]) for k in plain}


def _check_bias_partials(case, partials, exact):
    """bf16 replicated-bias gradient: each rank's partial is the exact one rounded once."""
    errs = [rel_err(got, ref) for got, ref in zip(partials, exact)]
    assert max(errs) <= BF16_PARTIAL_TOL, f"{case}: bias-gradient partials {errs}"


def _split_bias(errs, plain, key):
    """bf16: the summed bias gradient is judged per rank instead (see BF16_PARTIAL_TOL)."""
    if plain is not None and key in errs:
        errs, plain = dict(errs), dict(plain)
        del errs[key], plain[key]
    return errs, plain


def _per_size(strategy_for_p, min_size=1, max_size=3):
    """A batch of cases for every group size 1–4 (so each example exercises all four)."""
    return st.tuples(*(st.lists(strategy_for_p(p), min_size=min_size, max_size=max_size)
                       for p in GROUP_SIZES)).map(lambda t: [c for lst in t for c in lst])


# =============================================================================== METP MLP

@dataclass(frozen=True)
class MLPCase:
    p: int
    tokens: int          # per rank (the MLP is token-wise, so the layout does not matter)
    batch: int
    hidden: int
    ffn_per_rank: int
    activation: str
    bias: bool
    keep_intermediate: bool
    pass_ffn: bool       # give ffn_hidden_size (shard shapes checked against it)
    noncontig: bool      # x (and the output gradient) as non-contiguous views
    dtype: str
    seed: int


@st.composite
def mlp_case(draw, p):
    return MLPCase(p=p, tokens=draw(st.integers(1, 5)), batch=draw(st.integers(1, 3)),
                   hidden=draw(st.integers(2, 16)), ffn_per_rank=draw(st.integers(1, 6)),
                   activation=draw(st.sampled_from(["gelu", "swiglu"])), bias=draw(st.booleans()),
                   keep_intermediate=draw(st.booleans()), pass_ffn=draw(st.booleans()),
                   noncontig=draw(st.booleans()), dtype=draw(st.sampled_from(["fp32", "bf16"])),
                   seed=draw(st.integers(0, 999)))


def _mlp_full(c: MLPCase):
    return full_mlp_params(c.tokens * c.p, c.batch, c.hidden, c.ffn_per_rank * c.p, c.activation,
                           c.bias, seed=c.seed, dtype=DTYPES[c.dtype])


def _mlp_rank(rank, p, cases):
    out = []
    for c in cases:
        full, ffn, n = _mlp_full(c), c.ffn_per_rank * p, c.tokens
        params = {k: None if v is None else v.requires_grad_()
                  for k, v in shard_params(full, ffn, c.activation, rank, p).items()}
        x = _local(full["x"][rank * n:(rank + 1) * n], c.noncontig)
        y = metp_mlp(x, params["w1"], params["w2"], group=_group(p, "prop-mlp"),
                     activation=c.activation, fc1_bias=params["b1"], fc2_bias=params["b2"],
                     keep_intermediate=c.keep_intermediate,
                     ffn_hidden_size=ffn if c.pass_ffn else None)
        assert y.dtype == x.dtype and y.shape == x.shape
        y.backward(_local(full["gy"][rank * n:(rank + 1) * n], c.noncontig, grad=False))
        out.append({"y": y.detach(), "dx": x.grad,
                    "grads": {k: None if v is None else v.grad for k, v in params.items()}})
    return out


def _mlp_ref(full, activation, dtype):
    r = reference_mlp(full, activation, dtype=dtype)
    return {"y": r["y"], "dx": r["dx"], "dw1": r["dw1"], "db1": r["db1"], "dw2": r["dw2"],
            "db2": r["db2"]}


def _mlp_gather(c, out, i, full):
    return gather_mlp([o[i] for o in out], c.activation, full, FFN=c.ffn_per_rank * c.p)


def check_mlp_cases(cases):
    for p, cs in _by_size(cases).items():
        out = run_ranks(_mlp_rank, p, cs, timeout=120)
        for i, c in enumerate(cs):
            full = _mlp_full(c)
            got = _mlp_gather(c, out, i, full)
            ref = _mlp_ref(full, c.activation, torch.float32)
            plain = None
            if c.dtype == "bf16":
                one = replace(c, p=1, tokens=c.tokens * p, ffn_per_rank=c.ffn_per_rank * p)
                single = _mlp_gather(one, [_mlp_rank(0, 1, [one])], 0, full)
                plain = _yardstick(_errors(_mlp_ref(full, c.activation, torch.bfloat16), ref),
                                   _errors(single, ref))
                if c.bias:
                    n = c.tokens
                    _check_bias_partials(c, [o[i]["grads"]["b2"] for o in out],
                                         [full["gy"][r * n:(r + 1) * n].double().sum((0, 1))
                                          for r in range(p)])
            _check_errors(c, *_split_bias(_errors(got, ref), plain, "db2"))


@_settings(default=6, full=100)
@given(cases=_per_size(mlp_case))
def test_metp_mlp_matches_single_device_reference(cases):
    check_mlp_cases(cases)


# =============================================================================== ring attention

@dataclass(frozen=True)
class RingCase:
    p: int
    tokens: int          # per rank; even for dual_chunk (the sequence is cut into 2p chunks)
    batch: int
    kv_heads: int
    q_per_kv: int        # 1: MHA (or MQA when kv_heads == 1), > 1: GQA
    head_dim: int
    causal: bool
    layout: str
    kernel: str
    scale: Optional[float]
    noncontig: bool
    dtype: str
    seed: int


@st.composite
def ring_case(draw, p):
    layout = draw(st.sampled_from(["dual_chunk", "contiguous"]))
    tokens = 2 * draw(st.integers(1, 3)) if layout == "dual_chunk" else draw(st.integers(1, 6))
    return RingCase(p=p, tokens=tokens, batch=draw(st.integers(1, 2)),
                    kv_heads=draw(st.integers(1, 3)), q_per_kv=draw(st.integers(1, 3)),
                    head_dim=draw(st.sampled_from([1, 2, 3, 4, 8])), causal=draw(st.booleans()),
                    layout=layout, kernel=draw(st.sampled_from(["reference", "torch_flash"])),
                    scale=draw(st.sampled_from([None, None, 0.3])), noncontig=draw(st.booleans()),
                    dtype=draw(st.sampled_from(["fp32", "bf16"])), seed=draw(st.integers(0, 999)))


def _ring_full(c: RingCase):
    """Full-sequence ``q, k, v`` and the output gradient, ``[s, b, heads, d]``."""
    g = torch.Generator().manual_seed(c.seed)
    s, hq = c.tokens * c.p, c.kv_heads * c.q_per_kv
    shapes = ((hq, 1.0), (c.kv_heads, 1.0), (c.kv_heads, 1.0), (hq, 1.0))
    return [(torch.randn(s, c.batch, h, c.head_dim, generator=g) * sc).to(DTYPES[c.dtype])
            for h, sc in shapes]


def _ring_rank(rank, p, cases):
    out = []
    for c in cases:
        q, k, v, go = _ring_full(c)
        ql, kl, vl = (_local(shard_sequence(t, rank, p, layout=c.layout), c.noncontig)
                      for t in (q, k, v))
        grp = _group(p, "prop-ring")
        o = ring_attention(ql, kl, vl, group=grp, causal=c.causal, layout=c.layout,
                           softmax_scale=c.scale, kernel=c.kernel)
        assert o.dtype == ql.dtype and o.shape == ql.shape
        o.backward(_local(shard_sequence(go, rank, p, layout=c.layout), c.noncontig, grad=False))
        out.append({"o": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                    "kernels": dict(grp.stats.kernels)})
    return out


def _ring_ref(c: RingCase, dtype):
    q, k, v, go = _ring_full(c)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    o = reference_attention(q, k, v, c.causal, scale=c.scale, dtype=dtype)
    o.backward(go.to(dtype))
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ring_gather(c, out, i):
    return {k: unshard_sequence([o[i][k] for o in out], layout=c.layout)
            for k in ("o", "dq", "dk", "dv")}


def check_ring_cases(cases):
    for p, cs in _by_size(cases).items():
        out = run_ranks(_ring_rank, p, cs, timeout=120)
        for i, c in enumerate(cs):
            got = _ring_gather(c, out, i)
            assert out[0][i]["kernels"] == {c.kernel: 1}, (c, out[0][i]["kernels"])
            ref = _ring_ref(c, torch.float64)
            plain = None
            if c.dtype == "bf16":
                one = replace(c, p=1, tokens=c.tokens * p)
                plain = _yardstick(_errors(_ring_ref(c, torch.bfloat16), ref),
                                   _errors(_ring_gather(one, [_ring_rank(0, 1, [one])], 0), ref))
            _check_errors(c, _errors(got, ref), plain)


@_settings(default=6, full=100)
@given(cases=_per_size(ring_case))
def test_ring_attention_matches_single_device_reference(cases):
    check_ring_cases(cases)


# =============================================================================== METP attention

@dataclass(frozen=True)
class AttnCase:
    p: int
    tokens: int          # per rank
    batch: int
    hidden: int
    groups_per_rank: int  # query groups G = p · groups_per_rank
    q_per_group: int     # heads A = G · q_per_group (1: MHA)
    head_dim: int
    causal: bool
    layout: str
    qkv_bias: bool
    proj_bias: bool
    rope: Optional[str]  # None, "full" ([s,1,1,d] table) or "local" (Megatron's CP slice)
    kernel: str
    noncontig: bool
    dtype: str
    seed: int

    @property
    def num_query_groups(self):
        return self.p * self.groups_per_rank

    @property
    def num_heads(self):
        return self.num_query_groups * self.q_per_group


@st.composite
def attn_case(draw, p):
    layout = draw(st.sampled_from(["dual_chunk", "contiguous"]))
    tokens = 2 * draw(st.integers(1, 3)) if layout == "dual_chunk" else draw(st.integers(1, 5))
    rope = draw(st.sampled_from([None, "full", "local"]))
    head_dim = draw(st.sampled_from([2, 4, 6] if rope else [1, 2, 3, 4]))
    return AttnCase(p=p, tokens=tokens, batch=draw(st.integers(1, 2)),
                    hidden=draw(st.integers(2, 16)), groups_per_rank=draw(st.integers(1, 2)),
                    q_per_group=draw(st.integers(1, 3)), head_dim=head_dim,
                    causal=draw(st.booleans()), layout=layout, qkv_bias=draw(st.booleans()),
                    proj_bias=draw(st.booleans()), rope=rope,
                    kernel=draw(st.sampled_from(["reference", "torch_flash"])),
                    noncontig=draw(st.booleans()), dtype=draw(st.sampled_from(["fp32", "bf16"])),
                    seed=draw(st.integers(0, 999)))


def _attn_full(c: AttnCase):
    return full_attention_params(c.tokens * c.p, c.batch, c.hidden, c.num_heads,
                                 c.num_query_groups, c.head_dim, qkv_bias=c.qkv_bias,
                                 proj_bias=c.proj_bias, rope=c.rope is not None, seed=c.seed,
                                 dtype=DTYPES[c.dtype])


def _attn_rank(rank, p, cases):
    out = []
    for c in cases:
        full = _attn_full(c)
        A, G, d = c.num_heads, c.num_query_groups, c.head_dim
        params = {k: None if v is None else v.clone().requires_grad_()
                  for k, v in shard_attention(full, rank, p, A, G, d).items()}
        x = _local(shard_sequence(full["x"], rank, p, layout=c.layout), c.noncontig)
        freqs = full["rotary_pos_emb"]
        if c.rope == "local":
            freqs = shard_sequence(freqs, rank, p, layout=c.layout)
        grp = _group(p, "prop-attn")
        y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=grp,
                           num_heads=A, num_query_groups=G, causal=c.causal, layout=c.layout,
                           rotary_pos_emb=freqs, qkv_bias=params["qkv_bias"],
                           proj_bias=params["proj_bias"], kernel=c.kernel)
        assert y.dtype == x.dtype and y.shape == x.shape
        y.backward(_local(shard_sequence(full["gy"], rank, p, layout=c.layout), c.noncontig,
                          grad=False))
        out.append({"y": y.detach(), "dx": x.grad,
                    **{"d" + k: None if v is None else v.grad for k, v in params.items()}})
    return out


def _gather_attn(rs, layout):
    return {"y": unshard_sequence([r["y"] for r in rs], layout=layout),
            "dx": unshard_sequence([r["dx"] for r in rs], layout=layout),
            "dqkv_w": torch.cat([r["dqkv_weight"] for r in rs]),
            "dqkv_b": None if rs[0]["dqkv_bias"] is None
            else torch.cat([r["dqkv_bias"] for r in rs]),
            "dproj_w": torch.cat([r["dproj_weight"] for r in rs], dim=1),
            "dproj_b": None if rs[0]["dproj_bias"] is None
            else sum(r["dproj_bias"].double() for r in rs)}


def check_attn_cases(cases):
    for p, cs in _by_size(cases).items():
        out = run_ranks(_attn_rank, p, cs, timeout=120)
        for i, c in enumerate(cs):
            full = _attn_full(c)
            got = _gather_attn([o[i] for o in out], c.layout)
            kw = dict(num_heads=c.num_heads, num_query_groups=c.num_query_groups,
                      causal=c.causal)
            ref = reference_self_attention(full, dtype=torch.float32, **kw)
            plain = None
            if c.dtype == "bf16":
                one = replace(c, p=1, tokens=c.tokens * p, groups_per_rank=c.groups_per_rank * p)
                plain = _yardstick(
                    _errors(reference_self_attention(full, dtype=torch.bfloat16, **kw), ref),
                    _errors(_gather_attn(_attn_rank(0, 1, [one]), c.layout), ref))
                if c.proj_bias:
                    _check_bias_partials(
                        c, [o[i]["dproj_bias"] for o in out],
                        [shard_sequence(full["gy"], r, p, layout=c.layout).double().sum((0, 1))
                         for r in range(p)])
            _check_errors(c, *_split_bias(_errors(got, ref), plain, "dproj_b"))


@_settings(default=5, full=80)
@given(cases=_per_size(attn_case))
@example(cases=[  # found by the property: bf16 bias-gradient partials that cancel (p=4, h=2)
    AttnCase(p=4, tokens=6, batch=2, hidden=2, groups_per_rank=2, q_per_group=1, head_dim=2,
             causal=False, layout="dual_chunk", qkv_bias=True, proj_bias=True, rope="full",
             kernel="torch_flash", noncontig=True, dtype="bf16", seed=20)])
def test_metp_attention_matches_single_device_reference(cases):
    check_attn_cases(cases)


# =============================================================================== one-layer GPT

@dataclass(frozen=True)
class GPTCase:
    p: int
    groups_per_rank: int
    q_per_group: int
    head_dim: int
    ffn_per_rank: int
    seq_chunks: int      # sequence length = 2p · seq_chunks (Megatron's CP split)
    vocab: int
    swiglu: bool
    bias: bool
    normalization: str
    position_embedding: str

    def size(self):
        A = self.p * self.groups_per_rank * self.q_per_group
        return GPTSize(num_layers=1, hidden_size=A * self.head_dim, num_attention_heads=A,
                       num_query_groups=self.p * self.groups_per_rank,
                       ffn_hidden_size=self.p * self.ffn_per_rank, vocab_size=self.vocab,
                       seq_length=2 * self.p * self.seq_chunks, swiglu=self.swiglu, bias=self.bias,
                       normalization=self.normalization,
                       position_embedding_type=self.position_embedding)


@st.composite
def gpt_case(draw, p):
    return GPTCase(p=p, groups_per_rank=draw(st.integers(1, 2)),
                   q_per_group=draw(st.integers(1, 2)),
                   head_dim=draw(st.sampled_from([4, 6])), ffn_per_rank=draw(st.integers(1, 4)),
                   seq_chunks=draw(st.integers(1, 2)), vocab=12 * draw(st.integers(2, 5)),
                   swiglu=draw(st.booleans()), bias=draw(st.booleans()),
                   normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
                   position_embedding=draw(st.sampled_from(["rope", "learned_absolute"])))


def _gpt_rank(rank, world, cases):
    """For each case: one forward/backward with METP=world, then with stock TP=world."""
    from megatron.core import parallel_state as ps

    out = []
    for c in cases:
        res = {}
        for mode, layout in (("metp", Layout(metp=world)), ("tp", Layout(tp=world, mode="tp"))):
            try:
                res[mode] = one_step_grads(rank, world, c.size(), layout)
            finally:
                ps.destroy_model_parallel()
        out.append(res)
    return out


def check_gpt_cases(cases):
    for p, cs in _by_size(cases).items():
        out = run_ranks(_gpt_rank, p, cs, timeout=300)
        for i, c in enumerate(cs):
            size = c.size()
            metp, stock = ([o[i][m] for o in out] for m in ("metp", "tp"))
            got, ref = assemble(metp, size), assemble(stock, size)
            assert set(got) == set(ref), (c, set(got) ^ set(ref))
            errs = {k: rel_err(got[k], ref[k]) for k in ref}
            errs["loss"] = abs(metp[0]["loss"] - stock[0]["loss"]) / abs(stock[0]["loss"])
            _check_errors(c, errs, tol=GPT_TOL)


@_settings(default=2, full=25)
@given(cases=_per_size(gpt_case, max_size=2))
def test_one_layer_metp_gpt_matches_stock_tp(cases):
    check_gpt_cases(cases)


# =============================================================================== refused geometries
#
# A refusal case is a valid geometry plus one fault. Each fault maps to the fragment its
# ValueError must contain: the offending argument (or Megatron flag) by name.

MLP_FAULTS = {
    "ffn_not_divisible": "ffn_hidden_size",      # F % p != 0 (p > 1)
    "shards_of_other_size": "ffn_hidden_size",   # shards hold F/(2p) units, told F over p
    "swiglu_odd_rows": "fc1_weight",             # gate/up rows cannot pair up
    "fc1_hidden": "fc1_weight",
    "fc2_shape": "fc2_weight",
    "fc1_bias_shape": "fc1_bias",
    "fc2_bias_shape": "fc2_bias",
    "dtype": "fc2_weight has dtype",
    "x_rank": "x must be",
    "activation": "activation must be",
}
RING_FAULTS = {
    "odd_dual_chunk": "layout='dual_chunk'",     # odd local token count, causal dual_chunk
    "gqa_heads": "k/v heads",
    "head_dim": "head dims",
    "kv_shape": "k and v",
    "kv_tokens": "k/v hold",
    "dtype": "k has dtype",
    "q_rank": "q must be",
    "layout": "layout must be",
    "kernel": "attention kernel",
}
ATTN_FAULTS = {
    "groups_not_divisible": "num_query_groups",  # G % p != 0 (p > 1)
    "heads_vs_groups": "num_heads",              # A % G != 0 (G > 1)
    "odd_dual_chunk": "layout='dual_chunk'",
    "odd_tokens_full_rope": "layout='dual_chunk'",  # non-causal, odd tokens, whole-sequence RoPE
    "qkv_rows": "qkv_weight",
    "hidden": "qkv_weight",
    "proj_head_dim": "proj_weight",
    "qkv_bias_shape": "qkv_bias",
    "proj_bias_shape": "proj_bias",
    "rope_length": "rotary_pos_emb",
    "rope_too_wide": "rotary_pos_emb",
    "dtype": "proj_weight has dtype",
    "layout": "layout must be",
}
SHARD_FAULTS = {
    "dual_chunk_not_divisible": "sequence length",   # s % 2p != 0
    "contiguous_not_divisible": "sequence length",   # s % p != 0 (p > 1)
    "rank_out_of_range": "rank must be",
}
GPT_FAULTS = {  # the fragment is computed from the geometry, see _gpt_refusal_needle
    "seq_length": None, "query_groups": None, "ffn": None,
}


@dataclass(frozen=True)
class Refusal:
    op: str
    fault: str
    case: object
    extra: int = 1       # how far off the fault is (drawn)

    @property
    def p(self):
        return self.case.p


def _applicable(op, c):
    p = c.p
    if op == "mlp":
        skip = {"ffn_not_divisible"} if p == 1 else set()
        if c.activation != "swiglu":
            skip.add("swiglu_odd_rows")
        if not c.bias:
            skip |= {"fc1_bias_shape", "fc2_bias_shape"}
        return [f for f in MLP_FAULTS if f not in skip]
    if op == "ring":
        return list(RING_FAULTS)
    if op == "attn":
        skip = {"groups_not_divisible"} if p == 1 else set()
        if c.num_query_groups == 1:
            skip.add("heads_vs_groups")
        if not c.qkv_bias:
            skip.add("qkv_bias_shape")
        if not c.proj_bias:
            skip.add("proj_bias_shape")
        if c.rope is None:
            skip |= {"rope_length", "rope_too_wide", "odd_tokens_full_rope"}
        if p == 1:  # one rank: the whole-sequence table is this rank's, nothing to select
            skip.add("odd_tokens_full_rope")
        return [f for f in ATTN_FAULTS if f not in skip]
    if op == "shard":
        return [f for f in SHARD_FAULTS if not (p == 1 and f == "contiguous_not_divisible")]
    return list(GPT_FAULTS) if p > 1 else []


def refusal(p):
    ops = [("mlp", mlp_case(p)), ("ring", ring_case(p)), ("attn", attn_case(p)),
           ("shard", ring_case(p))]
    if p > 1:
        ops.append(("gpt", gpt_case(p)))
    return st.one_of(*(
        base.flatmap(lambda c, op=op: st.builds(
            Refusal, st.just(op), st.sampled_from(_applicable(op, c)), st.just(c),
            st.integers(1, 2 * p - 1 if p > 1 else 1)))
        for op, base in ops))


def _mlp_refusal_call(r: Refusal, rank, grp):
    c, f, p = r.case, r.fault, r.p
    full, ffn, n = _mlp_full(c), c.ffn_per_rank * p, c.tokens
    sh = shard_params(full, ffn, c.activation, rank, p)
    x = full["x"][rank * n:(rank + 1) * n].clone()
    w1, w2, b1, b2 = sh["w1"], sh["w2"], sh["b1"], sh["b2"]
    kw = dict(group=grp, activation=c.activation, ffn_hidden_size=ffn)
    if f == "ffn_not_divisible":
        kw["ffn_hidden_size"] = ffn + (r.extra % p or 1)
    elif f == "shards_of_other_size":
        kw["ffn_hidden_size"] = 2 * ffn
    elif f == "swiglu_odd_rows":
        w1 = w1[:-1]
        b1 = None if b1 is None else b1[:-1]
    elif f == "fc1_hidden":
        w1 = torch.zeros(w1.shape[0], w1.shape[1] + r.extra, dtype=w1.dtype)
    elif f == "fc2_shape":
        w2 = torch.zeros(w2.shape[0], w2.shape[1] + r.extra, dtype=w2.dtype)
    elif f == "fc1_bias_shape":
        b1 = torch.zeros(b1.numel() + r.extra, dtype=b1.dtype)
    elif f == "fc2_bias_shape":
        b2 = torch.zeros(b2.numel() + r.extra, dtype=b2.dtype)
    elif f == "dtype":
        w2 = w2.double()
    elif f == "x_rank":
        x = x.reshape(-1, x.shape[-1])
    elif f == "activation":
        kw["activation"] = "relu"
    return metp_mlp(x, w1, w2, fc1_bias=b1, fc2_bias=b2, **kw)


def _ring_refusal_call(r: Refusal, rank, grp):
    c, f, p = r.case, r.fault, r.p
    q, k, v, _ = _ring_full(c)
    q, k, v = (shard_sequence(t, rank, p, layout=c.layout) for t in (q, k, v))
    kw = dict(group=grp, causal=c.causal, layout=c.layout, softmax_scale=c.scale, kernel=c.kernel)

    def like(t, *, n=None, heads=None, d=None):
        n0, b, h0, d0 = t.shape
        return torch.zeros(n or n0, b, heads or h0, d or d0, dtype=t.dtype)

    if f == "odd_dual_chunk":
        q, k, v = like(q, n=2 * r.extra + 1), like(k, n=2 * r.extra + 1), like(v, n=2 * r.extra + 1)
        kw.update(causal=True, layout="dual_chunk")
    elif f == "gqa_heads":
        k, v = like(k, heads=q.shape[2] + r.extra), like(v, heads=q.shape[2] + r.extra)
    elif f == "head_dim":
        k, v = like(k, d=k.shape[3] + r.extra), like(v, d=v.shape[3] + r.extra)
    elif f == "kv_shape":
        v = like(v, d=v.shape[3] + r.extra)
    elif f == "kv_tokens":
        k, v = like(k, n=k.shape[0] + 2 * r.extra), like(v, n=v.shape[0] + 2 * r.extra)
    elif f == "dtype":
        k, v = k.double(), v.double()
    elif f == "q_rank":
        q = q.reshape(q.shape[0], -1, q.shape[-1])
    elif f == "layout":
        kw["layout"] = "zigzag"
    elif f == "kernel":
        kw["kernel"] = "triton"
    return ring_attention(q, k, v, **kw)


def _attn_refusal_call(r: Refusal, rank, grp):
    c, f, p = r.case, r.fault, r.p
    full = _attn_full(c)
    A, G, d = c.num_heads, c.num_query_groups, c.head_dim
    sh = shard_attention(full, rank, p, A, G, d)
    wq, wp, bq, bp = sh["qkv_weight"], sh["proj_weight"], sh["qkv_bias"], sh["proj_bias"]
    x = shard_sequence(full["x"], rank, p, layout=c.layout)
    freqs = full["rotary_pos_emb"]
    if c.rope == "local":
        freqs = shard_sequence(freqs, rank, p, layout=c.layout)
    kw = dict(group=grp, num_heads=A, num_query_groups=G, causal=c.causal, layout=c.layout,
              kernel=c.kernel)
    n, b, h = x.shape
    if f == "groups_not_divisible":
        g2 = G + (r.extra % p or 1)
        kw.update(num_query_groups=g2, num_heads=g2 * c.q_per_group)
    elif f == "heads_vs_groups":
        kw["num_heads"] = A + (r.extra % G or 1)
    elif f == "odd_dual_chunk":
        x, freqs = torch.zeros(2 * r.extra + 1, b, h, dtype=x.dtype), None
        kw.update(causal=True, layout="dual_chunk")
    elif f == "odd_tokens_full_rope":  # positions of odd local halves do not exist
        m = 2 * r.extra + 1
        x, freqs = torch.zeros(m, b, h, dtype=x.dtype), torch.zeros(m * p, 1, 1, d)
        kw.update(causal=False, layout="dual_chunk")
    elif f == "qkv_rows":
        wq = torch.zeros(wq.shape[0] + 1, h, dtype=wq.dtype)
    elif f == "hidden":
        x = torch.zeros(n, b, h + r.extra, dtype=x.dtype)
    elif f == "proj_head_dim":
        wp = torch.zeros(h, wp.shape[1] + r.extra, dtype=wp.dtype)
    elif f == "qkv_bias_shape":
        bq = torch.zeros(bq.numel() + r.extra, dtype=bq.dtype)
    elif f == "proj_bias_shape":
        bp = torch.zeros(h + r.extra, dtype=bp.dtype)
    elif f == "rope_length":
        freqs = torch.zeros(n * p + r.extra, 1, 1, freqs.shape[-1])
    elif f == "rope_too_wide":
        freqs = torch.zeros(freqs.shape[0], 1, 1, d + 2 * r.extra)
    elif f == "dtype":
        wp = wp.double()
    elif f == "layout":
        kw["layout"] = "zigzag"
    return metp_attention(x, wq, wp, rotary_pos_emb=freqs, qkv_bias=bq, proj_bias=bp, **kw)


def _shard_refusal_call(r: Refusal, rank, grp):
    c, f, p = r.case, r.fault, r.p
    s = c.tokens * p
    if f == "dual_chunk_not_divisible":
        return shard_sequence(torch.zeros(2 * s + (r.extra % (2 * p) or 1), 1), rank, p,
                              layout="dual_chunk")
    if f == "contiguous_not_divisible":
        return shard_sequence(torch.zeros(s + (r.extra % p or 1), 1), rank, p, layout="contiguous")
    return shard_sequence(torch.zeros(2 * s, 1), p + r.extra - 1, p, layout=c.layout)


def _gpt_refusal_size(r: Refusal) -> GPTSize:
    c, p = r.case, r.p
    size = c.size()
    if r.fault == "seq_length":
        return GPTSize(**{**size.__dict__,
                          "seq_length": size.seq_length + (r.extra % (2 * p) or 1)})
    if r.fault == "query_groups":
        g = size.num_query_groups + (r.extra % p or 1)
        a = g * c.q_per_group
        return GPTSize(**{**size.__dict__, "num_query_groups": g, "num_attention_heads": a,
                          "hidden_size": a * c.head_dim})
    return GPTSize(**{**size.__dict__,
                      "ffn_hidden_size": size.ffn_hidden_size + (r.extra % p or 1)})


def _gpt_refusal_needle(r: Refusal) -> str:
    size = _gpt_refusal_size(r)
    if r.fault == "seq_length":
        return "--seq-length"
    if r.fault == "ffn":
        return "--ffn-hidden-size"
    return ("--num-attention-heads" if size.num_attention_heads % r.p else "--num-query-groups")


def _needle(r: Refusal) -> str:
    table = {"mlp": MLP_FAULTS, "ring": RING_FAULTS, "attn": ATTN_FAULTS, "shard": SHARD_FAULTS}
    return _gpt_refusal_needle(r) if r.op == "gpt" else table[r.op][r.fault]


def _refusal_rank(rank, p, cases):
    from megatron.core import parallel_state as ps

    calls = {"mlp": _mlp_refusal_call, "ring": _ring_refusal_call, "attn": _attn_refusal_call,
             "shard": _shard_refusal_call}
    out = []
    for r in cases:
        grp = _group(p, f"refuse-{r.op}-{r.fault}")
        try:
            if r.op == "gpt":
                try:
                    one_step_grads(rank, p, _gpt_refusal_size(r), Layout(metp=p))
                finally:
                    ps.destroy_model_parallel()
            else:
                calls[r.op](r, rank, grp)
            out.append(("accepted", None, grp.stats.steps))
        except ValueError as exc:
            out.append(("ValueError", str(exc), grp.stats.steps))
        except Exception as exc:  # noqa: BLE001 - anything but ValueError is a wrong refusal
            out.append((type(exc).__name__, str(exc), grp.stats.steps))
    return out


def check_refusals(cases):
    for p, cs in _by_size(cases).items():
        out = run_ranks(_refusal_rank, p, cs, timeout=120)
        for i, r in enumerate(cs):
            for rank, o in enumerate(out):
                kind, msg, steps = o[i]
                assert kind == "ValueError", (r, rank, kind, msg)
                assert _needle(r) in msg, (r, rank, _needle(r), msg)
                assert steps == 0, (r, rank, "sent before refusing", steps)


@_settings(default=5, full=120)
@given(cases=_per_size(refusal, min_size=2, max_size=6))
def test_refused_geometries_raise_value_error_naming_the_argument_before_any_transfer(cases):
    check_refusals(cases)


def _fixed_bases(p):
    """One geometry per op under which every fault of that op applies."""
    return {
        "mlp": MLPCase(p=p, tokens=2, batch=2, hidden=6, ffn_per_rank=2, activation="swiglu",
                       bias=True, keep_intermediate=False, pass_ffn=True, noncontig=False,
                       dtype="fp32", seed=0),
        "ring": RingCase(p=p, tokens=4, batch=1, kv_heads=2, q_per_kv=2, head_dim=4, causal=True,
                         layout="dual_chunk", kernel="reference", scale=None, noncontig=False,
                         dtype="fp32", seed=0),
        "attn": AttnCase(p=p, tokens=4, batch=1, hidden=8, groups_per_rank=1, q_per_group=2,
                         head_dim=4, causal=True, layout="dual_chunk", qkv_bias=True,
                         proj_bias=True, rope="full", kernel="reference", noncontig=False,
                         dtype="fp32", seed=0),
        "shard": RingCase(p=p, tokens=2, batch=1, kv_heads=1, q_per_kv=1, head_dim=2, causal=True,
                          layout="dual_chunk", kernel="reference", scale=None, noncontig=False,
                          dtype="fp32", seed=0),
        "gpt": GPTCase(p=p, groups_per_rank=1, q_per_group=2, head_dim=4, ffn_per_rank=2,
                       seq_chunks=1, vocab=24, swiglu=True, bias=True, normalization="LayerNorm",
                       position_embedding="rope"),
    }


@pytest.mark.parametrize("p", [2, 3])
def test_every_fault_kind_is_refused(p):
    """The fixed complement of the property test: each fault kind at least once per run."""
    cases = [Refusal(op, fault, base, extra)
             for op, base in _fixed_bases(p).items()
             for fault in _applicable(op, base) for extra in (1, p)]
    tables = {"mlp": MLP_FAULTS, "ring": RING_FAULTS, "attn": ATTN_FAULTS, "shard": SHARD_FAULTS,
              "gpt": GPT_FAULTS}
    assert {(r.op, r.fault) for r in cases} == {(op, f) for op, t in tables.items() for f in t}
    check_refusals(cases)


# ============================================================================== cross-rank mismatch

def _mismatched_rank(rank, p, what, check=False):
    """Rank 0 holds a different geometry than the others: the ops cannot see it locally. With
    ``check`` False the cross-rank agreement check (on by default) is switched off."""
    import faulthandler
    import time

    from megatron_metp.runtime import agree

    agree.enable_agreement_checks(check)
    faulthandler.disable()  # gloo aborts one rank on purpose: no Python fatal-error dump
    grp = METPGroup.from_process_group(dist.group.WORLD, name="mismatch", timeout_s=5.0)
    t0 = time.monotonic()
    try:
        if what == "tokens":  # ring attention, a different local sequence length on rank 0
            n = 4 if rank == 0 else 6
            q = torch.randn(n, 1, 2, 4, requires_grad=True)
            ring_attention(q, q, q, group=grp).sum().backward()
        else:  # METP MLP without ffn_hidden_size, FFN shards of different sizes
            f = 2 if rank == 0 else 3
            w1 = torch.randn(f, 8, requires_grad=True)
            metp_mlp(torch.randn(4, 1, 8), w1, torch.randn(8, f), group=grp).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("what", ["tokens", "ffn"])
def test_geometry_that_differs_between_ranks_ends_the_job_not_a_wrong_result(what, p):
    """With the agreement check switched off (``METP_CHECK_AGREEMENT=0``) shapes are checked per
    rank, not across ranks. A mismatch still ends the step (forward and backward): the rank that receives a larger message than it posted is aborted by gloo
    ("Received data size doesn't match"), and the others fail with the ring's error naming the
    group, step and peer. (A rank receiving a *smaller* message is not stopped by gloo: its forward
    can finish on a partly filled buffer; only its next exchange fails.)"""
    out = run_ranks(_mismatched_rank, p, what, allow_errors=True, timeout=60)
    assert any(o is None for o in out), out  # at least one rank was aborted
    finished = [o for o in out if o is not None]
    assert finished and all(kind == "RingPeerError" or kind == "RingTimeoutError"
                            for kind, _, _ in finished), out
    for _, msg, elapsed in finished:
        assert "'mismatch'" in msg and "step " in msg and "peer " in msg, msg
        assert elapsed < 5.0 + 3.0, elapsed


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("what", ["tokens", "ffn"])
def test_geometry_that_differs_between_ranks_is_refused_by_default(what, p):
    """The same mismatch with the default agreement check: every rank raises
    GroupDisagreementError naming the field before anything is sent; no rank is aborted."""
    out = run_ranks(_mismatched_rank, p, what, True, timeout=60)
    field = "k differs" if what == "tokens" else "fc1_weight differs"
    for rank, (kind, msg, elapsed) in enumerate(out):
        assert kind == "GroupDisagreementError" and field in msg, out
        assert elapsed < 2.0, elapsed
        print(f"\n[fault] {what} differ between ranks (p={p}): rank {rank} {kind} after "
              f"{elapsed:.3f} s: {msg[:140]}")
