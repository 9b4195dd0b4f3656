"""METP MLP: ``y = f(x·W1ᵀ + b1)·W2ᵀ + b2`` with the weights on a ring and the tokens local.

Layout on rank ``r`` of a METP group of size ``p`` (exactly what Megatron TP rank ``r`` holds):

* ``x``, ``y``: this rank's tokens, ``[n, b, h]`` with ``n = s/p``;
* ``fc1_weight`` (``W1_r``): ColumnParallelLinear shard, ``[k·F/p, h]`` where ``F`` is the FFN size
  and ``k = 2`` for SwiGLU (rows ``[gate_r | up_r]``), else 1; ``fc1_bias`` ``[k·F/p]``;
* ``fc2_weight`` (``W2_r``): RowParallelLinear shard ``[h, F/p]``; ``fc2_bias`` ``[h]`` replicated.

Forward (``p`` steps, weight ring). At step ``t`` rank ``r`` holds shard ``j = (r - t) mod p`` and
computes ``y_r += f(x_r·W1_jᵀ + b1_j)·W2_jᵀ`` while shard ``j-1`` is in flight. Then ``y_r += b2``.
Partial sums accumulate in fp32 and are cast to the input dtype once.

Backward (``p`` steps). With ``g = dL/dy_r``, ``z_j = x_r·W1_jᵀ + b1_j`` and ``a_j = f(z_j)``::

    dz_j = (g·W2_j) ⊙ f'(z_j)          dx_r  = Σ_j dz_j·W1_j          (local, fp32 accumulation)
    dW2_j = Σ_r gᵀ·a_j                 dW1_j = Σ_r dz_jᵀ·x_r          db1_j = Σ_r Σ_tokens dz_j

Rank ``r`` visits shards ``r-1, r-2, …, r`` (its own last). A gradient accumulator travels with
each shard: at every step a rank adds its tokens' contribution and passes the accumulator on, so
after ``p`` steps every shard's gradient arrives complete at its owner — a ring reduce-scatter
fused into the rotation, no all-reduce. ``db2`` is the local token sum: ``b2`` is replicated, so its
gradient is reduced over the group by whoever reduces replicated parameters (Megatron DDP over DP×CP).

Communication per rank and call: forward ``p-1`` weight shards; backward ``p-1`` weight shards plus
``p-1`` gradient shards (fp32 by default, ``grad_reduce_dtype``). Nothing scales with ``s``.

Memory: by default only ``x`` (and the parameters) are saved; ``z_j`` is recomputed as the shard
passes in backward. ``keep_intermediate=True`` saves every ``z_j`` instead (``[n·b, k·F]``, the whole
intermediate of this rank's tokens) and skips the recompute.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..runtime.finite import check_finite
from ..runtime.groups import METPGroup, as_metp_group
from ..runtime.ring import RingExchanger
from . import activations as act
from ._accum import mm_acc as _mm_acc
from ._accum import mm_into, mm_new
from ._first_order import first_order_only
from ._flat import FlatLayout
from ._grads import weight_grad
from . import tiles as tiling


def _check_inputs(x, w1, w2, b1, b2, group: METPGroup, activation, ffn_hidden_size,
                  grad_reduce_dtype):
    if activation not in act.ACTIVATIONS:
        raise ValueError(f"activation must be one of {act.ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be this rank's tokens [s/p, b, h], got shape {tuple(x.shape)}")
    h = x.shape[-1]
    k = act.fc1_rows_per_ffn(activation)
    if w1.dim() != 2 or w1.shape[1] != h:
        raise ValueError(f"fc1_weight must be [{k}*ffn/p, h={h}] (ColumnParallelLinear shard), "
                         f"got {tuple(w1.shape)}")
    if w1.shape[0] % k:
        raise ValueError(f"fc1_weight for activation={activation!r} must have an even number of rows "
                         f"(gate then up), got {w1.shape[0]}")
    f = w1.shape[0] // k
    if w2.dim() != 2 or tuple(w2.shape) != (h, f):
        raise ValueError(f"fc2_weight must be [h={h}, ffn/p={f}] (RowParallelLinear shard matching "
                         f"fc1_weight), got {tuple(w2.shape)}")
    if b1 is not None and tuple(b1.shape) != (w1.shape[0],):
        raise ValueError(f"fc1_bias must be [{w1.shape[0]}] like fc1_weight's rows, got {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (h,):
        raise ValueError(f"fc2_bias must be replicated [h={h}], got {tuple(b2.shape)}")
    if ffn_hidden_size is not None:
        if ffn_hidden_size % group.size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by the METP group "
                             f"size {group.size}; pick a METP size that divides it")
        if f != ffn_hidden_size // group.size:
            raise ValueError(f"fc1_weight holds {f} FFN units but ffn_hidden_size/p = "
                             f"{ffn_hidden_size}/{group.size} = {ffn_hidden_size // group.size}: "
                             f"the shards do not match the group size (wrong group?)")
    named = [("x", x), ("fc1_weight", w1), ("fc2_weight", w2), ("fc1_bias", b1), ("fc2_bias", b2)]
    for name, t in named[1:]:
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but x has {x.dtype}; cast them to one dtype")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; move them to one device")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if grad_reduce_dtype is not None and not grad_reduce_dtype.is_floating_point:
        raise ValueError(f"grad_reduce_dtype must be a floating dtype, got {grad_reduce_dtype}")
    backend = group.backend
    if backend is not None:
        if "nccl" in backend and not x.is_cuda:
            raise ValueError(f"group {group.name!r} uses NCCL but x is on {x.device}; move the "
                             f"tensors to this rank's GPU")
        if backend == "gloo" and x.is_cuda:
            raise ValueError(f"group {group.name!r} uses gloo, which cannot send CUDA tensors here; "
                             f"use an NCCL group for GPU tensors")


class _METPMLPFunction(torch.autograd.Function):
    """Autograd function of :func:`metp_mlp` (see the module docstring for the equations).

    ``tiles``: the token-row slices (:mod:`.tiles`); one slice of every row is the untiled op.
    ``order``: ``"outer"`` runs the whole ring once per tile, ``"inner"`` runs it once and every
    step over the tiles (full-size fp32 accumulators)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, group: METPGroup, activation: str, keep: bool,
                grad_dtype: torch.dtype, label: str, tiles, order: str):
        check_finite(f"{label} (forward)", group, x=x, fc1_weight=w1, fc2_weight=w2, fc1_bias=b1,
                     fc2_bias=b2)
        ctx.label = label
        n_tok = x.shape[0] * x.shape[1]
        h = x.shape[-1]
        x2 = x.reshape(n_tok, h)
        layout = FlatLayout.of([w1, b1, w2])
        ring = RingExchanger(group, "mlp weights (fwd)")
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        T = len(tiles)
        kept = [None] * (group.size * T)
        inner = order == "inner" and T > 1
        passes = [None] if inner or T == 1 else list(range(T))

        def shard_rows(i, rows, w1j, b1j, w2j, j, y):
            z = torch.addmm(b1j, rows, w1j.t()) if b1j is not None else torch.mm(rows, w1j.t())
            a = act.forward(activation, z)
            if y is None:
                y = mm_new(a, w2j.t(), acc_dtype)
            else:
                _mm_acc(y, a, w2j.t())
            if keep:
                kept[i * group.size + j] = z
            return y

        out = None if T == 1 else torch.empty(n_tok, h, dtype=x.dtype, device=x.device)
        for tile in passes:
            y = None
            for t, j, (w1j, b1j, w2j) in weight_shards(group, ring, layout, (w1, b1, w2)):
                if tile is None and inner:  # tile-inner: every tile at each step
                    if y is None:
                        y = torch.empty(n_tok, h, dtype=acc_dtype, device=x.device)
                    for i, sl in enumerate(tiles):
                        z = _z(x2[sl], w1j, b1j)
                        a = act.forward(activation, z)
                        if t == 0:
                            mm_into(y[sl], a, w2j.t())
                        else:
                            _mm_acc(y[sl], a, w2j.t())
                        if keep:
                            kept[i * group.size + j] = z
                        del z, a
                else:
                    i = 0 if tile is None else tile
                    y = shard_rows(i, x2 if tile is None else x2[tiles[tile]], w1j, b1j, w2j, j, y)
            if b2 is not None:
                y.add_(b2)
            if out is None:
                out = y.to(x.dtype)
            elif inner:
                out.copy_(y)
            else:
                out[tiles[tile]].copy_(y)
            del y
        ctx.group, ctx.activation, ctx.keep, ctx.grad_dtype = group, activation, keep, grad_dtype
        ctx.tiles, ctx.order = tiles, order
        ctx.x_shape = x.shape
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, w1, b1, w2, *(kept if keep else []))
        return out.view(x.shape)

    @staticmethod
    @first_order_only("metp_mlp")
    def backward(ctx, grad_y):
        check_finite(f"{ctx.label} (backward)", ctx.group, grad_output=grad_y)
        group: METPGroup = ctx.group
        x, w1, b1, w2, *kept = ctx.saved_tensors
        b1 = b1 if ctx.has_b1 else None
        p = group.size
        n_tok, h = x.shape[0] * x.shape[1], x.shape[-1]
        x2 = x.reshape(n_tok, h)
        g = grad_y.reshape(n_tok, h).to(x.dtype)
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        grad_dtype = ctx.grad_dtype or acc_dtype
        db2 = g.sum(0, dtype=acc_dtype).to(x.dtype) if ctx.has_b2 else None
        w_layout = FlatLayout.of([w1, b1, w2])
        ring = RingExchanger(group, "mlp weights + grads (bwd)")
        tiles = ctx.tiles
        T = len(tiles)

        if T == 1 or ctx.order == "inner":
            kept_of = (lambda i, j: kept[i * p + j]) if ctx.keep else None
            dx, acc = backward_pass(ctx, group, ring, w_layout, x2, g, w1, b1, w2, kept_of,
                                    tiles if T > 1 else None, acc_dtype, grad_dtype)
            dx = dx.to(x.dtype)
        else:  # tile-outer: the whole ring once per tile; the owners add up the tiles' sums
            dx = torch.empty(n_tok, h, dtype=x.dtype, device=x.device)
            acc = None
            total_dtype = torch.promote_types(grad_dtype, acc_dtype)
            for i, sl in enumerate(tiles):
                kept_of = (lambda _i, j, i=i: kept[i * p + j]) if ctx.keep else None
                dx_t, acc_t = backward_pass(ctx, group, ring, w_layout, x2[sl], g[sl], w1, b1,
                                            w2, kept_of, None, acc_dtype, grad_dtype)
                dx[sl].copy_(dx_t)
                del dx_t
                if acc is None:
                    acc = acc_t if acc_t.dtype == total_dtype else acc_t.to(total_dtype)
                else:
                    acc.add_(acc_t)
                del acc_t

        dw1, db1, dw2 = w_layout.unpack(acc)
        return (dx.view(ctx.x_shape), weight_grad(w1, dw1),
                weight_grad(b1, db1), weight_grad(w2, dw2), db2,
                None, None, None, None, None, None, None)


