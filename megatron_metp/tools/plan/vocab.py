"""Transients of the METP vocabulary split (mode ``metp+vocab``, ``--vocab-parallel``): the ring
loss ``ops.metp_output_cross_entropy`` and the ring embedding ``ops.metp_embedding``."""

from __future__ import annotations

from typing import Dict

from .model import BF16, FP32

#: the ops' automatic token chunk: at most this many elements per ``[chunk, width]`` block
#: (``megatron_metp.ops.vocab.TOKEN_CHUNK_ELEMENTS``, 1 GiB in fp32)
TOKEN_CHUNK_ELEMENTS = 2 ** 28


def token_chunk(n: int, width: int) -> int:
    """Tokens per chunk of a tiled vocabulary op on ``n`` tokens (auto chunk, as the ops)."""
    return min(n, max(1, TOKEN_CHUNK_ELEMENTS // max(1, width)))


def vocab_loss_phases(n: int, h: int, v: int, p: int, b: int = 1) -> Dict[str, Dict[str, float]]:
    """Transients of ``ops.metp_output_cross_entropy`` (``n`` tokens of this rank, ``b`` folded
    in; a ``[v, h]`` output-layer shard, ``v = V/(t·p)``; a ring of ``p``), at each pass's
    largest step.

    The op tiles the tokens: every ``[tokens, v]`` block below is one chunk of
    ``c = min(n, 2**28 // v)`` tokens (:func:`token_chunk`).
    Forward: the bf16 weight-shard buffers in flight (a clone of the own shard and the receive
    buffer, ``p > 1``), the running max / sum / target logit ``[n]`` fp32, and one chunk of a
    shard's logits ``X_c·W_jᵀ`` in bf16 with their fp32 copy (``.float()``; exp and the shift
    run in place; the op releases each block before forming the next).
    Backward (the logits recomputed): the fp32 ``dX`` accumulator ``[n, h]``, two bf16 weight
    buffers and the weight-gradient sum's two fp32 buffers travelling the ring (one with
    ``p = 1``), and per shard the largest of: bf16 logits + their fp32 softmax; fp32 ``dZ`` + its
    bf16 copy (``dX_c += dZ·W_j`` and ``dW_j += dZᵀ·X_c`` accumulate in place in fp32:
    ``mm_acc``'s CUDA branch has no product temporary). At the end the fp32 ``dX`` and
    ``dW`` with their bf16 copies (the ring buffers and the second sum are gone by then)."""
    ring = p > 1
    c = token_chunk(n, v)
    logits = (BF16 + FP32) * c * v
    fwd = {"(log-sum-exp and loss not formed yet)": -2 * FP32 * n,
           "running max, sum, target logit [tokens] (fp32)": 3 * FP32 * n,
           "one shard's logits [tokens, V/(t·p)]: bf16 product + fp32 copy": logits}
    if b > 1:
        fwd["labels in token order (int64)"] = 8 * n
    if ring:
        fwd["output-layer shards in flight: own copy + received (bf16)"] = 2 * BF16 * v * h
    common = {"dX accumulator (fp32)": FP32 * n * h, "loss gradient [tokens] (fp32)": FP32 * n}
    if ring:
        common["output-layer shards in flight: own copy + held (bf16)"] = 2 * BF16 * v * h
        common["weight-gradient sum: two travelling buffers (fp32)"] = 2 * FP32 * v * h
    else:
        common["weight-gradient sum (fp32)"] = FP32 * v * h
    step = logits
    bwd = dict(common, **{"one shard's logits / dZ (fp32 + bf16)": step})
    end = {"dX (fp32) and its bf16 copy": (FP32 + BF16) * n * h,
           "dW (fp32 sum) and its bf16 copy": (FP32 + BF16) * v * h}
    if sum(end.values()) > sum(bwd.values()):
        bwd = end
    return {"loss (forward): one vocab shard's logits": fwd,
            "output layer + loss (backward): vocab ring": bwd}


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
