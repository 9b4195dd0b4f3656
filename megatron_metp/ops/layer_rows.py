"""The row-wise parts of the streaming METP layer (:mod:`.layer`), one tile of token rows at a time.

Everything in a transformer layer except the attention core is row-wise: the two norms, the
output projection, the residual adds and the MLP (its weights on the METP ring, its tokens
local). So for a tile ``T`` of token rows (``R = |T|·b`` rows of ``[·, h]``)::

    forward     h1_T = x_T + O_T·Woᵀ + bo             O_T: every head group's attention output
                y_T  = h1_T + MLP(norm2(h1_T)) + b2    (:func:`mlp.forward_rows`, one ring pass)

    backward    (dy_T given)   h1_T, n2_T = norm2(h1_T) recomputed
                dn2_T = MLPᵀ(dy_T)                      (:func:`mlp.backward_pass`, one ring pass:
                                                         the MLP weights' gradients travel home)
                dh1_T = dy_T + norm2ᵀ(dn2_T)            written over dy_T

    dx          dn1_T = dqkv_T·Wqkv                     every head group's d(qkv), one GEMM
                dx_T  = dh1_T + norm1ᵀ(dn1_T)           written over dh1_T

``Wo`` and ``Wqkv`` are the whole layer's (every rank's shard, gathered for these passes: for
Llama-3-8B 32 and 48 MiB, next to 6 GiB for one ``[s/p, h]`` activation at 6M tokens) so that
each tile is one GEMM, rounded once, like stock TP's single projection.

:class:`RowNorm` runs a Megatron norm module (torch, apex, Transformer Engine or the
instruments' CUDA stand-ins: whatever the layer was built with) on a tile, and differentiates
it on the tile with ``torch.func.functional_call`` on detached copies of its parameters
(nothing reaches the parameters' own ``.grad`` or Megatron's hooks: the layer op returns the
summed gradients to autograd once).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional

import torch

from ..runtime.groups import METPGroup
from ..runtime.ring import RingExchanger
from ._accum import mm_new
from ._flat import FlatLayout
from . import mlp as mlp_ops


class RowNorm:
    """A norm module applied to tiles of rows ``[R_tokens, b, h]`` (``None``: identity)."""

    def __init__(self, module: Optional[torch.nn.Module]):
        self.module = module
        named = list(module.named_parameters()) if module is not None else []
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.grads: List[Optional[torch.Tensor]] = [None] * len(self.params)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if self.module is None:
            return rows
        return self.module(rows)

    def with_grad(self, rows: torch.Tensor):
        """``(leaf, out, leaves)``: the norm of ``rows`` as a small graph to differentiate."""
        leaf = rows.detach().requires_grad_()
        if self.module is None:
            return leaf, leaf, []
        leaves = [p.detach().requires_grad_(p.requires_grad) for p in self.params]
        with torch.enable_grad():
            out = torch.func.functional_call(self.module, dict(zip(self.names, leaves)), (leaf,))
        return leaf, out, leaves

    def backward(self, graph, grad: torch.Tensor) -> torch.Tensor:
        """``d rows`` of ``graph`` (from :meth:`with_grad`) for the output gradient ``grad``;
        the parameters' gradients are added (fp32) into :attr:`grads`."""
        leaf, out, leaves = graph
        if self.module is None:
            return grad
        wanted = [leaf] + [p for p in leaves if p.requires_grad]
        got = torch.autograd.grad(out, wanted, grad.view_as(out))
        it = iter(got[1:])
        for i, p in enumerate(leaves):
            if not p.requires_grad:
                continue
            g = next(it).float()
            self.grads[i] = g if self.grads[i] is None else self.grads[i].add_(g)
        return got[0]

    def param_grads(self) -> List[Optional[torch.Tensor]]:
        """The summed parameter gradients, in the parameters' dtypes."""
        return [None if g is None else g.to(p.dtype) for g, p in zip(self.grads, self.params)]


