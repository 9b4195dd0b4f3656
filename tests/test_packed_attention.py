"""Packed sequences (``cu_seqlens``): ring and METP attention against a single-device reference
with a block-diagonal causal mask from the same full inputs/weights, the block plan against the
dense mask, skipped blocks, refusals.

fp32 tolerance ``1e-5`` (norm-wise relative error, outputs and every gradient), as for the plain
ops. The reference computes in fp64 by autograd; the masked scores are ``−inf`` outside
``doc(key) = doc(query) ∧ key ≤ query``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from megatron_metp import METPGroup
from megatron_metp.ops import metp_attention, ring_attention, shard_sequence
from megatron_metp.ops import attention_kernels, documents
from megatron_metp.ops.documents import (attention_work, block_pieces, check_cu_seqlens,
                                         document_ids, document_positions, forward_steps,
                                         layout_positions, piece_mask, plan_counts,
                                         shard_documents, to_layout_order, unshard_documents,
                                         work_balance)
from tests.harness import run_ranks
from tests.megatron_ref import _rope, full_attention_params
from tests.numerics import rel_err
from tests.test_attention import _shard as shard_attention

B, D = 1, 4
#: ``METP_FULL_PROPERTIES=1``: fresh random examples, 12x as many (as tests/test_properties.py).
FULL = os.environ.get("METP_FULL_PROPERTIES", "") not in ("", "0")


def doc_mask(cu, s):
    """Dense ``[s, s]``: ``True`` where ``doc(key) = doc(query)`` and ``key ≤ query``."""
    pos = torch.arange(s)
    doc = document_ids(cu, pos)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def reference_packed(q, k, v, cu, dtype=torch.float64):
    """Single-device attention ``[s, b, h, d]`` with the block-diagonal causal mask."""
    s, b, hq, d = q.shape
    rep = hq // k.shape[2]
    qh = q.to(dtype).permute(1, 2, 0, 3)
    kh = k.to(dtype).permute(1, 2, 0, 3).repeat_interleave(rep, 1)
    vh = v.to(dtype).permute(1, 2, 0, 3).repeat_interleave(rep, 1)
    sc = (qh @ kh.transpose(-1, -2) / math.sqrt(d)).masked_fill(~doc_mask(cu, s), float("-inf"))
    return (sc.softmax(-1) @ vh).permute(2, 0, 1, 3)


def _qkv(s, hq, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, B, h, D, generator=g) for h in (hq, hkv, hkv, hq)]


# ---------------------------------------------------------------- documents.py, no ranks

def test_cu_seqlens_validation_names_the_argument():
    assert check_cu_seqlens([0, 3, 8], 8) == (0, 3, 8)
    assert check_cu_seqlens(torch.tensor([0, 8], dtype=torch.int32), 8) == (0, 8)
    bad = {"not increasing": ([0, 5, 3, 8], "strictly increasing"),
           "empty doc": ([0, 4, 4, 8], "strictly increasing"),
           "not ending at s": ([0, 4, 7], "end at the sequence length 8"),
           "not starting at 0": ([1, 4, 8], "start at 0"),
           "negative": ([0, -2, 8], "must not be negative"),
           "float list": ([0, 4.0, 8], "integers"),
           "float tensor": (torch.tensor([0.0, 8.0]), "integers"),
           "2-D": (torch.tensor([[0, 8]]), "1-D"),
           "bool": ([0, True, 8], "integers"),
           "one entry": ([8], "at least two"),
           "string": ("0,8", "list/tuple")}
    for name, (cu, needle) in bad.items():
        with pytest.raises(ValueError, match="cu_seqlens") as exc:
            check_cu_seqlens(cu, 8)
        assert needle in str(exc.value), (name, str(exc.value))


def _random_cu(rng, s, max_docs=6, unit=1):
    """Random boundaries of ``s`` tokens, every document a multiple of ``unit`` tokens."""
    m = s // unit
    k = rng.randint(0, min(max_docs, m - 1))
    return tuple(unit * c for c in [0] + sorted(rng.sample(range(1, m), k)) + [m])


LAYOUTS3 = ["dual_chunk", "contiguous", "balanced"]


@pytest.fixture
def small_chunks():
    """``balanced`` with own chunks from 1 token: at these tiny lengths every document of at
    least ``2p`` tokens is dual-chunked on its own, the rest pooled (forked ranks inherit it)."""
    before = documents.set_balanced_min_chunk(1)
    yield
    documents.set_balanced_min_chunk(before)


def test_block_plan_covers_exactly_the_document_mask(small_chunks):
    """Every block's pieces (masked or split per document) tile exactly the dense mask's
    visible pairs, once each; skipped blocks have none; the work and step counts agree."""
    rng = random.Random(0)
    for _ in range(150):
        p, layout = rng.randint(1, 4), rng.choice(LAYOUTS3)
        s = 2 * p * rng.randint(1, 5)
        n = s // p
        cu = _random_cu(rng, s, unit=rng.choice([1, 2 * p]) if layout == "balanced" else 1)
        full = doc_mask(cu, s)
        work, last = [0] * p, 0
        for r in range(p):
            qp = layout_positions(r, p, n, layout, cu)
            for j in range(p):
                m = full[qp][:, layout_positions(j, p, n, layout, cu)]
                for masks in (True, False):
                    got = torch.zeros(m.shape, dtype=torch.int)
                    for pc in block_pieces(cu, r, j, n, p, layout, masks):
                        a, b = pc.rows.stop - pc.rows.start, pc.keys.stop - pc.keys.start
                        assert not (pc.masked and not masks)
                        if pc.masked:
                            sub = piece_mask(pc).int()
                        else:
                            sub = torch.ones(a, b, dtype=torch.int)
                            if pc.causal:
                                assert a == b
                                sub = sub.tril()
                        got[pc.rows, pc.keys] += sub
                    assert torch.equal(got, m.int()), (cu, p, layout, r, j, masks)
                work[r] += int(m.sum())
                if m.any():
                    last = max(last, (r - j) % p)
        assert attention_work(cu, p, layout) == tuple(work)
        assert forward_steps(cu, n, p, layout) == last + 1
        pos = torch.arange(s)
        rank, idx = to_layout_order(pos, p, s, layout, cu)
        docpos = pos - torch.tensor(cu)[document_ids(cu, pos)]
        parts = [shard_documents(pos, cu, r, p, layout=layout) for r in range(p)]
        assert torch.equal(unshard_documents(parts, cu, layout=layout), pos)
        for r in range(p):
            lp = layout_positions(r, p, n, layout, cu)
            assert torch.equal(parts[r], lp)
            assert torch.equal(rank[lp], torch.full((n,), r)) and torch.equal(idx[lp],
                                                                              torch.arange(n))
            assert torch.equal(document_positions(cu, r, p, n, layout), docpos[lp])
            assert torch.equal(documents.local_document_ids(cu, r, p, n, layout),
                               document_ids(cu, pos)[lp])


def test_balanced_layout_balances_the_work(small_chunks):
    """Documents that are multiples of ``2p`` tokens: exactly equal work on every rank; the
    benchmark's mixes (default own-chunk minimum, 32K, p = 8): within 1.05 where
    ``dual_chunk`` is off by more than 1.2; one document: exactly ``dual_chunk``."""
    rng = random.Random(1)
    for _ in range(40):
        p = rng.randint(1, 8)
        cu = _random_cu(rng, 2 * p * rng.randint(1, 40), max_docs=12, unit=2 * p)
        assert work_balance(cu, p, "balanced") == 1.0, (cu, p)
    for p in (2, 3):
        assert documents.balanced_runs((0, 12 * p), 1, p) == \
            tuple(documents.rank_runs(1, p, 12, "dual_chunk"))
    documents.set_balanced_min_chunk(documents.BALANCED_MIN_CHUNK_DEFAULT)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import packed
    for seed in (0, 1, 3):
        cu = packed.draw_mix(32768, seed)
        assert work_balance(cu, 8, "balanced") <= 1.05 < 1.2 < work_balance(cu, 8, "dual_chunk")


def test_one_document_plan_is_the_plain_causal_plan():
    for layout in ("dual_chunk", "contiguous"):
        one = plan_counts((0, 64), 4, layout)
        assert one["pairs"] == one["useful"] and one["steps"] == 4
        assert one["launches"] == ([4] * 4 if layout == "dual_chunk" else [1, 2, 3, 4])


# ---------------------------------------------------------------- ring attention parity

@contextlib.contextmanager
def _no_masks(kernel_name, on=True):
    """While on, ``kernel_name`` takes no mask: the plan then cuts the blocks into full/causal
    pieces per document, the path flash_attn and CUDA torch_flash take."""
    cls = attention_kernels._BY_NAME[kernel_name]
    before = cls.__dict__["takes_mask"]
    if on:
        cls.takes_mask = staticmethod(lambda q: False)
    try:
        yield
    finally:
        cls.takes_mask = before


def _ring_packed(rank, p, cases):
    res = []
    for case in cases:
        s, cu, layout, hq, hkv, kernel, split, seed = case
        q, k, v, go = _qkv(s, hq, hkv, seed)
        grp = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="pk")
        one = {}
        for key, c in (("packed", cu), ("plain", None)):
            if key == "plain" and len(cu) > 2:
                continue
            grp.stats.reset()
            lay = "dual_chunk" if key == "plain" and layout == "balanced" else layout
            ql, kl, vl = (shard_documents(t, cu, rank, p, layout=layout).requires_grad_()
                          for t in (q, k, v))
            with _no_masks(kernel, split):
                o = ring_attention(ql, kl, vl, group=grp, layout=lay, kernel=kernel,
                                   cu_seqlens=c)
                fwd, fwd_blocks = grp.stats.snapshot(), dict(grp.stats.blocks)
                o.backward(shard_documents(go, cu, rank, p, layout=layout))
            one[key] = {"o": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                        "fwd": fwd, "fwd_blocks": fwd_blocks, "blocks": dict(grp.stats.blocks)}
        res.append(one)
    return res


def _gather(out, i, key, layout, cu):
    return {name: unshard_documents([o[i][key][name] for o in out], cu, layout=layout)
            for name in ("o", "dq", "dk", "dv")}


def _check_launches(out, cases):
    """Each rank launched exactly the plan's pieces, forward and again backward."""
    for i, (s, cu, layout, hq, hkv, kernel, split, seed) in enumerate(cases):
        counts = plan_counts(cu, len(out), layout, masks=not split)
        for r, o in enumerate(out):
            assert o[i]["packed"]["fwd_blocks"] == {kernel: counts["launches"][r]}, cases[i]
            assert o[i]["packed"]["blocks"] == {kernel: 2 * counts["launches"][r]}, cases[i]


