"""The attention parts of the streaming METP layer (:mod:`.layer`): one head group at a time,
one tile of query rows at a time.

For head group ``g`` (its weights broadcast by their owner, as in :mod:`.attention`):

* :class:`KVForm` forms ``K_g``, ``V_g`` of every local token (``[b, G_g, n, d]`` heads-first,
  the per-head k norm and RoPE applied) piece by piece from ``norm1(x)``: the only ``n``-sized
  tensors of the group (``2·n·d`` per K/V head, against ``n·h`` for one activation), in a pass
  of their own (:func:`group_kv`) or inside the previous group's query-tile pass (the next
  group's weights come ahead: :func:`weights_ahead`; :mod:`.layer_reads`).
* :func:`forward_group` then runs, per query tile ``T``, ``q_T`` (from ``norm1(x_T)``) against
  every rank's ``K_g/V_g`` on the K/V ring (:func:`ring_attention_forward` with ``q_rows=T``):
  ``O_g[T]`` goes to the caller's stash, ``lse_g[T]`` is kept (``[b, H, n]`` fp32).
* :func:`backward_group` runs the same tiles backward, with ``dO_g[T] = dh1_T·Wo_g`` and
  ``O_g[T]`` back from the stash: ``dq_T`` is complete after the tile's ring (RoPE-transposed,
  through the q norm, into ``d(qkv)``'s q columns), each tile's ``dK/dV`` comes home on the ring
  and is summed over the tiles (fp32 ``[b, G_g, n, d]`` each), and only then turned into
  ``d(kv)`` (heads-first, in the group's K/V buffers), which the next group's pass (or ``dx``'s,
  :class:`PrevKV`) reduces against ``norm1(x)``. The group's weight gradients (``dWqkv_g = Σ_T
  d(qkv)_Tᵀ·norm1(x_T)``, ``dWo_g = Σ_T O_g[T]ᵀ·dh1_T``) are reduced to their owner once its
  ``d(kv)`` is in, while the next groups compute.

With ``kv_rows`` the ring carries only that many of every rank's key rows at a time (a tile's
ring runs once per key sub-block), so the travelling K/V and ``dK/dV`` buffers are that size;
``key_tile`` bounds the keys of one kernel call (:mod:`.windows`).

Query tiles and key sub-blocks are cut by :mod:`.balance`: under the causal ``dual_chunk``
layout each is two mirrored row ranges, ``[a, b)`` of the first chunk and ``[n − b, n − a)`` of
the second, so that every rank does the same work at every ring step; a tile's tensors (``q``,
``O``, ``dO``, ``lse``, ``dq``, ``d(qkv)`` rows) hold its ranges' rows concatenated, and are
read from / written to the stashes range by range (:func:`token_rows`).

The projection → q/k norm → RoPE step and its backward are :mod:`.attention_prep`'s, the weight
broadcasts and gradient reductions :mod:`.attention_weights`', as in :mod:`.attention`.
"""

from __future__ import annotations

import bisect
from typing import List, Optional

import torch

from ..runtime import loop_sample
from ..runtime.groups import METPGroup
from ..runtime.host_stash import PREFETCH_DEPTH
from ..runtime.ring import RingExchanger
from ._accum import mm_acc, mm_into
from ._flat import FlatLayout
from .attention_prep import (HeadGeometry, heads_first, norm_rope, norm_rope_backward, project,
                             seq_first, seq_first_q, split_qkv_rows)
from .attention_weights import block_weights, deliver_flat, keep_owned
from .ring_attention import ring_attention_backward, ring_attention_forward
from .rope import rope_tables
from .balance import as_tile, tile_parts, tile_rows


