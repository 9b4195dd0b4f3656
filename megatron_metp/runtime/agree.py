"""Check that every rank of a METP group calls an op with the same geometry and options.

The ops check each rank's arguments on their own; they cannot see that rank 0 holds 4 tokens and
rank 1 holds 6, or that one rank asked for ``swiglu`` and another for ``gelu``. Such a call used to
end half-way through the ring (gloo aborts one rank, the others get a ``RingPeerError``) or, when
the byte counts happen to match, compute a wrong result. With the check, the ranks exchange a
digest of each op call's shapes, dtypes and options over the group and every rank raises
:class:`GroupDisagreementError` (a ``ValueError``) before anything is sent, such as::

    METP: the ranks of group 'metp[tp=0,pp=0,dp=0]' called metp_attention 'layer 3
    self_attention' with different arguments. x differs: float32[4, 1, 8] on rank 0 (global 0);
    float32[6, 1, 8] on ranks 1, 2 (global 1, 2). Every rank of a METP group must call the same op
    with the same shapes, dtypes and options. This rank (1 of 3, global 1) has: causal=true, ...

A rank that refuses its own arguments (a local ``ValueError``) still takes part in an exchange,
so its peers fail at once naming it instead of waiting for a ring step that never comes.

**On by default, and cheap: when to exchange.** Exchanging at every call costs a collective per
op (on CUDA a host sync). Skipping the exchange for calls already checked ("cached") is only safe
if *every rank skips the same calls*: a rank that skips while a peer exchanges leaves the peer
waiting in the all-gather (and itself in the ring) until the timeout. A cache keyed by the local
digest cannot give that: when rank 0 calls with a signature it has checked before and rank 1 with
a new one — exactly the disagreement to catch — rank 0 would skip and rank 1 exchange. So the
decision depends on nothing local: each process group counts its METP op calls (every rank makes
the same calls in the same order, or the ring itself is already out of step) and the ranks
exchange at calls ``0 .. FIRST_CALLS-1`` and then at every ``EVERY``-th call, the same calls on
every rank. Nothing goes unchecked in between: every call's 16-byte digest is appended to a
window, and a scheduled exchange carries, besides the digest of its own call, the number of calls
since the previous exchange and a hash of their digests. If the windows differ, the ranks
exchange the windows (equal lengths on every rank), find the first call that differs and its
fields, and every rank raises :class:`GroupDisagreementError` naming that call, the number of
calls since, and the fields. So a disagreement on any of the first ``FIRST_CALLS`` calls of a
group (a whole first step of a small model; always a mismatch present from the start) is refused
before anything is sent; one that appears later is refused within ``EVERY`` calls, at the next
scheduled exchange — in between, a disagreement that moves the same bytes computes a wrong
result that the error then reports (differing byte counts end the ring step itself first, with
gloo's error or ``RingPeerError``), and :func:`check_pending` (which the project's checkpoint
save runs first) checks the calls since the last exchange at once. A local memo maps each call's arguments to their digest, so a
call between exchanges costs a tuple hash, a dictionary look-up and a 16-byte append.

Modes: ``METP_CHECK_AGREEMENT`` unset or ``1`` (the default, as above), ``every`` (exchange at
every call: every disagreement refused before anything is sent), ``0`` (off). Switch it the same
way on *every* rank of the job (:func:`enable_agreement_checks` in code): a rank with the check off
never joins an exchange, and its peers wait for it until the group's timeout. The exchange waits
at most ``group.timeout_s`` on gloo (then :class:`~megatron_metp.runtime.ring.RingTimeoutError` naming the
check); on NCCL the process group's own timeout applies. The fake process group of the dry runs
and launch counters exchanges nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch
import torch.distributed as dist

from . import overrides
from .bounded_wait import group_text, transport_failure, wait_bounded, wait_error
from .groups import METPGroup

def _mode_from_env() -> str:
    raw = (overrides.raw("METP_CHECK_AGREEMENT") or "").lower()
    if raw in ("", "1", "true", "on", "yes"):
        return "cached"
    if raw in ("0", "false", "off", "no"):
        return "off"
    if raw in ("every", "always", "all"):
        return "every"
    raise ValueError(f"METP_CHECK_AGREEMENT={raw!r}: use 1 (the default: exchange at the first "
                     f"calls of each group and every {EVERY}th), every (each call) or 0 (off)")


#: every call of a process group exchanges for its first FIRST_CALLS calls, then every EVERY-th
FIRST_CALLS = 8
EVERY = 64

_mode = _mode_from_env()
_enabled = _mode != "off"

#: int64 words of the exchanged record: the encoded fields' byte length, then the digest.
_DIGEST_WORDS = 8
_WINDOW_WORDS = 4  # hash of the window of digests since the last exchange
_CALL_DIGEST_BYTES = 16  # per call in the window
_REFUSED = "refused"  # field of a rank whose own arguments were refused locally
_MEMO_MAX = 512


class GroupDisagreementError(ValueError):
    """The ranks of a METP group called an op with different shapes, dtypes or options (only
    raised when agreement checks are on)."""


def enable_agreement_checks(on: bool = True, *, every: bool = False) -> None:
    """Switch the check on (the default schedule, or at ``every`` call) or off, in this process
    (do the same on every rank). Resets the call counters (on every rank alike)."""
    global _enabled, _mode
    _enabled = bool(on)
    _mode = "off" if not on else ("every" if every else "cached")
    _windows.clear()


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


#: the check exchanges (this module's and the NaN/Inf check's) posted by this process: calls and
#: bytes sent (ring convention, ``(p-1)·record``), so traffic reports can tell them apart
exchange_stats = {"calls": 0, "bytes_sent": 0}


def all_gather_bounded(group: METPGroup, t: torch.Tensor, what: str, label: str) -> list:
    """All-gather ``t`` over the group, waiting at most ``group.timeout_s`` on CPU; counted in
    :data:`exchange_stats` (this module's checks and :mod:`.finite`'s use it)."""
    g = group
    exchange_stats["calls"] += 1
    exchange_stats["bytes_sent"] += (g.size - 1) * t.numel() * t.element_size()
    outs = [torch.empty_like(t) for _ in range(g.size)]
    message = (lambda first: f"METP agreement check of {label} on group {g.name!r} "
               f"{group_text(g)}: {what} failed (timeout {g.timeout_s:g} s): {first}. A peer "
               f"rank died, stalled, is in another op, or runs with the check off "
               f"(METP_CHECK_AGREEMENT=0: switch it the same way on every rank).")
    try:
        work = dist.all_gather(outs, t, group=g.group, async_op=True)
    except Exception as exc:  # noqa: BLE001 - posting failed: named as a failed wait is
        if not transport_failure(exc):
            raise  # this rank's own error surfacing here (bounded_wait): not the peer's
        raise wait_error(exc, message) from exc
    wait_bounded([work], g, cuda=t.is_cuda, message=message)
    return [o.cpu() for o in outs]


#: the name this module's checks call it by (a test rebinds it to count their exchanges)
_all_gather = all_gather_bounded


class _Window:
    """Per process group: calls counted, and the digests of the calls since the last exchange."""

    __slots__ = ("calls", "first", "digests", "labels", "blobs", "memo", "skip")

    def __init__(self, skip: bool):
        self.calls = 0          # METP op calls on this group so far (the schedule's clock)
        self.first = 0          # index of the first call in ``digests``
        self.digests = bytearray()  # _CALL_DIGEST_BYTES per call since the last exchange
        self.labels: list = []  # the label of each of those calls (the callers' own strings)
        self.blobs: dict = {}   # digest -> encoded fields, for the calls in the window
        self.memo: dict = {}    # (label, fields key) -> (blob, record): no re-encoding
        self.skip = skip        # the fake backend: nothing to agree with

    def reset(self, calls: int) -> None:
        self.first = calls
        self.digests = bytearray()
        self.labels = []
        self.blobs = {}


_windows: dict = {}


def _window(group: METPGroup) -> _Window:
    w = _windows.get(group.group)
    if w is None:
        w = _windows[group.group] = _Window(skip=(group.backend or "") == "fake")
    return w


def _scheduled(n: int) -> bool:
    """Whether call ``n`` of a group exchanges: a function of ``n`` only, the same on every rank."""
    return _mode == "every" or n < FIRST_CALLS or n % EVERY == 0


_PLAIN = frozenset((bool, int, float, str, type(None), torch.dtype))


def _memo_key(label: str, fields: dict):
    key = [label]
    for k, v in fields.items():
        t = type(v)
        if t in _PLAIN:
            key.append((k, t, v))  # the type too: True and 1 are different keys, as in the digest
        elif isinstance(v, torch.Tensor):
            key.append((k, v.dtype, v.shape))
        else:
            key.append((k, _memo_item(v)))
    return tuple(key)


def _memo_item(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_memo_item(x) for x in v))
    try:
        hash(v)
    except TypeError:
        return ("repr", repr(v))
    return (type(v).__name__, v)  # True and 1 are different keys, as in the digest


def _encoded(w: _Window, label: str, fields: dict):
    """``(blob, record, window digest)`` of a call, from the memo when its arguments were seen
    before."""
    key = _memo_key(label, fields)
    hit = w.memo.get(key)
    if hit is None:
        blob = encode(fields)
        record = _record(blob)
        hit = (blob, record, _call_digest(record))
        if len(w.memo) >= _MEMO_MAX:
            w.memo.clear()
        w.memo[key] = hit
    return hit


def _call_digest(record: list) -> bytes:
    return b"".join(int(x).to_bytes(8, "little", signed=True) for x in record[1:3])


def check_group_agrees(group: METPGroup, label: str, /, **fields) -> None:
    """Raise :class:`GroupDisagreementError` on every rank unless all ranks of ``group`` passed
    equal ``fields`` (no-op when checks are off or ``group.size == 1``); see the module
    docstring for when the ranks exchange (the first calls of the group and every ``EVERY``-th,
    the window of calls in between checked with it).

    ``fields``: tensors (compared by shape and dtype), dtypes, strings, numbers, booleans, ``None``
    and tuples of these. ``label`` names the call (op and layer) in the message.
    """
    if not _enabled or group.size == 1:
        return
    _check_call(group, label, fields, force=False)


def check_pending(group: Optional[METPGroup], label: str = "before a checkpoint save") -> None:
    """Exchange now, on every rank of ``group`` together (a collective: call it at the same
    point on all of them): the calls since the group's last exchange are checked at once, so a
    disagreement that appeared between scheduled exchanges is refused (``GroupDisagreementError``
    on every rank, naming the call) before, e.g., a checkpoint publishes what it computed.
    No-op when checks are off, for ``None`` or a group of one."""
    if group is None or not _enabled or group.size == 1:
        return
    _check_call(group, label, {}, force=True)


def _check_call(group: METPGroup, label: str, fields: dict, force: bool) -> None:
    w = _window(group)
    if w.skip:
        return
    n = w.calls
    w.calls += 1
    blob, record, d = _encoded(w, label, fields)
    if not force and not _scheduled(n):
        w.digests += d
        w.labels.append(label)
        w.blobs.setdefault(d, blob)
        return
    try:
        _exchange(group, w, n, label, blob, record)
    except GroupDisagreementError:
        # every rank raises at this same call: all start the schedule over, alike
        w.calls = 0
        w.reset(0)
        raise


def _window_words(w: _Window) -> list:
    h = hashlib.blake2b(bytes(w.digests), digest_size=8 * _WINDOW_WORDS).digest()
    return [len(w.digests) // _CALL_DIGEST_BYTES] + [
        int.from_bytes(h[8 * i:8 * i + 8], "little", signed=True) for i in range(_WINDOW_WORDS)]


def _exchange(group: METPGroup, w: _Window, n: int, label: str, blob: bytes, record: list) -> None:
    """Call ``n`` is a scheduled one: exchange its record and the window's hash, raise on every
    rank if anything differs."""
    device = torch.device("cpu") if "nccl" not in (group.backend or "") else _device(group, {})
    mine = torch.tensor(record + _window_words(w), dtype=torch.int64, device=device)
    rows = [r.tolist() for r in _all_gather(group, mine, "exchanging the argument digest",
                                            label)]
    mine_rec = rows[group.rank]
    rest = 1 + _DIGEST_WORDS
    window_rows = [r[rest:] for r in rows]
    if all(r[:rest] == mine_rec[:rest] for r in rows) and \
            all(x == window_rows[0] for x in window_rows):
        w.reset(n + 1)
        return
    if any(r[:rest] != mine_rec[:rest] for r in rows):
        _raise_with_fields(group, label, blob, [r[0] for r in rows], device)
    counts = [x[0] for x in window_rows]
    if any(c != counts[0] for c in counts):
        raise GroupDisagreementError(
            f"METP: the ranks of group {group.name!r} made different numbers of METP op calls on "
            f"it since its last agreement check (call {w.first}): "
            f"{'; '.join(f'{c} on {_ranks_text(group, [i])}' for i, c in enumerate(counts))}. "
            f"Every rank of a METP group must make the same op calls in the same order.")
    # the windows differ: find the first call that differs, then exchange its fields
    win = torch.frombuffer(bytearray(w.digests), dtype=torch.uint8).to(device)
    wins = [bytes(x.tolist()) for x in _all_gather(group, win, "exchanging the window", label)]
    step = _CALL_DIGEST_BYTES
    first = next(i for i in range(counts[0])
                 if len({x[i * step:(i + 1) * step] for x in wins}) > 1)
    mine_label = w.labels[first]
    mine_blob = w.blobs[bytes(w.digests[first * step:(first + 1) * step])]
    at = w.first + first
    lens = [int(x[0]) for x in _all_gather(
        group, torch.tensor([len(mine_blob)], dtype=torch.int64, device=device),
        "exchanging the arguments' size", label)]
    what = (f"{mine_label} (call {at} of the METP ops on this group; found by the agreement "
            f"check at call {n}, {n - at} calls later: the calls in between may have computed "
            f"wrong results)")
    _raise_with_fields(group, what, mine_blob, lens, device)


def _raise_with_fields(group: METPGroup, label: str, blob: bytes, lens: list, device) -> None:
    """Every rank sends its encoded fields; raise the same diagnosis everywhere."""
    longest = max(lens)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    blobs = _all_gather(group, buf.to(device), "exchanging the arguments", label)
    per_rank = [bytes(b[:n].tolist()) for b, n in zip(blobs, lens)]
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

