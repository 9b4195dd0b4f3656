"""METP output layer fused with cross-entropy: the loss without ever holding full logits.

Layout on rank ``r`` of a METP group of size ``p`` (see :mod:`megatron_metp.ops.vocab`):

* ``hidden`` (``X``): this rank's tokens ``[n, b, h]`` (``n = s/p``); ``labels`` ``[b, n]``;
* ``weight`` (``W_r``): output-layer rows ``[vocab_start + r·v, vocab_start + (r+1)·v)``, ``[v, h]``
  (Megatron's ``ColumnParallelLinear`` vocabulary shard for TP of size ``t·p``);
* returns the per-token loss ``[b, n]`` in fp32, as Megatron's ``compute_language_model_loss``.

Forward (``p`` steps, weight ring). At step ``t`` rank ``r`` holds shard ``j = (r - t) mod p``
and, while shard ``j-1`` is in flight, goes through its ``N = n·b`` tokens in chunks ``C`` of
``token_chunk`` rows (the last one shorter), forming ``Z_{C,j} = X_C·W_jᵀ`` (``[|C|, v]``, fp32)
and folding it into the online log-sum-exp and the target logit of those tokens::

    m_C ← max(m_C, max_k Z_{C,j}[:, k])    l_C ← l_C·e^(m_C,old - m_C) + Σ_k e^(Z_{C,j}[:, k] - m_C)
    z_y ← z_y + Z_{C,j}[i, y_i - lo_j]     (for the tokens i ∈ C whose label lies in shard j)

Every update is per token, so the chunking changes no value: it only bounds the logits block.

With TP the partial ``(m, l, z_y)`` of each TP rank's vocabulary range are merged by all-reduces
(max, then sums), as Megatron's ``vocab_parallel_cross_entropy`` does. Then
``lse = m + log l`` and ``loss = lse - z_y``. With label smoothing ``ε`` (Megatron's form,
``ε' = ε·V/(V-1)``): ``loss = lse - (1-ε')·z_y - ε'·(Σ_k Z[:, k])/V``.

Backward (``p`` steps, second pass of the ring). ``Z_{C,j}`` is recomputed chunk by chunk as
shard ``j`` passes::

    dZ_{C,j} = g_C ⊙ (softmax(Z_{C,j}) - (1-ε')·onehot_j - ε'/V),   softmax = e^(Z_{C,j} - lse_C)
    dX_C += dZ_{C,j}·W_j   (local, fp32 accumulator for 16-bit inputs)
    dW_j += dZ_{C,j}ᵀ·X_C  (into the fp32 sum travelling to the owner, chunk after chunk)

With TP, dX is summed over TP (per token tile, below). Saved for backward: ``X``, ``labels`` and
``lse`` (``[n·b]`` fp32); nothing of size ``V``.

Token tiles of the backward (tile-outer, as :mod:`.mlp`'s). The ``N`` token rows are cut into
``T`` balanced tiles of at most ``token_tile`` rows (:func:`.vocab.loss_tiles`: the argument, else
``METP_LOSS_TOKEN_TILE``, else auto from ``METP_TILE_BUDGET_MIB``, 1 GiB of fp32 ``dX`` per
tile: 65,536 rows at ``h = 4096``). For each tile ``T_i`` the whole backward ring above runs once
over the tile's rows only (its chunks ``C ⊂ T_i``)::

    dX_{T_i} = Σ_j Σ_{C ⊂ T_i} dZ_{C,j}·W_j     (fp32 [|T_i|, h], summed over TP, then written
                                                 into the dX output in the input dtype)
    dW_r    = Σ_i (Σ_ranks Σ_{C ⊂ T_i} dZ_{C,r}ᵀ·X_C)   (each tile's sum arrives complete at the
                                                         owner r, which adds up the tiles)

so the fp32 ``dX`` accumulator is one tile's, never ``[N, h]``. The backward's weight shards
and gradient sums go round ``T`` times (``T·(p-1)`` shards of ``[v, h]`` in the input dtype and
``T·(p-1)`` fp32 sums per rank). Each ring step of a tile still computes on ``|T_i|`` rows (3
GEMMs of ``|T_i|·v·h``), far above the ring's overlap threshold at the auto tile. One tile is
exactly the untiled backward (one fp32 ``dX`` cast once). With ``grad_into_hidden`` the ``dX``
output is ``X``'s own storage: tile ``T_i``'s rows of ``X`` are read for the last time in its
pass (``dW_j`` needs ``X_C``), so its ``dX`` rows overwrite them right after.

Chunks and memory. ``token_chunk`` (keyword argument; else the environment variable
``METP_LOSS_TOKEN_CHUNK``; else auto: the most rows with ``token_chunk·v <= 2**28``, i.e. one
fp32 logits chunk of at most 1 GiB — 16,644 tokens for Llama-3's vocabulary at ``p = 8``,
``V = 129024`` padded, ``v = 16128``) bounds every temporary with a vocabulary axis: the largest
is one ``[token_chunk, v]`` fp32 logits / ``dZ`` chunk (with its 16-bit twin), whatever the
number of tokens per rank; the token tiles bound the fp32 ``dX`` accumulator to
``[token_tile, h]``. What still grows with the tokens is ``[n·b, h]`` (``X``, and the ``dX``
output in the input dtype unless it is written into ``X``) and ``[n·b]`` (``m``, ``l``, ``z_y``,
``lse``, labels). The ring is untouched by the chunks (unlike the tiles): the same shards in the
same order, the same messages and sizes (``group.stats``), one chunk loop per ring step; ranks
may use different chunks. The loss and ``dX`` are per token; ``dW_j`` is summed chunk after
chunk and tile after tile (``Σ_C dZ_{C,j}ᵀ·X_C`` instead of one matmul), so results equal the
untiled op's up to the fp32 rounding of that order.

:func:`metp_output_logits` is the same ring without the loss (``[n, b, p·v]`` logits of this
group's vocabulary range, Megatron's ``parallel_output`` logits): for evaluation and generation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..runtime.finite import check_finite
from ..runtime.groups import METPGroup, as_metp_group
from ..runtime.ring import RingExchanger, TravellingSum
from ._first_order import first_order_only
from ._accum import mm_acc
from . import tiles as tiling
from .vocab import (LOSS_TOKEN_CHUNK_ENV, check_ids, check_table, local_rows, loss_tiles,
                    resolve_token_chunk, shard_rows, token_chunks, vocab_bounds)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _all_reduce(t: torch.Tensor, op, group, timeout) -> None:
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    if t.is_cuda:
        work.wait()
    else:
        work.wait(timeout)


def _tp_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def _ring_pass(x2, rows: slice, weight, group: METPGroup, grad_dtype, vocab_start, shard_dz,
               what, token_chunk=None):
    """One backward pass of the weight ring over the token rows ``rows`` of ``x2`` (a tile).

    For every shard ``j`` (visited ``r-1, r-2, …, r``: the owner's last) and every chunk ``C`` of
    ``token_chunk`` rows of the tile (the whole tile at once if ``None``), ``shard_dz(w_j, lo,
    hi, C)`` returns ``dZ_{C,j}`` ``[|C|, v]`` in the input dtype for the shard's rows ``[lo, hi)``
    (counted from ``vocab_start``; ``C`` indexes ``x2``'s rows); ``dX_C += dZ_{C,j}·W_j`` into the
    tile's accumulator and ``dZ_{C,j}ᵀ·X_C`` into the gradient sum travelling with shard ``j``.
    Returns ``(dX_tile [|rows|, h] in the accumulation dtype, dW_tile [v, h])``, ``dW_tile`` the
    complete sum of this rank's shard over every rank's rows of this tile.
    """
    p = group.size
    v, h = weight.shape
    acc = _acc_dtype(x2.dtype)
    a, b = rows.start, rows.stop
    dx = torch.zeros(b - a, h, dtype=acc, device=x2.device)
    sums = TravellingSum(RingExchanger(group, f"{what} grads (bwd)"), v * h, grad_dtype or acc,
                         x2.device)
    w_ring = RingExchanger(group, f"{what} weights (bwd)")
    chunks = token_chunks(b - a, token_chunk or max(1, b - a)) or [slice(0, 0)]  # tile rows

    def visit(w_j, j):
        lo, hi = shard_rows(vocab_start, v, j)
        dw = sums.buffer().view(v, h)
        for c in chunks:
            rows_c = slice(a + c.start, a + c.stop)  # the chunk's rows of x2
            dz = shard_dz(w_j, lo, hi, rows_c)
            mm_acc(dx[c], dz, w_j)
            mm_acc(dw, dz.t(), x2[rows_c])
            del dz  # one chunk's dZ alive at a time

    if p > 1:
        first = weight.detach().clone()
        held = w_ring.start(first, torch.empty_like(first), step=0).wait()
        for t, w_j in w_ring.circulate(held, steps=p - 1, spare=first):
            visit(w_j, group.owner_at_step(t, offset=1))
            sums.pass_on()
    visit(weight, group.rank)
    return dx, sums.buffer().view(v, h)


def _weight_ring_backward(x2, weight, group: METPGroup, grad_dtype, vocab_start, shard_dz, what,
                          token_chunk=None, tiles=None, tp_group=None, into=None):
    """The backward ring shared by the loss and the logits path, tile-outer.

    ``tiles``: row slices of ``x2`` ``[N, h]`` (:func:`.vocab.loss_tiles`; ``None`` = one tile
    of every row). For each tile the whole weight ring runs once (:func:`_ring_pass`): the
    tile's ``dX`` is accumulated in fp32 (for 16-bit inputs) over the ``p`` shards, summed over
    TP (``tp_group``), and written into the ``dX`` output in ``x2``'s dtype; the tile's ``dW``
    sum arrives complete at its owner and the owner adds up the tiles' sums::

        dX_T = Σ_j Σ_{C ⊂ T} dZ_{C,j}·W_j          dW_r = Σ_T Σ_ranks Σ_{C ⊂ T} dZ_{C,r}ᵀ·X_C

    so no ``[N, h]`` fp32 tensor exists when ``T > 1``. ``into``: where the ``dX`` output goes
    (``x2`` itself when the caller lets the gradient overwrite the saved hidden states: each
    tile's rows are written only after that tile's pass, the last read of them), else a new
    tensor. One tile and no ``into`` is the untiled op exactly (the fp32 ``dX`` cast once).
    Returns ``(dX [N, h] in x2's dtype, dW [v, h])``.
    """
    N, h = x2.shape
    tiles = list(tiles) if tiles else [slice(0, N)]
    acc = _acc_dtype(x2.dtype)
    total_dtype = torch.promote_types(grad_dtype or acc, acc)
    dx, dw = into, None
    for tile in tiles:
        dx_t, dw_t = _ring_pass(x2, tile, weight, group, grad_dtype, vocab_start, shard_dz, what,
                                token_chunk)
        if _tp_size(tp_group) > 1:
            _all_reduce(dx_t, dist.ReduceOp.SUM, tp_group, group.timeout)
        if dx is None and len(tiles) == 1:
            dx = dx_t.to(x2.dtype)  # untiled: today's single cast
        else:
            if dx is None:
                dx = torch.empty(N, h, dtype=x2.dtype, device=x2.device)
            dx[tile].copy_(dx_t)  # the tile's rows of X are not read again
        del dx_t
        if dw is None:  # the owner adds up the tiles' complete sums
            dw = dw_t if len(tiles) == 1 or dw_t.dtype == total_dtype else dw_t.to(total_dtype)
        else:
            dw.add_(dw_t)
        del dw_t
    return dx, dw


class _METPCrossEntropyFunction(torch.autograd.Function):
    """Autograd function of :func:`metp_output_cross_entropy` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group: METPGroup, tp_group, vocab_start: int,
                vocab_size: int, smoothing: float, grad_dtype, label: str, token_chunk: int,
                tiles, into_hidden: bool):
        check_finite(f"{label} (forward)", group, hidden=hidden, weight=weight)
        n, b, h = hidden.shape
        v = weight.shape[0]
        x2 = hidden.reshape(n * b, h)
        y = labels.t().reshape(-1)  # [b, n] -> token order of x2 ([n, b])
        N = y.numel()
        m = torch.full((N,), float("-inf"), dtype=torch.float32, device=hidden.device)
        l = torch.zeros(N, dtype=torch.float32, device=hidden.device)
        zy = torch.zeros_like(l)
        zsum = torch.zeros_like(l) if smoothing else None
        ring = RingExchanger(group, "output-layer shards (fwd)")
        shards = ring.circulate(weight.detach().clone()) if group.size > 1 else [(0, weight)]
        chunks = token_chunks(N, token_chunk)
        for t, w in shards:
            lo, hi = shard_rows(vocab_start, v, group.owner_at_step(t))
            for c in chunks:  # the tokens in chunks: the logits block is [<= token_chunk, v]
                z = torch.mm(x2[c], w.t()).float()  # [|C|, v]: the only logits alive
                local, inside = local_rows(y[c], lo, v)
                zy[c].add_(z.gather(1, local[:, None]).squeeze(1).masked_fill_(~inside, 0))
                if zsum is not None:
                    zsum[c].add_(z.sum(1))
                m_c = m[c]
                m_new = torch.maximum(m_c, z.amax(1))
                l[c].mul_(torch.exp(m_c - m_new)).add_(z.sub_(m_new[:, None]).exp_().sum(1))
                m_c.copy_(m_new)
                del z, m_new  # before the next block is formed: one logits block alive at a time
        if _tp_size(tp_group) > 1:
            m_all = m.clone()
            _all_reduce(m_all, dist.ReduceOp.MAX, tp_group, group.timeout)
            l.mul_(torch.exp(m - m_all))
            parts = torch.stack([l, zy] + ([zsum] if zsum is not None else []))
            _all_reduce(parts, dist.ReduceOp.SUM, tp_group, group.timeout)
            l, zy = parts[0], parts[1]
            zsum = parts[2] if zsum is not None else None
            m = m_all
        lse = m + torch.log(l)
        if smoothing:
            eps = smoothing * vocab_size / (vocab_size - 1)
            loss = lse - (1.0 - eps) * zy - eps * zsum / vocab_size
        else:
            eps = 0.0
            loss = lse - zy
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.group, ctx.tp_group, ctx.vocab_start, ctx.vocab_size = group, tp_group, vocab_start, \
            vocab_size
        ctx.eps, ctx.grad_dtype, ctx.label, ctx.token_chunk = eps, grad_dtype, label, token_chunk
        ctx.tiles, ctx.into_hidden = tiles, into_hidden
        return loss.view(n, b).t().contiguous()  # [b, n], contiguous like Megatron's loss

    @staticmethod
    @first_order_only("metp_output_cross_entropy")
    def backward(ctx, grad_loss):
        check_finite(f"{ctx.label} (backward)", ctx.group, grad_output=grad_loss)
        hidden, weight, labels, lse = ctx.saved_tensors
        group: METPGroup = ctx.group
        n, b, h = hidden.shape
        x2 = hidden.reshape(n * b, h)
        y = labels.t().reshape(-1)
        g = grad_loss.t().reshape(-1).float()
        eps, V = ctx.eps, ctx.vocab_size

        def shard_dz(w_j, lo, hi, c):  # dZ of the tokens of chunk c ([|C|, v])
            z = torch.mm(x2[c], w_j.t()).float()
            dz = z.sub_(lse[c, None]).exp_()  # softmax over the whole vocabulary, shard j
            if eps:
                dz.sub_(eps / V)
            local, inside = local_rows(y[c], lo, hi - lo)
            dz.scatter_add_(1, local[:, None], inside[:, None].to(dz.dtype) * -(1.0 - eps))
            dz.mul_(g[c, None])
            return dz.to(x2.dtype)

        into = x2 if ctx.into_hidden and ctx.needs_input_grad[0] else None
        dx, dw = _weight_ring_backward(x2, weight, group, ctx.grad_dtype, ctx.vocab_start,
                                       shard_dz, "output layer", ctx.token_chunk, ctx.tiles,
                                       ctx.tp_group, into)
        return (dx.view(n, b, h), dw.to(weight.dtype), None, None, None, None, None, None, None,
                None, None, None, None)


def _backward_tiles(hidden, token_tile):
    """The backward's token tiles for ``hidden`` ``[s/p, b, h]`` (:func:`.vocab.loss_tiles`)."""
    acc_elem = _acc_dtype(hidden.dtype).itemsize
    return loss_tiles(token_tile, hidden.shape[0] * hidden.shape[1], hidden.shape[-1], acc_elem)


def _gradient_fields(hidden, weight, tiles) -> dict:
    """What the agreement check compares about the backward: whether a gradient is needed and,
    if so, the token tile count (each tile is one pass of the ring; the forward is per token)."""
    grad = needs_grad(hidden, weight)
    return dict(needs_grad=grad, **(tiling.agreement_fields(len(tiles), "outer") if grad else {}))


def _check_grad_into_hidden(hidden, grad_into_hidden) -> bool:
    """Whether the backward may write ``dX`` into ``hidden`` (see ``grad_into_hidden``)."""
    if not isinstance(grad_into_hidden, bool):
        raise ValueError(f"grad_into_hidden must be True or False, got {grad_into_hidden!r}")
    if not (grad_into_hidden and hidden.requires_grad):
        return False  # no gradient of hidden: nothing to write
    if hidden.grad_fn is None:
        raise ValueError("grad_into_hidden=True but hidden is a leaf tensor: its gradient would "
                         "overwrite the caller's values; pass it only for an intermediate that "
                         "nothing reads after this op's backward")
    if hidden._base is not None:
        raise ValueError("grad_into_hidden=True but hidden is a view of a larger tensor (other "
                         "views of it could read the overwritten rows); pass a tensor of its own")
    if not hidden.is_contiguous():
        raise ValueError(f"grad_into_hidden=True needs a contiguous hidden [s/p, b, h], got "
                         f"strides {hidden.stride()}")
    return True


def _check_hidden(hidden, weight, group, grad_reduce_dtype):
    check_table(weight, "weight")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be this rank's tokens [s/p, b, h], got shape "
                         f"{tuple(hidden.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the output weight "
                         f"shard {tuple(weight.shape)} ([V/(t*p), h])")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; cast "
                         f"them to one dtype")
    if hidden.device != weight.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if grad_reduce_dtype is not None and not grad_reduce_dtype.is_floating_point:
        raise ValueError(f"grad_reduce_dtype must be a floating dtype, got {grad_reduce_dtype}")


