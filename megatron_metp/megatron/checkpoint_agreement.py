"""Every rank of a checkpoint save or load ends the same way: all succeed or all raise.

A rank that fails on its own (a file it cannot write, a shard whose checksum does not match)
must not leave its peers waiting in the next collective or, worse, continuing with a
checkpoint that is half written or half loaded. :func:`agree` is a bounded all-gather of a
small fixed-size record per rank (a failure flag, a few integers and the first bytes of the
failure's message) that each phase of :func:`~megatron_metp.megatron.checkpoint.save_checkpoint`
and :func:`~megatron_metp.megatron.checkpoint.load_checkpoint` ends with: if any rank failed,
every rank raises the same :class:`CheckpointError` naming the failing ranks and their reasons.

The wait is bounded by the job timeout (:mod:`megatron_metp.runtime.watchdog`: ``METP_RING_TIMEOUT_S``,
default 600 s, the timeout of every process group), or by ``METP_CHECKPOINT_TIMEOUT_S`` when that
is set lower (a larger one is refused: the process group would end the wait first); on NCCL the
process group's own timeout applies (the record travels on the current CUDA device). A peer that
died is reported at once on gloo (its sockets close). Either way the error names the ranks that
did not answer and where each was last seen (:func:`megatron_metp.runtime.watchdog.diagnose`). Each record carries a tag of its phase, so
a rank that timed out and moved on cannot be mistaken for a peer's answer in another phase.
After a timeout the process group is out of step: the job should end (torchrun ends the other
ranks when one exits with the error).
"""

from __future__ import annotations

import datetime
import math
import zlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..runtime import overrides
from .checkpoint_errors import CheckpointError

#: environment variable bounding each agreement's wait, in seconds
TIMEOUT_ENV = "METP_CHECKPOINT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
_MAX_INTS = 8
_MSG_BYTES = 1536
_HEADER = 4 + _MAX_INTS  # failed flag, message length, number of ints, phase tag, the ints


def checkpoint_timeout_s() -> float:
    """The agreement's bound: the job timeout, or ``METP_CHECKPOINT_TIMEOUT_S`` (a positive finite
    number, at most the job timeout) when set."""
    from ..runtime.watchdog import job_timeout_s

    job = job_timeout_s()
    raw = overrides.raw(TIMEOUT_ENV)
    if raw is None:
        return job
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive finite number of seconds "
                         f"(unset it for the job timeout, {job:g} s)")
    if value > job:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is longer than the job timeout {job:g} s "
                         f"(METP_RING_TIMEOUT_S, which bounds every process group, so the "
                         f"agreement could never wait that long): unset it or raise "
                         f"METP_RING_TIMEOUT_S")
    return value


