"""The streaming METP layer: a whole transformer layer as one op that keeps only its input.

``metp_layer`` is Megatron's pre-norm GPT layer ::

    h1 = x + Attn(norm1(x))·Woᵀ + bo          (METP attention: head-group loop, K/V ring)
    y  = h1 + MLP(norm2(h1)) + b2             (METP MLP: weight ring)

computed so that nothing the size of this rank's tokens is held whole on the device beyond the
layer's input/output and its gradient, whatever ``s/p``. It is what Megatron's full recompute
of one layer per checkpoint (``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``) computes, organised for memory:

* **Saved for backward: the layer input ``x`` only** — on the host when the layer is offloaded
  (``host=True``, :mod:`megatron_metp.runtime.host_stash`: the layer then reads it back tile by
  tile and never holds it whole on the device), else on the device. The forward writes ``y``
  over ``x``'s storage (``in_place``) once ``x`` is safely on the host.
* **Forward**, per head group ``g``: ``K_g``, ``V_g`` of every local token, then per *query
  tile* (``q`` tokens; causal ``dual_chunk``: mirrored rows of both chunks, so the ring's ranks
  are evenly loaded at every step, :mod:`.balance`) the K/V ring (:mod:`.layer_attention`):
  ``O_g`` of the tile goes to a
  stash (host when offloading). Then per *row tile* (``rows`` tokens,
  :mod:`.layer_rows`): ``h1 = x + O·Woᵀ + bo`` and ``y = h1 + MLP(norm2(h1)) + b2`` (one MLP
  weight-ring pass per tile, as :mod:`.mlp`'s token tiles).
* **Backward**, given ``dy`` (overwritten in place: it becomes ``dh1``, then ``dx``):

  1. the attention forward again, per group and query tile: ``O_g`` to the stash, ``lse_g``
     kept (``[b, H, n]`` fp32 per group) — the recompute; skipped with ``keep_attention``
     (below). ``K_{g+1}, V_{g+1}`` are formed from the query tiles' ``norm1(x)`` of group
     ``g`` (only group 0's have a pass of their own), the last group's forming the backward's
     group 0 (:mod:`.layer_reads`);
  2. per row tile: ``h1`` recomputed from ``x`` and ``O``, ``dn2 = MLPᵀ(dy)`` (one backward
     pass of the MLP ring: its weight gradients travel home), ``dh1 = dy + norm2ᵀ(dn2)``;
  3. per group and query tile: ``dO_g = dh1·Wo_g``, the K/V ring backward (``dq`` of the tile
     complete; ``dK/dV`` of every rank's keys travel home and are summed over the tiles),
     ``dq_g`` to a stash, ``dWq_g``, ``dWo_g``; the same reads of ``x`` reduce group
     ``g − 1``'s ``d(kv)`` (``dWk/dWv``, its rows to a stash) and form ``K_{g+1}, V_{g+1}``;
     group ``g``'s weight gradients go to their owner once its ``d(kv)`` is reduced;
  4. per row tile: ``dx = dh1 + norm1ᵀ(d(qkv)·Wqkv)`` (every group's ``d(qkv)``, one GEMM),
     the last group's ``d(kv)`` (still on the device) reduced in the same pass.

What the device holds, besides ``dy``: two head groups' ``K, V`` (the group's and the next
one's, or the previous group's ``d(kv)`` in the same buffers) and one group's fp32 ``dK/dV``
(``n·G·d·(4+8)`` bytes per K/V head: 1.3 GiB for Llama-3-8B at 768K tokens per rank, against
6 GiB for one ``[n, h]`` activation), the ring buffers of one K/V sub-block, and one tile's
working set (:class:`~megatron_metp.ops.tiles.LayerTiles`: a budget, 1 GiB by default). The
attention runs ``T_q`` rings per group instead of one (K/V traffic ×``T_q``, hidden while a
tile's step outlasts its transfer: ``metp plan`` reports it), the MLP ``T_rows`` ring passes.

**Kept attention** (``keep_attention=True``, ``--metp-keep-attention-output``): the forward keeps
every group's ``O_g`` stash (``[n·b, H·d]``, the size of the layer input) and its ``lse_g``
(fp32 ``[b, H, n]``, a stash of ``b·H`` rows of ``n``) for the backward, on the host where the
layer input goes to the host (``host``), else on the device; the backward skips step 1 (the
attention forward never runs a second time: one K/V ring per group and query tile per layer,
not two) and runs steps 2–4 from the kept ``O`` and ``lse``, re-forming ``q``, ``K``, ``V`` from
``x`` (norm, projection, q/k norm, RoPE) in step 3. Each group's kept ``O`` and ``lse`` are
released once its step 3 is done. The gradients are the recompute's: the recompute forms ``O``
and ``lse`` by the same code on the same inputs, bit for bit (``tests/test_layer_keep.py``).

Exactness: the same arithmetic as the METP layer of :mod:`.attention` and :mod:`.mlp` plus
Megatron's norms and bias-dropout-add, up to the order of fp32 sums (one GEMM over every head
for the projection and for ``dx``, like stock TP's single matmuls); ``tests/test_layer.py``.
Not covered (the caller uses the separate ops instead): TP > 1 inside the layer, dropout,
``keep_intermediate``.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Optional

import torch

from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                             refuse_together)
from ..runtime.finite import check_finite
from ..runtime.groups import as_metp_group
from ..runtime import loop_sample
from ..runtime.host_stash import Stash
from . import activations as act
from ._first_order import first_order_only
from ._grads import weight_grad
from .attention import prepare_attention
from .attention_prep import HeadGeometry
from .attention_weights import block_weights, keep_owned
from .head_norm import head_norm_grads
from .balance import kv_blocks as balanced_kv_blocks, query_tiles
from .layer_attention import (GroupGrads, PrevKV, Rows, backward_group, deliver, forward_group,
                              kv_form, token_rows, weights_ahead)
from .layer_rows import (MLPBackward, RowNorm, attention_residual, dx_rows, gather_rows,
                         mlp_forward)
from .tiles import LayerTiles, mlp_row_bytes


def _acc(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _token_rows(t: slice, b: int) -> slice:
    return slice(t.start * b, t.stop * b)


def _write_tile(stash, t, b: int, rows: torch.Tensor) -> None:
    """``rows`` (``[|t|·b, ·]``, the tile's ranges in order) into ``stash`` at the tile's rows."""
    for dst, rel in token_rows(t, b):
        stash.write(dst, rows[rel])


def _read_tile(stash, t, b: int) -> torch.Tensor:
    """The tile's rows of ``stash`` ``[|t|·b, ·]`` (its ranges concatenated, read one range at
    a time into the tile's tensor)."""
    parts = token_rows(t, b)
    if len(parts) == 1:
        return stash.read(parts[0][0])
    out = torch.empty(parts[-1][1].stop, stash.width, dtype=stash.dtype, device=stash.device)
    for dst, rel in parts:
        out[rel].copy_(stash.read(dst))
    return out


class _Spec:
    """What :class:`_METPLayerFunction` needs besides tensors (the same on every rank)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _o_stashes(spec, like, N):
    return [Stash(N, spec.geo.heads_local * spec.geo.d, like, host=spec.host,
                  offloader=spec.offloader) for _ in range(spec.group.size)]


def _attention_outputs(spec, src: Rows, wqkv, bqkv, wo, o_stash, lses, keep=None,
                       done=None) -> None:
    """Every head group's ``O_g`` into ``o_stash[g]`` (and ``lse_g`` into ``lses[g]``);
    ``keep``: per group ``(q stash, k/v stash)`` the projections also go to
    (:mod:`.layer_reads`); ``done(g)``: called once group ``g``'s tiles are all written."""
    b = src.b
    for g, (WQ, BQ, _) in block_weights(spec.group, wqkv, bqkv, wo, "fwd", 1):
        stash = o_stash[g]
        forward_group(src, spec.q_tiles, WQ, BQ, spec.geo, spec.seq, spec.attn, spec.head_norm,
                      lambda t, o, s=stash: _write_tile(s, t, b, o), lses[g],
                      proj_out=None if keep is None else keep[g])
        if done is not None:
            done(g)


def _keep_lse(spec, lse: torch.Tensor) -> Stash:
    """One group's ``lse_g`` (fp32 ``[b, H, n]``) kept for the backward (``keep_attention``):
    a host stash of ``b·H`` rows of ``n`` where the layer input goes to the host, else the
    device tensor itself."""
    rows = lse.view(-1, lse.shape[-1])
    if not spec.host:
        return Stash.wrap(rows)
    st = Stash(rows.shape[0], rows.shape[1], lse, host=True, offloader=spec.offloader)
    st.write(slice(0, rows.shape[0]), rows)
    return st


def _kept_lse(st: Stash, b: int, n: int) -> torch.Tensor:
    """A kept ``lse_g`` back on the device, ``[b, H, n]`` fp32."""
    return st.read(slice(0, st.rows)).view(b, -1, n)


def _dq_stashes(spec, like, N):
    """Every head group's ``d(qkv)`` q-column stash ``[N, G_g·qpg·d]``."""
    geo = spec.geo
    return [Stash(N, geo.groups_local * geo.q_per_group * geo.d, like, host=spec.host,
                  offloader=spec.offloader) for _ in range(spec.group.size)]


def _dkv_stash(spec, like, N):
    """One head group's ``d(qkv)`` k/v-column stash ``[N, G_g·2·d]``."""
    return Stash(N, spec.geo.groups_local * 2 * spec.geo.d, like, host=spec.host,
                 offloader=spec.offloader)


def _rows(spec, stash, dtype) -> Rows:
    """The layer input's reader (:class:`~.layer_attention.Rows`) with the K/V cut set."""
    src = Rows(stash, spec.norm1, spec.n, spec.b, stash.width, spec.freqs, dtype,
               spec.row_tokens)
    src.set_kv_cut(spec.q_tiles, spec.row_tiles)
    return src


def _prefetch(tiles, i: int, b: int, stashes) -> None:
    """Start the host copies of row tile ``i`` (if any) while tile ``i − 1`` computes."""
    if i < len(tiles):
        rows = _token_rows(tiles[i], b)
        for s in stashes:
            s.prefetch(rows)


def _read_o(o_stash, rows: slice) -> torch.Tensor:
    parts = [s.read(rows) for s in o_stash]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class _METPLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, x, wqkv, bqkv, wo, bo, w1, b1, w2, b2, qn_w, qn_b, kn_w, kn_b,
                *norm_params):
        check_finite(f"{spec.label} (forward)", spec.group, x=x, qkv_weight=wqkv, proj_weight=wo,
                     fc1_weight=w1, fc2_weight=w2)
        n, b, h = x.shape
        N = n * b
        x2 = x.detach().view(N, h)  # (modules called on its tiles must not see x's autograd)
        keep = any(ctx.needs_input_grad)
        xs = None
        if keep and spec.host:  # the input goes to the host now, read back tile by tile
            xs = Stash(N, h, x, host=True, offloader=spec.offloader)
            xs.write(slice(0, N), x2)
        src = _rows(spec, Stash.wrap(x2), x.dtype)
        o_stash = _o_stashes(spec, x, N)
        kept = keep and spec.keep_attention  # O and lse kept for the backward
        p = spec.group.size
        lses = [torch.empty(b, spec.geo.heads_local, n, dtype=torch.float32, device=x.device)
                for _ in range(p if kept else 1)] * (1 if kept else p)
        kept_lse = [None] * p

        def done(g):
            if kept:
                kept_lse[g] = _keep_lse(spec, lses[g])
                lses[g] = None
        _attention_outputs(spec, src, wqkv, bqkv, wo, o_stash, lses, done=done)
        del lses
        wo_all_t = gather_rows(spec.group, wo.t(), "attention proj (gather)")
        in_place = spec.in_place and (xs is not None or not keep)
        if xs is not None:
            xs.fence()  # x is on the host before y overwrites it
        y = x2 if in_place else torch.empty_like(x2)
        acc = _acc(x.dtype)
        for _, t in loop_sample.tiles(spec.row_tiles):
            rows = _token_rows(t, b)
            h1 = attention_residual(x2[rows], _read_o(o_stash, rows), wo_all_t, bo)
            y[rows].copy_(mlp_forward(h1.view(-1, b, h), spec.norm2, w1, b1, w2, b2, spec.group,
                                      spec.activation, acc).view(-1, h))
            del h1
        if kept:
            for s in kept_lse:
                s.fence()  # written before the lse tensors' device side is dropped
            ctx.kept = (o_stash, kept_lse)
        else:
            for s in o_stash:
                s.release()
            ctx.kept = None
        del wo_all_t, o_stash
        ctx.spec, ctx.x_stash = spec, xs
        ctx.save_for_backward(x if keep and xs is None else None, wqkv, bqkv, wo, bo, w1, b1,
                              w2, b2)
        if in_place:
            ctx.mark_dirty(x)
            return x
        return y.view(n, b, h)

    @staticmethod
    @first_order_only("metp_layer")
    def backward(ctx, grad_y):
        spec = ctx.spec
        check_finite(f"{spec.label} (backward)", spec.group, grad_output=grad_y)
        x, wqkv, bqkv, wo, bo, w1, b1, w2, b2 = ctx.saved_tensors
        group, geo, b = spec.group, spec.geo, spec.b
        p = group.size
        dtype = wqkv.dtype
        n, h = spec.n, wqkv.shape[1]
        N = n * b
        xs = ctx.x_stash if ctx.x_stash is not None else Stash.wrap(x.view(N, h))
        # dy becomes dh1, then dx, in place (a private copy when it cannot be written)
        dy = grad_y if (grad_y.dtype == dtype and grad_y.is_contiguous()) else \
            grad_y.to(dtype).contiguous().clone()
        dy2 = dy.view(N, h)
        acc, gdt = _acc(dtype), spec.grad_dtype or _acc(dtype)
        src = _rows(spec, xs, dtype)
        spec.norm1.grads = [None] * len(spec.norm1.params)
        spec.norm2.grads = [None] * len(spec.norm2.params)

        # 1. the attention forward again (unless kept): O_g to the stashes, lse_g kept; K/V of
        # group g + 1 formed in group g's query tiles, the last group's forming the backward's
        # group 0; with x on the host every group's q projections kept in its dq stash
        # (.layer_reads)
        dq_st = kept_lse = kv = None
        if ctx.kept is not None:
            o_stash, kept_lse = ctx.kept
            ctx.kept = None
            lses = [lambda g=g: _kept_lse(kept_lse[g], b, n) for g in range(p)]
            reuse = False
        else:
            o_stash = _o_stashes(spec, dy, N)
            made = [torch.empty(b, geo.heads_local, n, dtype=torch.float32, device=dy.device)
                    for _ in range(p)]
            lses = [lambda t=t: t for t in made]
            reuse = ctx.x_stash is not None
            if reuse:
                dq_st = _dq_stashes(spec, dy, N)
            for g, (WQ, BQ, _), nxt in weights_ahead(group, wqkv, bqkv, wo, "fwd", True):
                form = kv_form(src, nxt, geo, spec.head_norm, keep_pre=g == p - 1)
                forward_group(src, spec.q_tiles, WQ, BQ, geo, spec.seq, spec.attn,
                              spec.head_norm, lambda t, o, s=o_stash[g]: _write_tile(s, t, b, o),
                              made[g], proj_out=dq_st[g] if reuse else None, kv=kv, nxt=form,
                              then=spec.q_tiles[0] if g + 1 < p else None)
                kv = form.done()
            del made

        # 2. MLP and projection backward, row tile by row tile: dy -> dh1 (with kept attention
        # the backward's group-0 K/V are formed here, from the same reads of x)
        wgen = None
        form0 = None
        if kv is None:
            wgen = weights_ahead(group, wqkv, bqkv, wo, "bwd")
            first = next(wgen)
            form0 = kv_form(src, (first[1][0], first[1][1]), geo, spec.head_norm, True)
        wo_all_t = gather_rows(group, wo.t(), "attention proj (gather)")
        mlp = MLPBackward(group, w1, b1, w2, spec.activation, acc, gdt)
        db2 = dbo = None
        for i, t in loop_sample.tiles(spec.row_tiles):
            rows = _token_rows(t, b)
            _prefetch(spec.row_tiles, i + 1, b, [xs] + o_stash)
            x_t = xs.read(rows)
            if form0 is not None:
                form0.add(t, spec.norm1.forward(x_t.view(-1, b, h)).reshape(-1, h))
            h1 = attention_residual(x_t, _read_o(o_stash, rows), wo_all_t, bo)
            del x_t
            graph = spec.norm2.with_grad(h1.view(-1, b, h))
            del h1
            g = dy2[rows]
            if b2 is not None:
                s = g.sum(0, dtype=torch.float32)
                db2 = s if db2 is None else db2.add_(s)
            dn2 = mlp.tile(graph[1].detach().reshape(-1, h), g)
            g.add_(spec.norm2.backward(graph, dn2.to(dtype)).reshape(-1, h))
            del graph, dn2
            if bo is not None:
                s = g.sum(0, dtype=torch.float32)
                dbo = s if dbo is None else dbo.add_(s)
        del wo_all_t
        dw1, db1, dw2 = mlp.grads()
        if form0 is not None:
            kv = form0.done()
            groups = itertools.chain([first], wgen)
        else:
            groups = weights_ahead(group, wqkv, bqkv, wo, "bwd")

        # 3. attention backward, head group by head group: group g's pass over x also reduces
        # group g − 1's d(kv) (into its stash, for dx) and forms group g + 1's K/V
        if dq_st is None:
            dq_st = _dq_stashes(spec, dy, N)
        dkv_st = [None] * p
        norm_acc = [None] * 4
        in_flight, owned, grad_layout = [], [None, None, None], None
        prev = None
        for g, (WQ, BQ, WOT), nxt in groups:
            grads = GroupGrads(wqkv, bqkv, wo, geo, gdt, dy.device)
            stash = o_stash[g]
            form = kv_form(src, nxt, geo, spec.head_norm, True,
                           bufs=None if prev is None else prev.bufs)
            bufs = backward_group(
                src, spec.q_tiles, spec.kv_blocks, WQ, BQ, WOT, geo, spec.seq, spec.attn,
                spec.head_norm, norm_acc, lambda t, s=stash: _read_tile(s, t, b), dy2, lses[g](),
                lambda t, r, s=dq_st[g]: _write_tile(s, t, b, r), grads, kv,
                proj=dq_st[g] if reuse else None, nxt=form, prev=prev)
            stash.release()
            lses[g] = None
            if kept_lse is not None:
                kept_lse[g].release()
            if prev is not None:
                in_flight, owned = deliver(group, g - 1, prev.grads, in_flight, owned)
            kv = None if form is None else form.done()
            write = None
            if g + 1 < p:  # the last group's d(kv) stay on the device (dx's pass)
                dkv_st[g] = _dkv_stash(spec, dy, N)
                write = lambda t, r, s=dkv_st[g]: _write_tile(s, t, b, r)  # noqa: E731
            prev = PrevKV(bufs, grads, write)
            grad_layout = grads.layout
            del grads, bufs

        # 4. dx = dh1 + norm1ᵀ(d(qkv)·Wqkv), row tile by row tile; the last group's d(kv)
        # reduced in the same pass (dWk/dWv against norm1(x))
        w_all = _qkv_rows_by_part(gather_rows(group, wqkv, "attention qkv (gather)"), geo, p)
        for i, t in loop_sample.tiles(spec.row_tiles):
            rows = _token_rows(t, b)
            _prefetch(spec.row_tiles, i + 1, b, [xs] + dq_st + dkv_st[:p - 1])
            graph = spec.norm1.with_grad(xs.read(rows).view(-1, b, h))
            last = prev.take(t, graph[1].detach().reshape(-1, h), write=False)
            d_t = torch.cat([s.read(rows) for s in dq_st] +
                            [s.read(rows) for s in dkv_st[:p - 1]] +
                            [last.view(last.shape[0], -1)], dim=1)
            del last
            dn1 = dx_rows(d_t, w_all, dtype)
            del d_t
            dy2[rows].add_(spec.norm1.backward(graph, dn1).reshape(-1, h))
            del graph, dn1
        in_flight, owned = deliver(group, p - 1, prev.grads, in_flight, owned)
        del prev
        owned = keep_owned(in_flight, group.rank, owned)
        dwq, dbq, dwot = grad_layout.unpack(owned[0])
        for s in dq_st + dkv_st[:p - 1]:
            s.release()
        if ctx.x_stash is not None:
            ctx.x_stash.release()
            ctx.x_stash = None
        qn = head_norm_grads(spec.head_norm, norm_acc)
        return (None, dy.view(n, b, h), weight_grad(wqkv, dwq), weight_grad(bqkv, dbq),
                weight_grad(wo, dwot.t()), None if dbo is None else dbo.to(dtype),
                weight_grad(w1, dw1), weight_grad(b1, db1), weight_grad(w2, dw2),
                None if db2 is None else db2.to(dtype), *qn,
                *spec.norm1.param_grads(), *spec.norm2.param_grads())