class Rows:
    """Where the streaming layer's attention reads its token rows: ``x`` tiles from a
    :class:`~megatron_metp.runtime.host_stash.Stash` (``[n·b, h]``), through ``norm1``, with this
    rank's RoPE angles ``freqs`` ``[n, 1, 1, r]`` (or ``None``). ``chunk``: the most tokens
    whose ``x`` and ``norm1(x)`` are formed at once (the row tile: a query tile is projected
    chunk by chunk)."""

    def __init__(self, x_stash, norm1, n: int, b: int, h: int, freqs, dtype, chunk: int,
                 depth: int = PREFETCH_DEPTH):
        self.x, self.norm1, self.n, self.b, self.h = x_stash, norm1, n, b, h
        self.freqs, self.dtype, self.chunk = freqs, dtype, max(1, int(chunk))
        self.depth = max(1, int(depth))
        self._seq, self._pos = [], {}  # the current pass's chunks (and what follows it)
        self.kv_bounds: List[int] = []  # the K/V cut (:meth:`set_kv_cut`)

    def set_kv_cut(self, q_tiles, row_tiles) -> None:
        """The K/V cut: the rows where a K/V projection's GEMM starts or stops, the same
        wherever K/V are formed (a query tile's chunks, a row tile: :class:`KVForm`): every
        chunk boundary of the query tiles (:meth:`chunks`) and every row tile boundary."""
        cuts = set()
        for t in q_tiles:
            for c, _ in self._cut(t):
                cuts.update((c.start, c.stop))
        for t in row_tiles:
            cuts.update((t.start, t.stop))
        self.kv_bounds = sorted(cuts)

    def kv_pieces(self, c: slice):
        """``c`` cut at the K/V cut: ``[(piece, offset of its first row in c)]``."""
        i = bisect.bisect_right(self.kv_bounds, c.start)
        out, a = [], c.start
        while i < len(self.kv_bounds) and self.kv_bounds[i] < c.stop:
            out.append((slice(a, self.kv_bounds[i]), a - c.start))
            a = self.kv_bounds[i]
            i += 1
        out.append((slice(a, c.stop), a - c.start))
        return out

    def chunks(self, t, then=None):
        """``[(chunk, offset)]``: the tile ``t`` (a slice or a tuple of row ranges,
        :mod:`.balance`) cut into consecutive token slices of at most :attr:`chunk` tokens
        within each range, and where each chunk's rows start in the tile's own tensor. A pass:
        its chunks are read in order (:meth:`read`, :meth:`x_tile`), each read starting the
        host copies of the :attr:`depth` chunks read next; after the pass's last chunks, of the
        first chunks of ``then`` (the tile the next pass reads from the same stash; ``None``:
        nothing, a prefetch that no read asks for would hold its device tile until the stash
        is released)."""
        out = loop_sample.subset(self._cut(t), first=self.depth + 1)  # the fake instruments
        seq = [c for c, _ in out]
        if then is not None:
            seq += [c for c, _ in self._cut(then)[:self.depth]]
        self._seq = seq
        self._pos = {(c.start, c.stop): i for i, (c, _) in enumerate(out)}
        return out

    def _cut(self, t):
        out = []
        for r, off in tile_parts(t):
            out.extend((slice(a, min(a + self.chunk, r.stop)), off + a - r.start)
                       for a in range(r.start, r.stop, self.chunk))
        return out

    def _rows(self, t: slice) -> slice:
        return slice(t.start * self.b, t.stop * self.b)

    def read(self, stash, t: slice) -> torch.Tensor:
        """Rows of tokens ``t`` of ``stash`` (``[|t|·b, width]``); the host copies of the
        pass's next :attr:`depth` chunks of the same stash are started."""
        out = stash.read(self._rows(t))
        i = self._pos.get((t.start, t.stop))
        if i is not None:
            for c in self._seq[i + 1:i + 1 + self.depth]:
                stash.prefetch(self._rows(c))
        return out

    def warm(self, stash, t) -> None:
        """Start the host copy of the first chunk of tile ``t`` (read by a later pass)."""
        stash.prefetch(self._rows(self._cut(t)[0][0]))

    def x_tile(self, t: slice) -> torch.Tensor:
        """``x`` of tokens ``t``: ``[|t|, b, h]`` (:meth:`read`)."""
        return self.read(self.x, t).view(-1, self.b, self.h)

    def normed(self, t: slice) -> torch.Tensor:
        """``norm1(x)`` of tokens ``t``: ``[|t|·b, h]``."""
        return self.norm1.forward(self.x_tile(t)).reshape(-1, self.h)

    def rope(self, t):
        """``(freqs, tables)`` of tokens ``t`` (a slice or a tile's ranges, concatenated;
        ``None``s without RoPE)."""
        if self.freqs is None:
            return None, None
        parts = as_tile(t)
        f = self.freqs[parts[0]] if len(parts) == 1 else \
            torch.cat([self.freqs[r] for r in parts])
        return f, rope_tables(f, self.dtype)


