"""Balanced row slices: how every tile loop of the ops cuts ``n`` rows (token tiles of the MLP
and the layer, :mod:`.tiles`; query tiles and key sub-blocks, :mod:`.balance`; MoE tiles)."""

from __future__ import annotations

import math
from typing import List

__all__ = ["tile_slices"]


def tile_slices(n_rows: int, rows: int) -> List[slice]:
    """Balanced tiles covering ``n_rows``: ``ceil(n/rows)`` slices of ``ceil(n/T)`` rows (one
    slice of everything when ``rows >= n_rows``; one empty slice for ``n_rows = 0``)."""
    if n_rows <= 0:
        return [slice(0, 0)]
    count = math.ceil(n_rows / max(1, rows))
    size = math.ceil(n_rows / count)
    return [slice(a, min(a + size, n_rows)) for a in range(0, n_rows, size)]
