"""Windows of a ring-attention block (``ops/windows.py``) and the windowed ring (query tiles ×
key tiles) against the whole ring."""

import itertools
import random

import pytest
import torch

from megatron_metp import METPGroup
from megatron_metp.ops import select_kernel, shard_sequence
from megatron_metp.ops.ring_attention import (check_packed, ring_attention_backward,
                                              ring_attention_forward)
from megatron_metp.ops.windows import clip_rect, key_ranges, window_pieces
from megatron_metp.ops.documents import Piece, piece_mask
from tests.harness import run_ranks
from tests.numerics import rel_err


def _visible(rect):
    a, b, c, d, causal = rect
    return {(i, k) for i in range(a, b) for k in range(c, d) if not causal or k - c <= i - a}


def _pairs(rects):
    out = []
    for r in rects:
        out.extend(_visible(r))
    return out


def _naive_clip(rect, r0, r1, k0, k1):
    """Negative control: intersect the box and keep the causal flag (wrong once the window
    cuts the diagonal off-centre)."""
    a, b, c, d, causal = rect
    A, B, C, D = max(a, r0), min(b, r1), max(c, k0), min(d, k1)
    return [] if A >= B or C >= D else [(A, B, C, D, causal)]


def test_clip_rect_keeps_exactly_the_visible_pairs_of_the_window():
    rng = random.Random(0)
    wrong = 0
    for _ in range(400):
        causal = rng.random() < 0.7
        a, c = rng.randrange(0, 6), rng.randrange(0, 6)
        L = rng.randrange(1, 9)
        rect = (a, a + L, c, c + (L if causal else rng.randrange(1, 9)), causal)
        r0, k0 = rng.randrange(0, 12), rng.randrange(0, 12)
        r1, k1 = r0 + rng.randrange(1, 8), k0 + rng.randrange(1, 8)
        want = {(i, k) for (i, k) in _visible(rect) if r0 <= i < r1 and k0 <= k < k1}
        got = clip_rect(rect, r0, r1, k0, k1)
        pairs = _pairs(got)
        assert len(pairs) == len(set(pairs)), (rect, (r0, r1, k0, k1), got)  # no overlap
        assert set(pairs) == want, (rect, (r0, r1, k0, k1), got)
        for g in got:  # every causal piece is a square the kernels can take
            assert not g[4] or g[1] - g[0] == g[3] - g[2]
        wrong += set(_pairs(_naive_clip(rect, r0, r1, k0, k1))) != want
    assert wrong > 20  # the naive clip is caught


