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

With TP, dX is summed over TP at the end. Saved for backward: ``X``, ``labels`` and ``lse``
(``[n·b]`` fp32); nothing of size ``V``.

Tiling and memory. ``token_chunk`` (keyword argument; else the environment variable
``METP_LOSS_TOKEN_CHUNK``; else auto: the most rows with ``token_chunk·v <= 2**28``, i.e. one
fp32 logits chunk of at most 1 GiB — 16,644 tokens for Llama-3's vocabulary at ``p = 8``,
``V = 129024`` padded, ``v = 16128``) bounds every temporary with a vocabulary axis: the largest
is one ``[token_chunk, v]`` fp32 logits / ``dZ`` chunk (with its 16-bit twin), whatever the
number of tokens per rank. What still grows with the tokens is ``[n·b, h]`` (``X``, the fp32
``dX`` accumulator and its copy in the input dtype) and ``[n·b]`` (``m``, ``l``, ``z_y``,
``lse``, labels); per chunk the backward adds ``[token_chunk, h]`` and ``[v, h]`` fp32 products
(``mm_acc``'s CUDA branch). The ring is untouched by the tiling: the same shards in the same
order, the same messages and sizes (``group.stats``), one chunk loop per ring step; ranks may use
different chunks. The loss and ``dX`` are per token; ``dW_j`` is summed chunk after chunk
(``Σ_C dZ_{C,j}ᵀ·X_C`` instead of one matmul), so results equal the untiled op's up to the fp32
rounding of that order.

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
from .vocab import (LOSS_TOKEN_CHUNK_ENV, check_ids, check_table, local_rows, resolve_token_chunk,
                    shard_rows, token_chunks, vocab_bounds)


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


def _weight_ring_backward(x2, weight, group: METPGroup, grad_dtype, vocab_start, shard_dz, what,
                          token_chunk=None):
    """The backward ring shared by the loss and the logits path.

    For every shard ``j`` (visited ``r-1, r-2, …, r``: the owner's last) and every chunk ``C`` of
    ``token_chunk`` token rows (all ``N`` rows at once if ``None``), ``shard_dz(w_j, lo, hi, C)``
    returns ``dZ_{C,j}`` ``[|C|, v]`` in the input dtype for the shard's rows ``[lo, hi)``
    (counted from ``vocab_start``); ``dX_C += dZ_{C,j}·W_j`` locally and ``dZ_{C,j}ᵀ·X_C`` is
    added into the gradient sum travelling with shard ``j``. Returns ``(dX, dW)`` (``dW``
    complete for this rank's shard). The chunks change only the compute between ring steps.
    """
    p = group.size
    v, h = weight.shape
    acc = _acc_dtype(x2.dtype)
    dx = torch.zeros(x2.shape[0], h, dtype=acc, device=x2.device)
    sums = TravellingSum(RingExchanger(group, f"{what} grads (bwd)"), v * h, grad_dtype or acc,
                         x2.device)
    w_ring = RingExchanger(group, f"{what} weights (bwd)")

    N = x2.shape[0]
    chunks = token_chunks(N, token_chunk or max(1, N)) or [slice(0, 0)]

    def visit(w_j, j):
        lo, hi = shard_rows(vocab_start, v, j)
        dw = sums.buffer().view(v, h)
        for c in chunks:
            dz = shard_dz(w_j, lo, hi, c)
            mm_acc(dx[c], dz, w_j)
            mm_acc(dw, dz.t(), x2[c])
            del dz  # one chunk's dZ alive at a time

    if p > 1:
        first = weight.detach().clone()
        held = w_ring.start(first, torch.empty_like(first), step=0).wait()
        for t, w_j in w_ring.circulate(held, steps=p - 1, spare=first):
            visit(w_j, group.owner_at_step(t, offset=1))
            sums.pass_on()
    visit(weight, group.rank)
    return dx, sums.buffer().view(v, h)


class _METPCrossEntropyFunction(torch.autograd.Function):
    """Autograd function of :func:`metp_output_cross_entropy` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group: METPGroup, tp_group, vocab_start: int,
                vocab_size: int, smoothing: float, grad_dtype, label: str, token_chunk: int):
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

        dx, dw = _weight_ring_backward(x2, weight, group, ctx.grad_dtype, ctx.vocab_start,
                                       shard_dz, "output layer", ctx.token_chunk)
        if _tp_size(ctx.tp_group) > 1:
            _all_reduce(dx, dist.ReduceOp.SUM, ctx.tp_group, group.timeout)
        return (dx.to(hidden.dtype).view(n, b, h), dw.to(weight.dtype), None, None, None, None,
                None, None, None, None, None)


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
                              token_chunk: Optional[int] = None) -> torch.Tensor:
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

    Returns:
        ``[b, s/p]`` fp32 losses (unreduced; apply the loss mask and average as Megatron does).
        The weight shard's gradient is complete (summed over the group's tokens).

    Memory: the largest temporary is one ``[token_chunk, v]`` fp32 logits (or ``dZ``) chunk with
    its 16-bit twin; besides the weight shards in flight and the fp32 weight-gradient sums
    ``[v, h]``, the rest is ``[s/p·b, h]`` (``dX``) or ``[s/p·b]``.
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
    except ValueError as exc:
        refuse_together(group, name, exc)
        raise
    if agreement_checks_enabled():  # token counts (and token chunks) may differ: per token
        check_group_agrees(group, name, label=label, hidden_size=hidden.shape[-1],
                           hidden_dtype=hidden.dtype, weight=weight, vocab_start=int(vocab_start),
                           vocab_size=hi, label_smoothing=float(label_smoothing),
                           check_labels=bool(check_labels), grad_reduce_dtype=grad_reduce_dtype,
                           needs_grad=needs_grad(hidden, weight))
    if check_labels:
        check_ids(labels, lo, hi, group, "labels",
                  "check the data's token ids against the vocabulary size")
    return _METPCrossEntropyFunction.apply(hidden, weight, labels.long(), group, tp_group,
                                           int(vocab_start), int(hi), float(label_smoothing),
                                           grad_reduce_dtype, label, chunk)


class _METPLogitsFunction(torch.autograd.Function):
    """Autograd function of :func:`metp_output_logits`."""

    @staticmethod
    def forward(ctx, hidden, weight, group: METPGroup, grad_dtype, label: str):
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
        ctx.group, ctx.grad_dtype, ctx.label = group, grad_dtype, label
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
                                       "output logits")
        return dx.to(hidden.dtype).view(n, b, h), dw.to(weight.dtype), None, None, None


def metp_output_logits(hidden: torch.Tensor, weight: torch.Tensor, *, group,
                       grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
                       label: str = "metp_output_logits") -> torch.Tensor:
    """Logits of this rank's tokens over the METP group's vocabulary range, ``[s/p, b, p·v]``.

    The weight shards pass around the ring; the result equals Megatron's ``parallel_output``
    logits of TP rank ``τ`` (columns ``[τ·p·v, (τ+1)·p·v)``). For evaluation/generation: training
    uses :func:`metp_output_cross_entropy`, which never holds more than ``[token_chunk, v]``
    logits. Not tiled (its output is ``[s/p·b, p·v]`` anyway).
    """
    group = as_metp_group(group)
    _check_hidden(hidden, weight, group, grad_reduce_dtype)
    return _METPLogitsFunction.apply(hidden, weight, group, grad_reduce_dtype, label)
