"""Which rows of a ring block attend to which: rank ``r``'s queries against rank ``j``'s keys
for the ``n`` local tokens of each rank, in the ``contiguous`` or the causal ``dual_chunk``
layout (two chunks of ``n/2`` tokens per rank). The ring attention
(:mod:`.ring_attention`), the packed documents' pieces (:mod:`.documents`: a block with no
document boundary is this plain block) and the tile balance (:mod:`.balance`) read the same plan.
"""

from __future__ import annotations


def block_plan(r: int, j: int, n: int, causal: bool, layout: str):
    """``(query rows, key rows, causal)`` of the block of rank ``r``'s queries against rank
    ``j``'s keys, as slices of the local ``n`` tokens, or ``None`` when fully masked."""
    every = slice(0, n)
    if not causal:
        return every, every, False
    if j == r:
        return every, every, True
    if layout == "contiguous":
        return (every, every, False) if j < r else None
    c = n // 2
    return (every, slice(0, c), False) if j < r else (slice(c, n), every, False)