def _ring_errors(out, cases, ref_cu=None):
    errs = []
    for i, (s, cu, layout, hq, hkv, kernel, split, seed) in enumerate(cases):
        q, k, v, go = (t.double().requires_grad_() for t in _qkv(s, hq, hkv, seed))
        ref = reference_packed(q, k, v, ref_cu or cu)
        ref.backward(go.detach())
        got = _gather(out, i, "packed", layout, cu)
        # documents one token long have dq = dk = 0 exactly (a constant softmax): measure the
        # kernels' rounding there against the op's gradient scale, ‖dv‖
        scale = v.grad.norm().item()
        errs.append({"o": rel_err(got["o"], ref), "dq": rel_err(got["dq"], q.grad, scale),
                     "dk": rel_err(got["dk"], k.grad, scale), "dv": rel_err(got["dv"], v.grad)})
    return errs


def _cases(p):
    """(s, cu_seqlens, layout, hq, hkv, kernel, split per document, seed)."""
    s = 8 * p  # chunks of 4 (dual_chunk), blocks of 8 (contiguous)
    c = s // (2 * p)
    out = []
    for li, layout in enumerate(("dual_chunk", "contiguous")):
        short = tuple(range(0, s, 3)) + (s,)                        # shorter than a chunk
        longer = (0, 1, s - 2, s)                                   # longer than a rank's share
        edges = tuple(range(0, s + 1, c))                           # exactly at chunk edges
        out += [(s, short, layout, 4, 2, "reference", False, 10 * li + 1),       # GQA
                (s, longer, layout, 2, 2, "torch_flash", False, 10 * li + 2),
                (s, edges, layout, 4, 1, "torch_flash", False, 10 * li + 3),     # MQA
                (s, short, layout, 4, 2, "torch_flash", True, 10 * li + 4),      # split
                (s, (0, s), layout, 2, 2, "torch_flash", False, 10 * li + 5)]    # one document
    u = 2 * p  # balanced (own chunks from 1 token): documents of >= 2p tokens on their own
    def cuts(*at):
        return (0,) + tuple(sorted({c for c in at if 0 < c < s})) + (s,)

    out += [(s, cuts(u, 3 * u), "balanced", 4, 2, "torch_flash", False, 31),
            (s, cuts(1, u + 3, 2 * u + 2, 3 * u), "balanced", 2, 1, "reference", False, 32),
            (s, cuts(u - 1, 3 * u + 1), "balanced", 2, 2, "torch_flash", True, 33),
            (s, (0, s), "balanced", 2, 2, "reference", False, 34)]       # = dual_chunk
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_ring_attention_packed_fp32_parity(p, small_chunks):
    cases = _cases(p)
    out = run_ranks(_ring_packed, p, cases)
    for case, errs in zip(cases, _ring_errors(out, cases)):
        assert max(errs.values()) <= 1e-5, (case, errs)
    _check_launches(out, cases)
    for i, case in enumerate(cases):
        if len(case[1]) == 2:  # one document: equal to plain causal, same blocks and traffic
            packed = _gather(out, i, "packed", case[2], case[1])
            plain = _gather(out, i, "plain", case[2], case[1])
            for name in packed:
                assert rel_err(packed[name], plain[name]) <= 1e-6, (case, name)
            for o in out:
                assert o[i]["packed"]["fwd"] == o[i]["plain"]["fwd"]
                assert o[i]["packed"]["blocks"] == o[i]["plain"]["blocks"]