def _z(rows, w1j, b1j):
    """``rows·W1_jᵀ + b1_j``."""
    return torch.addmm(b1j, rows, w1j.t()) if b1j is not None else torch.mm(rows, w1j.t())


def weight_shards(group: METPGroup, ring: RingExchanger, layout: FlatLayout, own):
    """Yield ``(t, j, (W1_j, b1_j, W2_j))`` for the ``p`` steps of one forward pass of the weight
    ring (shard ``j = (r − t) mod p`` at step ``t``, the next one in flight); ``own`` is this
    rank's ``(W1, b1, W2)``."""
    if group.size == 1:
        yield 0, 0, tuple(own)
        return
    for t, flat in ring.circulate(layout.pack(list(own))):
        yield t, group.owner_at_step(t), (tuple(own) if t == 0 else tuple(layout.unpack(flat)))


def forward_rows(rows: torch.Tensor, w1, b1, w2, group: METPGroup, activation: str,
                 acc_dtype: torch.dtype) -> torch.Tensor:
    """One pass of the weight ring over token ``rows`` ``[R, h]``: ``Σ_j f(rows·W1_jᵀ + b1_j)·W2_jᵀ``
    in ``acc_dtype`` (``[R, h]``, no ``b2``), each shard's product added with one rounding. The
    streaming layer's MLP forward of one token tile (:mod:`.layer_rows`)."""
    layout = FlatLayout.of([w1, b1, w2])
    ring = RingExchanger(group, "mlp weights (fwd)")
    y = None
    for _, _, (w1j, b1j, w2j) in weight_shards(group, ring, layout, (w1, b1, w2)):
        a = act.forward(activation, _z(rows, w1j, b1j))
        if y is None:
            y = mm_new(a, w2j.t(), acc_dtype)
        else:
            _mm_acc(y, a, w2j.t())
        del a
    return y


