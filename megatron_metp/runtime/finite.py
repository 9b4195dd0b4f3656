"""Optional NaN/Inf checks on what enters the METP ops, naming the layer and iteration.

Off by default (a check synchronises with the device). Switch on with ``METP_CHECK_FINITE=1`` or
:func:`enable_finite_checks`. When on, every METP op checks its inputs in forward and the incoming
gradient in backward, and raises :class:`NonFiniteError` such as::

    METP: non-finite values entering layer 3 self_attention (forward input x) at iteration 17:
    12 NaN, 0 Inf of 4096 elements

The training loop reports the iteration with :func:`set_iteration`; the Megatron modules pass
their layer number as the op's ``label``. The ops pass their group: every rank of it then raises
at once, naming the ranks that hold the non-finite values (switch the checks on for every rank,
as a rank with them off never joins the exchange).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import overrides

_enabled = overrides.raw("METP_CHECK_FINITE") not in (None, "0", "false", "False")
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


def _counts(tensors: dict):
    """``(name, NaN count, Inf count, numel)`` of the first non-finite tensor, or ``None``."""
    for name, t in tensors.items():
        if t is None or not t.is_floating_point():
            continue
        if bool(torch.isfinite(t).all()):
            continue
        return name, int(torch.isnan(t).sum()), int(torch.isinf(t).sum()), t.numel()
    return None


def check_finite(where: str, group=None, **tensors) -> None:
    """Raise :class:`NonFiniteError` if any given tensor holds NaN/Inf (no-op when checks are off).

    With ``group`` (the op's :class:`~megatron_metp.runtime.groups.METPGroup`, size > 1) the ranks
    exchange what they found (one small all-gather, bounded by the group's timeout) and *every*
    rank raises, naming the ranks whose values are not finite, before the op sends anything: a
    NaN on one rank ends its peers at once instead of after a ring timeout (or spreading into
    their gradients).
    """
    if not _enabled:
        return
    found = _counts(tensors)
    when = f" at iteration {_iteration}" if _iteration is not None else ""
    if group is None or group.size == 1:
        if found is not None:
            name, nan, inf, n = found
            raise NonFiniteError(f"METP: non-finite values entering {where} ({name}){when}: "
                                 f"{nan} NaN, {inf} Inf of {n} elements")
        return
    from .agree import all_gather_bounded

    names = list(tensors)
    mine = torch.tensor([-1, 0, 0, 0] if found is None else
                        [names.index(found[0]), found[1], found[2], found[3]], dtype=torch.int64)
    if "nccl" in (group.backend or ""):
        mine = mine.cuda()
    rows = [r.tolist() for r in all_gather_bounded(group, mine, "exchanging the finite check",
                                                     where)]
    bad = [(i, r) for i, r in enumerate(rows) if r[0] >= 0]
    if not bad:
        return
    parts = "; ".join(f"rank {i} (global {group.ranks[i]}): {names[r[0]]} has {r[1]} NaN, "
                      f"{r[2]} Inf of {r[3]} elements" for i, r in bad)
    raise NonFiniteError(f"METP: non-finite values entering {where}{when} on group "
                         f"{group.name!r}: {parts} (raised on every rank of the group; this is "
                         f"rank {group.rank})")
