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
from megatron_metp.ops.balance import kv_blocks as kv_blocks_of
from megatron_metp.ops.balance import query_tiles, tile_parts
from megatron_metp.ops.layer_attention import take_rows
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


def _back(pc, rows, keys):
    """A window piece's visible pairs in block coordinates (rows/keys: the window's ranges)."""
    def to_block(ranges, i):
        for r, off in tile_parts(ranges):
            if off <= i < off + r.stop - r.start:
                return r.start + i - off
        raise AssertionError(i)
    a, b, c, d, causal = pc.rows.start, pc.rows.stop, pc.keys.start, pc.keys.stop, pc.causal
    return {(to_block(rows, i), to_block(keys, k)) for (i, k) in _visible((a, b, c, d, causal))}


def test_window_pieces_of_several_ranges_keep_exactly_the_visible_pairs():
    """A window of several row ranges × several key ranges (a balanced query tile × a balanced
    key sub-block): each piece lies in one row range and one key range of the window's own
    tensors and the pieces hold exactly the block's visible pairs inside the window; a full
    block's pieces over a mirrored tile are one call (merged)."""
    n = 12
    blocks = [(0, n, 0, n, True), (0, n, 0, n // 2, False), (n // 2, n, 0, n, False)]
    rng = random.Random(1)
    for _ in range(60):
        a = rng.randrange(0, 5)
        b = a + rng.randrange(1, 6 - a + 1) if a < 6 else a + 1
        b = min(b, 6)
        rows = (slice(a, b), slice(n - b, n - a)) if b < 6 else (slice(a, n - a),)
        k0 = rng.randrange(0, 5)
        k1 = min(6, k0 + rng.randrange(1, 4))
        keys = (slice(k0, k1), slice(n - k1, n - k0)) if k1 < 6 else (slice(k0, n - k0),)
        for rect in blocks:
            pieces = (Piece(slice(rect[0], rect[1]), slice(rect[2], rect[3]), rect[4], False),)
            want = {(i, k) for (i, k) in _visible(rect)
                    if any(r.start <= i < r.stop for r in rows)
                    and any(r.start <= k < r.stop for r in keys)}
            got = []
            for pc in window_pieces(pieces, rows, keys, key_tile=rng.choice([None, 2, 3])):
                got.extend(_back(pc, rows, keys))
                assert not pc.causal or pc.rows.stop - pc.rows.start == \
                    pc.keys.stop - pc.keys.start
            assert len(got) == len(set(got)) and set(got) == want, (rect, rows, keys)
    full = (Piece(slice(0, n), slice(0, n // 2), False, False),)
    assert window_pieces(full, (slice(1, 3), slice(9, 11)), slice(0, n)) == \
        (Piece(slice(0, 4), slice(0, n // 2), False, False),)


# ---------------------------------------------------------------- the windowed ring

S, B, HQ, HK, D = 48, 1, 4, 2, 8


def _windowed_vs_whole(rank, world, layout, causal, kernel, cu, tiles, key_tile, perturb,
                       kv_blocks=1, balanced=False):
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
    if balanced:  # the streaming layer's cut: tuples of row ranges (mirrored in both chunks)
        q_tiles = query_tiles(n, size, layout, causal, packed=cu is not None)
        k_blocks = kv_blocks_of(n, ksize, layout, causal, packed=cu is not None)
        assert any(len(t) > 1 for t in q_tiles) == (layout == "dual_chunk" and causal)
    else:
        q_tiles = [(slice(r0, min(n, r0 + size)),) for r0 in range(0, n, size)]
        k_blocks = [(slice(k0, min(n, k0 + ksize)),) for k0 in range(0, n, ksize)]
    outs, lses, dqs = [torch.zeros_like(t) for t in (out, lse, dq)]
    dk_sum, dv_sum = torch.zeros_like(dk), torch.zeros_like(dv)
    for rows in q_tiles:
        if perturb and rows[0].start > 0:  # negative control: the tile's rows shifted by one
            rows_q = tuple(slice(r.start - 1, r.stop - 1) for r in rows)
        else:
            rows_q = rows
        parts, dq_t = [], 0
        for ks in k_blocks:
            kk, vv = take_rows(kh, ks, copy=True), take_rows(vh, ks, copy=True)
            win = dict(cu_seqlens=cu, q_rows=rows, key_tile=key_tile,
                       k_rows=ks if len(k_blocks) > 1 else None, block_rows=n)
            o_t, l_t = ring_attention_forward(take_rows(qh, rows_q, copy=True), kk, vv, g,
                                              causal, layout, scale, kern, **win)
            parts.append((o_t, l_t))
            dq_s, dk_t, dv_t = ring_attention_backward(
                take_rows(doh, rows, copy=True), take_rows(qh, rows, copy=True), kk, vv,
                take_rows(out, rows, copy=True).to(q.dtype), take_rows(lse, rows, copy=True),
                g, causal, layout, scale, kern, **win)
            dq_t = dq_t + dq_s
            for r, off in tile_parts(ks):
                dk_sum[:, :, r] += dk_t[:, :, off:off + r.stop - r.start]
                dv_sum[:, :, r] += dv_t[:, :, off:off + r.stop - r.start]
        l_all = torch.logsumexp(torch.stack([lt for _, lt in parts]), 0)
        o_all = sum(torch.exp(lt - l_all).nan_to_num().unsqueeze(-1) * ot for ot, lt in parts)
        for r, off in tile_parts(rows):
            rel = slice(off, off + r.stop - r.start)
            outs[:, :, r], lses[:, :, r], dqs[:, :, r] = o_all[:, :, rel], l_all[:, :, rel], \
                dq_t[:, :, rel]
    return (rel_err(outs, out), rel_err(lses, lse), rel_err(dqs, dq),
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


BALANCED = [  # (p, layout, causal, kernel, query tiles, key tile, K/V sub-blocks)
    (2, "dual_chunk", True, "torch_flash", 3, 5, 3),   # n = 24: tiles of 4+4 rows, 24 = 3·8
    (3, "dual_chunk", True, "reference", 3, 3, 2),     # n = 16: 3+3, 3+3, 2 (meets at c)
    (4, "dual_chunk", True, "torch_flash", 5, None, 1),
    (2, "contiguous", True, "reference", 3, 4, 2),     # contiguous cut kept
]


@pytest.mark.parametrize("p,layout,causal,kernel,tiles,key_tile,kv_blocks", BALANCED)
def test_balanced_tiles_ring_equals_the_whole_ring(p, layout, causal, kernel, tiles, key_tile,
                                                   kv_blocks):
    """Query tiles and key sub-blocks of two mirrored row ranges (:mod:`ops.balance`) give the
    whole ring's output, log-sum-exp and gradients."""
    for errs in run_ranks(_windowed_vs_whole, p, layout, causal, kernel, None, tiles, key_tile,
                          False, kv_blocks, True):
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
