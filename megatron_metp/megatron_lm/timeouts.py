"""The ring timeout under Megatron-LM, read from its flags.

Megatron-LM gives every process group ``--distributed-timeout-minutes`` (default 30); METP's
ring steps, the barriers :mod:`.last_seen` bounds and every op started inside ``train_step``
wait at most that, or a shorter ``--metp-ring-timeout`` / ``METP_RING_TIMEOUT_S``. The generic part (the one job timeout, naming
the rank that stalled) is :mod:`megatron_metp.runtime.watchdog`; only this module knows
Megatron-LM's flag.
"""

from __future__ import annotations

from ..runtime import overrides
from ..runtime.ring_timeout import ring_timeout_from_env

__all__ = ["megatron_lm_timeout_s"]


def megatron_lm_timeout_s(args) -> float:
    """The ring timeout under Megatron-LM: ``--distributed-timeout-minutes`` × 60 (Megatron's
    default 30 minutes), or a ``--metp-ring-timeout`` / ``METP_RING_TIMEOUT_S`` at most that;
    ``ValueError`` naming both settings when one is larger (contradictory)."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    minutes = 30 if minutes is None else minutes
    pg_s = float(minutes) * 60.0
    given = [("--metp-ring-timeout", getattr(args, "metp_ring_timeout", None))]
    if overrides.is_set("METP_RING_TIMEOUT_S"):
        given.append(("METP_RING_TIMEOUT_S", ring_timeout_from_env()))
    for name, value in given:
        if value is not None and value > pg_s:
            raise ValueError(
                f"{name} {value:g} s is longer than --distributed-timeout-minutes {minutes:g} "
                f"({pg_s:g} s): under Megatron-LM every process group waits at most "
                f"--distributed-timeout-minutes, so a ring step could never wait that long. Set "
                f"--distributed-timeout-minutes (the one timeout; the ring timeout defaults to "
                f"it) and drop {name}, or give {name} at most {pg_s:g}")
    for _, value in given:
        if value is not None:
            return float(value)
    return pg_s
