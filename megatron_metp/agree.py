"""Optional check that every rank of a METP group calls an op with the same geometry and options.

The ops check each rank's arguments on their own; they cannot see that rank 0 holds 4 tokens and
rank 1 holds 6, or that one rank asked for ``swiglu`` and another for ``gelu``. Such a call used to
end half-way through the ring (gloo aborts one rank, the others get a ``RingPeerError``) or, when
the byte counts happen to match, compute a wrong result. With the check on, every op first
exchanges a 72-byte digest of its shapes, dtypes and options over the group, and every rank raises
:class:`GroupDisagreementError` (a ``ValueError``) before anything is sent, such as::

    METP: the ranks of group 'metp[tp=0,pp=0,dp=0]' called metp_attention 'layer 3
    self_attention' with different arguments. x differs: float32[4, 1, 8] on rank 0 (global 0);
    float32[6, 1, 8] on ranks 1, 2 (global 1, 2). Every rank of a METP group must call the same op
    with the same shapes, dtypes and options. This rank (1 of 3, global 1) has: causal=true, ...

A rank that refuses its own arguments (a local ``ValueError``) still takes part in the exchange,
so its peers fail at once naming it instead of waiting for a ring step that never comes.

Off by default (the exchange is one small collective per op call, and on CUDA a host sync). Switch
it on with ``METP_CHECK_AGREEMENT=1`` or :func:`enable_agreement_checks` — on *every* rank of the
job: a rank with the check off never joins the exchange, and its peers wait for it until the
group's timeout. The exchange waits at most ``group.timeout_s`` on gloo (then
:class:`~megatron_metp.ring.RingTimeoutError`); on NCCL the process group's own timeout applies.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from .groups import METPGroup
from .ring import RingPeerError, RingTimeoutError

_enabled = os.environ.get("METP_CHECK_AGREEMENT", "0") not in ("", "0", "false", "False")

#: int64 words of the exchanged record: the encoded fields' byte length, then the digest.
_DIGEST_WORDS = 8
_REFUSED = "refused"  # field of a rank whose own arguments were refused locally


class GroupDisagreementError(ValueError):
    """The ranks of a METP group called an op with different shapes, dtypes or options (only
    raised when agreement checks are on)."""


def enable_agreement_checks(on: bool = True) -> None:
    global _enabled
    _enabled = bool(on)


def agreement_checks_enabled() -> bool:
    return _enabled


def op_label(op: str, label: str) -> str:
    """``metp_mlp 'layer 3 mlp'``, or just ``metp_mlp`` when the label is the op's default."""
    return op if label in (None, "", op) else f"{op} {label!r}"


def needs_grad(*tensors) -> bool:
    """Whether a call builds a backward: if one rank's does and another's does not, only some
    ranks would run the backward ring (an agreement field of the ops)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def describe(value):
    """A JSON-able, rank-independent description of one field: a tensor becomes
    ``"float32[4, 1, 8]"`` (its device is left out: each rank has its own GPU)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list, torch.Size)):
        return [describe(v) for v in value]
    return repr(value)


def encode(fields: dict) -> bytes:
    """Canonical encoding of the described fields (sorted keys, ASCII JSON)."""
    return json.dumps({k: describe(v) for k, v in fields.items()}, sort_keys=True,
                      separators=(",", ":")).encode("ascii")


def _record(blob: bytes) -> list:
    digest = hashlib.blake2b(blob, digest_size=8 * _DIGEST_WORDS).digest()
    words = [int.from_bytes(digest[8 * i:8 * i + 8], "little", signed=True)
             for i in range(_DIGEST_WORDS)]
    return [len(blob)] + words


def _device(group: METPGroup, fields: dict) -> torch.device:
    """Where the exchange runs: CPU for gloo; for NCCL a CUDA tensor's device (or the current)."""
    backend = group.backend or ""
    if "nccl" not in backend:
        return torch.device("cpu")
    for v in fields.values():
        if isinstance(v, torch.Tensor) and v.is_cuda:
            return v.device
    return torch.device("cuda", torch.cuda.current_device())