def q_tile(src: Rows, t, WQq, BQq, geo: HeadGeometry, head_norm, keep_pre=None, then=None,
           proj=None, proj_out=None, also=None):
    """Heads-first ``q`` ``[b, H, |t|, d]`` of the tile ``t`` (its ranges' tokens in order; q
    norm, RoPE), projected chunk by chunk (:meth:`Rows.chunks`; ``then``: the tile read next);
    ``keep_pre``: receives the pre-norm ``[|t|, b, G_g, qpg, d]`` (the q norm's backward).
    ``proj_out``: a stash ``[n·b, H·d]`` the chunks' projections are also written to;
    ``proj``: such a stash, read instead of projecting (:mod:`.layer_reads`). ``also(c, n1)``:
    called with each chunk's ``norm1(x)`` ``[|c|·b, h]`` (the next group's K/V,
    :class:`KVForm`)."""
    nt, b, d, Gl, qpg = tile_rows(t), src.b, geo.d, geo.groups_local, geo.q_per_group
    q = torch.empty(b, Gl * qpg, nt, d, dtype=WQq.dtype, device=WQq.device)
    dst_all = seq_first_q(q, qpg)
    pre_all = None
    if head_norm is not None and keep_pre is not None:
        pre_all = torch.empty(nt, b, Gl, qpg, d, dtype=WQq.dtype, device=WQq.device)
        keep_pre.append(pre_all)
    for c, off in src.chunks(t, then):
        nc = c.stop - c.start
        rel = slice(off, off + nc)
        if proj is not None:
            pre = src.read(proj, c).view(nc, b, Gl, qpg, d)
        else:
            n1 = src.normed(c)
            pre = project(n1, WQq, BQq).view(nc, b, Gl, qpg, d)
            if also is not None:
                also(c, n1)
            del n1
            if proj_out is not None:
                proj_out.write(src._rows(c), pre)
        if pre_all is not None:
            pre_all[rel].copy_(pre)
        norm_rope(pre, "q", head_norm, src.rope(c), dst_all[rel])
        del pre
    return q


class KVForm:
    """``K_g``, ``V_g`` of one head group (heads-first ``[b, G_g, n, d]``, k norm and RoPE
    applied), formed piece by piece from ``norm1(x)`` by whichever pass reads ``x``
    (:meth:`add`): :func:`group_kv`'s own pass, the previous group's query tiles
    (:func:`forward_group`, :func:`backward_group`), the MLP backward's row tiles
    (:mod:`.layer`). Each piece of the K/V cut (:meth:`Rows.set_kv_cut`) is one GEMM, the same
    wherever it is formed, so every pass forms the same K/V bit for bit. ``bufs``: two
    ``[b, G_g, n, d]`` tensors to form them in (a finished group's, :func:`backward_group`);
    ``keep_pre``: also keep the pre-norm keys ``[n, b, G_g, d]`` (a q/k norm's backward)."""

    def __init__(self, src: Rows, WQkv, BQkv, geo: HeadGeometry, head_norm,
                 keep_pre: bool = False, bufs=None):
        n, b, d, Gl = src.n, src.b, geo.d, geo.groups_local
        self.src, self.W, self.B, self.head_norm = src, WQkv, BQkv, head_norm
        self.shape = (b, Gl, d)
        if bufs is None:
            k = torch.empty(b, Gl, n, d, dtype=WQkv.dtype, device=WQkv.device)
            bufs = (k, torch.empty_like(k))
        self.k, self.v = bufs
        self.k_pre = (torch.empty(n, b, Gl, d, dtype=WQkv.dtype, device=WQkv.device)
                      if keep_pre and head_norm is not None else None)

    def add(self, c: slice, n1: torch.Tensor) -> None:
        """Form the rows of tokens ``c`` from their ``norm1(x)`` ``n1`` ``[|c|·b, h]``."""
        b, Gl, d = self.shape
        for s, off in self.src.kv_pieces(c):
            ns = s.stop - s.start
            kv = project(n1[off * b:(off + ns) * b], self.W, self.B).view(ns, b, Gl, 2, d)
            if self.k_pre is not None:
                self.k_pre[s].copy_(kv[:, :, :, 0])
            norm_rope(kv[:, :, :, 0], "k", self.head_norm, self.src.rope(s),
                      seq_first(self.k[:, :, s]))
            seq_first(self.v[:, :, s]).copy_(kv[:, :, :, 1])
            del kv

    def done(self):
        """``(k, v, k_pre)`` (``k_pre`` ``None`` unless kept)."""
        out = (self.k, self.v, self.k_pre)
        self.k = self.v = self.k_pre = None
        return out