def metp_output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                              group, tp_group=None, vocab_start: int = 0,
                              vocab_size: Optional[int] = None, label_smoothing: float = 0.0,
                              check_labels: bool = True,
                              grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
                              label: str = "metp_output_cross_entropy",
                              token_chunk: Optional[int] = None,
                              token_tile: Optional[int] = None,
                              grad_into_hidden: bool = False) -> torch.Tensor:
    """Per-token cross-entropy of ``softmax(hidden·Wᵀ)`` with the vocabulary shards on a ring.

    Args:
        hidden: this rank's final hidden states ``[s/p, b, h]``.
        weight: this rank's output-layer shard ``[v, h]`` (rows ``vocab_start + rank·v`` on).
        labels: target ids ``[b, s/p]`` in ``[0, V)``.
        group: the METP group (:class:`~megatron_metp.runtime.groups.METPGroup`, ProcessGroup or None).
        tp_group: Megatron's TP group when the vocabulary is also split over TP (``None``: no TP).
        vocab_start: first row of this METP group's range (``tp_rank·p·v``).
        vocab_size: the full padded vocabulary ``V`` (default ``p·v``: no TP).
        label_smoothing: Megatron's label smoothing (0 = off, the default).
        check_labels: check on every rank (one tiny all-reduce) that labels lie in ``[0, V)``.
        grad_reduce_dtype: dtype of the weight-gradient sum travelling the ring (default fp32).
        label: names this call in NaN/Inf reports and in the cross-rank agreement check
            (:mod:`megatron_metp.runtime.agree`, on by default).
        token_chunk: token rows (of the ``s/p·b`` flattened ``[s/p, b]`` tokens) per chunk of the
            per-shard compute, forward and backward. ``None`` (default): the environment variable
            ``METP_LOSS_TOKEN_CHUNK`` if set, else auto (``max(1, 2**28 // v)``: one fp32
            ``[token_chunk, v]`` logits chunk is at most 1 GiB). A positive integer, else
            ``ValueError`` (naming the argument or the variable) before any transfer. Changes
            neither the ring's messages nor the result beyond fp32 summation order.
        token_tile: token rows per tile of the backward (tile-outer: the weight ring runs once
            per tile, the tile's ``dX`` accumulated in fp32 and written into the ``dX`` output,
            the tiles' ``dW`` sums added up at the owner). ``None`` (default): the environment
            variable ``METP_LOSS_TOKEN_TILE`` if set, else auto (the most rows whose fp32 ``dX``
            accumulator fits ``METP_TILE_BUDGET_MIB``, 1 GiB: 65,536 rows at ``h = 4096``);
            ``0`` = whole. One tile is the untiled op; ``T`` tiles send the backward's weight
            shards and gradient sums ``T`` times. Every rank of the group must get the same
            tile count (the agreement check compares it when a gradient is needed).
        grad_into_hidden: write the gradient of ``hidden`` into ``hidden``'s own storage, tile by
            tile once the tile's ring pass is done (its last read), instead of a new tensor:
            saves ``[s/p·b, h]`` in ``hidden``'s dtype at the end of the backward. Only for a
            ``hidden`` that nothing reads after this op's backward (Megatron's final-norm output:
            :class:`megatron_metp.megatron.vocab.METPGPTModel` passes it); ``hidden`` must then
            be an intermediate (not a leaf: its values would be lost), contiguous and not a view
            (other views could read the rows), else ``ValueError``. The in-place write bumps
            ``hidden``'s version counter, so any other autograd node that saved ``hidden`` fails
            loudly ("modified by an inplace operation") instead of reading the gradient.

    Returns:
        ``[b, s/p]`` fp32 losses (unreduced; apply the loss mask and average as Megatron does).
        The weight shard's gradient is complete (summed over the group's tokens).

    Memory: the largest temporary is one ``[token_chunk, v]`` fp32 logits (or ``dZ``) chunk with
    its 16-bit twin, or one tile's fp32 ``dX`` accumulator ``[token_tile, h]``; besides the
    weight shards in flight and the fp32 weight-gradient sums ``[v, h]`` (one more with tiles:
    the owner's running total), the rest is the ``dX`` output ``[s/p·b, h]`` in the input dtype
    (none with ``grad_into_hidden``) or ``[s/p·b]``.
    """
    group = as_metp_group(group)
    name = op_label("metp_output_cross_entropy", label)
    try:
        _check_hidden(hidden, weight, group, grad_reduce_dtype)
        n, b, _ = hidden.shape
        if labels.dim() != 2 or tuple(labels.shape) != (b, n):
            raise ValueError(f"labels must be [b, s/p] = [{b}, {n}] like hidden [s/p, b, h], "
                             f"got {tuple(labels.shape)}")
        if labels.is_floating_point():
            raise ValueError(f"labels must be integer ids, got {labels.dtype}")
        t = _tp_size(tp_group)
        if vocab_size is None and t > 1:
            raise ValueError("vocab_size (the full padded vocabulary) is required with a TP "
                             "group")
        lo, hi = vocab_bounds(vocab_start, weight.shape[0], group.size, vocab_size)
        if hi != t * group.size * weight.shape[0]:
            raise ValueError(f"vocab_size {hi} != TP x METP x shard rows = {t}*{group.size}*"
                             f"{weight.shape[0]}: the shards do not cover the padded vocabulary")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        chunk = resolve_token_chunk(token_chunk, weight.shape[0], LOSS_TOKEN_CHUNK_ENV)
        tiles = _backward_tiles(hidden, token_tile)
        into = _check_grad_into_hidden(hidden, grad_into_hidden)
    except ValueError as exc:
        refuse_together(group, name, exc)
        raise
    if agreement_checks_enabled():  # token counts (and token chunks) may differ: per token
        check_group_agrees(group, name, label=label, hidden_size=hidden.shape[-1],
                           hidden_dtype=hidden.dtype, weight=weight, vocab_start=int(vocab_start),
                           vocab_size=hi, label_smoothing=float(label_smoothing),
                           check_labels=bool(check_labels), grad_reduce_dtype=grad_reduce_dtype,
                           **_gradient_fields(hidden, weight, tiles))
    if check_labels:
        check_ids(labels, lo, hi, group, "labels",
                  "check the data's token ids against the vocabulary size")
    return _METPCrossEntropyFunction.apply(hidden, weight, labels.long(), group, tp_group,
                                           int(vocab_start), int(hi), float(label_smoothing),
                                           grad_reduce_dtype, label, chunk, tiles, into)


