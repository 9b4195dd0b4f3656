"""``METP_STREAMING_LAYER``: whether full recompute of one METP layer per checkpoint runs the
streaming layer op (:mod:`megatron_metp.megatron.streaming`, default on). Kept apart from that
module so that the planner reads the same switch without importing megatron-core."""

from __future__ import annotations

import os

#: ``0`` keeps Megatron's checkpoint and the separate METP ops under full recompute
STREAMING_ENV = "METP_STREAMING_LAYER"


def streaming_enabled() -> bool:
    """The switch's value; ``ValueError`` naming the variable for anything but 0 or 1."""
    raw = os.environ.get(STREAMING_ENV, "").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"the environment variable {STREAMING_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"