def backward_pass(ctx, group: METPGroup, ring: RingExchanger, w_layout: FlatLayout, x2, g,
                  w1, b1, w2, kept_of, tiles, acc_dtype, grad_dtype):
    """One backward pass of the weight ring over the rows ``x2``/``g`` ``[R, h]``: returns
    ``(dx [R, h] in acc_dtype, the complete flat (dW1, db1, dW2) of this rank's own shard)``.
    ``tiles``: row slices each ring step walks one by one (tile-inner), or ``None`` (all rows
    at once). ``kept_of(i, j)``: the kept ``z`` of tile ``i`` (0 without tiles) and shard ``j``."""
    p, r = group.size, group.rank
    g_layout = w_layout  # gradients of (W1_j, b1_j, W2_j) have the weights' shapes
    dx = None
    pieces = [(0, slice(None))] if tiles is None else list(enumerate(tiles))

    def shard_dz(rows_x, rows_g, w1j, b1j, w2j, i, j):
        """``(dz, a)`` of one shard over some rows."""
        z = kept_of(i, j) if ctx.keep else _z(rows_x, w1j, b1j)
        a = act.forward(ctx.activation, z)
        dz = act.backward(ctx.activation, z, torch.mm(rows_g, w2j))
        return dz, a

    def add_grads(flat, rows_x, rows_g, dz, a, first):
        """This rank's (dW1, db1, dW2) of the shard into its travelling sum ``flat``;
        ``first``: the sum starts here (written, not added: no zero fill)."""
        dw1, db1, dw2 = g_layout.unpack(flat)
        if first:
            mm_into(dw1, dz.t(), rows_x)
            mm_into(dw2, rows_g.t(), a)
            if db1 is not None:
                torch.sum(dz, 0, dtype=db1.dtype, out=db1)
            return
        _mm_acc(dw1, dz.t(), rows_x)
        _mm_acc(dw2, rows_g.t(), a)
        if db1 is not None:
            db1.add_(dz.sum(0, dtype=acc_dtype))

    def shard_step(w1j, b1j, w2j, j, t, flat=None, wait=None):
        """The shard's dz over the rows: dx += dz·W1_j; its gradients go into ``flat`` (after
        ``wait()``: the travelling sum may still be arriving), tile by tile when tile-inner."""
        nonlocal dx
        if tiles is None:
            dz, a = shard_dz(x2, g, w1j, b1j, w2j, 0, j)
            if dx is None:
                dx = mm_new(dz, w1j, acc_dtype)
            else:
                _mm_acc(dx, dz, w1j)
            if wait is not None:
                wait()
            add_grads(flat(), x2, g, dz, a, t == 0)
            return
        if wait is not None:
            wait()
        if dx is None:
            dx = torch.empty(x2.shape[0], x2.shape[1], dtype=acc_dtype, device=x2.device)
        buf = flat()
        for i, sl in pieces:
            dz, a = shard_dz(x2[sl], g[sl], w1j, b1j, w2j, i, j)
            if t == 0:
                mm_into(dx[sl], dz, w1j)
            else:
                _mm_acc(dx[sl], dz, w1j)
            add_grads(buf, x2[sl], g[sl], dz, a, t == 0 and i == 0)
            del dz, a

    # Rank r visits shards r-1, r-2, ..., r+1, r: its own last, so each gradient sum ends
    # its p-1 hops at the shard's owner. One batched exchange per step carries the shard the
    # next step needs (a step ahead) and the previous shard's gradient sum (waited for only
    # after this shard's dz and dx are done).
    sums = [torch.empty(g_layout.numel, dtype=grad_dtype, device=x2.device), None]
    cur = 0
    if p > 1:
        own = w_layout.pack([w1, b1, w2])
        held = ring.start(own, torch.empty_like(own), step=0).wait()  # shard r-1; the
        spare = own  # one transfer not hidden behind compute
    for t in range(p):
        last = t == p - 1
        j = r if last else group.owner_at_step(t, offset=1)
        sends, recvs = [], []
        prefetch = not last and t + 1 <= p - 2
        if prefetch:
            sends.append(held)
            recvs.append(spare)
        if t >= 1:
            if sums[1 - cur] is None:
                sums[1 - cur] = torch.empty_like(sums[cur])
            sends.append(sums[cur])
            recvs.append(sums[1 - cur])
        step = ring.exchange(sends, recvs, step=t + 1) if sends else None

        def wait(step=step, t=t, last=last):
            nonlocal held, spare, cur
            if step is not None:
                step.wait()
            if t >= 1:
                cur = 1 - cur
            if last:
                sums[1 - cur] = None
                held = spare = None

        ws = (w1, b1, w2) if last else w_layout.unpack(held)
        shard_step(*ws, j, t, flat=lambda: sums[cur], wait=wait)
        step = None
        if prefetch:
            held, spare = spare, held
    return dx, sums[cur]


