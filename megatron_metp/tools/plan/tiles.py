"""Token tiles of the METP MLP in the plan (``ops/tiles.py``): the rows one pass of the weight
ring takes, so the MLP's transients are planned as the op allocates them.

Tile-outer with ``T`` tiles of ``R`` rows: the backward holds the whole ``dx`` output ``[n, h]``
(16-bit, filled tile by tile) and, per tile, the fp32 ``dx`` accumulator ``[R, h]`` and one
shard's ``z``, ``f(z)``, ``dz`` over ``R`` rows; the forward the whole output ``[n, h]`` and a
``[R, h]`` fp32 accumulator. The weight ring (and in backward the gradient sums) go round ``T``
times."""

from __future__ import annotations

from typing import Optional

from ...ops import tiles as tiling
from .model import BF16, FP32


def mlp_tile_rows(n: int, h: int, f: int, k: int, keep: bool,
                  token_tile: Optional[int] = None) -> int:
    """Rows per MLP tile for ``n`` rows (``n`` = whole) as the op resolves them: the job's
    ``token_tile`` (``Job.mlp_token_tile``, its ``--metp-mlp-token-tile``), else
    ``METP_MLP_TOKEN_TILE``, else the auto budget."""
    return tiling.resolve_rows(token_tile, n, tiling.mlp_row_bytes(h, f, k, BF16, FP32, keep),
                               arg="--metp-mlp-token-tile")


def mlp_tile_count(n: int, h: int, f: int, k: int, keep: bool,
                   token_tile: Optional[int] = None) -> int:
    """Passes of the MLP's weight ring per forward (and per backward)."""
    return len(tiling.tile_slices(n, mlp_tile_rows(n, h, f, k, keep, token_tile)))