def gather_rows(group: METPGroup, shard: torch.Tensor, what: str) -> torch.Tensor:
    """Every rank's ``shard`` ``[m, k]`` stacked in group order ``[p·m, k]`` (one all-gather)."""
    if group.size == 1:
        return shard
    out = torch.empty((group.size * shard.shape[0],) + tuple(shard.shape[1:]), dtype=shard.dtype,
                      device=shard.device)
    RingExchanger(group, what).all_gather(out, shard.contiguous(), step=0).wait()
    return out


def attention_residual(x_t: torch.Tensor, o_t: torch.Tensor, wo_all_t: torch.Tensor,
                       bo: Optional[torch.Tensor]) -> torch.Tensor:
    """``h1 = x + (O·Woᵀ + bo)`` for rows ``x_t [R, h]``, ``o_t [R, A·d]`` (every head group's
    output, the gathered ``wo_all_t = Woᵀ`` ``[A·d, h]``): Megatron's projection then its
    bias-dropout-add without dropout."""
    a = torch.mm(o_t, wo_all_t)
    if bo is not None:
        a.add_(bo)
    return a.add_(x_t)


def mlp_forward(h1_t, norm2: RowNorm, w1, b1, w2, b2, group, activation, acc_dtype):
    """``y = h1 + MLP(norm2(h1)) + b2`` for one tile ``h1_t [Rt, b, h]``."""
    n2 = norm2.forward(h1_t)
    y = mlp_ops.forward_rows(n2.reshape(-1, n2.shape[-1]), w1, b1, w2, group, activation,
                             acc_dtype)
    del n2
    if b2 is not None:
        y.add_(b2)
    return y.view(h1_t.shape).to(h1_t.dtype).add_(h1_t)


class MLPBackward:
    """The MLP's backward over tiles: each :meth:`tile` runs one backward pass of the weight ring
    (the tile's shard gradients travel to their owners) and returns ``norm2ᵀ(MLPᵀ(dy))``; the
    owned shard's complete gradient is the sum over tiles (:attr:`acc`)."""

    def __init__(self, group: METPGroup, w1, b1, w2, activation: str, acc_dtype, grad_dtype):
        self.group, self.w1, self.b1, self.w2 = group, w1, b1, w2
        self.acc_dtype, self.grad_dtype = acc_dtype, grad_dtype
        self.layout = FlatLayout.of([w1, b1, w2])
        self.ring = RingExchanger(group, "mlp weights + grads (bwd)")
        self.ctx = SimpleNamespace(keep=False, activation=activation)
        self.acc = None

    def tile(self, n2_rows: torch.Tensor, dy_rows: torch.Tensor) -> torch.Tensor:
        """``d n2`` ``[R, h]`` (fp32 accumulation dtype) of the tile whose norm output is
        ``n2_rows`` and output gradient ``dy_rows`` (``[R, h]`` each)."""
        dx, acc_t = mlp_ops.backward_pass(self.ctx, self.group, self.ring, self.layout, n2_rows,
                                          dy_rows, self.w1, self.b1, self.w2, None, None,
                                          self.acc_dtype, self.grad_dtype)
        total = torch.promote_types(self.grad_dtype, self.acc_dtype)
        if self.acc is None:
            self.acc = acc_t if acc_t.dtype == total else acc_t.to(total)
        else:
            self.acc.add_(acc_t)
        return dx

    def grads(self):
        """``(dW1, db1, dW2)`` of this rank's own shards (complete: every rank, every tile)."""
        return self.layout.unpack(self.acc)


def dx_rows(dqkv_t: torch.Tensor, wqkv_all: torch.Tensor, acc_dtype) -> torch.Tensor:
    """``d n1 = d(qkv)·Wqkv`` for rows ``dqkv_t [R, Σ rows]`` and the gathered ``Wqkv``
    ``[Σ rows, h]``: one GEMM over every head group, rounded once (into ``acc_dtype``)."""
    return mm_new(dqkv_t, wqkv_all, acc_dtype)