class _METPLogitsFunction(torch.autograd.Function):
    """Autograd function of :func:`metp_output_logits`."""

    @staticmethod
    def forward(ctx, hidden, weight, group: METPGroup, grad_dtype, label: str, tiles):
        check_finite(f"{label} (forward)", group, hidden=hidden, weight=weight)
        n, b, h = hidden.shape
        v = weight.shape[0]
        x2 = hidden.reshape(n * b, h)
        out = torch.empty(n * b, group.size * v, dtype=hidden.dtype, device=hidden.device)
        ring = RingExchanger(group, "output-layer shards (fwd)")
        shards = ring.circulate(weight.detach().clone()) if group.size > 1 else [(0, weight)]
        for t, w in shards:
            j = group.owner_at_step(t)
            torch.mm(x2, w.t(), out=out[:, j * v:(j + 1) * v])
        ctx.save_for_backward(hidden, weight)
        ctx.group, ctx.grad_dtype, ctx.label, ctx.tiles = group, grad_dtype, label, tiles
        return out.view(n, b, group.size * v)

    @staticmethod
    @first_order_only("metp_output_logits")
    def backward(ctx, grad_logits):
        check_finite(f"{ctx.label} (backward)", ctx.group, grad_output=grad_logits)
        hidden, weight = ctx.saved_tensors
        n, b, h = hidden.shape
        v = weight.shape[0]
        x2 = hidden.reshape(n * b, h)
        g = grad_logits.reshape(n * b, -1).to(hidden.dtype)

        def shard_dz(w_j, lo, hi, c):
            return g[c, lo:hi]

        dx, dw = _weight_ring_backward(x2, weight, ctx.group, ctx.grad_dtype, 0, shard_dz,
                                       "output logits", tiles=ctx.tiles)
        return dx.view(n, b, h), dw.to(weight.dtype), None, None, None, None


