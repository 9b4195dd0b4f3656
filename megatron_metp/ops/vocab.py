"""Vocabulary shards of the METP group: padding, row ranges and a group-wide token-id check.

A vocabulary-parallel table (word embedding or output layer) ``[V, h]`` is split by rows into
``t·p`` shards of ``v = V/(t·p)`` rows, TP-major, exactly as Megatron's ``VocabParallelEmbedding``
splits it over TP of size ``t·p``: METP rank ``r`` of TP rank ``τ`` holds rows
``[(τ·p + r)·v, (τ·p + r + 1)·v)``. The ring of one METP group therefore carries the contiguous
range ``[τ·p·v, (τ+1)·p·v)``; its start is the ops' ``vocab_start``. ``V`` is Megatron's padded
vocabulary (:func:`padded_vocab_size`); the padding rows are ordinary rows, as in Megatron.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..runtime import overrides
from ..runtime.groups import METPGroup
from . import tiles as tiling


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                      metp_parallel_size: int = 1) -> int:
    """Megatron's vocabulary padding with the METP size folded in: the smallest multiple of
    ``divisible_by · t · p`` that is ``>= vocab_size`` (Megatron pads to ``divisible_by · t``)."""
    for name, val in (("vocab_size", vocab_size), ("divisible_by", divisible_by),
                      ("tensor_model_parallel_size", tensor_model_parallel_size),
                      ("metp_parallel_size", metp_parallel_size)):
        if int(val) != val or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    multiple = divisible_by * tensor_model_parallel_size * metp_parallel_size
    return -(-vocab_size // multiple) * multiple


def shard_rows(vocab_start: int, rows: int, j: int) -> tuple:
    """``(lo, hi)``: the rows of the ring's shard ``j`` (rows ``[lo, hi)`` of the full table)."""
    lo = vocab_start + j * rows
    return lo, lo + rows


def local_rows(ids: torch.Tensor, lo: int, rows: int) -> tuple:
    """``(local, inside)``: each id's row in the shard of ``rows`` rows starting at ``lo``
    (clamped into the shard) and whether the id really lies there. Shapes stay static (no
    ``nonzero``): no device sync, and fake-tensor memory measurement works."""
    local = ids - lo
    inside = (local >= 0) & (local < rows)
    return local.clamp_(0, rows - 1), inside


def check_table(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name} must be this rank's vocabulary shard [V/(t*p), h], got shape "
                         f"{tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {weight.dtype}")


