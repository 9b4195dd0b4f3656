"""Transients of the METP vocabulary split (mode ``metp+vocab``, ``--vocab-parallel``): the ring
loss ``ops.metp_output_cross_entropy`` (its backward in token tiles, ``METP_LOSS_TOKEN_TILE``)
and the ring embedding ``ops.metp_embedding``; and the bytes their rings send."""

from __future__ import annotations

from typing import Dict, Optional

from ...ops.vocab import loss_grad_into_hidden_env, loss_tiles
from .model import BF16, FP32

#: the ops' automatic token chunk: at most this many elements per ``[chunk, width]`` block
#: (``megatron_metp.ops.vocab.TOKEN_CHUNK_ELEMENTS``, 1 GiB in fp32)
TOKEN_CHUNK_ELEMENTS = 2 ** 28


def token_chunk(n: int, width: int) -> int:
    """Tokens per chunk of a tiled vocabulary op on ``n`` tokens (auto chunk, as the ops)."""
    return min(n, max(1, TOKEN_CHUNK_ELEMENTS // max(1, width)))


def loss_tile_rows(n: int, h: int) -> int:
    """Rows per token tile of the ring loss's backward for ``n`` rows (``n`` = whole), from
    ``METP_LOSS_TOKEN_TILE`` or the auto budget, as the op resolves them (the largest tile)."""
    tiles = loss_tiles(None, n, h, FP32)
    return tiles[0].stop - tiles[0].start


def loss_tile_count(n: int, h: int) -> int:
    """Passes of the ring loss's backward ring (its token tiles) for ``n`` rows."""
    return len(loss_tiles(None, n, h, FP32))


def vocab_loss_phases(n: int, h: int, v: int, p: int, b: int = 1,
                      grad_into_hidden: Optional[bool] = None) -> Dict[str, Dict[str, float]]:
    """Transients of ``ops.metp_output_cross_entropy`` (``n`` tokens of this rank, ``b`` folded
    in; a ``[v, h]`` output-layer shard, ``v = V/(t·p)``; a ring of ``p``), at each pass's
    largest step.

    The op chunks the tokens: every ``[tokens, v]`` block below is one chunk of
    ``c = min(n, 2**28 // v)`` tokens (:func:`token_chunk`), at most one backward tile's rows.
    Forward: the bf16 weight-shard buffers in flight (a clone of the own shard and the receive
    buffer, ``p > 1``), the running max / sum / target logit ``[n]`` fp32, and one chunk of a
    shard's logits ``X_c·W_jᵀ`` in bf16 with their fp32 copy (``.float()``; exp and the shift
    run in place; the op releases each block before forming the next).
    Backward (the logits recomputed), tile-outer over ``T`` token tiles of ``R`` rows
    (:func:`loss_tile_rows`; ``T = 1``: the untiled op): the fp32 ``dX`` accumulator of one tile
    ``[R, h]``, the ``dX`` output ``[n, h]`` in bf16 unless the model writes it into the saved
    hidden states (``grad_into_hidden``, the METP GPT model's default:
    ``METP_LOSS_GRAD_INTO_HIDDEN``; then it costs nothing: the hidden states are counted as the
    final norm's output), two bf16 weight buffers and the weight-gradient sum's two fp32 buffers
    travelling the ring (one with ``p = 1``), with ``T > 1`` the owner's fp32 total of the
    previous tiles' sums, and per shard the largest of: bf16 logits + their fp32 softmax; fp32
    ``dZ`` + its bf16 copy (``dX_c += dZ·W_j`` and ``dW_j += dZᵀ·X_c`` accumulate in place in
    fp32: ``mm_acc``'s CUDA branch has no product temporary). At the end (the ring buffers and
    the second sum are gone by then): untiled, the fp32 ``dX`` with its cast (a bf16 copy, or
    none into the hidden states) next to ``dW``'s fp32 sum; then the ``dX`` output with ``dW``'s
    fp32 sum and its bf16 copy."""
    into = loss_grad_into_hidden_env() if grad_into_hidden is None else grad_into_hidden
    ring = p > 1
    R = loss_tile_rows(n, h)
    tiled = R < n
    c = min(token_chunk(n, v), R)
    logits = (BF16 + FP32) * c * v
    fwd = {"(log-sum-exp and loss not formed yet)": -2 * FP32 * n,
           "running max, sum, target logit [tokens] (fp32)": 3 * FP32 * n,
           "one shard's logits [tokens, V/(t·p)]: bf16 product + fp32 copy": logits}
    if b > 1:
        fwd["labels in token order (int64)"] = 8 * n
    if ring:
        fwd["output-layer shards in flight: own copy + received (bf16)"] = 2 * BF16 * v * h
    common = {"dX accumulator of one token tile [tile, h] (fp32)": FP32 * R * h,
              "loss gradient [tokens] (fp32)": FP32 * n}
    if tiled and not into:
        common["dX output [tokens, h] (bf16), filled tile by tile"] = BF16 * n * h
    if ring:
        common["output-layer shards in flight: own copy + held (bf16)"] = 2 * BF16 * v * h
        common["weight-gradient sum: two travelling buffers (fp32)"] = 2 * FP32 * v * h
    else:
        common["weight-gradient sum (fp32)"] = FP32 * v * h
    if tiled:
        common["weight-gradient total of the previous tiles (fp32)"] = FP32 * v * h
    step = logits
    bwd = dict(common, **{"one shard's logits / dZ (fp32 + bf16)": step})
    out = {} if into else {"dX output [tokens, h] (bf16)": BF16 * n * h}
    # at the end: untiled, the whole fp32 dX is cast once (into a new tensor or the hidden
    # states) next to dW's fp32 sum, and freed; then dW's bf16 copy is made
    cast = dict(out, **{"dX (fp32), cast once": FP32 * n * h, "dW (fp32 sum)": FP32 * v * h})
    end = dict(out, **{"dW (fp32 sum) and its bf16 copy": (FP32 + BF16) * v * h})
    for phase in ([cast] if not tiled else []) + [end]:
        if sum(phase.values()) > sum(bwd.values()):
            bwd = phase
    return {"loss (forward): one vocab shard's logits": fwd,
            "output layer + loss (backward): vocab ring": bwd}


def vocab_ring_traffic(n: int, h: int, v: int, p: int, embedding: bool = True,
                       loss: bool = True) -> Dict[str, float]:
    """Bytes one rank sends per micro-batch in the vocabulary rings (``[v, h]`` shards, ring of
    ``p``; bf16 tables, fp32 gradient sums, as the METP GPT model runs them): the embedding's
    (``embedding``: first stage) ``p-1`` table shards forward and ``p-1`` gradient sums
    backward; the loss's (``loss``: last stage) ``p-1`` shards forward and, once per backward
    token tile (:func:`loss_tile_count`), ``p-1`` shards and ``p-1`` gradient sums."""
    out: Dict[str, float] = {}
    if p == 1:
        return out
    shard = v * h
    if embedding:
        out["embedding ring: fwd shards (bf16), bwd gradient sums (fp32)"] = \
            (p - 1) * shard * (BF16 + FP32)
    if loss:
        T = loss_tile_count(n, h)
        out[f"loss ring: fwd shards (bf16); bwd shards + fp32 sums × {T} token tile"
            f"{'s' if T > 1 else ''}"] = (p - 1) * shard * (BF16 + T * (BF16 + FP32))
    return out


def vocab_embedding_forward(n: int, h: int, v: int, p: int) -> Dict[str, float]:
    """Forward of ``ops.metp_embedding`` besides its output: the table shards in flight (a
    clone of the own shard and the receive buffer, bf16, ``p > 1``) and one token chunk's
    looked-up rows ``[c, h]`` (bf16, ``c = min(n, 2**28 // h)``) with their row ids (int64) and
    masks."""
    c = token_chunk(n, h)
    out = {"one chunk's looked-up rows [chunk, h] (bf16)": BF16 * c * h,
           "row ids (int64) and masks (bool) of one chunk": 10 * c}
    if p > 1:
        out["table shards in flight: own copy + received (bf16)"] = 2 * BF16 * v * h
    return out


def vocab_embedding_backward(n: int, h: int, v: int, p: int) -> Dict[str, float]:
    """Backward of ``ops.metp_embedding`` (``[v, h]`` table shard, ring of ``p``): the
    table-gradient sum travelling the ring (two fp32 buffers, one with ``p = 1``), and either a
    token chunk's masked gradient rows (fp32 ``[c, h]``, ``c = min(n, 2**28 // h)``) or, at the
    end, the bf16 copy of the complete sum (the table's gradient)."""
    c = token_chunk(n, h)
    out = {"table-gradient sum: travelling buffers (fp32)": (2 if p > 1 else 1) * FP32 * v * h}
    step = max(FP32 * c * h + 10 * c, BF16 * v * h)
    out["masked gradient rows (fp32), or the bf16 table gradient at the end"] = step
    return out