def metp_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, *, group,
             activation: str = "gelu", fc1_bias: Optional[torch.Tensor] = None,
             fc2_bias: Optional[torch.Tensor] = None, keep_intermediate: bool = False,
             ffn_hidden_size: Optional[int] = None,
             grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
             label: str = "metp_mlp", token_tile: Optional[int] = None) -> torch.Tensor:
    """The METP MLP block ``y = f(x·W1ᵀ + b1)·W2ᵀ + b2`` over a weight ring.

    Args:
        x: this rank's tokens ``[s/p, b, h]``.
        fc1_weight: this rank's ColumnParallelLinear shard ``[k·F/p, h]`` (``k=2`` for swiglu,
            rows gate then up, as Megatron's TP shard).
        fc2_weight: this rank's RowParallelLinear shard ``[h, F/p]``.
        group: a :class:`~megatron_metp.runtime.groups.METPGroup` (or a ProcessGroup, or ``None`` for p=1).
        activation: ``"gelu"`` or ``"swiglu"``.
        fc1_bias: ``[k·F/p]``, sharded like ``fc1_weight``. fc2_bias: ``[h]``, replicated, added once.
        keep_intermediate: save ``x·W1ᵀ`` of every shard instead of recomputing it in backward.
        ffn_hidden_size: the full ``F``; when given, the shard shapes are checked against it.
        grad_reduce_dtype: dtype of the weight-gradient accumulators that travel the ring
            (default fp32; ``None`` = the accumulation dtype, fp32 for 16-bit inputs; Megatron's
            METP modules pass their ``main_grad``'s dtype). Each hop adds its contribution in
            one GEMM (fp32 inside) and rounds once into this dtype. Where a weight has
            Megatron's ``main_grad``, its complete gradient is added there directly (no rounding
            to the weight's dtype first; :mod:`._grads`).
        label: names this call in NaN/Inf reports (:mod:`megatron_metp.runtime.finite`) and in the
            cross-rank agreement check (:mod:`megatron_metp.runtime.agree`, on by default), which also
            requires it, every shape/dtype and every option to be equal on all ranks of the
            group.
        token_tile: token rows (of ``s/p·b``) per tile (:mod:`.tiles`): ``None`` = the
            environment variable ``METP_MLP_TOKEN_TILE``, else auto from ``METP_TILE_BUDGET_MIB``
            (default 1 GiB of token-proportional transient per tile); ``0`` = whole. One tile is
            the untiled op; ``T`` tiles run the weight ring ``T`` times (tile-outer;
            ``METP_MLP_TILE_ORDER=inner``: once, each step over the tiles). Every rank of the
            group must get the same tile count (checked with the agreement check).

    Returns:
        ``y`` ``[s/p, b, h]``: this rank's tokens' MLP output. Gradients of the weight shards are
        complete (summed over every rank's tokens); ``fc2_bias``'s gradient is this rank's part.
    """
    group = as_metp_group(group)
    try:
        _check_inputs(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, group, activation,
                      ffn_hidden_size, grad_reduce_dtype)
        n_rows = x.shape[0] * x.shape[1]
        k = act.fc1_rows_per_ffn(activation)
        acc_elem = 4 if x.dtype in (torch.float16, torch.bfloat16) else x.element_size()
        rows = tiling.resolve_rows(token_tile, n_rows, tiling.mlp_row_bytes(
            x.shape[-1], fc1_weight.shape[0] // k, k, x.element_size(), acc_elem,
            bool(keep_intermediate)))
        tiles = tiling.tile_slices(n_rows, rows)
        order = tiling.tile_order()
    except ValueError as exc:
        refuse_together(group, op_label("metp_mlp", label), exc)
        raise
    if agreement_checks_enabled():
        # Each rank's tokens are its own: only x's hidden size and dtype must agree (a rank with
        # more or fewer tokens than its peers still gets the right result).
        check_group_agrees(group, op_label("metp_mlp", label), label=label,
                           x_hidden_size=x.shape[-1], x_dtype=x.dtype, fc1_weight=fc1_weight,
                           fc2_weight=fc2_weight, fc1_bias=fc1_bias, fc2_bias=fc2_bias,
                           activation=activation,
                           keep_intermediate=bool(keep_intermediate),
                           ffn_hidden_size=ffn_hidden_size, grad_reduce_dtype=grad_reduce_dtype,
                           needs_grad=needs_grad(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias),
                           **tiling.agreement_fields(len(tiles), order))
    return _METPMLPFunction.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, group,
                                  activation, bool(keep_intermediate), grad_reduce_dtype, label,
                                  tiles, order)