def group_kv(src: Rows, WQkv, BQkv, geo: HeadGeometry, head_norm, tiles, keep_pre: bool = False,
             then=None):
    """``(k, v, k_pre)`` of one head group (:class:`KVForm`) in a pass of their own over the
    chunks of ``tiles`` (the query tiles: every row once; ``then``: the tile read next)."""
    form = KVForm(src, WQkv, BQkv, geo, head_norm, keep_pre)
    for i, t in enumerate(tiles):
        for c, _ in src.chunks(t, tiles[i + 1] if i + 1 < len(tiles) else then):
            form.add(c, src.normed(c))
    return form.done()


def weights_ahead(group: METPGroup, wqkv, bqkv, wo, phase: str, first_again: bool = False):
    """Yield ``(g, (WQ, BQ, WOT), nxt)`` for every head group ``g`` (:func:`block_weights`,
    three receive buffers), ``nxt`` the next group's ``(WQ, BQ)`` (its broadcast waited for
    before group ``g`` computes: the next group's K/V are formed in ``g``'s passes), after the
    last group group 0's again (a copy kept from the first) with ``first_again``, else
    ``None``."""
    it = block_weights(group, wqkv, bqkv, wo, phase, 1, spares=3)
    g, cur = next(it)
    first = None
    if first_again:
        first = tuple(None if w is None else w.clone() for w in cur[:2]) if group.size > 1 \
            else cur[:2]
    while True:
        item = next(it, None)
        yield g, cur, (item[1][:2] if item is not None else first)
        if item is None:
            return
        g, cur = item


def kv_form(src: Rows, nxt, geo: HeadGeometry, head_norm, keep_pre: bool, bufs=None):
    """A :class:`KVForm` for the group whose ``(WQ, BQ)`` is ``nxt`` (``None``: none)."""
    if nxt is None:
        return None
    _, WQkv = split_qkv_rows(nxt[0], geo)
    _, BQkv = split_qkv_rows(nxt[1], geo)
    return KVForm(src, WQkv, BQkv, geo, head_norm, keep_pre, bufs)


def forward_group(src: Rows, q_tiles, WQ, BQ, geo: HeadGeometry, seq: METPGroup, attn, head_norm,
                  write_o, lse: torch.Tensor, proj_out=None, kv=None,
                  nxt: Optional[KVForm] = None, then=None) -> None:
    """Head group ``g``'s attention output for every query tile (:func:`.balance.query_tiles`:
    each a tuple of row ranges): ``write_o(t, O_t)`` with ``O_t`` ``[|t|·b, H·d]`` (seq-first,
    the ranges' rows in order), and ``lse`` (fp32 ``[b, H, n]``) filled at the tile's rows.
    ``proj_out``: a q stash the q projections are also written to (:mod:`.layer_reads`: the
    group's backward reads them instead of ``x``). ``kv``: the group's ``(k, v, ·)`` formed by
    an earlier pass (``None``: formed here, :func:`group_kv`); ``nxt``: the next group's
    :class:`KVForm`, fed from the query tiles' ``norm1(x)``; ``then``: the tile the next pass
    reads first."""
    WQq, WQkv = split_qkv_rows(WQ, geo)
    BQq, BQkv = split_qkv_rows(BQ, geo)
    if kv is None:
        k, v, _ = group_kv(src, WQkv, BQkv, geo, head_norm, q_tiles, then=q_tiles[0])
    else:
        k, v = kv[0], kv[1]
    H, d, b = geo.heads_local, geo.d, src.b
    also = None if nxt is None else nxt.add
    for i, t in loop_sample.tiles(q_tiles):
        nt = tile_rows(t)
        after = _after(q_tiles, i)
        q = q_tile(src, t, WQq, BQq, geo, head_norm, then=after if after is not None else then,
                   proj_out=proj_out, also=also)
        o = torch.empty(nt, b, H * d, dtype=q.dtype, device=q.device)
        _, lse_t = ring_attention_forward(q, k, v, seq, attn.causal, attn.layout, attn.scale,
                                          attn.kernel, out=heads_first(o, H, d),
                                          cu_seqlens=attn.cu, q_rows=t,
                                          key_tile=attn.key_tile)
        for r, off in tile_parts(t):
            lse[:, :, r].copy_(lse_t[:, :, off:off + r.stop - r.start])
        del q, lse_t
        write_o(t, o.view(nt * b, H * d))
        del o