def _all_gather(group: METPGroup, t: torch.Tensor, what: str, label: str) -> list:
    """All-gather ``t`` over the group, waiting at most ``group.timeout_s`` on CPU."""
    g = group
    outs = [torch.empty_like(t) for _ in range(g.size)]
    try:
        work = dist.all_gather(outs, t, group=g.group, async_op=True)
        if t.is_cuda:
            work.wait()  # stream-ordered; the NCCL watchdog owns the timeout
        else:
            work.wait(g.timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised with the group and op named
        text = str(exc)
        kind = RingTimeoutError if "imed out" in text or "imeout" in text else RingPeerError
        raise kind(
            f"METP agreement check of {label} on group {g.name!r} (rank {g.rank} of {g.size}, "
            f"global ranks {list(g.ranks)}): {what} failed (timeout {g.timeout_s:g} s): "
            f"{text.splitlines()[0] if text else type(exc).__name__}. A peer rank died, stalled, "
            f"is in another op, or runs without METP_CHECK_AGREEMENT=1 (switch it on for every "
            f"rank).") from exc
    return [o.cpu() for o in outs]


def check_group_agrees(group: METPGroup, label: str, /, **fields) -> None:
    """Raise :class:`GroupDisagreementError` on every rank unless all ranks of ``group`` passed
    equal ``fields`` (no-op when checks are off or ``group.size == 1``).

    ``fields``: tensors (compared by shape and dtype), dtypes, strings, numbers, booleans, ``None``
    and tuples of these. ``label`` names the call (op and layer) in the message. Every rank takes
    part in the same one all-gather of a 72-byte record (the encoded fields' length and a 64-byte
    BLAKE2b digest), so the check cannot deadlock on a disagreement; only when the records differ
    do the ranks exchange the encoded fields themselves (a second all-gather, entered by every rank
    since all saw the same records) to name what differs.
    """
    if not _enabled or group.size == 1:
        return
    blob = encode(fields)
    device = _device(group, fields)
    mine = torch.tensor(_record(blob), dtype=torch.int64, device=device)
    records = [r.tolist() for r in _all_gather(group, mine, "exchanging the argument digest",
                                               label)]
    if all(r == records[0] for r in records):
        return
    longest = max(r[0] for r in records)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    blobs = _all_gather(group, buf.to(device), "exchanging the arguments", label)
    per_rank = [bytes(b[:r[0]].tolist()) for b, r in zip(blobs, records)]
    raise GroupDisagreementError(_message(group, label, [json.loads(b) for b in per_rank]))


def _ranks_text(group: METPGroup, idx: list) -> str:
    word = "rank" if len(idx) == 1 else "ranks"
    return (f"{word} {', '.join(map(str, idx))} "
            f"(global {', '.join(str(group.ranks[i]) for i in idx)})")


def _value_text(canonical: Optional[str]) -> str:
    """A field as the message shows it: strings bare, the rest as JSON, a missing one marked."""
    if canonical is None:
        return "<absent>"
    v = json.loads(canonical)
    return v if isinstance(v, str) else canonical


def _message(group: METPGroup, label: str, per_rank: list) -> str:
    """The same text on every rank: what differs and on which ranks, then this rank's fields."""
    g = group
    head = f"METP: the ranks of group {g.name!r} called {label} with different arguments. "
    refused = [i for i, f in enumerate(per_rank) if _REFUSED in f]
    if refused:
        body = "".join(f"{_ranks_text(g, [i])} refused its own arguments: "
                       f"{per_rank[i][_REFUSED]}. " for i in refused)
    else:
        # compare canonical JSON, not Python values (True == 1 in Python but not in the digest)
        canon = [{k: json.dumps(v, sort_keys=True) for k, v in f.items()} for f in per_rank]
        parts = []
        for k in sorted(set().union(*canon)):
            vals = [c.get(k) for c in canon]
            if all(v == vals[0] for v in vals) and vals[0] is not None:
                continue
            by_value: dict = {}  # value -> ranks holding it, in order of first appearance
            for i, v in enumerate(vals):
                by_value.setdefault(v, []).append(i)
            parts.append(f"{k} differs: " + "; ".join(
                f"{_value_text(v)} on {_ranks_text(g, idx)}" for v, idx in by_value.items()))
        body = "".join(f"{part}. " for part in parts)
    mine = per_rank[g.rank]
    have = ", ".join(f"{k}={_value_text(json.dumps(v))}" for k, v in sorted(mine.items()))
    return (head + body + "Every rank of a METP group must call the same op with the same shapes, "
            f"dtypes and options. This rank ({g.rank} of {g.size}, global {g.rank_global}) has: "
            f"{have}")


def refuse_together(group: METPGroup, label: str, error: ValueError) -> None:
    """Called by an op whose local checks raised ``error``: with checks on, join the exchange
    (with the refusal as the only field) so the peers fail at once naming this rank, instead of
    waiting for a ring step that never comes. The caller then raises ``error`` itself."""
    if not _enabled or group.size == 1:
        return
    try:
        check_group_agrees(group, label, **{_REFUSED: str(error)})
    except Exception:  # noqa: BLE001 - disagreement (the peers know) or a peer that never came:
        pass           # either way this rank reports its own error

