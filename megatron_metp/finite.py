"""Optional NaN/Inf checks on what enters the METP ops, naming the layer and iteration.

Off by default (a check synchronises with the device). Switch on with ``METP_CHECK_FINITE=1`` or
:func:`enable_finite_checks`. When on, every METP op checks its inputs in forward and the incoming
gradient in backward, and raises :class:`NonFiniteError` such as::

    METP: non-finite values entering layer 3 self_attention (forward input x) at iteration 17:
    12 NaN, 0 Inf of 4096 elements

The training loop reports the iteration with :func:`set_iteration`; the Megatron modules pass
their layer number as the op's ``label``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

_enabled = os.environ.get("METP_CHECK_FINITE", "0") not in ("", "0", "false", "False")
_iteration: Optional[int] = None


class NonFiniteError(FloatingPointError):
    """A NaN or Inf reached a METP op (only raised when checks are on)."""


def enable_finite_checks(on: bool = True) -> None:
    global _enabled
    _enabled = bool(on)


def finite_checks_enabled() -> bool:
    return _enabled


def set_iteration(iteration: Optional[int]) -> None:
    """Record the training iteration reported in error messages."""
    global _iteration
    _iteration = iteration


def check_finite(where: str, **tensors) -> None:
    """Raise :class:`NonFiniteError` if any given tensor holds NaN/Inf (no-op when checks are off)."""
    if not _enabled:
        return
    for name, t in tensors.items():
        if t is None or not t.is_floating_point():
            continue
        if bool(torch.isfinite(t).all()):
            continue
        nan = int(torch.isnan(t).sum())
        inf = int(torch.isinf(t).sum())
        when = f" at iteration {_iteration}" if _iteration is not None else ""
        raise NonFiniteError(f"METP: non-finite values entering {where} ({name}){when}: "
                             f"{nan} NaN, {inf} Inf of {t.numel()} elements")