class GroupGrads:
    """One head group's weight gradients (``d linear_qkv`` rows, bias, ``d linear_projᵀ``) in one
    flat buffer (the layout :mod:`.attention` reduces to the owner), filled tile by tile."""

    def __init__(self, wqkv, bqkv, wo, geo: HeadGeometry, dtype, device):
        self.layout = FlatLayout([wqkv.shape, None if bqkv is None else bqkv.shape,
                                  (wo.shape[1], wo.shape[0])])
        self.flat = torch.empty(self.layout.numel, dtype=dtype, device=device)
        self.wq, self.bq, self.wot = self.layout.unpack(self.flat)
        self.geo = geo
        self.started = set()

    def _add(self, key, out, a, b_):
        if key in self.started:
            mm_acc(out, a, b_)
        else:
            mm_into(out, a, b_)
            self.started.add(key)

    def add_qkv(self, part: str, d_rows: torch.Tensor, n1: torch.Tensor) -> None:
        """``part`` ``"q"`` or ``"kv"``: rows ``d_rows`` ``[R, G_g, parts, d]`` of d(qkv) against
        the tile's ``norm1(x)`` ``[R, h]``: ``dW[part rows] += d_rowsᵀ·n1`` (and the bias)."""
        geo = self.geo
        Gl, qpg, d = geo.groups_local, geo.q_per_group, geo.d
        sel = slice(0, qpg) if part == "q" else slice(qpg, qpg + 2)
        wq = self.wq.view(Gl, qpg + 2, d, -1)
        R = d_rows.shape[0]
        for gl in range(Gl):
            rows = d_rows[:, gl].reshape(R, -1)
            self._add((part, gl), wq[gl, sel].reshape(-1, wq.shape[-1]), rows.t(), n1)
            if self.bq is not None:
                bq = self.bq.view(Gl, qpg + 2, d)[gl, sel].reshape(-1)
                s = rows.sum(0, dtype=torch.float32)
                if (part, gl, "b") in self.started:
                    bq.add_(s)
                else:
                    bq.copy_(s)
                    self.started.add((part, gl, "b"))

    def add_proj(self, o_t: torch.Tensor, dh1_t: torch.Tensor) -> None:
        """``d linear_projᵀ += O_tᵀ·dh1_t``."""
        self._add("o", self.wot, o_t.t(), dh1_t)


class PrevKV:
    """The previous head group's ``d(kv)`` (heads-first ``dk``, ``dv`` ``[b, G_g, n, d]`` in
    that group's K/V buffers, :func:`backward_group`'s return) waiting to be reduced: its
    weight gradients (``dWk/dWv += d(kv)ᵀ·norm1(x)``, into ``grads``) and its rows to
    ``write(c, rows)`` (``[|c|·b, G_g·2·d]``, for ``dx``), both chunk by chunk in the next
    pass that reads ``x`` (:meth:`take`)."""

    def __init__(self, bufs, grads: "GroupGrads", write):
        self.bufs, self.grads, self.write = bufs, grads, write

    def rows(self, c: slice) -> torch.Tensor:
        """``d(kv)`` rows of tokens ``c``: ``[|c|·b, G_g, 2, d]`` (Megatron's k/v column order)."""
        dk, dv = self.bufs
        return torch.stack([seq_first(dk[:, :, c]), seq_first(dv[:, :, c])], dim=3) \
            .reshape((c.stop - c.start) * dk.shape[0], dk.shape[1], 2, dk.shape[3])

    def take(self, c: slice, n1: torch.Tensor, write: bool = True) -> torch.Tensor:
        """Reduce the rows of tokens ``c`` against their ``norm1(x)`` ``n1``; returns them."""
        rows = self.rows(c)
        self.grads.add_qkv("kv", rows, n1)
        if write and self.write is not None:
            self.write(c, rows.view(rows.shape[0], -1))
        return rows