def test_negative_control_a_boundary_off_by_one_does_not_match():
    p, s = 2, 16
    cases = [(s, (0, 5, 11, s), "dual_chunk", 2, 2, "reference", False, 7)]
    out = run_ranks(_ring_packed, p, cases)
    assert max(_ring_errors(out, cases)[0].values()) <= 1e-5
    errs = _ring_errors(out, cases, ref_cu=(0, 6, 11, s))[0]
    assert errs["o"] > 1e-2 and errs["dk"] > 1e-2, errs


# ---------------------------------------------------------------- property: random mixes

def _mixes(p, seed, count):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        layout = rng.choice(LAYOUTS3)
        s = 2 * p * rng.randint(1, 4)
        hkv = rng.choice([1, 2])
        cu = _random_cu(rng, s, max_docs=8)
        out.append((s, cu, layout, hkv * rng.choice([1, 2]), hkv,
                    rng.choice(["reference", "torch_flash"]), rng.random() < 0.3, seed + i))
    return out


@settings(max_examples=24 if FULL else 2, deadline=None, derandomize=not FULL,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10 ** 6))
def test_random_document_mixes_match_the_reference(seed):
    before = documents.set_balanced_min_chunk(1)
    try:
        _random_mixes(seed)
    finally:
        documents.set_balanced_min_chunk(before)


