"""``METP_STREAMING_LAYER``: whether full recompute of one METP layer per checkpoint runs the
streaming layer op (:mod:`megatron_metp.megatron.streaming`, default on). Kept apart from that
module so that the planner reads the same switch without importing megatron-core."""

from __future__ import annotations

from ..runtime import overrides

#: ``0`` keeps Megatron's checkpoint and the separate METP ops under full recompute
STREAMING_ENV = "METP_STREAMING_LAYER"


def streaming_enabled() -> bool:
    """The switch's value; ``ValueError`` naming the variable for anything but 0 or 1."""
    return overrides.flag(STREAMING_ENV)