def backward_group(src: Rows, q_tiles, kv_blocks, WQ, BQ, WOT, geo: HeadGeometry, seq: METPGroup,
                   attn, head_norm, norm_acc: list, read_o, dh1, lse: torch.Tensor,
                   write_dq, grads: GroupGrads, kv, proj=None, nxt: Optional[KVForm] = None,
                   prev: Optional[PrevKV] = None):
    """Head group ``g``'s backward (``q_tiles``, ``kv_blocks``: tiles of row ranges,
    :mod:`.balance`). ``read_o(t)``: ``O_g`` of the tile ``t`` ``[|t|·b, H·d]``;
    ``dh1`` ``[n·b, h]``: the gradient of the attention block's output (after the residual);
    ``write_dq(t, rows)``: d(qkv)'s q columns ``[|t|·b, G_g·qpg·d]``; ``norm_acc``: the q/k
    norm weights' gradient sums (:meth:`HeadNorm.backward_one`). ``kv``: the group's
    ``(k, v, k_pre)`` (:class:`KVForm`, formed by an earlier pass). ``proj``: a q stash holding
    the recompute's q projections (:func:`forward_group`'s ``proj_out``; ``write_dq`` writes
    over them after reading them), read instead of forming ``q`` from ``x``.

    The pass that reads ``x`` after each tile's ring (``dWq``, chunk by chunk) also reduces
    ``prev`` (the previous group's ``d(kv)``: :class:`PrevKV`) and forms the next group's K/V
    (``nxt``, in ``prev``'s buffers once read). Returns this group's ``d(kv)`` as ``(dk, dv)``
    heads-first in its own K/V buffers (RoPE transposed, through the k norm), for the next
    group's pass or ``dx``'s."""
    WQq, _ = split_qkv_rows(WQ, geo)
    BQq, _ = split_qkv_rows(BQ, geo)
    k, v, k_pre = kv
    if proj is not None:
        src.warm(proj, q_tiles[0])
    H, Gl, qpg, d, b, n = geo.heads_local, geo.groups_local, geo.q_per_group, geo.d, src.b, src.n
    dk = dv = None  # fp32 [b, G_g, n, d]: the own keys' gradients, summed over the tiles
    for i, t in loop_sample.tiles(q_tiles):
        nt, then = tile_rows(t), _after(q_tiles, i)
        pre: List[torch.Tensor] = []
        # q from the kept projections (its next tile's first chunk ahead), else from x (the
        # dWq pass reads the same tile's x next)
        q = q_tile(src, t, WQq, BQq, geo, head_norm, keep_pre=pre,
                   then=then if proj is not None else t, proj=proj)
        if proj is not None:  # the dWq pass reads x next: its first chunk during the ring
            src.warm(src.x, t)
        o = read_o(t)
        d_o = _proj_grads(grads, o, dh1, t, b, WOT)
        o_hf, do_hf = heads_first(o.view(nt, b, -1), H, d), heads_first(d_o.view(nt, b, -1), H, d)
        dq = None
        lse_t = take_rows(lse, t)
        for _, ks in loop_sample.tiles(kv_blocks):
            sub = tile_rows(ks) < n
            kk = take_rows(k, ks, copy=True) if sub else k
            vv = take_rows(v, ks, copy=True) if sub else v
            dq_s, dk_s, dv_s = ring_attention_backward(
                do_hf, q, kk, vv, o_hf, lse_t, seq, attn.causal, attn.layout,
                attn.scale, attn.kernel, cu_seqlens=attn.cu, q_rows=t, key_tile=attn.key_tile,
                k_rows=ks if sub else None, block_rows=n)
            del kk, vv
            dq = dq_s if dq is None else dq.add_(dq_s)
            if dk is None:
                dk = torch.zeros(b, Gl, n, d, dtype=torch.float32, device=q.device)
                dv = torch.zeros_like(dk)
            for r, off in tile_parts(ks):
                rel = slice(off, off + r.stop - r.start)
                dk[:, :, r].add_(dk_s[:, :, rel])
                dv[:, :, r].add_(dv_s[:, :, rel])
            del dq_s, dk_s, dv_s
        del q, o, d_o, o_hf, do_hf, lse_t
        # dq: RoPE transposed, through the q norm, into d(qkv)'s q columns
        d_rows = torch.empty(nt, b, Gl, qpg, d, dtype=WQ.dtype, device=WQ.device)
        norm_rope_backward(seq_first_q(dq, qpg), "q", head_norm, pre.pop() if pre else None,
                           src.rope(t), d_rows, norm_acc)
        del dq
        d_rows = d_rows.view(nt * b, Gl, qpg, d)
        # the pass over x: dWq; the previous group's d(kv) reduced; the next group's K/V formed
        for c, off in src.chunks(t, then):
            rel = slice(off * b, (off + c.stop - c.start) * b)
            n1 = src.normed(c)
            grads.add_qkv("q", d_rows[rel], n1)
            if prev is not None:
                prev.take(c, n1)
            if nxt is not None:
                nxt.add(c, n1)
            del n1
        write_dq(t, d_rows.view(nt * b, -1))
        del d_rows
    # the own keys' dK/dV are complete: RoPE transposed (k), through the k norm, into this
    # group's K/V buffers (free now)
    for t in _plain_cut(n, src.chunk):
        norm_rope_backward(seq_first(dk[:, :, t]), "k", head_norm,
                           None if k_pre is None else k_pre[t], src.rope(t),
                           seq_first(k[:, :, t]), norm_acc)
        seq_first(v[:, :, t]).copy_(seq_first(dv[:, :, t]))
    del dk, dv, k_pre
    return k, v


