"""The streaming METP layer in the plan (``ops/layer.py``, ``megatron/streaming.py``): which jobs
run it, what it keeps per layer, and the transients of its phases.

Megatron's full recompute of one layer per checkpoint with a METP layer of TP 1 (no dropout, no
``keep_intermediate``) runs as one op that saves only the layer input (on the host with
``--offload-activations``) and, in its backward, re-forms one head group and one tile of tokens
at a time. So a layer keeps its input ``x`` (as with Megatron's checkpoint), nothing of it is
re-formed whole, and the last layer's phases hold (besides the incoming gradient, overwritten in
place, and the head's stored tensors, freed by then):

===================  =======================================================================
forward              one group's K/V (and the ring's copy and received block), one query tile's
                     q, output and fp32 accumulators, a piece's output and the merge's fp32
                     copies; then one row tile's ``h1``, ``norm2(h1)``, MLP pass (a shard's
                     ``z, f(z)`` and the previous shard's ``f(z)``); every group's ``O`` on the
                     device unless offloaded; ``y`` beside ``x`` from the row passes on unless
                     written over it
attention recompute  the same attention, plus every group's fp32 log-sum-exp ``[b, A, n]``, the
                     next group's K/V formed from the query tiles' ``norm1(x)`` (one more K/V
                     pair; the last group's: the backward's group 0, with its pre-norm keys),
                     a third head-group weight buffer (the next group's weights are needed
                     while a group computes) and a copy of group 0's ``linear_qkv`` rows
MLP backward         one row tile: ``h1``, ``norm2(h1)``, the MLP pass (fp32 ``d norm2``; one
                     shard's ``z, f(z), dz``); the MLP's travelling gradient sums (their total
                     a separate buffer only from the second row tile on); the backward's group-0
                     K/V (formed by the recompute, held over this pass)
attention backward   one group's K/V, one K/V sub-block's ring buffers (copy, held, two fp32
                     sums), one query tile's ``q``, ``dO`` (``O`` too when read back from the
                     host: a device stash's read is a view), fp32 ``dq``, the kernel's copies
                     and expanded K/V; the group's fp32 ``dK/dV`` summed over the query tiles
                     (allocated after the first ring call: only with more than one query tile
                     or sub-block); every group's ``d(qkv)`` on the device unless offloaded;
                     the ``O`` stashes and log-sum-exps of the groups not done yet against the
                     head-group weight gradients (filling, the previous group's waiting for its
                     ``d(kv)``, in flight, owned); one more K/V pair: the previous group's
                     ``d(kv)`` (heads-first, in its K/V buffers), read chunk by chunk while the
                     next group's K/V are formed into the same buffers
dx                   one row tile: every group's ``d(qkv)`` (copies when offloaded), ``d
                     norm1``, norm1's backward; the gathered ``Wqkv``; the last group's
                     ``d(kv)`` (one K/V pair) and weight gradients (reduced in this pass)
===================  =======================================================================

Each weight ring lives only in its passes (the head groups' broadcast in the attention passes,
the MLP's in the row passes). Tiles are the op's balanced ones
(:func:`~megatron_metp.ops.tiles.tile_slices`), so whole tiles (one query tile, one K/V
sub-block, one row tile) drop the buffers that only a second tile needs.

Tile sizes: :class:`megatron_metp.ops.tiles.LayerTiles`, as the op resolves them.
"""

from __future__ import annotations

from typing import Dict

from ...ops import tiles as tiling
from .model import BF16, FP32


def streaming_applies(job, lay, mode: str) -> bool:
    """Whether ``mode`` of ``job`` runs the streaming layer op (``prepare_recompute``'s rule:
    ``megatron/streaming.py``; the plan has no dropout and ``METP_STREAMING_LAYER`` is read
    here too, without importing megatron-core: ``ops/streaming_switch.py``)."""
    from ...ops.streaming_switch import streaming_enabled

    return (mode == "metp" and job.recompute == "full" and job.recompute_method == "uniform"
            and job.recompute_num_layers == 1 and lay.t == 1 and not job.keep_intermediate
            and streaming_enabled())