def _qkv_rows_by_part(w_all: torch.Tensor, geo: HeadGeometry, p: int) -> torch.Tensor:
    """The gathered ``linear_qkv`` rows (``p`` shards, each in Megatron's interleaved per-group
    layout) reordered as every shard's q rows, then every shard's k/v rows: the column order of
    the d(qkv) tile the ``dx`` pass assembles from the stashes."""
    Gl, qpg, d = geo.groups_local, geo.q_per_group, geo.d
    w = w_all.view(p, Gl, qpg + 2, d, -1)
    h = w.shape[-1]
    return torch.cat([w[:, :, :qpg].reshape(-1, h), w[:, :, qpg:].reshape(-1, h)], dim=0)


def metp_layer(x: torch.Tensor, *, group, num_heads: int, num_query_groups: int,
               qkv_weight: torch.Tensor, proj_weight: torch.Tensor, fc1_weight: torch.Tensor,
               fc2_weight: torch.Tensor, activation: str,
               norm1: Optional[torch.nn.Module], norm2: Optional[torch.nn.Module],
               qkv_bias=None, proj_bias=None, fc1_bias=None, fc2_bias=None,
               causal: bool = True, layout: str = "dual_chunk", rotary_pos_emb=None,
               softmax_scale: Optional[float] = None, kernel: Optional[str] = None,
               cu_seqlens=None, rope_per_document: bool = False, context_group=None,
               qk_norm: Optional[str] = None, qk_norm_eps: float = 1e-5, q_norm_weight=None,
               k_norm_weight=None, q_norm_bias=None, k_norm_bias=None,
               grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
               host: bool = False, offloader=None, in_place: bool = False,
               token_tile: Optional[int] = None, mlp_token_tile: Optional[int] = None,
               keep_attention: bool = False, label: str = "metp_layer") -> torch.Tensor:
    """One pre-norm transformer layer ``y = h1 + MLP(norm2(h1)) + b2``,
    ``h1 = x + Attn(norm1(x))·Woᵀ + bo``, streamed (see the module docstring).

    Args (as :func:`~megatron_metp.ops.metp_attention` and :func:`~megatron_metp.ops.metp_mlp`
    for the weights, RoPE, documents, CP and q/k norm):
        x: ``[s/p, b, h]`` this rank's tokens (contiguous).
        norm1, norm2: the norm modules (``input_layernorm``, ``pre_mlp_layernorm``; ``None``:
            identity); their parameters' gradients are returned like any input's.
        proj_bias, fc2_bias: ``[h]`` replicated, added inside (Megatron's bias-dropout-add
            without dropout).
        host: keep the layer input (saved for backward), the attention outputs and ``d(qkv)``
            on the host (pinned; ``--metp-offload-activations``) and read them back tile by
            tile; ``offloader``: whose statistics count those host bytes.
        in_place: write ``y`` over ``x``'s storage (``x`` must not be needed by anyone else:
            the streaming block's layers hand their outputs on only to the next layer); done
            only where safe (``x`` on the host first, or no backward).
        token_tile: tokens per row/query tile (``0``: whole); default
            :class:`~megatron_metp.ops.tiles.LayerTiles` from the budget.
        mlp_token_tile: the row passes' tile in rows of tokens × batch, as the MLP op's
            ``token_tile`` (the spec's ``mlp_token_tile``; ``None``: ``METP_MLP_TOKEN_TILE``,
            else the budget); a ``token_tile`` wins.
        keep_attention: keep every head group's attention output ``O_g`` and its fp32
            log-sum-exp for the backward (on the host with ``host``, else on the device), so
            the backward never runs the attention forward again (the module docstring's
            "Kept attention"; ``--metp-keep-attention-output``).
    """
    group = as_metp_group(group)
    seq, d, kern, _, cu, freqs, head_norm = prepare_attention(
        x, qkv_weight, proj_weight, group=group, num_heads=num_heads,
        num_query_groups=num_query_groups, causal=causal, layout=layout,
        rotary_pos_emb=rotary_pos_emb, qkv_bias=qkv_bias, proj_bias=proj_bias, kernel=kernel,
        head_block=1, cu_seqlens=cu_seqlens, rope_per_document=rope_per_document,
        context_group=context_group, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, q_norm_bias=q_norm_bias,
        k_norm_bias=k_norm_bias, label=label, op="metp_layer")
    geo = HeadGeometry(num_heads, num_query_groups, d, group.size)
    n, b, h = x.shape
    try:
        if activation not in act.ACTIVATIONS:
            raise ValueError(f"activation must be one of {act.ACTIVATIONS}, got {activation!r}")
        k = act.fc1_rows_per_ffn(activation)
        f = fc1_weight.shape[0] // k
        if fc1_weight.shape != (k * f, h) or fc2_weight.shape != (h, f):
            raise ValueError(f"fc1_weight must be [{k}·ffn/p, h={h}] and fc2_weight [h, ffn/p], "
                             f"got {tuple(fc1_weight.shape)} and {tuple(fc2_weight.shape)}")
        if not x.is_contiguous():
            raise ValueError("metp_layer takes a contiguous x [s/p, b, h]")
        elem = x.element_size()
        tiles = LayerTiles(n, b, h, geo.heads_local * d, geo.groups_local * d, elem,
                           mlp_row_bytes(h, f, k, elem, 4 if elem < 4 else elem), token_tile,
                           mlp_token_tile)
    except ValueError as exc:
        refuse_together(seq, op_label("metp_layer", label), exc)
        raise
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if agreement_checks_enabled():
        check_group_agrees(seq, op_label("metp_layer", label), label=label, x=x,
                           qkv_weight=qkv_weight, proj_weight=proj_weight, fc1_weight=fc1_weight,
                           fc2_weight=fc2_weight, qkv_bias=qkv_bias, proj_bias=proj_bias,
                           fc1_bias=fc1_bias, fc2_bias=fc2_bias, activation=activation,
                           causal=bool(causal), layout=layout, softmax_scale=float(scale),
                           kernel=kern.name, qk_norm=qk_norm, host=bool(host),
                           keep_attention=bool(keep_attention),
                           needs_grad=needs_grad(x, qkv_weight, proj_weight, fc1_weight,
                                                 fc2_weight), **tiles.fields())
    # writing y over x: never over a view (autograd's view + in-place rules) nor a leaf that
    # requires grad (a pipeline stage's received input)
    in_place = bool(in_place) and x._base is None and not (x.is_leaf and x.requires_grad)
    n1, n2 = RowNorm(norm1), RowNorm(norm2)
    spec = _Spec(group=group, seq=seq, geo=geo, b=b, n=n, label=label, freqs=freqs,
                 head_norm=head_norm, norm1=n1, norm2=n2, activation=activation,
                 grad_dtype=grad_reduce_dtype, host=bool(host), offloader=offloader,
                 in_place=in_place, keep_attention=bool(keep_attention),
                 q_tiles=query_tiles(n, tiles.q, layout, causal, packed=cu is not None),
                 kv_blocks=balanced_kv_blocks(n, tiles.kv, layout, causal,
                                              packed=cu is not None),
                 row_tiles=tiles.row_tiles(n), kv_rows=tiles.kv, row_tokens=tiles.rows,
                 attn=SimpleNamespace(causal=bool(causal), layout=layout, scale=float(scale),
                                      kernel=kern, cu=cu,
                                      key_tile=None if tiles.keys >= n else tiles.keys))
    hn = (q_norm_weight, q_norm_bias, k_norm_weight, k_norm_bias)
    return _METPLayerFunction.apply(spec, x, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                    fc1_weight, fc1_bias, fc2_weight, fc2_bias, *hn,
                                    *n1.params, *n2.params)
