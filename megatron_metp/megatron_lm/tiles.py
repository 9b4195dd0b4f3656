"""``--metp-mlp-token-tile``: Megatron-LM's flag for the METP MLP's token tiles
(:mod:`megatron_metp.ops.tiles`).

The flag sets ``METP_MLP_TOKEN_TILE`` in every rank's environment during ``validate_args``
(every rank parses the same command line), which the METP MLP reads when it resolves its tiles:
``N`` token rows per tile, ``0`` whole; without the flag the variable (if set) or the auto tile
from ``METP_TILE_BUDGET_MIB`` apply. Refused before any rank starts work where no METP MLP
runs: without ``--metp-parallel-size`` > 1 and with ``--metp-disable-weight-ring`` (Megatron's
own MLP).
"""

from __future__ import annotations

import os

from ..ops import tiles as tiling


def add_tile_args(group) -> None:
    group.add_argument(
        "--metp-mlp-token-tile", type=int, default=None, metavar="ROWS",
        help="Token rows (of this rank's s/p x micro-batch) per pass of the METP MLP's weight "
             "ring: the MLP's fp32 accumulators and one shard's intermediates are [ROWS, .] "
             "instead of [s/p, .], the weight ring goes round once per tile. 0: whole. "
             "Default: $METP_MLP_TOKEN_TILE, else auto (the most rows within "
             "$METP_TILE_BUDGET_MIB, 1024 MiB, of token-proportional transient; whole when "
             "the rank's tokens fit).")


def tile_arg_problems(args, metp_on: bool) -> list:
    """``--metp-mlp-token-tile`` given where it cannot work, each naming the flag and the
    alternative (empty when it is fine or not given)."""
    rows = getattr(args, "metp_mlp_token_tile", None)
    if rows is None:
        return []
    if not metp_on:
        return ["--metp-mlp-token-tile tiles the METP MLP; it needs --metp-parallel-size > 1 "
                "(drop the flag, or set METP)"]
    if getattr(args, "metp_disable_weight_ring", False):
        return ["--metp-mlp-token-tile with --metp-disable-weight-ring: the ring self-attention "
                "baseline runs Megatron's own MLP, which has no token tiles; drop one of the "
                "flags"]
    if rows < 0:
        return [f"--metp-mlp-token-tile must be >= 0 (token rows per tile, 0 = whole), got "
                f"{rows}"]
    return []


def map_tile_args(args, metp_on: bool) -> None:
    """Check ``--metp-mlp-token-tile`` and hand it to the METP MLP (``ValueError`` naming the
    flag and the alternative)."""
    problems = tile_arg_problems(args, metp_on)
    if problems:
        raise ValueError(problems[0])
    rows = getattr(args, "metp_mlp_token_tile", None)
    if rows is not None:
        os.environ[tiling.MLP_TOKEN_TILE_ENV] = str(rows)
