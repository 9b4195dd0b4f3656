"""METP word embedding: ``y = E[ids]`` with the table's vocabulary shards on a ring.

Layout on rank ``r`` of a METP group of size ``p`` (see :mod:`megatron_metp.ops.vocab`):

* ``tokens``: this rank's token ids ``[b, n]`` (``n = s/p``, Megatron's CP order);
* ``weight`` (``E_r``): rows ``[vocab_start + r·v, vocab_start + (r+1)·v)`` of the table, ``[v, h]``
  — Megatron's ``VocabParallelEmbedding`` shard for TP of size ``t·p`` at index ``τ·p + r``;
* ``y``: ``[b, n, h]``, the rows of this rank's tokens that fall in the group's range
  ``[vocab_start, vocab_start + p·v)``; zeros elsewhere (the other TP ranks' rows: sum over TP).

Forward (``p`` steps, weight ring). At step ``t`` rank ``r`` holds shard ``j = (r - t) mod p`` and
adds ``y[i] += E_j[ids_i - lo_j]`` for its tokens with ``lo_j <= ids_i < lo_j + v`` (a masked
lookup: static shapes, no ``nonzero`` and so no device sync) while shard ``j-1`` is in flight.
Each token is found in exactly one shard.

Backward. ``dE_j[k] = Σ_ranks Σ_{i: ids_i = lo_j + k} dy_i``. The weights are not needed: only a
gradient accumulator ``[v, h]`` (fp32 by default) travels, each rank adding its tokens' rows of the
shard it is visiting (``index_add``), so every shard's gradient arrives complete at its owner after
``p-1`` hops — a ring reduce-scatter.

Communication per call: ``p-1`` table shards forward, ``p-1`` gradient shards backward; nothing
scales with ``s``. Memory: ``tokens`` is all that is saved; two shard buffers in flight.

Tiling. No temporary here has a vocabulary axis over the tokens (nothing is ``[tokens, v]``), but
untiled each step made ``[tokens, h]`` temporaries next to the ``[tokens, h]`` output or gradient:
the looked-up rows in forward, and in backward the incoming gradient's fp32 copy plus the step's
masked fp32 rows — at 512K tokens per rank and ``h = 4096`` with bf16 that is 16 GiB of fp32 next
to a 4 GiB gradient. So both passes go through the tokens in chunks of ``token_chunk`` rows
(default auto: ``max(1, 2**28 // h)``, at most 1 GiB of fp32 per chunk), inside each ring step:
forward ``y_C += E_j[ids_C - lo_j]`` (masked), backward ``dE_j += index_add(dy_C in fp32,
masked)``, chunk after chunk in token order. The largest temporary is then ``[token_chunk, h]``
(fp32 in backward); the output ``[tokens, h]`` and the fp32 ``[v, h]`` ring sums remain. Values are
unchanged (the same additions in the same order); the ring and its messages are untouched.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..runtime.finite import check_finite
from ..runtime.groups import METPGroup, as_metp_group
from ..runtime.ring import RingExchanger, TravellingSum
from ._first_order import first_order_only
from .vocab import (check_ids, check_table, local_rows, resolve_token_chunk, shard_rows,
                    token_chunks, vocab_bounds)


class _METPEmbeddingFunction(torch.autograd.Function):
    """Autograd function of :func:`metp_embedding` (equations in the module docstring)."""

    @staticmethod
    def forward(ctx, ids, weight, group: METPGroup, vocab_start: int, grad_dtype, label: str,
                token_chunk: int):
        check_finite(f"{label} (forward)", group, weight=weight)
        v, h = weight.shape
        flat_ids = ids.reshape(-1)
        y = torch.zeros(flat_ids.numel(), h, dtype=weight.dtype, device=weight.device)
        ring = RingExchanger(group, "embedding shards (fwd)")
        shards = ring.circulate(weight.detach().clone()) if group.size > 1 else [(0, weight)]
        chunks = token_chunks(flat_ids.numel(), token_chunk)
        for t, w in shards:
            lo, _ = shard_rows(vocab_start, v, group.owner_at_step(t))
            for c in chunks:  # [token_chunk, h] rows at a time
                local, inside = local_rows(flat_ids[c], lo, v)
                rows = w.index_select(0, local).masked_fill_(~inside[:, None], 0)
                y[c].add_(rows)  # each token lies in exactly one shard: its row once, zeros else
                del rows
        ctx.save_for_backward(ids)
        ctx.group, ctx.vocab_start, ctx.grad_dtype, ctx.label = group, vocab_start, grad_dtype, label
        ctx.table_shape, ctx.table_dtype = weight.shape, weight.dtype
        ctx.token_chunk = token_chunk
        return y.view(*ids.shape, h)

    @staticmethod
    @first_order_only("metp_embedding")
    def backward(ctx, grad_y):
        check_finite(f"{ctx.label} (backward)", ctx.group, grad_output=grad_y)
        (ids,) = ctx.saved_tensors
        group: METPGroup = ctx.group
        v, h = ctx.table_shape
        flat_ids = ids.reshape(-1)
        acc_dtype = ctx.grad_dtype or (torch.float32 if ctx.table_dtype in
                                       (torch.float16, torch.bfloat16) else ctx.table_dtype)
        g = grad_y.reshape(-1, h)  # converted to acc_dtype a chunk at a time
        chunks = token_chunks(flat_ids.numel(), ctx.token_chunk)
        sums = TravellingSum(RingExchanger(group, "embedding grads (bwd)"), v * h, acc_dtype,
                             grad_y.device)
        # Rank r adds into shards r-1, r-2, ..., r: its own last, where the sum ends complete.
        for step in range(group.size):
            lo, _ = shard_rows(ctx.vocab_start, v, group.owner_at_step(step, offset=1))
            dw = sums.buffer().view(v, h)
            for c in chunks:  # in token order, as one index_add over all tokens would add
                local, inside = local_rows(flat_ids[c], lo, v)
                rows = g[c].to(acc_dtype, copy=True).masked_fill_(~inside[:, None], 0)
                dw.index_add_(0, local, rows)
                del rows
            if step < group.size - 1:
                sums.pass_on()
        return (None, sums.buffer().view(v, h).to(ctx.table_dtype), None, None, None, None,
                None)


def metp_embedding(tokens: torch.Tensor, weight: torch.Tensor, *, group, vocab_start: int = 0,
                   vocab_size: Optional[int] = None, check_token_ids: bool = True,
                   grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
                   label: str = "metp_embedding",
                   token_chunk: Optional[int] = None) -> torch.Tensor:
    """Word embedding lookup with the table's vocabulary shards on the METP ring.

    Args:
        tokens: this rank's token ids ``[b, s/p]`` (integer).
        weight: this rank's table shard ``[v, h]`` (rows ``vocab_start + rank·v`` onwards).
        group: a :class:`~megatron_metp.runtime.groups.METPGroup` (or a ProcessGroup, or ``None``).
        vocab_start: first row of the group's range (``tp_rank·p·v`` when composed with TP).
        vocab_size: the full (padded) vocabulary ``V``; token ids must lie in ``[0, V)``.
            Default: the end of the group's range (no TP).
        check_token_ids: check the ids on every rank (one tiny all-reduce over the group) and
            raise ``ValueError`` everywhere if any is out of range, before any ring step.
        grad_reduce_dtype: dtype of the gradient accumulator that travels the ring (default
            fp32; ``None``: the table's dtype, fp32 for 16-bit tables).
        label: names this call in NaN/Inf reports and in the cross-rank agreement check
            (:mod:`megatron_metp.runtime.agree`, on by default).
        token_chunk: tokens per chunk of each ring step's lookup (forward) and gradient
            scatter (backward); ``None`` (default): auto, ``max(1, 2**28 // h)`` (one fp32
            ``[token_chunk, h]`` chunk is at most 1 GiB). A positive integer, else
            ``ValueError`` naming it before any transfer. Changes neither values nor messages.

    Returns:
        ``[b, s/p, h]``: the embeddings of this rank's tokens whose ids fall in the group's range,
        zeros for the others (reduce over TP to complete them). The table shard's gradient is
        complete (summed over every rank's tokens).
    """
    group = as_metp_group(group)
    name = op_label("metp_embedding", label)
    try:
        check_table(weight, "weight")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be this rank's token ids [b, s/p], got shape "
                             f"{tuple(tokens.shape)}")
        if tokens.device != weight.device:
            raise ValueError(f"tokens are on {tokens.device} but weight is on {weight.device}")
        if grad_reduce_dtype is not None and not grad_reduce_dtype.is_floating_point:
            raise ValueError(f"grad_reduce_dtype must be a floating dtype, got {grad_reduce_dtype}")
        lo, hi = vocab_bounds(vocab_start, weight.shape[0], group.size, vocab_size)
        chunk = resolve_token_chunk(token_chunk, weight.shape[1])
    except ValueError as exc:
        refuse_together(group, name, exc)
        raise
    if agreement_checks_enabled():  # token counts may differ: each rank looks up its own
        check_group_agrees(group, name, label=label, weight=weight, vocab_start=int(vocab_start),
                           vocab_size=hi, check_token_ids=bool(check_token_ids),
                           grad_reduce_dtype=grad_reduce_dtype, needs_grad=needs_grad(weight))
    if check_token_ids:
        check_ids(tokens, lo, hi, group, "token ids",
                  "check the tokenizer's vocabulary against --vocab-size/--vocab-file")
    elif tokens.is_floating_point():
        raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
    return _METPEmbeddingFunction.apply(tokens.long(), weight, group, int(vocab_start),
                                        grad_reduce_dtype, label, chunk)