def test_key_ranges_and_window_pieces_cover_the_block():
    assert key_ranges(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert key_ranges(0, 10, None) == [(0, 10)]
    with pytest.raises(ValueError, match="key_tile"):
        key_ranges(0, 10, 0)
    n = 12
    pieces = (Piece(slice(0, n), slice(0, n), True, False),)
    whole = _visible((0, n, 0, n, True))
    got = set()
    for r0, r1 in ((0, 5), (5, 9), (9, 12)):
        for pc in window_pieces(pieces, slice(r0, r1), slice(0, n), key_tile=5):
            assert pc.keys.stop - pc.keys.start <= 5
            got |= {(i + r0, k) for (i, k) in
                    _visible((pc.rows.start, pc.rows.stop, pc.keys.start, pc.keys.stop,
                              pc.causal))}
    assert got == whole
    # a masked piece keeps its mask's pairs, window by window
    parts = ((0, 4, 0, 4, True), (4, 8, 2, 6, False))
    masked = Piece(slice(0, 8), slice(0, 6), False, True, parts)
    want = {(i, k) for i, k in itertools.product(range(8), range(6)) if
            piece_mask(masked)[i, k]}
    got = set()
    for r0, r1 in ((0, 3), (3, 8)):
        for pc in window_pieces((masked,), slice(r0, r1), slice(0, 6), key_tile=4):
            if pc.masked:
                m = piece_mask(pc)
                got |= {(pc.rows.start + i + r0, pc.keys.start + k)
                        for i, k in zip(*torch.nonzero(m, as_tuple=True))
                        for i, k in [(int(i), int(k))]}
            else:
                got |= {(i + r0, k) for (i, k) in _visible(
                    (pc.rows.start, pc.rows.stop, pc.keys.start, pc.keys.stop, pc.causal))}
    assert got == want


# ---------------------------------------------------------------- the windowed ring

S, B, HQ, HK, D = 48, 1, 4, 2, 8


def _windowed_vs_whole(rank, world, layout, causal, kernel, cu, tiles, key_tile, perturb,
                       kv_blocks=1):
    import torch.distributed as dist
    torch.manual_seed(0)
    g = METPGroup.from_process_group(dist.group.WORLD if world > 1 else None, name="win")
    q, k, v, do = (torch.randn(S, B, h, D, dtype=torch.float64) for h in (HQ, HK, HK, HQ))
    if layout == "balanced":
        from megatron_metp.ops.documents import shard_documents
        shard = lambda t: shard_documents(t, cu, rank, world, layout=layout)  # noqa: E731
    else:
        shard = lambda t: shard_sequence(t, rank, world, layout=layout)  # noqa: E731
    q, k, v, do = (shard(t).float() for t in (q, k, v, do))
    hf = lambda t: t.permute(1, 2, 0, 3).contiguous()  # noqa: E731
    qh, kh, vh, doh = hf(q), hf(k), hf(v), hf(do)
    kern = select_kernel(q.device, q.dtype, kernel)
    cu = check_packed(cu, S, causal, layout, world)
    scale = D ** -0.5
    out, lse = ring_attention_forward(qh, kh, vh, g, causal, layout, scale, kern, cu_seqlens=cu)
    dq, dk, dv = ring_attention_backward(doh, qh, kh, vh, out.to(q.dtype), lse, g, causal,
                                         layout, scale, kern, cu_seqlens=cu)
    n = qh.shape[2]
    size = -(-n // tiles)
    ksize = -(-n // kv_blocks)
    outs, lses, dqs = [], [], []
    dk_sum, dv_sum = torch.zeros_like(dk), torch.zeros_like(dv)
    for r0 in range(0, n, size):
        rows = slice(r0, min(n, r0 + size))
        if perturb and r0 > 0:  # negative control: the tile's rows shifted by one
            rows_q = slice(rows.start - 1, rows.stop - 1)
        else:
            rows_q = rows
        parts, dq_t = [], 0
        for k0 in range(0, n, ksize):
            ks = slice(k0, min(n, k0 + ksize))
            win = dict(cu_seqlens=cu, q_rows=rows, key_tile=key_tile,
                       k_rows=ks if kv_blocks > 1 else None, block_rows=n)
            o_t, l_t = ring_attention_forward(qh[:, :, rows_q], kh[:, :, ks].contiguous(),
                                              vh[:, :, ks].contiguous(), g, causal, layout,
                                              scale, kern, **win)
            parts.append((o_t, l_t))
            dq_s, dk_t, dv_t = ring_attention_backward(
                doh[:, :, rows], qh[:, :, rows], kh[:, :, ks].contiguous(),
                vh[:, :, ks].contiguous(), out[:, :, rows].to(q.dtype), lse[:, :, rows], g,
                causal, layout, scale, kern, **win)
            dq_t = dq_t + dq_s
            dk_sum[:, :, ks] += dk_t
            dv_sum[:, :, ks] += dv_t
        l_all = torch.logsumexp(torch.stack([lt for _, lt in parts]), 0)
        o_all = sum(torch.exp(lt - l_all).nan_to_num().unsqueeze(-1) * ot for ot, lt in parts)
        outs.append(o_all)
        lses.append(l_all)
        dqs.append(dq_t)
    cat = lambda xs: torch.cat(xs, 2)  # noqa: E731
    return (rel_err(cat(outs), out), rel_err(cat(lses), lse), rel_err(cat(dqs), dq),
            rel_err(dk_sum, dk), rel_err(dv_sum, dv))


CASES = [  # (p, layout, causal, kernel, cu_seqlens, query tiles, key tile, K/V sub-blocks)
    (1, "dual_chunk", True, "torch_flash", None, 3, 7, 1),
    (2, "dual_chunk", True, "torch_flash", None, 3, 5, 1),
    (2, "dual_chunk", True, "torch_flash", None, 3, None, 3),
    (3, "dual_chunk", True, "reference", None, 2, 3, 2),
    (3, "contiguous", True, "torch_flash", None, 4, None, 1),
    (2, "dual_chunk", False, "reference", None, 3, 4, 2),
    (2, "dual_chunk", True, "reference", (0, 10, 11, 30, 48), 3, 5, 2),
    (3, "balanced", True, "torch_flash", (0, 5, 40, 48), 2, 3, 1),
]


@pytest.mark.parametrize("p,layout,causal,kernel,cu,tiles,key_tile,kv_blocks", CASES)
def test_windowed_ring_equals_the_whole_ring(p, layout, causal, kernel, cu, tiles, key_tile,
                                             kv_blocks):
    for errs in run_ranks(_windowed_vs_whole, p, layout, causal, kernel, cu, tiles, key_tile,
                          False, kv_blocks):
        assert max(errs) <= 1e-6, errs


def test_windowed_ring_negative_control_shifted_rows():
    errs = run_ranks(_windowed_vs_whole, 2, "dual_chunk", True, "torch_flash", None, 3, 5,
                     True)
    assert all(max(e) > 1e-2 for e in errs), errs


def test_key_sub_block_needs_the_block_rows():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="block_rows"):
        ring_attention_forward(q, q[:, :1], q[:, :1], METPGroup.single(), True, "dual_chunk",
                               1.0, select_kernel(q.device, q.dtype), k_rows=slice(0, 4))