def _plain_cut(n: int, chunk: int):
    return [slice(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def deliver(group: METPGroup, i: int, grads: GroupGrads, in_flight, acc):
    """Post the reduce of group ``i``'s flat gradients to owner ``i`` (waiting for the previous
    one first: at most one in flight); returns ``(in_flight, acc)`` as :mod:`.attention` keeps
    them (``acc[0]``: the owned flat gradient once it arrived)."""
    acc = keep_owned(in_flight, group.rank, acc)
    if group.size == 1:
        return [], [grads.flat, None, None]
    return deliver_flat(RingExchanger(group, "attention weight grads (bwd)"), i, grads.flat), acc


def _after(tiles, i: int):
    """The tile after ``tiles[i]`` (``None`` after the last)."""
    return tiles[i + 1] if i + 1 < len(tiles) else None


def take_rows(t: torch.Tensor, tile, copy: bool = False) -> torch.Tensor:
    """``t[:, :, tile]`` of a heads-first ``[b, heads, n, ·]`` tensor (or ``[b, heads, n]``):
    a view for one range (a contiguous copy with ``copy``), the ranges concatenated else."""
    parts = as_tile(tile)
    if len(parts) == 1:
        got = t[:, :, parts[0]]
        return got.contiguous() if copy else got
    return torch.cat([t[:, :, r] for r in parts], dim=2)


def token_rows(tile, b: int):
    """``[(rows, rel)]``: each range of ``tile`` as rows of a ``[n·b, ·]`` tensor and as rows of
    the tile's own ``[|tile|·b, ·]`` tensor."""
    return [(slice(r.start * b, r.stop * b), slice(off * b, (off + r.stop - r.start) * b))
            for r, off in tile_parts(tile)]


def _proj_grads(grads: GroupGrads, o: torch.Tensor, dh1: torch.Tensor, t, b: int, WOT):
    """``dWo_gᵀ += O_tᵀ·dh1_t`` and ``dO_t = dh1_t·Wo_g`` ``[|t|·b, H·d]``, range by range of
    the tile (no copy of ``dh1``'s rows)."""
    parts = token_rows(t, b)
    if len(parts) == 1:
        g = dh1[parts[0][0]]
        grads.add_proj(o, g)
        return torch.mm(g, WOT.t())
    d_o = torch.empty(o.shape[0], WOT.shape[0], dtype=o.dtype, device=o.device)
    for rows, rel in parts:
        g = dh1[rows]
        grads.add_proj(o[rel], g)
        torch.mm(g, WOT.t(), out=d_o[rel])
    return d_o