def check_ids(ids: torch.Tensor, lo: int, hi: int, group: METPGroup, what: str, flag: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` if any rank's ``ids`` leave ``[lo, hi)``.

    One two-element all-reduce over the group (every rank takes part whatever its data), so all
    ranks raise together before any ring step starts instead of one rank reading out of bounds
    and its peers waiting for it.
    """
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"{what} must be an integer tensor, got {ids.dtype}")
    if _has_no_values(ids):
        return  # fake/meta tensors (memory measurement): there are no values to check
    if ids.numel():
        mn, mx = torch.aminmax(ids.reshape(-1).to(torch.int64))
        bounds = torch.stack([-mn, mx])
    else:
        bounds = torch.tensor([-lo, lo], dtype=torch.int64, device=ids.device)
    if group.size > 1:
        work = dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group.group, async_op=True)
        if ids.is_cuda:
            work.wait()
        else:
            work.wait(group.timeout)
    mn, mx = -int(bounds[0]), int(bounds[1])
    if mn < lo or mx >= hi:
        where = "on this rank" if group.size == 1 else f"on a rank of METP group {group.name!r}"
        raise ValueError(f"{what} out of range {where}: got ids from {mn} to {mx}, but the "
                         f"vocabulary has rows [{lo}, {hi}); {flag}")


def _has_no_values(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def vocab_bounds(vocab_start: int, rows: int, p: int, vocab_size: Optional[int]) -> tuple:
    """Valid token ids ``[0, V)``; ``V`` defaults to the end of this METP group's range."""
    end = vocab_start + p * rows
    if vocab_size is None:
        return 0, end
    if vocab_size < end:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the end of this group's shards "
                         f"({vocab_start} + {p}*{rows} = {end})")
    return 0, vocab_size


#: Auto token chunk: at most this many elements in one chunk's ``[token_chunk, width]`` block
#: (2**28 fp32 elements = 1 GiB).
TOKEN_CHUNK_ELEMENTS = 1 << 28
#: Environment variable that sets the loss's token chunk when ``token_chunk`` is not passed.
LOSS_TOKEN_CHUNK_ENV = "METP_LOSS_TOKEN_CHUNK"


def resolve_token_chunk(token_chunk, width: int, env: Optional[str] = None,
                        arg: str = "token_chunk") -> int:
    """Rows of tokens per chunk of an op that tiles its tokens (``[token_chunk, width]`` blocks).

    ``token_chunk`` if given (a positive integer, else ``ValueError`` naming ``arg``); otherwise
    the override ``env`` if it is set and not empty (a positive integer, else ``ValueError``
    naming the variable; :func:`~megatron_metp.runtime.overrides.integer_setting`); otherwise
    auto: the most rows whose ``[rows, width]`` block has at most :data:`TOKEN_CHUNK_ELEMENTS`
    elements (1 GiB in fp32), at least 1. A chunk larger than the rank's token count means one
    chunk (no tiling).
    """
    if token_chunk is not None or env is not None:  # (no env: the argument's bounds alone)
        chunk = overrides.integer_setting(token_chunk, env or LOSS_TOKEN_CHUNK_ENV, arg)
        if chunk is not None:
            return chunk
    return max(1, TOKEN_CHUNK_ELEMENTS // max(1, int(width)))


def token_chunks(n: int, chunk: int):
    """The row slices ``[a, min(a + chunk, n))`` covering ``n`` rows in order (none for 0)."""
    return [slice(a, min(a + chunk, n)) for a in range(0, n, chunk)]


#: Environment variable that sets the rows per token tile of the loss's backward (0 = whole)
#: when ``token_tile`` is not passed (:func:`loss_tiles`).
LOSS_TOKEN_TILE_ENV = "METP_LOSS_TOKEN_TILE"


def loss_row_bytes(h: int, acc_elem: int = 4) -> int:
    """Token-proportional bytes of one tile of the ring loss's backward per token row: the
    ``dX`` accumulator ``[rows, h]`` (``acc_elem`` bytes, fp32 for 16-bit inputs). The logits
    and ``dZ`` are bounded by the token chunk, not by the tile."""
    return acc_elem * h


def loss_tiles(token_tile, n_rows: int, h: int, acc_elem: int = 4, arg: str = "token_tile"):
    """Token tiles of the ring loss's (and the ring logits') backward, one pass of the weight
    ring each (:mod:`.tiles`): ``token_tile`` rows (``0`` = whole), else the environment variable
    ``METP_LOSS_TOKEN_TILE``, else auto: the most rows whose ``dX`` accumulator fits
    ``METP_TILE_BUDGET_MIB`` (1 GiB: 65,536 rows at ``h = 4096``). Balanced slices; one slice of
    every row when the rank's rows fit (the untiled op)."""
    rows = tiling.resolve_rows(token_tile, n_rows, loss_row_bytes(h, acc_elem),
                               LOSS_TOKEN_TILE_ENV, arg)
    return tiling.tile_slices(n_rows, rows)


#: ``0`` keeps the ring loss's input gradient out of the final hidden states' storage in
#: Megatron (:class:`megatron_metp.megatron.vocab.METPGPTModel`); ``1`` or unset: written there
LOSS_GRAD_INTO_HIDDEN_ENV = "METP_LOSS_GRAD_INTO_HIDDEN"


def loss_grad_into_hidden_env() -> bool:
    """``METP_LOSS_GRAD_INTO_HIDDEN``: ``1`` (or unset, the default) lets the METP GPT model's
    loss write its input gradient into the final hidden states (``grad_into_hidden``), ``0``
    does not; anything else is refused naming the variable."""
    return overrides.flag(LOSS_GRAD_INTO_HIDDEN_ENV)
