"""``--metp-mlp-token-tile`` (defined with the other flags, :mod:`.flags`): Megatron-LM's flag
for the METP MLP's token tiles
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

from .settings_args import metp_settings


def tile_arg_problems(args, metp_on: bool) -> list:
    """``--metp-mlp-token-tile`` / ``--metp-moe-token-tiles`` given where they cannot work, each
    naming the flag and the alternative (empty when fine or not given): the settings' rule
    (:meth:`megatron_metp.megatron.settings.METPSettings.tile_problems`), with METP on or off as
    ``metp_on`` says."""
    settings = metp_settings(args)
    if metp_on and settings.mode == "tp":
        settings = settings.replace(mode="metp")
    elif not metp_on:
        settings = settings.replace(mode="tp")
    return settings.tile_problems(num_experts=getattr(args, "num_experts", None) or 0)


def map_tile_args(args, metp_on: bool) -> None:
    """Check ``--metp-mlp-token-tile`` and ``--metp-moe-token-tiles`` (``ValueError`` naming the
    flag and the alternative); the values reach the model through :func:`tile_kwargs`."""
    problems = tile_arg_problems(args, metp_on)
    if problems:
        raise ValueError(problems[0])


def tile_kwargs(args) -> dict:
    """The layer spec's tile arguments from ``args`` (``mlp_token_tile``: ``--metp-mlp-token-tile``,
    ``moe_token_tiles``: ``--metp-moe-token-tiles``; ``None`` where the flag is not given: the
    override, else auto), as the builder takes them from :func:`.settings_args.metp_settings`."""
    return metp_settings(args).tile_kwargs()