def _random_mixes(seed):
    """One example is a batch of random mixes (lengths, boundaries, layout, GQA, kernel) for
    each group size, one ``run_ranks`` call per size."""
    for p in (2, 3, 4):
        cases = _mixes(p, seed + p, 4)
        out = run_ranks(_ring_packed, p, cases)
        for case, errs in zip(cases, _ring_errors(out, cases)):
            assert max(errs.values()) <= 1e-5, (p, case, errs)
        _check_launches(out, cases)


# ---------------------------------------------------------------- skipping

def _skip_rank(rank, p, s, cu):
    q, k, v, go = _qkv(s, 2, 2, 0)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="skip")
    ql, kl, vl = (shard_sequence(t, rank, p, layout="contiguous").clone().requires_grad_()
                  for t in (q, k, v))
    o = ring_attention(ql, kl, vl, group=grp, layout="contiguous", kernel="reference",
                       cu_seqlens=cu)
    fwd = (grp.stats.snapshot(), dict(grp.stats.blocks))
    o.backward(shard_sequence(go, rank, p, layout="contiguous"))
    return fwd, dict(grp.stats.blocks)


def test_skipped_blocks_launch_no_kernel_and_unneeded_steps_are_not_sent():
    """Documents inside each rank's block (contiguous): only the diagonal blocks run (ranks 0
    and 2 hold two documents each: two causal pieces, as one masked box would be 3x and 2.4x
    their pairs), and the forward ring sends nothing (one step); with documents crossing each
    rank boundary, the blocks they cross run too and the forward needs two steps."""
    p, s = 4, 32
    within = (0, 3, 8, 16, 20, 24, 32)
    assert all(block_pieces(within, r, j, 8, p, "contiguous") == ()
               for r in range(p) for j in range(p) if j != r)
    assert [len(block_pieces(within, r, r, 8, p, "contiguous")) for r in range(p)] == [2, 1, 2, 1]
    for r, ((fwd, blocks_fwd), blocks) in enumerate(run_ranks(_skip_rank, p, s, within)):
        assert fwd["steps"] == 0 and fwd["bytes_sent"] == 0
        launches = [2, 1, 2, 1][r]
        assert blocks_fwd == {"reference": launches} and blocks == {"reference": 2 * launches}
    crossing = (0, 12, 20, 32)
    counts = plan_counts(crossing, p, "contiguous")
    res = run_ranks(_skip_rank, p, s, crossing)
    for r, ((fwd, blocks_fwd), blocks) in enumerate(res):
        assert fwd["steps"] == counts["steps"] - 1 == 1
        assert blocks_fwd == {"reference": counts["launches"][r]}
        assert blocks == {"reference": 2 * counts["launches"][r]}
    assert counts["launches"] == [1, 3, 3, 2]  # diagonal pieces per document + the crossing


