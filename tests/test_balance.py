"""Balanced query tiles of the streaming layer (``ops/balance.py``): every rank's attention work
at every K/V ring step, counted from the op's own block plan, for the tiles the 4M, 6M and 16M
configs cut (tile sizes as ``metp plan`` resolves them); no ranks, pure arithmetic."""

import pytest

from megatron_metp.ops import balance

CONFIGS = [  # (config, ring ranks: METP × CP, local tokens)
    ("configs/llama3-8b-4m-metp8.sh", 8, 524288),
    ("configs/llama3-8b-6m-metp8.sh", 8, 786432),
    ("configs/llama3-8b-16m-metp8-cp4.sh", 32, 524288),
]


def _job_tiles(config):
    """``(n, ring, q, kv)``: local tokens, ring size, query tile and K/V sub-block sizes of a
    config, resolved as ``metp plan --config`` resolves them."""
    from megatron_metp.tools.cli import build_from_argv
    from megatron_metp.tools.plan import model as M
    from megatron_metp.tools.plan.streaming import layer_tiles

    model, job, _ = build_from_argv(["--config", config])
    lay = M.layout("metp", job)
    n = model.seq // lay.c * job.micro_batch
    tl = layer_tiles(model, job, lay, n)
    return n // job.micro_batch, lay.c, tl.q, tl.kv


@pytest.mark.parametrize("config,ring,local", CONFIGS)
def test_config_tiles_are_balanced_at_every_ring_step(config, ring, local):
    n, p, q, kv = _job_tiles(config)
    assert (p, n) == (ring, local)
    tiles = balance.query_tiles(n, q)
    assert len(tiles) > 1 and all(balance.tile_rows(t) <= q for t in tiles)
    blocks = balance.kv_blocks(n, kv)
    for kvb in (None, blocks):  # forward (whole blocks), backward (key sub-blocks)
        work = balance.tile_step_work(n, p, tiles, kv_blocks=kvb)
        assert len(work) == len(tiles) and len(work[0]) == p * (1 if kvb is None else len(kvb))
        for steps in work:
            for row in steps:
                assert len(row) == p
                mean = sum(row) / p
                assert max(row) <= 1.05 * mean, (config, row)
        assert balance.ring_imbalance(n, p, tiles, kv_blocks=kvb) <= 1.05
        # the work is all of it: the causal square of every rank's s = p·n tokens, per rank
        total = sum(sum(row) for steps in work for row in steps)
        assert total == (p * n) * (p * n + 1) // 2
    # negative control: the contiguous cut (each tile inside one chunk) under the same plan
    contiguous = balance.query_tiles(n, q, layout="contiguous")
    assert all(len(t) == 1 for t in contiguous)
    figs = balance.imbalance_figures(n, p, contiguous)
    assert figs["imbalance"] > 1.3 and figs["worst_step"] >= p - 0.5


def _global(i, r, n, p):
    """Global position of local row ``i`` of rank ``r`` under ``dual_chunk`` (chunks ``r`` and
    ``2p − 1 − r`` of ``2p``)."""
    c = n // 2
    return r * c + i if i < c else (2 * p - 1 - r) * c + (i - c)


@pytest.mark.parametrize("n,p,q,kv", [(12, 3, 4, None), (16, 4, 5, 6), (10, 2, 3, 4),
                                      (14, 3, 14, 5)])
def test_work_counts_every_visible_pair_of_the_definition(n, p, q, kv):
    """The analytic count (rectangles of the op's plan) against the visible pairs enumerated
    from global positions: ``key ≤ query``, for the balanced and the contiguous cut."""
    for layout in ("dual_chunk", "contiguous"):
        tiles = balance.query_tiles(n, q, layout=layout)
        blocks = balance.kv_blocks(n, kv, layout=layout)
        work = balance.tile_step_work(n, p, tiles, kv_blocks=blocks)
        for ti, tile in enumerate(tiles):
            rows = [i for rg in tile for i in range(rg.start, rg.stop)]
            for bi, block in enumerate(blocks):
                keys = [k for rg in block for k in range(rg.start, rg.stop)]
                for t in range(p):
                    for r in range(p):
                        j = (r - t) % p
                        want = sum(_global(k, j, n, p) <= _global(i, r, n, p)
                                   for i in rows for k in keys)
                        assert work[ti][bi * p + t][r] == want, (layout, ti, bi, t, r)


@pytest.mark.parametrize("n,q", [(12, 2), (12, 5), (14, 4), (16, 3), (8, 8), (1000, 37),
                                 (524288, 47662), (786432, 47662)])
def test_balanced_tiles_cover_the_rows_once_half_from_each_chunk(n, q):
    tiles = balance.query_tiles(n, q)
    rows = sorted(i for t in tiles for rg in t for i in range(rg.start, rg.stop))
    assert rows == list(range(n))
    c = n // 2
    for t in tiles:
        assert all(a.stop <= b.start for a, b in zip(t, t[1:]))  # increasing, disjoint
        first = sum(min(rg.stop, c) - min(rg.start, c) for rg in t)
        assert 2 * first == balance.tile_rows(t)  # as many rows of each chunk
        assert balance.tile_rows(t) <= max(q, 2)
    if q < n:
        assert len(tiles) == -(-c // max(1, q // 2))
        assert len(tiles[-1]) == 1  # the last tile's two ranges meet at c
    assert balance.imbalance_figures(n, 4, tiles)["worst_step"] == 1.0


def test_contiguous_cut_where_balance_does_not_apply():
    want = [(slice(0, 4),), (slice(4, 8),), (slice(8, 12),)]
    assert balance.query_tiles(12, 4, layout="contiguous") == want
    assert balance.query_tiles(12, 4, causal=False) == want
    assert balance.query_tiles(12, 4, packed=True) == want  # documents set the work
    assert balance.query_tiles(12, 12) == [(slice(0, 12),)]
    assert balance.kv_blocks(12, None) == [(slice(0, 12),)]
    # contiguous layout: every off-diagonal block is whole or absent whatever the cut
    for cut in ("contiguous", "dual_chunk"):
        tiles = balance.query_tiles(12, 4, layout=cut, causal=False)
        assert balance.ring_imbalance(12, 3, tiles, causal=False) == 1.0


def test_bad_tile_sizes_are_refused():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="q"):
            balance.query_tiles(12, bad)
    with pytest.raises(ValueError, match="ring"):
        balance.tile_step_work(12, 0, 4)