class _StreamingNormFunction(torch.autograd.Function):
    """:func:`streaming_norm`: the forward writes ``norm(x)`` row tile by row tile (over ``x``'s
    storage once ``x`` is on the host); the backward re-forms each tile's norm from ``x`` and
    writes the input gradient over the output gradient."""

    @staticmethod
    def forward(ctx, spec, x, *params):
        n, b, h = x.shape
        N = n * b
        x2 = x.detach().view(N, h)
        keep = any(ctx.needs_input_grad)
        xs = None
        if keep and spec.host:
            from ..runtime.host_stash import Stash

            xs = Stash(N, h, x, host=True, offloader=spec.offloader)
            xs.write(slice(0, N), x2)
            xs.fence()
        in_place = spec.in_place and (xs is not None or not keep)
        y = x2 if in_place else torch.empty_like(x2)
        for t in spec.tiles:
            rows = slice(t.start * b, t.stop * b)
            y[rows].copy_(spec.norm.forward(x2[rows].view(-1, b, h)).reshape(-1, h))
        ctx.spec, ctx.x_stash, ctx.shape = spec, xs, (n, b, h)
        ctx.save_for_backward(x if keep and xs is None else None)
        if in_place:
            ctx.mark_dirty(x)
            return x
        return y.view(n, b, h)

    @staticmethod
    def backward(ctx, grad_y):
        from ..runtime.host_stash import Stash

        spec = ctx.spec
        n, b, h = ctx.shape
        N = n * b
        (x,) = ctx.saved_tensors
        xs = ctx.x_stash if ctx.x_stash is not None else Stash.wrap(x.view(N, h))
        dtype = xs.dtype
        dy = grad_y if (grad_y.dtype == dtype and grad_y.is_contiguous()) else \
            grad_y.to(dtype).contiguous().clone()
        dy2 = dy.view(N, h)
        spec.norm.grads = [None] * len(spec.norm.params)
        for t in spec.tiles:
            rows = slice(t.start * b, t.stop * b)
            graph = spec.norm.with_grad(xs.read(rows).view(-1, b, h))
            dy2[rows].copy_(spec.norm.backward(graph, dy2[rows]).reshape(-1, h))
            del graph
        if ctx.x_stash is not None:
            ctx.x_stash.release()
            ctx.x_stash = None
        return (None, dy.view(n, b, h), *spec.norm.param_grads())


def streaming_norm(x: torch.Tensor, norm: torch.nn.Module, *, host: bool = False,
                   offloader=None, in_place: bool = False, tile_rows: Optional[int] = None):
    """``norm(x)`` for ``x`` ``[n, b, h]`` (the streaming block's final norm): saves only ``x``
    (on the host with ``host``, read back tile by tile), runs in tiles of ``tile_rows`` tokens
    (default: a quarter GiB of ``[·, h]`` rows), writes its output over ``x`` where safe
    (``in_place``, as :func:`~megatron_metp.ops.layer.metp_layer`) and its input gradient over
    the output gradient: no ``[n, h]`` tensor beyond its input (or output) and their gradient."""
    from .tiles import tile_slices

    n, b, h = x.shape
    if not x.is_contiguous():
        raise ValueError("streaming_norm takes a contiguous x [s/p, b, h]")
    rows = tile_rows or max(1, (1 << 28) // max(1, b * h * x.element_size()))
    in_place = bool(in_place) and x._base is None and not (x.is_leaf and x.requires_grad)
    rn = RowNorm(norm)
    spec = SimpleNamespace(norm=rn, tiles=tile_slices(n, rows), host=bool(host),
                           offloader=offloader, in_place=in_place)
    return _StreamingNormFunction.apply(spec, x, *rn.params)
