"""The K/V ring's per-step imbalance in the plan, from the op's own tile plan
(:mod:`megatron_metp.ops.balance`): a ring moves at its busiest rank each step, so attention on a
ring takes ``imbalance ×`` a balanced ring's time.

METP (streaming layer or whole blocks) runs one ring per query tile over ``R = p·c`` ranks; the
forward and the recompute carry whole K/V blocks, the backward ``kv``-row sub-blocks
(:class:`~megatron_metp.ops.tiles.LayerTiles`). Stock context parallelism (modes ``cp`` and
``ring``) runs whole dual-chunk blocks, one tile of everything: balanced by construction (the
same call says so, 1.0). Tensor parallelism has no ring (1.0).
"""

from __future__ import annotations

from typing import Dict


def query_tile_plan(n: int, q: int):
    """The query tiles the op cuts for ``n`` local tokens at ``q`` per tile
    (:func:`megatron_metp.ops.balance.query_tiles`; a test's negative control replaces it)."""
    from ...ops import balance

    return balance.query_tiles(n, q)


def ring_imbalance(n: int, ring: int, q: int, kv: int) -> Dict[str, float]:
    """``{"forward", "backward", "q_tiles", "kv_blocks", "empty_steps_forward",
    "empty_steps_backward"}`` (the last two: ring steps of all tiles where no rank has work) for ``n`` local tokens on a causal
    dual-chunk ring of ``ring`` ranks with query tiles of ``q`` and backward K/V sub-blocks of
    ``kv`` tokens (:func:`megatron_metp.ops.balance.ring_imbalance`)."""
    from ...ops import balance

    if ring <= 1:
        return {"forward": 1.0, "backward": 1.0, "q_tiles": 1, "kv_blocks": 1,
                "empty_steps_forward": 0, "empty_steps_backward": 0}
    tiles = query_tile_plan(n, q)
    blocks = balance.kv_blocks(n, kv)

    def empty(work):  # ring steps where no rank has work: the block only travels
        return sum(1 for steps in work for row in steps if max(row) == 0)

    return {"forward": balance.ring_imbalance(n, ring, tiles),
            "backward": balance.ring_imbalance(n, ring, tiles, kv_blocks=blocks),
            "q_tiles": len(tiles), "kv_blocks": len(blocks),
            "empty_steps_forward": empty(balance.tile_step_work(n, ring, tiles)),
            "empty_steps_backward": empty(balance.tile_step_work(n, ring, tiles,
                                                                 kv_blocks=blocks))}