def metp_output_logits(hidden: torch.Tensor, weight: torch.Tensor, *, group,
                       grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
                       label: str = "metp_output_logits",
                       token_tile: Optional[int] = None) -> torch.Tensor:
    """Logits of this rank's tokens over the METP group's vocabulary range, ``[s/p, b, p·v]``.

    The weight shards pass around the ring; the result equals Megatron's ``parallel_output``
    logits of TP rank ``τ`` (columns ``[τ·p·v, (τ+1)·p·v)``). For evaluation/generation: training
    uses :func:`metp_output_cross_entropy`, which never holds more than ``[token_chunk, v]``
    logits. Its forward is not tiled (its output is ``[s/p·b, p·v]`` anyway); its backward runs
    in token tiles as the loss's does (``token_tile``: see :func:`metp_output_cross_entropy`),
    so the fp32 ``dX`` accumulator is one tile's. Every rank of the group must get the same tile
    count (agreement check).
    """
    group = as_metp_group(group)
    name = op_label("metp_output_logits", label)
    try:
        _check_hidden(hidden, weight, group, grad_reduce_dtype)
        tiles = _backward_tiles(hidden, token_tile)
    except ValueError as exc:
        refuse_together(group, name, exc)
        raise
    if agreement_checks_enabled():
        check_group_agrees(group, name, label=label, hidden_size=hidden.shape[-1],
                           hidden_dtype=hidden.dtype, weight=weight,
                           grad_reduce_dtype=grad_reduce_dtype,
                           **_gradient_fields(hidden, weight, tiles))
    return _METPLogitsFunction.apply(hidden, weight, group, grad_reduce_dtype, label, tiles)
