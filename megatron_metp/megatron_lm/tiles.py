"""``--metp-mlp-token-tile``: Megatron-LM's flag for the METP MLP's token tiles
(:mod:`megatron_metp.ops.tiles`); ``--metp-moe-token-tiles``: the MoE layers' token tiles
(:mod:`megatron_metp.megatron.moe_tiles`, ``METP_MOE_TOKEN_TILES``; refused without
``--num-experts`` or METP, or below 1).

The flags reach the model as arguments of the layer spec (:func:`tile_kwargs`: the spec's
``mlp_token_tile`` / ``moe_token_tiles``, then :class:`~megatron_metp.megatron.modules.METPMLP`
and the ops): ``N`` token rows per tile, ``0`` whole; without the flag the override
``METP_MLP_TOKEN_TILE`` (if set) or the auto tile from ``METP_TILE_BUDGET_MIB`` apply
(:mod:`megatron_metp.runtime.overrides`). Refused before any rank starts work where no METP MLP
runs: without ``--metp-parallel-size`` > 1 and with ``--metp-disable-weight-ring`` (Megatron's
own MLP).
"""

from __future__ import annotations


def add_tile_args(group) -> None:
    group.add_argument(
        "--metp-mlp-token-tile", type=int, default=None, metavar="ROWS",
        help="Token rows (of this rank's s/p x micro-batch) per pass of the METP MLP's weight "
             "ring: the MLP's fp32 accumulators and one shard's intermediates are [ROWS, .] "
             "instead of [s/p, .], the weight ring goes round once per tile. 0: whole. "
             "Default: $METP_MLP_TOKEN_TILE, else auto (the most rows within "
             "$METP_TILE_BUDGET_MIB, 1024 MiB, of token-proportional transient; whole when "
             "the rank's tokens fit).")
    group.add_argument(
        "--metp-moe-token-tiles", type=int, default=None, metavar="TILES",
        help="Token tiles of every MoE layer's routed part (dispatch, experts, combine; the "
             "router runs once over all local tokens): only one tile's routed tokens are kept "
             "for backward. 1: whole. Default: $METP_MOE_TOKEN_TILES, else auto (the fewest "
             "tiles whose routed tokens fit $METP_TILE_BUDGET_MIB, 1024 MiB; one when they "
             "fit).")


def tile_arg_problems(args, metp_on: bool) -> list:
    """``--metp-mlp-token-tile`` given where it cannot work, each naming the flag and the
    alternative (empty when it is fine or not given)."""
    out = _moe_tile_problems(args, metp_on)
    rows = getattr(args, "metp_mlp_token_tile", None)
    if rows is None:
        return out
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


def _moe_tile_problems(args, metp_on: bool) -> list:
    tiles = getattr(args, "metp_moe_token_tiles", None)
    if tiles is None:
        return []
    if not getattr(args, "num_experts", None):
        return ["--metp-moe-token-tiles tiles MoE layers; it needs --num-experts (drop the flag)"]
    if not metp_on:
        return ["--metp-moe-token-tiles tiles the METP spec's MoE layers; it needs "
                "--metp-parallel-size > 1 (drop the flag, or set METP)"]
    if tiles < 1:
        return [f"--metp-moe-token-tiles must be >= 1 (token tiles per MoE layer, 1 = whole), "
                f"got {tiles}"]
    return []


def map_tile_args(args, metp_on: bool) -> None:
    """Check ``--metp-mlp-token-tile`` and ``--metp-moe-token-tiles`` (``ValueError`` naming the
    flag and the alternative); the values reach the model through :func:`tile_kwargs`."""
    problems = tile_arg_problems(args, metp_on)
    if problems:
        raise ValueError(problems[0])


def tile_kwargs(args) -> dict:
    """The layer spec's tile arguments from ``args``: ``mlp_token_tile`` (``--metp-mlp-token-tile``)
    and ``moe_token_tiles`` (``--metp-moe-token-tiles``), ``None`` where the flag is not given
    (the override, else auto). For :func:`~megatron_metp.megatron.spec.get_gpt_layer_metp_spec`
    / :func:`~megatron_metp.megatron.moe.get_gpt_decoder_block_metp_spec`."""
    return {"mlp_token_tile": getattr(args, "metp_mlp_token_tile", None),
            "moe_token_tiles": getattr(args, "metp_moe_token_tiles", None)}