# ---------------------------------------------------------------- refusals

def _bad_rank(rank, p):
    grp = METPGroup.from_process_group(dist.group.WORLD, name="bad")
    x = torch.zeros(4, 1, 2, 4)
    msgs = {}
    for name, cu in {"not_increasing": [0, 5, 3, 8], "not_ending_at_s": [0, 4, 6],
                     "negative": [0, -1, 8], "float": [0.0, 4.0, 8.0],
                     "float_tensor": torch.tensor([0.0, 8.0])}.items():
        try:
            ring_attention(x, x, x, group=grp, cu_seqlens=cu)
            msgs[name] = None
        except ValueError as exc:
            msgs[name] = str(exc)
    for name, kw in {"not_causal": dict(causal=False, cu_seqlens=[0, 8]),
                     "balanced_no_cu": dict(layout="balanced")}.items():
        try:
            ring_attention(x, x, x, group=grp, **kw)
            msgs[name] = None
        except ValueError as exc:
            msgs[name] = str(exc)
    return msgs, grp.stats.steps


def test_bad_boundaries_are_refused_on_every_rank_before_any_transfer():
    for msgs, steps in run_ranks(_bad_rank, 2, timeout=60):
        assert steps == 0
        assert all(m is not None and "cu_seqlens" in m for m in msgs.values()), msgs
        assert "strictly increasing" in msgs["not_increasing"]
        assert "layout='balanced'" in msgs["balanced_no_cu"]
        assert "end at the sequence length 8" in msgs["not_ending_at_s"]
        assert "causal=True" in msgs["not_causal"]


# ---------------------------------------------------------------- METP attention

S_ATT, H_ATT = 16, 8


def reference_packed_self_attention(full, cu, A, G):
    """Single-device self-attention (fp64, autograd) with the block-diagonal causal mask and
    RoPE positions restarting per document: ``freqs[x − c_doc(x)]``."""
    leaf = {k: None if full[k] is None else full[k].double().requires_grad_()
            for k in ("x", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias")}
    s, b, _ = leaf["x"].shape
    d = full["qkv_weight"].shape[0] // (A + 2 * G)
    npg = A // G
    qkv = torch.nn.functional.linear(leaf["x"], leaf["qkv_weight"], leaf["qkv_bias"])
    q, k, v = torch.split(qkv.view(s, b, G, (npg + 2) * d), [npg * d, d, d], dim=-1)
    q = q.reshape(s, b, A, d)
    if full["rotary_pos_emb"] is not None:
        pos = torch.arange(s)
        freqs = full["rotary_pos_emb"].double()[pos - torch.tensor(cu)[document_ids(cu, pos)]]
        q, k = _rope(q, freqs), _rope(k, freqs)
    ctx = reference_packed(q, k, v, cu).reshape(s, b, A * d)
    y = torch.nn.functional.linear(ctx, leaf["proj_weight"], leaf["proj_bias"])
    y.backward(full["gy"].double())
    return {"y": y.detach(), **{"d" + k: None if t is None else t.grad for k, t in leaf.items()}}


def _metp_packed(rank, p, cases):
    res = []
    for A, G, layout, rope, kernel, cu, seed, kb in cases:
        full = full_attention_params(S_ATT, B, H_ATT, A, G, D, rope=rope, seed=seed)
        params = {k: None if v is None else v.clone().requires_grad_()
                  for k, v in shard_attention(full, rank, p, A, G, D).items()}
        x = shard_documents(full["x"], cu, rank, p, layout=layout).requires_grad_()
        grp = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="mp")
        y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=grp,
                           num_heads=A, num_query_groups=G, layout=layout,
                           rotary_pos_emb=full["rotary_pos_emb"], qkv_bias=params["qkv_bias"],
                           proj_bias=params["proj_bias"], kernel=kernel, cu_seqlens=cu,
                           head_block=kb if p % kb == 0 else 1)
        y.backward(shard_documents(full["gy"], cu, rank, p, layout=layout))
        res.append({"y": y.detach(), "dx": x.grad,
                    **{"d" + k: None if v is None else v.grad for k, v in params.items()}})
    return res