def layer_tiles(model, job, lay, n: int):
    """The op's :class:`~megatron_metp.ops.tiles.LayerTiles` for ``n`` rows (tokens × ``b``)."""
    b = job.micro_batch
    h, d = model.hidden, model.head_dim
    sh = lay.t * lay.p
    k = 2 if model.swiglu else 1
    f = model.ffn // sh
    hqg, hkg = model.heads * d // sh, model.groups * d // sh
    return tiling.LayerTiles(n // b, b, h, hqg, hkg, BF16,
                             tiling.mlp_row_bytes(h, f, k, BF16, FP32, False),
                             mlp_token_tile=job.mlp_token_tile)


def streaming_phases(model, job, lay, n: int, host: bool,
                     kept: bool = False) -> Dict[str, Dict[str, float]]:
    """The streaming layer's phase transients for ``n`` rows per rank (see the module
    docstring), at each phase's largest moment (inside a ring step's kernel call), relative to
    what is stored (the incoming gradient and the freed head are added by the caller, as for
    every layer; the forward phases' layer input/output by :func:`.activations`).

    GQA: a full block's kernel folds the query heads into rows (no K/V copy); the causal pieces
    of a query tile (its square of the diagonal block) expand K/V to the query heads
    (:mod:`megatron_metp.ops.attention_kernels`).

    ``kept``: the layer keeps its attention output and log-sum-exp (``keep_attention``): no
    recompute phase; its MLP backward forms the backward's group-0 K/V from each row tile's
    ``norm1(x)`` with the head-group weights' broadcast already running; the kept tensors
    themselves are what the layer stores (on the host with ``host``), not a transient here."""
    b = job.micro_batch
    h, d, A = model.hidden, model.head_dim, model.heads
    p = lay.p
    sh = lay.t * p
    k = 2 if model.swiglu else 1
    f = model.ffn // sh
    hq, hk = A * d // lay.t, model.groups * d // lay.t      # every group's widths
    hqg, hkg, Ag = hq // p, hk // p, A // sh                # one head group's
    Gl = model.groups // sh                                 # K/V heads of one head group
    qkv = hq + 2 * hk
    tl = layer_tiles(model, job, lay, n)
    nt = n // b
    # the op's tiles are balanced (tiles.tile_slices): ceil(n/T) tokens each, T = ceil(n/size)
    q_tiles, row_tiles, sub_blocks = (-(-nt // max(1, t)) for t in (tl.q, tl.rows, tl.kv))
    Q, R, KV = (-(-nt // T) * b for T in (q_tiles, row_tiles, sub_blocks))
    C = min(nt, tl.rows) * b                                # a pass's x chunk (not balanced)
    e = BF16
    wa = (hqg + 2 * hkg) * h + h * hqg                      # one head group's weights
    wm = k * f * h + h * f                                  # one MLP shard
    # per head group: its attention output O (a device stash unless offloaded) and its fp32
    # log-sum-exp (kept from the recompute to the group's backward)
    o_g = 0 if host else e * n * hqg
    lse_g = FP32 * n * Ag
    o_all = {} if host else {"every group's attention output O (bf16, not offloaded)":
                             p * o_g}
    lse_all = {"every group's log-sum-exp [b, A, n] (fp32)": p * lse_g}
    # the weight rings live in their own passes: the head groups' broadcast (own packed copy,
    # a receive buffer per other group, two at most, used alternately; none at p = 1) in the
    # attention passes, the MLP's (own packed + held shard) in the row passes
    w_attn = {"head-group weights: own packed + receive buffers (bf16)":
              (1 + min(2, p - 1)) * e * wa if p > 1 else 0}
    # the recompute and the backward hold the next group's weights while a group computes:
    # three receive buffers (the recompute: and a copy of group 0's linear_qkv rows, for the
    # backward's group-0 K/V its last group forms)
    w_ahead = {"head-group weights: own packed + receive buffers (bf16)":
               (1 + min(3, p - 1)) * e * wa if p > 1 else 0}
    w_first = {"group 0's linear_qkv rows, kept for the last group's pass (bf16)":
               e * (hqg + 2 * hkg) * h if p > 1 else 0}
    w_mlp = {"MLP weight ring: own packed + held shard (bf16)": 2 * e * wm}
    gqa = hkg < hqg
    group_kv = {"one group's K and V (bf16)": e * 2 * n * hkg}
    if model.qk_layernorm:
        group_kv["one group's pre-norm keys (bf16, --qk-layernorm)"] = e * n * hkg
    # the next group's K/V (formed in this group's passes: ops/layer_reads.py), and their
    # pre-norm keys where the backward needs them
    kv_next = {"the next group's K and V, being formed (bf16)": e * 2 * n * hkg}
    kpre_next = {"the next group's pre-norm keys (bf16, --qk-layernorm)":
                 e * n * hkg if model.qk_layernorm else 0}
    if Gl > 1:  # _split: the q rows and the k/v rows of interleaved groups are copies
        group_kv["one group's q and k/v weight rows, copied apart (bf16, G_g > 1)"] = \
            e * (hqg + 2 * hkg) * h
    attn_fwd = dict(group_kv, **{
        "K/V ring: payload copy + received block (bf16)": 2 * e * 2 * n * hkg,
        # (q_tile's RoPE tables are gone once q is formed)
        "query tile: q and its output (bf16)": e * Q * 2 * hqg,
        "query tile: output and log-sum-exp accumulators (fp32)": FP32 * Q * (hqg + 2 * Ag),
        # a piece's output and, at its merge, the output in fp32 and its weighted copy: more
        # than the kernel call itself (the causal square's K/V at the query heads, bf16)
        "a piece's output (bf16) and the merge's two fp32 copies of it":
            e * Q * hqg + max(2 * FP32 * Q * hqg, e * Q * 2 * hqg if gqa else 0)})
    # the row tile's O (a view of a device stash, or a copy from the host) is gone once h1 is
    # formed; while a shard's z and f(z) are formed the previous shard's f(z) is still held
    rows_fwd = {"row tile: h1 and norm2(h1) (bf16)": e * R * 2 * h,
                "row tile: MLP output accumulator (fp32)": FP32 * R * h,
                "row tile: one MLP shard's z, f(z), the previous shard's f(z) (bf16)":
                    e * R * (k * f + f + (f if p > 1 else 0)),
                "the gathered output projection Woᵀ (bf16)": e * hq * h}
    ph: Dict[str, Dict[str, float]] = {}
    ph["streaming layer forward: attention (last layer)"] = dict(o_all, **w_attn, **attn_fwd)
    ph["streaming layer forward: rows (last layer)"] = dict(o_all, **w_mlp, **rows_fwd)
    # read back from the host, a query tile's last x chunk starts the copy of the next tile's
    # first one (the backward's and the recompute's passes; the forward reads x in place)
    x_next = {"the next query tile's first x chunk, on its way from the host (bf16)":
              e * C * h if host and q_tiles > 1 else 0}
    if not kept:
        ph["streaming layer recompute: attention (last layer)"] = dict(
            o_all, **lse_all, **w_ahead, **w_first, **attn_fwd, **x_next, **kv_next,
            **kpre_next)
    mlp_tile = tiling.mlp_row_bytes(h, f, k, e, FP32, False) * R
    mlp_grads = {"the MLP's weight gradients, summed over the row tiles (fp32)": FP32 * wm}
    kv0 = {"the backward's group-0 K and V, held (bf16)": e * 2 * n * hkg,
           "the backward's group-0 pre-norm keys (bf16, --qk-layernorm)":
               e * n * hkg if model.qk_layernorm else 0}
    if kept:  # group 0's K/V formed here: a row tile's norm1(x), the groups' weights arriving
        kv0 = dict(kv0, **w_ahead, **{"row tile: norm1(x) for group 0's K/V (bf16)": e * R * h})
    ph["streaming layer MLP backward (last layer)"] = dict(
        o_all, **({} if kept and host else lse_all), **w_mlp, **kv0, **{
        "row tile: h1 and norm2(h1) (bf16; x and O freed once h1 is formed)": e * R * 2 * h,
        "row tile: the MLP backward pass (fp32 d norm2; one shard's z, f(z), g·W2, dz)":
            mlp_tile,
        "the gathered output projection Woᵀ (bf16)": e * hq * h,
        "MLP gradient sums: two travelling (fp32)": 2 * FP32 * wm,
        # the first tile's arriving sum becomes the total: a separate one from the second on
        "the MLP's weight gradients, summed over the row tiles (fp32; > 1 row tile)":
            FP32 * wm if row_tiles > 1 else 0})
    d_all = {} if host else {"every group's d(qkv) (bf16, not offloaded)": e * n * qkv}
    causal_kernel = e * Q * (3 * hqg + (2 * hqg + 2 * hkg if gqa else 2 * hkg))
    full_kernel = e * (Q * hqg + 2 * KV * hkg)
    # head group g (the loop's g-th; rank 0): the O stashes and log-sum-exps of groups < g are
    # freed, its weight gradients fill while group g − 1's are reduced to their owner and this
    # rank's own arrived (g ≥ 2): the largest of these moments
    o_lse, wgrads = max([((p - g) * (o_g + lse_g), min(g + 1, 4) * FP32 * wa)
                         for g in range(p)], key=sum)
    ph["streaming layer attention backward (last layer)"] = dict(
        d_all, **w_ahead, **group_kv, **mlp_grads, **x_next, **kpre_next, **{
            "the previous group's d(kv), then the next group's K/V (bf16, one buffer pair)":
                e * 2 * n * hkg if p > 1 else 0,
            "the O stashes (bf16, not offloaded) and log-sum-exps (fp32) of the groups left":
                o_lse,
            # allocated after the first ring call returns: alive in a kernel only from the
            # second query tile or key sub-block on
            "one group's dK/dV summed over the query tiles (fp32; > 1 query tile or sub-block)":
                FP32 * 2 * n * hkg if q_tiles > 1 or sub_blocks > 1 else 0,
            "K/V sub-block ring: copy + held (bf16)": 2 * e * 2 * KV * hkg,
            "K/V sub-block ring: travelling dK/dV sums (fp32)": 2 * FP32 * 2 * KV * hkg,
            # O read back from a device stash is a view; the previous tile's RoPE tables are
            # still bound while the next tile's ring runs
            "query tile: q, dO, O (read back from the host) and the kernel's contiguous copies "
            "(bf16), the previous tile's RoPE tables (> 1 query tile)":
                e * Q * ((6 if host else 5) * hqg + (2 * d if q_tiles > 1 else 0)
                         + (hqg if model.qk_layernorm else 0)),
            "query tile: dq (fp32; and a sub-block's)": (1 + (sub_blocks > 1)) * FP32 * Q * hqg,
            "kernel: dq, dK/dV of a call (the causal square's at the query heads) (bf16)":
                max(causal_kernel, full_kernel),
            "head-group weight gradients: filling, waiting for d(kv), in flight, owned (fp32)":
                wgrads})
    # a row tile's moments: its d(qkv) gathered from the stashes (read back from the host:
    # copies, concatenated), then d norm1 = d(qkv)·Wqkv (d(qkv) freed after), then norm1's
    # backward (x read back from the host: a copy, norm1(x), d norm1, the input gradient);
    # offloaded, the next tile's x and d(qkv) are on their way (> 1 row tile)
    dx_tile = max(e * R * qkv * (2 if host else 1), e * R * (qkv + h),
                  e * R * h * (4 if host else 3))
    ph["streaming layer dx (last layer)"] = dict(d_all, **mlp_grads, **{
        "the owned head group's weight gradients (fp32)": FP32 * wa,
        "the last group's d(kv) (bf16, heads-first) and weight gradients (fp32)":
            e * 2 * n * hkg + FP32 * wa,
        "the gathered Wqkv (bf16)": e * qkv * h,
        "row tile: d(qkv) of every group, d norm1, norm1's backward (bf16; the largest)":
            dx_tile,
        "row tile: the next tile's x and d(qkv), prefetched (bf16; offloaded, > 1 row tile)":
            e * R * (h + qkv) if host and row_tiles > 1 else 0})
    return ph


def streaming_traffic(model, job, lay, n: int) -> Dict[str, Dict[str, float]]:
    """Bytes one rank sends per streaming layer (ring convention, as
    :func:`.traffic.traffic_per_layer`): ``{"layer": {...}, "recompute": {...}}``, the recompute
    part being what its backward sends to re-form the attention outputs (the weight broadcasts
    and the K/V rings of every head group and query tile once more).

    Per query tile the K/V ring of each head group goes round once (forward and recompute: the
    K/V blocks; backward: the K/V blocks and their fp32 ``dK/dV`` sums, in sub-blocks that add
    up to the same bytes), so the K/V bytes are the untiled layer's times the query tiles
    ``T_q``; the MLP's weight ring goes round once per row tile ``T_rows`` (forward: the bf16
    shards; backward: the shards and the fp32 gradient sums; the MLP's forward is not run
    again); the row passes all-gather ``Wo`` (forward, and backward) and ``Wqkv`` (the ``dx``
    pass)."""
    from .model import BF16, FP32

    b = job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    p, c, t = lay.p, lay.c, lay.t
    sh = t * p
    k = 2 if model.swiglu else 1
    hq, hk = A * d, G * d
    wa = ((hq + 2 * hk) * h + h * hq) // sh * BF16
    wm = (k * F * h + F * h) // sh
    kv = 2 * n * (hk // sh) * BF16
    tl = layer_tiles(model, job, lay, n)
    Tq = len(tl.q_tiles(n // b))
    Tr = len(tl.row_tiles(n // b))
    layer = {
        "attention weights: bcast fwd+bwd, fp32 reduce": 4 * (p - 1) * wa,
        f"attention K/V ring (every head group, {Tq} query tile(s))": 4 * Tq * p * (c - 1) * kv,
        f"MLP weight ring fwd+bwd, fp32 gradient ring ({Tr} row tile(s))":
            Tr * (p - 1) * (2 * wm * BF16 + wm * FP32),
        "row passes: all-gather Wo (fwd, bwd) and Wqkv": (p - 1) * (2 * h * hq + (hq + 2 * hk)
                                                                    * h) // sh * BF16}
    recompute = {"attention weights: bcast (recompute)": (p - 1) * wa,
                 "attention K/V ring (recompute)": Tq * p * (c - 1) * kv}
    return {"layer": layer, "recompute": recompute}


def streaming_host_bytes(model, job, lay, n: int, kept: bool = False) -> float:
    """Bytes one offloaded streaming layer moves between host and device per micro-batch: its
    input written once (the forward) and read back once per backward pass that needs it
    (:func:`megatron_metp.ops.layer_reads.host_reads`: ``2p + 3``, the recompute's first K/V
    pass and its query-tile passes, the MLP backward, the attention backward's dWq passes,
    ``dx``), every head group's attention output five times (written and read in the forward,
    written in the recompute, read in the MLP and in the attention backward), the q
    projections the recompute keeps for the backward (written and read once, then ``dq`` over
    them: written, read by ``dx``) and the ``d(kv)`` of every group but the last (written by
    the next group's pass, read by ``dx``; the last group's stay on the device).

    ``kept``: a layer with kept attention (no recompute: ``2p + 2`` reads of ``x``, its output
    written and read by the forward, read by the MLP and the attention backward, its fp32
    log-sum-exp written and read once, ``dq`` written and read, the ``d(kv)`` as above).
    :func:`.step_time.streaming_passes` splits the same bytes pass by pass."""
    from ...ops.layer_reads import host_reads
    from .model import BF16, FP32

    p, t = lay.p, lay.t
    d = model.head_dim
    hq, hk = model.heads * d // t, model.groups * d // t
    x = BF16 * n * model.hidden
    O, kq, kkv = BF16 * n * hq, BF16 * n * hq, BF16 * n * 2 * hk
    dkv = 2 * (p - 1) / p * kkv
    reads = x * (1 + sum(host_reads(p, kept=kept).values()))
    if kept:
        return reads + 4 * O + 2 * FP32 * n * model.heads // t + 2 * kq + dkv
    return reads + 5 * O + 4 * kq + dkv