def describe(exc: BaseException) -> str:
    """What went wrong, in a line: the exception's type unless it is ours; for torch's
    ``CheckpointException`` the first line of each failing rank's exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and not failures:
        return f"{type(exc).__name__}: torch.distributed.checkpoint reported another rank's failure"
    if isinstance(failures, dict):
        parts = []
        for r, f in sorted(failures.items()):
            e = f[0] if isinstance(f, tuple) else f
            parts.append(f"rank {r}: {describe(e) if isinstance(e, BaseException) else e}")
        return f"{type(exc).__name__} ({'; '.join(parts)})"
    text = str(exc).strip() or type(exc).__name__
    if not isinstance(exc, CheckpointError):
        text = f"{type(exc).__name__}: {text.splitlines()[0]}"
    return text


def _encode(what: str, error: Optional[BaseException], ints: Sequence[int]) -> torch.Tensor:
    if len(ints) > _MAX_INTS:
        raise ValueError(f"agree() carries at most {_MAX_INTS} integers, got {len(ints)}")
    msg = b"" if error is None else describe(error).encode("utf-8", "replace")[:_MSG_BYTES]
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = int(error is not None)
    header[1] = len(msg)
    header[2] = len(ints)
    header[3] = zlib.crc32(what.encode())
    header[4:4 + len(ints)] = torch.tensor([int(i) for i in ints], dtype=torch.int64)
    buf = torch.zeros(_HEADER * 8 + _MSG_BYTES, dtype=torch.uint8)
    buf[:_HEADER * 8] = header.view(torch.uint8)
    if msg:
        buf[_HEADER * 8:_HEADER * 8 + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor):
    buf = buf.cpu()
    header = buf[:_HEADER * 8].clone().view(torch.int64).tolist()
    failed, n_msg, n_ints, tag = header[0], header[1], header[2], header[3]
    n_msg, n_ints = min(max(n_msg, 0), _MSG_BYTES), min(max(n_ints, 0), _MAX_INTS)
    msg = bytes(buf[_HEADER * 8:_HEADER * 8 + n_msg].tolist()).decode("utf-8", "replace")
    return bool(failed), msg, header[4:4 + n_ints], tag


def _first_line(exc: BaseException) -> str:
    """The first sentence of a transport error (gloo's come with a long tail)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text.split(". ")[0][:300]


def _ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def agree(what: str, error: Optional[BaseException], ints: Sequence[int] = (), *,
          outcome: str = "", group=None) -> List[List[int]]:
    """Called by every rank at the end of a phase ``what`` (e.g. ``"saving iteration 4 to
    '/ckpt'"``) with this rank's ``error`` (``None`` if it succeeded) and up to eight integers.

    Returns every rank's integers (``result[rank]``). Raises :class:`CheckpointError` on every
    rank if any rank passed an error, or if a peer does not answer within
    :func:`checkpoint_timeout_s` (dead or hung): the message names the ranks and their reasons,
    identical reasons grouped, followed by ``outcome`` (what the failure leaves behind, e.g.
    which checkpoint stays valid). The local error is chained as the cause.
    """
    tail = f" {outcome}" if outcome else ""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise CheckpointError(f"{what} failed: {describe(error)}.{tail}") from error
        return [list(ints)]
    world = dist.get_world_size(group)
    buf = _encode(what, error, ints)
    if dist.get_backend(group) == "nccl":
        buf = buf.to(torch.device("cuda", torch.cuda.current_device()))
    out = [torch.empty_like(buf) for _ in range(world)]
    timeout = checkpoint_timeout_s()
    from ..runtime import watchdog

    if group is None:
        watchdog.enter(what)
    try:
        work = dist.all_gather(out, buf, group=group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - gloo: peer closed or timed out
        first = _first_line(exc)
        mine = describe(error) if error is not None else ""
        mine = f" This rank failed first: {mine}." if mine and first not in mine else ""
        who, stalled, _ = watchdog.diagnose(what, exc, timeout_s=timeout) if group is None else ("", [], [])
        named = (f" rank{'s' if len(stalled) > 1 else ''} {_ranges(stalled)} did not answer."
                 if stalled else "")
        raise CheckpointError(
            f"{what}: a peer rank died or hangs (it did not answer; the wait is bounded by "
            f"{TIMEOUT_ENV if overrides.is_set(TIMEOUT_ENV) else 'the job timeout'}"
            f"={timeout:g} s): {first}.{named} {who}{mine}{tail}".replace("  ", " ")
        ) from (error or exc)
    decoded = [_decode(b) for b in out]
    tag = zlib.crc32(what.encode())
    astray = [r for r, d in enumerate(decoded) if d[3] != tag]
    if astray:
        raise CheckpointError(
            f"{what}: rank{'s' if len(astray) > 1 else ''} {_ranges(astray)} answered from "
            f"another step of a checkpoint save or load (the ranks are out of step, e.g. after "
            f"a timeout on one of them); the process group cannot be trusted any more: end the "
            f"job.{tail}") from error
    failed = [r for r, d in enumerate(decoded) if d[0]]
    if failed:
        by_msg = {}
        for r in failed:
            by_msg.setdefault(decoded[r][1], []).append(r)
        parts = [f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {m}" for m, rs in by_msg.items()]
        text = " | ".join(parts)
        text += "" if text.endswith((".", "?", "!")) else "."
        raise CheckpointError(f"{what} failed on rank{'s' if len(failed) > 1 else ''} "
                              f"{_ranges(failed)} of {world}. {text}{tail}") from error
    return [d[2] for d in decoded]