METP_CASES = [  # (A, G, layout, rope, kernel, cu_seqlens, seed, head_block)
    (4, 4, "dual_chunk", True, "torch_flash", (0, 3, 9, 16), 1, 1),
    (8, 4, "contiguous", True, "reference", (0, 8, 11, 16), 2, 1),     # GQA, boundary at a block
    (4, 4, "dual_chunk", False, "reference", (0, 16), 3, 1),           # one document
    (4, 4, "balanced", True, "torch_flash", (0, 9, 16), 4, 1),         # balanced layout
    (4, 4, "dual_chunk", True, "torch_flash", (0, 2, 7, 16), 5, 2),    # head blocks of 2
]


@pytest.mark.parametrize("p", [1, 2, 4])
def test_metp_attention_packed_fp32_parity_with_per_document_rope(p, small_chunks):
    out = run_ranks(_metp_packed, p, METP_CASES)
    for i, (A, G, layout, rope, kernel, cu, seed, kb) in enumerate(METP_CASES):
        full = full_attention_params(S_ATT, B, H_ATT, A, G, D, rope=rope, seed=seed)
        ref = reference_packed_self_attention(full, cu, A, G)
        rs = [o[i] for o in out]
        got = {"y": unshard_documents([r["y"] for r in rs], cu, layout=layout),
               "dx": unshard_documents([r["dx"] for r in rs], cu, layout=layout)}
        errs = {k: rel_err(got[k], ref[k]) for k in got}
        rows = (G // p) * (A // G + 2) * D
        cols = (A // p) * D
        dwq = torch.cat([r["dqkv_weight"] for r in rs])
        dbq = torch.cat([r["dqkv_bias"] for r in rs])
        dwo = torch.cat([r["dproj_weight"] for r in rs], dim=1)
        dbo = sum(r["dproj_bias"] for r in rs)
        assert dwq.shape[0] == p * rows and dwo.shape[1] == p * cols
        errs.update(dqkv_w=rel_err(dwq, ref["dqkv_weight"]), dqkv_b=rel_err(dbq, ref["dqkv_bias"]),
                    dproj_w=rel_err(dwo, ref["dproj_weight"]), dproj_b=rel_err(dbo, ref["dproj_bias"]))
        assert max(errs.values()) <= 1e-5, (METP_CASES[i], errs)


def _local_rope_rank(rank, p):
    full = full_attention_params(S_ATT, B, H_ATT, 4, 4, D, rope=True, seed=0)
    params = shard_attention(full, rank, p, 4, 4, D)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="lr")
    try:
        metp_attention(shard_sequence(full["x"], rank, p), params["qkv_weight"],
                       params["proj_weight"], group=grp, num_heads=4, num_query_groups=4,
                       rotary_pos_emb=shard_sequence(full["rotary_pos_emb"], rank, p),
                       cu_seqlens=(0, 5, S_ATT))
    except ValueError as exc:
        return str(exc), grp.stats.steps
    return None, grp.stats.steps


def test_per_rank_rope_slice_with_cu_seqlens_is_refused():
    for msg, steps in run_ranks(_local_rope_rank, 2):
        assert msg is not None and "whole-sequence table" in msg and steps == 0


def _per_document_rope_rank(rank, p):
    from megatron_metp.ops.documents import document_positions

    full = full_attention_params(S_ATT, B, H_ATT, 4, 4, D, rope=True, seed=3)
    cu = (0, 5, 11, S_ATT)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="pd")
    n = S_ATT // p
    angles = full["rotary_pos_emb"].index_select(0, document_positions(cu, rank, p, n,
                                                                       "dual_chunk"))
    outs = []
    for rope, per_doc in ((full["rotary_pos_emb"], False), (angles, True)):
        params = {k: None if v is None else v.clone().requires_grad_()
                  for k, v in shard_attention(full, rank, p, 4, 4, D).items()}
        x = shard_documents(full["x"], cu, rank, p).requires_grad_()
        y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=grp,
                           num_heads=4, num_query_groups=4, rotary_pos_emb=rope,
                           qkv_bias=params["qkv_bias"], cu_seqlens=cu,
                           rope_per_document=per_doc)
        y.backward(shard_documents(full["gy"], cu, rank, p))
        outs.append((y.detach(), x.grad, params["qkv_weight"].grad))
    errors = []
    for kwargs in (dict(rope_per_document=True),  # no cu_seqlens
                   dict(rope_per_document=True, cu_seqlens=cu, rope=full["rotary_pos_emb"])):
        rope = kwargs.pop("rope", angles)
        shard = shard_attention(full, rank, p, 4, 4, D)
        try:
            metp_attention(shard_documents(full["x"], cu, rank, p), shard["qkv_weight"],
                           shard["proj_weight"], group=grp, num_heads=4, num_query_groups=4,
                           rotary_pos_emb=rope, **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    return outs, errors


def test_per_document_angles_given_once_equal_the_per_call_selection():
    """``rope_per_document=True`` (Megatron's packed path computes the angles once per
    micro-batch) gives bit-identical outputs and gradients to selecting them from the whole
    table in the op; without cu_seqlens or with the whole table it is refused."""
    for (a, b), errors in run_ranks(_per_document_rope_rank, 2):
        for t, u in zip(a, b):
            assert torch.equal(t, u)
        assert len(errors) == 2 and "needs cu_seqlens" in errors[0] \
            and "per-document angles" in errors[1], errors


# ---------------------------------------------------------------- the benchmark

def _bench_rank(rank, p, cases):
    res = []
    for s, cu, layout in cases:
        q, k, v, go = _qkv(s, 2, 2, 0)
        grp = METPGroup.from_process_group(dist.group.WORLD, name="bench")
        ql, kl, vl = (shard_sequence(t, rank, p, layout=layout).clone().requires_grad_()
                      for t in (q, k, v))
        o = ring_attention(ql, kl, vl, group=grp, layout=layout, kernel="torch_flash",
                           cu_seqlens=cu)
        fwd = grp.stats.snapshot()
        o.backward(shard_sequence(go, rank, p, layout=layout))
        res.append((fwd["bytes_sent"], grp.stats.bytes_sent - fwd["bytes_sent"],
                    dict(grp.stats.blocks)))
    return res


def test_packed_benchmark_quick_and_its_arithmetic_is_what_the_ranks_do(capsys):
    """``benchmarks/packed.py --quick`` prints its tables; its byte and launch arithmetic equals
    what forked ranks send and launch for the same plans (tiny shapes, fp32)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import packed

    balance, layer = packed.main(["--quick"])
    text = capsys.readouterr().out
    assert "| context | seed | docs | dual_chunk | contiguous |" in text and "launches" in text
    assert all(r["dual_chunk"] >= 1.0 for r in balance)
    full = [r for r in layer if r["mix"] == "full causal" and r["layout"] == "dual_chunk"][0]
    assert full["balance"] == 1.0 and full["fwd_steps"] == 4 and full["launches_masked"] == 4
    assert packed.draw_mix(2048, 1)[-1] == 2048

    p, s = 4, 32
    rng = random.Random(5)
    cases = [(s, _random_cu(rng, s, 5), lay) for lay in ("dual_chunk", "contiguous")
             for _ in range(2)] + [(s, (0, 3, 8, 16, 20, 24, 32), "contiguous")]
    res = run_ranks(_bench_rank, p, cases)
    for i, (s_, cu, layout) in enumerate(cases):
        kv = packed.kv_bytes(cu, p, layout, B, 2, D, 4)
        counts = plan_counts(cu, p, layout, masks=True)
        for r in range(p):
            fwd, bwd, blocks = res[r][i]
            assert (fwd, bwd) == (kv["fwd"], kv["bwd"]), (cu, layout, r)
            assert blocks == {"torch_flash": 2 * counts["launches"][r]}, (cu, layout, r)


# ---------------------------------------------------------------- GPU paths, bf16, head blocks

def test_cuda_kernels_get_per_document_pieces_without_a_mask():
    """No GPU here: with the CUDA branches selected (:func:`emulate_cuda`, the launch
    benchmark's mode) on fake tensors, the packed ring (p = 1) runs torch_flash's CUDA calling
    convention with full/causal pieces only (it takes no mask; a mask is refused) and the
    shapes come out."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.ops.attention_kernels import FlashAttnKernel, TorchFlashKernel
    from megatron_metp.ops.cuda_emulation import emulate_cuda
    from megatron_metp.ops.ring_attention import ring_attention_backward, ring_attention_forward

    cu = (0, 5, 6, 16, 32)
    grp = METPGroup.single("fake")
    undo = emulate_cuda(matmul=False)
    try:
        with FakeTensorMode():
            q = torch.empty(1, 4, 32, 8, dtype=torch.bfloat16)
            k = torch.empty(1, 2, 32, 8, dtype=torch.bfloat16)
            v = torch.empty(1, 2, 32, 8, dtype=torch.bfloat16)
            assert not TorchFlashKernel.takes_mask(q) and not FlashAttnKernel.takes_mask(q)
            out, lse = ring_attention_forward(q, k, v, grp, True, "dual_chunk", 0.3,
                                              TorchFlashKernel, cu_seqlens=cu)
            assert out.shape == q.shape and lse.shape == (1, 4, 32)
            dq, dk, dv = ring_attention_backward(out.to(q.dtype), q, k, v, out, lse, grp, True,
                                                 "dual_chunk", 0.3, TorchFlashKernel,
                                                 cu_seqlens=cu)
            assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
            with pytest.raises(ValueError, match="takes no attention mask"):
                TorchFlashKernel.forward(q, k, v, False, 0.3,
                                         mask=torch.ones(32, 32, dtype=torch.bool))
    finally:
        undo()
    pieces = block_pieces(cu, 0, 0, 32, 1, "dual_chunk", False)
    assert grp.stats.blocks == {"torch_flash": 2 * len(pieces)} and len(pieces) == 4


def _bf16_rank(rank, p, cu, layout):
    q, k, v, go = (t.to(torch.bfloat16) for t in _qkv(32, 4, 2, 9))
    grp = METPGroup.from_process_group(dist.group.WORLD, name="bf16")
    ql, kl, vl = (shard_documents(t, cu, rank, p, layout=layout).requires_grad_()
                  for t in (q, k, v))
    o = ring_attention(ql, kl, vl, group=grp, layout=layout, kernel="torch_flash", cu_seqlens=cu)
    o.backward(shard_documents(go, cu, rank, p, layout=layout))
    return o.detach(), ql.grad


@pytest.mark.parametrize("layout", ["dual_chunk", "balanced"])
def test_bf16_packed_is_finite_and_close(layout, small_chunks):
    """bf16 inputs (masked CPU flash kernel, rows without a visible key in many pieces): finite
    and within bf16 rounding of the fp64 reference from the same rounded inputs."""
    p, cu = 2, (0, 3, 4, 13, 30, 32)
    out = run_ranks(_bf16_rank, p, cu, layout)
    o = unshard_documents([r[0] for r in out], cu, layout=layout)
    dq = unshard_documents([r[1] for r in out], cu, layout=layout)
    q, k, v, go = (t.to(torch.bfloat16).double().requires_grad_() for t in _qkv(32, 4, 2, 9))
    ref = reference_packed(q, k, v, cu)
    ref.backward(go.detach())
    assert torch.isfinite(o).all() and torch.isfinite(dq).all()
    assert rel_err(o, ref) <= 2e-2 and rel_err(dq, q.grad) <= 3e-2
