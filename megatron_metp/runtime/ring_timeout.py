"""The one timeout of a METP job (seconds a ring step or a collective may wait before the op fails,
naming the rank): ``METP_RING_TIMEOUT_S`` or what the job recorded (torch-free: the launcher's
preflight checks the variable before any rank starts; the groups that apply it are in
:mod:`.groups` and :mod:`.watchdog`)."""

from __future__ import annotations

import math
from typing import Optional

from . import overrides

#: Default time a ring step may wait for its peer before the op fails with a message.
#: Overridable per group or with the ``METP_RING_TIMEOUT_S`` environment variable (seconds).
DEFAULT_RING_TIMEOUT_S = 600.0


def ring_timeout_from_env() -> float:
    """``METP_RING_TIMEOUT_S`` (seconds; default :data:`DEFAULT_RING_TIMEOUT_S`): a positive,
    finite number, else ``ValueError`` naming the variable."""
    raw = overrides.raw("METP_RING_TIMEOUT_S")
    if raw is None:
        return float(DEFAULT_RING_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"METP_RING_TIMEOUT_S={raw!r}: must be a positive, finite number of "
                         f"seconds (e.g. 600); unset it for the default "
                         f"{DEFAULT_RING_TIMEOUT_S:g}")
    return value


_job_timeout_s: Optional[float] = None


def set_job_timeout(seconds: Optional[float]) -> None:
    """Record the job timeout (``None``: back to ``METP_RING_TIMEOUT_S``)."""
    global _job_timeout_s
    _job_timeout_s = None if seconds is None else float(seconds)


def job_timeout_s() -> float:
    """The one timeout: what :func:`set_job_timeout` recorded, else ``METP_RING_TIMEOUT_S``
    (:mod:`.watchdog` applies it to the process groups and names the rank that stalled)."""
    return _job_timeout_s if _job_timeout_s is not None else ring_timeout_from_env()
