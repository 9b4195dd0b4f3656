"""METP self-attention: a head-group loop around a K/V ring.

Layout on rank ``r`` of ``p`` (exactly what Megatron TP rank ``r`` holds for the weights):

* ``x``, ``y``: this rank's tokens ``[n, b, h]`` (``n = s/p`` in ``layout`` order);
* ``qkv_weight`` (``Wqkv_r``): ``linear_qkv``'s ColumnParallelLinear shard, the rows of query groups
  ``r·G/p … (r+1)·G/p`` in Megatron's interleaved layout (per group: its ``A/G`` query heads, then
  its key head, then its value head; ``A`` heads, ``G`` query groups, head dim ``d``):
  ``[(G/p)·(A/G + 2)·d, h]``; ``qkv_bias`` likewise;
* ``proj_weight`` (``Wo_r``): ``linear_proj``'s RowParallelLinear shard ``[h, (A/p)·d]``;
  ``proj_bias`` ``[h]`` replicated, added once.

Forward, outer loop over head groups ``g = 0 … p−1``, the same ``g`` on every rank at the same
time (the inner K/V ring exchanges blocks *of one head group* between ranks, so all ranks must be
on that group). The weights of group ``g`` come from their owner by an async broadcast, posted one
step ahead into the second of two buffers, so it travels while group ``g−1`` computes::

    [Q_g | K_g | V_g] = x·Wqkv_gᵀ + bqkv_g,    Q_g, K_g ← RoPE(positions of this rank's tokens)
    O_g = ring_attention(Q_g, K_g, V_g)        (inner K/V ring over the same group, p steps)
    y  += O_g·Wo_gᵀ                           (fp32 accumulator)

then ``y += bo``. Why a broadcast and not the weight ring of :mod:`.mlp`: a ring hands rank ``r``
shard ``r−t`` at step ``t`` — a different head group on every rank — which the K/V ring cannot
serve. Forwarding one shard hop by hop to all ranks costs ``(p−1)`` sequential shard transfers
per step, against about one for a pipelined broadcast (NCCL's ring/tree), with the same bytes.

Backward (same head-group order, weights broadcast again)::

    dO_g = dy·Wo_g            dWo_g  = Σ_r dyᵀ·O_g
    (dQ_g, dK_g, dV_g) = ring_attention backward (dK/dV travel home on the inner ring)
    dQ_g, dK_g ← RoPEᵀ        dqkv_g = [dQ_g | dK_g | dV_g] (Megatron layout)
    dWqkv_g = Σ_r dqkv_gᵀ·x   dbqkv_g = Σ_r Σ_tokens dqkv_g      dx += dqkv_g·Wqkv_g

Each rank's fp32 contribution to ``(dWqkv_g, dbqkv_g, dWo_g)`` is reduced to owner ``g`` with an
async reduce that overlaps the next head group's compute (at most two in flight).

Head-group blocks (``head_block`` = ``kb``, :func:`head_block_size`): the outer loop runs over
``p/kb`` blocks of ``kb`` consecutive head groups, each one weight fetch (one packed broadcast
per group at ``kb = 1``; per-piece broadcasts into block buffers; one all-gather per piece when
``kb = p``) and one K/V ring of ``kb·A/p`` heads, with one GEMM per block for Q/K/V, the output
projection, ``dO``, ``dW`` and ``dx`` (rounded once, like stock TP's, when one block holds every
head). Where ``s/p`` is short on a GPU few larger blocks keep the device busy with far fewer
launches; the result does not depend on ``kb``. The K/V ring runs on the group's K/V process
group (:attr:`METPGroup.kv_ring`), so its transfers never queue behind the weight traffic, with
one batched exchange per step (backward: the next K/V block together with the previous block's
``dK/dV`` sum); a block's first backward K/V exchange is posted before its ``dO``/``dWo`` GEMMs.

Saved for backward: ``x``, every head group's attention output ``O_g`` and its fp32 log-sum-exp:
``Q/K/V`` are recomputed from ``x`` as the weights pass (no rank ever holds whole Q/K/V, whole
weights, or ``s×s`` scores). Under a full recompute the re-run of a forward may take ``O_g`` and
its LSE from the first forward instead of running the K/V ring again (``keep``,
:mod:`.attention_keep`). With ``recompute_core`` (Megatron's selective ``core_attn``) only
``x``: the backward re-runs each block's K/V ring forward to re-form ``O_g`` and the LSE.

Traffic per rank and call (``W`` = one head group's weight shard, ``KV`` = one K/V block of one head
group): forward ``(p−1)·W`` received + ``p(p−1)·KV``; backward ``(p−1)·W`` received,
``(p−1)·W`` (fp32) sent to owners, and ``p(p−1)·(KV + KV fp32)``.

The projection → q/k norm → RoPE step and its backward (shared with the streaming layer):
:mod:`.attention_prep`; the weight broadcasts and gradient reductions: :mod:`.attention_weights`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..runtime import overrides
from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                     refuse_together)
from ..runtime.finite import check_finite
from ..runtime.groups import METPGroup, as_metp_group
from ..runtime.ring import RingExchanger
from ._accum import mm_acc, mm_into, mm_new
from ._first_order import first_order_only
from ._flat import FlatLayout
from ._grads import weight_grad
from .attention_keep import AttentionKeep, check_kept
from .attention_kernels import select_kernel
from .attention_prep import HeadGeometry, heads_first, project_block, project_block_backward
from .attention_weights import block_weights, deliver_flat, deliver_grads, keep_owned
from .cuda_emulation import emulating_cuda
from .documents import cu_seqlens_digest, document_positions
from .head_norm import check_head_norm, head_norm_grads
from .ring_attention import (check_packed, post_first_kv_packed, ring_attention_backward,
                             ring_attention_forward, shape_layout)
from .rope import rope_tables
from .sinks import add_sink_, sink_grad
from .sequence import LAYOUTS, local_positions


def _check_inputs(x, wqkv, wo, bqkv, bo, group: METPGroup, A, G, layout, causal, freqs,
                  P=None):
    p = group.size
    P = p if P is None else P  # ranks the sequence is split over (p·c under METP × CP)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be this rank's tokens [s/p, b, h], got shape {tuple(x.shape)}")
    n, b, h = x.shape
    if A <= 0 or G <= 0 or A % G:
        raise ValueError(f"num_heads ({A}) must be a positive multiple of num_query_groups ({G})")
    if G % p:
        raise ValueError(f"num_query_groups ({G}) is not divisible by the METP group size {p}; "
                         f"choose a METP size that divides the number of query groups")
    if wqkv.dim() != 2 or wqkv.shape[1] != h:
        raise ValueError(f"qkv_weight must be [(G/p)·(A/G+2)·d, h={h}], got {tuple(wqkv.shape)}")
    per_d = (G // p) * (A // G + 2)
    if wqkv.shape[0] % per_d:
        raise ValueError(f"qkv_weight has {wqkv.shape[0]} rows, not a multiple of "
                         f"(G/p)·(A/G+2) = {per_d}: the shard does not match num_heads={A}, "
                         f"num_query_groups={G} and group size {p}")
    d = wqkv.shape[0] // per_d
    if wo.dim() != 2 or tuple(wo.shape) != (h, (A // p) * d):
        raise ValueError(f"proj_weight must be [h={h}, (A/p)·d={(A // p) * d}] (head dim {d} from "
                         f"qkv_weight), got {tuple(wo.shape)}: mismatched head dims or group size")
    if bqkv is not None and tuple(bqkv.shape) != (wqkv.shape[0],):
        raise ValueError(f"qkv_bias must be [{wqkv.shape[0]}], got {tuple(bqkv.shape)}")
    if bo is not None and tuple(bo.shape) != (h,):
        raise ValueError(f"proj_bias must be replicated [h={h}], got {tuple(bo.shape)}")
    for name, t in (("qkv_weight", wqkv), ("proj_weight", wo), ("qkv_bias", bqkv),
                    ("proj_bias", bo), ("rotary_pos_emb", freqs)):
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
        if name != "rotary_pos_emb" and t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
    if causal and layout == "dual_chunk" and n % 2:
        raise ValueError(f"layout='dual_chunk' needs an even number of local tokens (sequence "
                         f"split into 2·{'p·c' if P != p else 'p'} = {2 * P} chunks), got {n}; "
                         f"make the sequence length divisible by {2 * P}")
    if freqs is not None:
        if freqs.dim() != 4 or freqs.shape[0] not in (n, n * P) or freqs.shape[-1] > d \
                or freqs.shape[-1] % 2:
            raise ValueError(f"rotary_pos_emb must be Megatron's RoPE angles [s/p={n} or s={n * P}, "
                             f"1, 1, r] with even r <= head dim {d}, got {tuple(freqs.shape)}")
    return d


#: Query-head rows (heads × local tokens × batch) a head-group block aims for on a GPU: enough
#: for the flash kernels to fill the device (2¹⁷ rows ≈ 1,024 tiles of 128 rows, ≈ 7.8 waves of
#: one tile per SM on an H100/H200's 132 SMs, so the partial last wave costs at most ~1/8 of a
#: ring step; 2¹⁶ would be 3.9 waves, up to 1/4); beyond it larger blocks only cost memory.
#:
#: Why not larger (re-examined for issue 21, where Llama-7B at s = 128K, p = 8 runs 4 blocks of
#: kb = 2 and counted 8.7× TP+SP's launches): at s/p = 16K one head group already has 64K rows,
#: and a forward ring step of a kb = 2 block is ≈ 5.5·10¹¹ FLOP (~1 ms on an H100; backward
#: 2.5×), against the one to three elementwise kernels per step around it (the output's
#: ``addcmul_``; the ``dQ``, ``dK``, ``dV`` sums) and a few dozen per block, which a GPU queues
#: behind the steps' flash kernels. A larger block would save only those launches, and costs
#: memory in proportion to kb: ``benchmarks/attention_memory.py --seq 131072 --p 8 --methods
#: metp-gpumm --part attention`` peaks at 1,298 / 1,782 / 3,863 MiB per rank with
#: ``METP_HEAD_BLOCK`` = 1 / 2 / 8 (Q/K/V, the ``p`` 16-bit block outputs kept for
#: :func:`lse.combine`, the fp32 ``dQ`` and ``dK/dV`` sums all grow with the block). The launch
#: count was cut per block instead (:func:`lse.combine`, :func:`rope.apply_rope`: 550 → 462
#: launches at 128K, 7.3× TP+SP's).
HEAD_BLOCK_ROWS = 2 ** 17


def head_block_size(p: int, heads_local: int, rows: int, device, requested=None) -> int:
    """Head groups per block ``kb`` (a divisor of ``p``): the outer loop runs ``p/kb`` blocks, each
    one weight fetch of ``kb`` head groups and one K/V ring of ``kb·A/p`` heads.

    ``requested``: an int, or ``"auto"`` (default; ``METP_HEAD_BLOCK`` overrides): on CUDA (or
    when the counting benchmark selects the CUDA branches) the largest divisor of ``p`` whose
    block has at most :data:`HEAD_BLOCK_ROWS` query-head rows, so that where ``s/p`` is short
    few, larger blocks keep the GPU busy with fewer launches; elsewhere 1 (the smallest
    transient memory; what ``metp plan`` models)."""
    if requested is None:
        requested = overrides.head_block()
    if requested == "auto":
        if not (getattr(device, "type", None) == "cuda" or emulating_cuda("kernels")):
            return 1
        kb = 1
        for c in range(1, p + 1):
            if p % c == 0 and c * heads_local * rows <= HEAD_BLOCK_ROWS:
                kb = c
        return kb
    try:
        kb = int(requested)
    except (TypeError, ValueError):
        kb = 0
    if kb < 1 or p % kb:
        raise ValueError(f"head_block (or METP_HEAD_BLOCK) must be 'auto' or a divisor of the "
                         f"METP group size {p}, got {requested!r}")
    return kb


class _METPAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wqkv, bqkv, wo, bo, freqs, group: METPGroup, geo: HeadGeometry, causal, layout,
                scale, kernel, label, kb, grad_dtype, cu, seq: METPGroup, head_norm, qn_w, qn_b,
                kn_w, kn_b, keep: Optional[AttentionKeep], recompute_core=False, sinks=None):
        check_finite(f"{label} (forward)", group, x=x, qkv_weight=wqkv, proj_weight=wo,
                     qkv_bias=bqkv, proj_bias=bo)
        ctx.label = label
        n, b, h = x.shape
        N = n * b
        x2 = x.reshape(N, h)
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        nb = group.size // kb
        H = kb * geo.heads_local
        y = None

        def project_out(o2, WOT):  # y += O_i·Wo_iᵀ
            nonlocal y
            if nb == 1:  # one GEMM over every head: rounded once, like stock TP's
                y = torch.mm(o2, WOT)
            elif y is None:
                y = mm_new(o2, WOT, acc_dtype)
            else:
                mm_acc(y, o2, WOT)

        if keep is not None and not keep.runs_ring:
            # the outputs an earlier forward kept (attention_keep): no K/V ring, no Q/K/V;
            # only the output projections' weights pass
            outs, lses = check_kept(keep.kept, nb, n, b, H, geo.d, x)
            for i, (_, _, WOT) in block_weights(group, None, None, wo, "fwd", kb):
                project_out(outs[i].view(N, -1), WOT)
        else:
            outs, lses = [], []
            tables = rope_tables(freqs, x.dtype) if freqs is not None else None
            for i, (WQ, BQ, WOT) in block_weights(group, wqkv, bqkv, wo, "fwd", kb):
                q, k, v, kv = project_block(x2, WQ, BQ, geo, n, b, kb, (freqs, tables),
                                            head_norm)
                o = torch.empty(n, b, H * geo.d, dtype=x.dtype, device=x.device)
                _, lse = ring_attention_forward(q, k, v, seq, causal, layout, scale, kernel,
                                                kv_packed=kv, defer_merge=kb > 1,
                                                out=heads_first(o, H, geo.d), cu_seqlens=cu)
                if sinks is not None:  # once per row, after the ring (ops/sinks.py)
                    add_sink_(heads_first(o, H, geo.d), lse, sinks[i * H:(i + 1) * H])
                if not recompute_core:  # core_attn recompute: neither kept, re-formed in backward
                    outs.append(o)
                    lses.append(lse)
                project_out(o.view(N, -1), WOT)
            if keep is not None:
                keep.sink(outs, lses)
        if bo is not None:
            y.add_(bo)
        ctx.save_for_backward(x, wqkv, bqkv, wo, freqs, sinks, *outs, *lses)
        ctx.args = (group, geo, causal, layout, scale, kernel, kb, grad_dtype)
        ctx.cu, ctx.seq, ctx.head_norm = cu, seq, head_norm
        ctx.recompute_core = recompute_core
        ctx.has = (bqkv is not None, bo is not None, freqs is not None)
        return y.to(x.dtype).view(n, b, h)

    @staticmethod
    @first_order_only("metp_attention")
    def backward(ctx, grad_y):
        check_finite(f"{ctx.label} (backward)", ctx.args[0], grad_output=grad_y)
        group, geo, causal, layout, scale, kernel, kb, grad_dtype = ctx.args
        has_bq, has_bo, has_freqs = ctx.has
        saved = ctx.saved_tensors
        x, wqkv, bqkv, wo, freqs, sinks = saved[:6]
        p, r = group.size, group.rank
        nb = p // kb
        if ctx.recompute_core:
            outs, lses = [None] * nb, [None] * nb
        else:
            outs, lses = saved[6:6 + nb], saved[6 + nb:6 + 2 * nb]
        bqkv = bqkv if has_bq else None
        freqs = freqs if has_freqs else None
        n, b, h = x.shape
        N = n * b
        x2 = x.reshape(N, h)
        gy = grad_y.reshape(N, h).to(x.dtype)
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        dx = None
        dbo = gy.sum(0, dtype=acc_dtype).to(x.dtype) if has_bo else None
        rows, d, qpg = geo.qkv_rows, geo.d, geo.q_per_group
        G, H = kb * geo.groups_local, kb * geo.heads_local
        grad_layout = FlatLayout([wqkv.shape, None if bqkv is None else bqkv.shape,
                                  (wo.shape[1], wo.shape[0])])

        # Each block's gradients are reduced to their owners while the next block computes; at
        # most two blocks' contributions are alive. Only the owner's results are kept.
        grad_ring = RingExchanger(group, "attention weight grads (bwd)")
        acc, in_flight = [None, None, None], []
        tables = rope_tables(freqs, x.dtype) if freqs is not None else None
        gw = dict(dtype=grad_dtype or acc_dtype, device=x.device)
        head_norm, norm_acc, pre = ctx.head_norm, [None] * 4, []
        d_sinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32,
                                                         device=x.device)
        for i, (WQ, BQ, WOT) in block_weights(group, wqkv, bqkv, wo, "bwd", kb):
            q, k, v, kv = project_block(x2, WQ, BQ, geo, n, b, kb, (freqs, tables), head_norm,
                                        pre)
            if ctx.recompute_core:  # the forward's K/V ring again (k, v packed anew: it
                # consumes its payload), the same kernel in the same order: the same O and LSE
                o_i = torch.empty(n, b, H * d, dtype=x.dtype, device=x.device)
                _, lses[i] = ring_attention_forward(q, k, v, ctx.seq, causal, layout, scale,
                                                    kernel, defer_merge=kb > 1,
                                                    out=heads_first(o_i, H, d), cu_seqlens=ctx.cu)
                if sinks is not None:
                    add_sink_(heads_first(o_i, H, d), lses[i], sinks[i * H:(i + 1) * H])
                outs[i] = o_i
            first = post_first_kv_packed(kv, ctx.seq)  # hidden behind the dO / dWo GEMMs
            o2 = outs[i].view(N, -1)
            d_o = torch.mm(gy, WOT.t())
            if kb == 1:  # one buffer, one reduce: the pieces back to back
                flat = torch.empty(grad_layout.numel, **gw)
                g_wq, g_bq, g_wot = grad_layout.unpack(flat)
            else:
                flat = None
                g_wq = torch.empty(kb * rows, h, **gw)
                g_bq = torch.empty(kb * rows, **gw) if has_bq else None
                g_wot = torch.empty(kb * geo.heads_local * d, h, **gw)
            dWOT = mm_into(g_wot, o2.t(), gy)
            if sinks is not None:  # this rank's rows; DDP adds the other ranks'
                d_sinks[i * H:(i + 1) * H] = sink_grad(heads_first(d_o.view(n, b, -1), H, d),
                                                       heads_first(outs[i], H, d), lses[i],
                                                       sinks[i * H:(i + 1) * H])
            made = []

            def dqkv_dv():  # dqkv allocated at the ring's last step; dv written into it there
                made.append(torch.empty(N, kb * rows, dtype=x.dtype, device=x.device))
                return made[0].view(n, b, G, qpg + 2, d)[:, :, :, qpg + 1].permute(1, 2, 0, 3)

            dq, dk, dv = ring_attention_backward(
                heads_first(d_o.view(n, b, -1), H, d), q, k, v,
                heads_first(outs[i], H, d), lses[i], ctx.seq, causal, layout, scale, kernel,
                first=first, dv_out=dqkv_dv, cu_seqlens=ctx.cu)
            del q, k, v, kv, d_o, first, dv  # dv: written into dqkv already
            if ctx.recompute_core:
                outs[i] = lses[i] = None  # one block's re-formed O and LSE alive at a time
            dqkv = made[0]
            # dq, dk: RoPE transposed, through the q/k norm (weight grads summed), into dqkv
            project_block_backward(dq, dk, dqkv.view(n, b, G, qpg + 2, d), geo, (freqs, tables),
                                   head_norm, pre.pop() if head_norm is not None else None,
                                   norm_acc)
            del dq, dk
            dWQ = mm_into(g_wq, dqkv.t(), x2)
            dBQ = torch.sum(dqkv, 0, dtype=g_bq.dtype, out=g_bq) if has_bq else None
            if nb == 1:
                dx = torch.mm(dqkv, WQ)
            elif dx is None:
                dx = mm_new(dqkv, WQ, acc_dtype)
            else:
                mm_acc(dx, dqkv, WQ)
            made.clear()
            del dqkv  # not alive during the next block's ring
            if p == 1:
                acc = [dWQ, dBQ, dWOT]
                continue
            acc = keep_owned(in_flight, r, acc)
            if flat is not None:
                in_flight = deliver_flat(grad_ring, i, flat)
            else:
                in_flight = deliver_grads(grad_ring, group, kb, i, (dWQ, dBQ, dWOT))
        acc = keep_owned(in_flight, r, acc)
        if p > 1 and kb == 1:
            acc = grad_layout.unpack(acc[0])
        dwq, dbq, dwot = acc
        return (dx.to(x.dtype).view(n, b, h), weight_grad(wqkv, dwq), weight_grad(bqkv, dbq),
                weight_grad(wo, dwot.t()), dbo,
                None, None, None, None, None, None, None, None, None, None, None, None,
                None, *head_norm_grads(head_norm, norm_acc), None, None,
                None if d_sinks is None or not ctx.needs_input_grad[-1] else
                d_sinks.to(sinks.dtype))


def prepare_attention(x, qkv_weight, proj_weight, *, group: METPGroup, num_heads: int,
                      num_query_groups: int, causal: bool, layout: str, rotary_pos_emb,
                      qkv_bias, proj_bias, kernel, head_block, cu_seqlens, rope_per_document,
                      context_group, qk_norm, qk_norm_eps, q_norm_weight, k_norm_weight,
                      q_norm_bias, k_norm_bias, label: str,
                      op: str = "metp_attention"):
    """The checks and set-up :func:`metp_attention` and the streaming layer
    (:func:`~megatron_metp.ops.layer.metp_layer`) share: ``(seq, d, kernel, kb, cu, freqs,
    head_norm)``: the sequence ring (the METP group, or the context group under CP), the head
    dim, the block kernel, the head-group block size, the checked document boundaries, this
    rank's RoPE angles ``[s/p, 1, 1, r]`` (or ``None``) and the q/k norm (or ``None``). A
    ``ValueError`` is raised on every rank of the sequence ring together, naming ``op``."""
    seq = group.sequence_ring if context_group is None else as_metp_group(context_group)
    try:
        if seq is not group and (seq.size % group.size
                                 or any(g not in seq.ranks for g in group.ranks)):
            raise ValueError(f"context_group {seq.name!r} (global ranks {list(seq.ranks)}) must "
                             f"contain every rank of the METP group {group.name!r} "
                             f"({list(group.ranks)}) and have a multiple of {group.size} ranks")
        d = _check_inputs(x, qkv_weight, proj_weight, qkv_bias, proj_bias, group, num_heads,
                          num_query_groups, shape_layout(layout), causal, rotary_pos_emb,
                          seq.size)
        kern = select_kernel(x.device, x.dtype, kernel, head_dim=d)
        kb = head_block_size(group.size, num_heads // group.size, x.shape[0] * x.shape[1],
                             x.device, head_block)
        n, p = x.shape[0], seq.size  # the sequence's split (p·c ranks under CP)
        cu = check_packed(cu_seqlens, n * p, causal, layout, p)
        freqs = rotary_pos_emb
        if rope_per_document and cu is None:
            raise ValueError("rope_per_document=True needs cu_seqlens (the angles are positions "
                             "within packed documents); pass cu_seqlens or drop it")
        if rope_per_document and freqs is not None:
            if freqs.shape[0] != n:
                raise ValueError(f"rotary_pos_emb with rope_per_document=True must be this "
                                 f"rank's per-document angles [s/p={n}, 1, 1, r], got "
                                 f"{tuple(freqs.shape)}")
        elif freqs is not None and cu is not None:
            if freqs.shape[0] != n * p:
                raise ValueError(f"rotary_pos_emb with cu_seqlens must be the whole-sequence "
                                 f"table [s={n * p}, 1, 1, r] (positions restart at each "
                                 f"document start), got {tuple(freqs.shape)}: a per-rank "
                                 f"[s/p, 1, 1, r] slice cannot be re-indexed per document")
            freqs = freqs.index_select(0, document_positions(cu, seq.rank, p, n, layout,
                                                             device=x.device))
        elif freqs is not None and freqs.shape[0] != n:
            pos = local_positions(seq.rank, p, n, layout=layout, device=x.device)
            freqs = freqs.index_select(0, pos)
        head_norm = check_head_norm(qk_norm, qk_norm_eps, q_norm_weight, k_norm_weight,
                                    q_norm_bias, k_norm_bias, d, x)
    except ValueError as exc:
        refuse_together(seq, op_label(op, label), exc)
        raise
    return seq, d, kern, kb, cu, freqs, head_norm


def metp_attention(x: torch.Tensor, qkv_weight: torch.Tensor, proj_weight: torch.Tensor, *, group,
                   num_heads: int, num_query_groups: int, causal: bool = True,
                   layout: str = "dual_chunk", rotary_pos_emb: Optional[torch.Tensor] = None,
                   qkv_bias: Optional[torch.Tensor] = None,
                   proj_bias: Optional[torch.Tensor] = None,
                   softmax_scale: Optional[float] = None,
                   kernel: Optional[str] = None, label: str = "metp_attention",
                   head_block=None,
                   grad_reduce_dtype: Optional[torch.dtype] = torch.float32,
                   cu_seqlens=None, rope_per_document: bool = False,
                   context_group=None,
                   qk_norm: Optional[str] = None, qk_norm_eps: float = 1e-5,
                   q_norm_weight: Optional[torch.Tensor] = None,
                   k_norm_weight: Optional[torch.Tensor] = None,
                   q_norm_bias: Optional[torch.Tensor] = None,
                   k_norm_bias: Optional[torch.Tensor] = None,
                   keep: Optional[AttentionKeep] = None,
                   recompute_core: bool = False,
                   softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The METP self-attention block (before the residual): ``y = Attn(x)·Woᵀ + bo``.

    Args:
        x: ``[s/p, b, h]`` this rank's tokens in ``layout`` order.
        qkv_weight: this rank's ``linear_qkv`` ColumnParallelLinear shard
            ``[(G/p)·(A/G+2)·d, h]`` (Megatron's query-group interleaved layout).
        proj_weight: this rank's ``linear_proj`` RowParallelLinear shard ``[h, (A/p)·d]``.
        group: :class:`~megatron_metp.runtime.groups.METPGroup` (or ProcessGroup, or ``None`` for p=1).
        num_heads, num_query_groups: ``A`` and ``G`` of the whole model (GQA when ``G < A``).
        causal, layout: as in :func:`~megatron_metp.ops.ring_attention`.
        rotary_pos_emb: Megatron's RoPE angles ``[s/p, 1, 1, r]`` for this rank's tokens (as
            Megatron's ``RotaryEmbedding`` returns them under context parallelism) or ``[s, 1, 1, r]``
            for the whole sequence (this rank's positions are selected). With ``cu_seqlens`` it
            must be the whole-sequence table ``[s, 1, 1, r]`` (rows ``0 … s−1``): positions
            restart at 0 at each document start (:func:`documents.document_positions`); a
            per-rank ``[s/p, 1, 1, r]`` slice (``p > 1``) is refused, since its rows are this
            rank's global positions, not positions within documents — unless
            ``rope_per_document``.
        qkv_bias: ``[(G/p)·(A/G+2)·d]`` sharded like ``qkv_weight``; proj_bias: ``[h]`` replicated.
        softmax_scale: default ``1/sqrt(d)``. kernel: block kernel name, default best available.
        head_block: head groups per block of the outer loop, a divisor of ``p``, or ``"auto"``
            (default, see :func:`head_block_size`): ``kb`` groups share one weight fetch and one
            K/V ring of ``kb·A/p`` heads. The result is the same for every choice.
        grad_reduce_dtype: dtype in which each head group's weight gradient is formed and
            reduced to its owner (default fp32; ``None``: the accumulation dtype; Megatron's
            METP modules pass their ``main_grad``'s dtype). Where a weight has Megatron's
            ``main_grad``, the complete gradient is added there directly (no rounding to the
            weight's dtype first).
        cu_seqlens: packed documents, as in :func:`~megatron_metp.ops.ring_attention`:
            cumulative document lengths of the global sequence ``[0, …, s]`` (natural token
            order, identical on every rank); attention is causal within each document and RoPE
            positions restart per document. ``None``: unchanged.
        rope_per_document: with ``cu_seqlens``, ``rotary_pos_emb`` is already this rank's
            per-document angles ``[s/p, 1, 1, r]`` (row ``i`` = the angles of local token ``i``'s
            position within its document, :func:`documents.document_positions`), computed once
            per micro-batch and shared by every layer (Megatron's METP modules: what
            :mod:`megatron_metp.megatron.packing` computes), instead of a per-layer selection
            from the whole-sequence table.
        qk_norm: ``"RMSNorm"`` or ``"LayerNorm"``: normalise every query and key head over its
            ``d`` channels after the projection and before RoPE (Megatron's
            ``--qk-layernorm``, :mod:`.head_norm`), with ``qk_norm_eps`` and the replicated
            ``q_norm_weight``/``k_norm_weight`` ``[d]`` (``q_norm_bias``/``k_norm_bias`` ``[d]``
            with ``LayerNorm``); their gradients are this rank's token partials, like
            ``proj_bias``'s. ``None`` (default): no norm.
        label: names this call in NaN/Inf reports (:mod:`megatron_metp.runtime.finite`) and in the
            cross-rank agreement check (:mod:`megatron_metp.runtime.agree`, on by default), which also requires
            it, every shape/dtype and every option to be equal on all ranks of the group.

        context_group: METP × context parallelism (:mod:`megatron_metp.runtime.context`): the
            sequence ring, a :class:`METPGroup` of ``p·c`` ranks containing ``group``'s (default:
            ``group.context``, else ``group`` itself, ``c = 1``). The sequence is then split over
            its ``p·c`` ranks in ``layout`` order (``x [s/(p·c), b, h]``; its rank index ``R``
            is the chunk index; RoPE rows and ``cu_seqlens`` refer to the whole sequence of
            ``s`` tokens); the weight broadcasts stay in ``group``; each head group's K/V ring
            (forward, and dK/dV home in backward) runs over the ``p·c`` ranks.

        keep: kept attention outputs across a recompute (:mod:`.attention_keep`): with
            ``AttentionKeep(sink=f)`` the call runs as usual and hands every head-group block's
            ``O`` and fp32 ``LSE`` to ``f``; with ``AttentionKeep(kept=(outs, lses))`` (what an
            earlier call with the same inputs handed over) it runs no K/V ring and no Q/K/V
            projection, forms ``y`` from the kept ``O`` and saves them for its backward, which
            re-forms Q/K/V from ``x`` as always. Every rank of the sequence ring must pass the
            same kind. ``None`` (default): neither.
        recompute_core: Megatron's selective recompute of ``core_attn``
            (:mod:`megatron_metp.megatron.selective`): keep neither the head groups' outputs
            ``O_g`` nor their log-sum-exps for backward (``[s/p, b, A·d]`` + fp32
            ``[b, A, s/p]`` less per call: every head of this rank's tokens); the backward
            re-runs each head-group block's K/V ring forward (same kernel, same order: the same
            ``O``, LSE and gradients) before that block's attention backward. Not together with
            ``keep`` (the one keeps what the other re-forms).
        softmax_offset: attention sinks (Megatron's ``softmax_type`` ``learnable`` or
            ``off-by-one``): one logit per head ``[A]`` (every head, replicated), added to every
            row's softmax denominator once, after the K/V ring (:mod:`.sinks`); its gradient is
            this rank's rows' partial (reduced over the sequence ranks by the caller's DDP, like
            ``proj_bias``'s). ``None`` (default): plain softmax.

    Returns: ``y [s/p, b, h]`` (``[s/(p·c), b, h]`` under CP). Weight-shard gradients are
    complete over the tokens of ``group`` (under CP the caller sums them over the ``c`` METP
    groups of the context group, Megatron's expert-DP reduction); ``proj_bias``'s is this
    rank's token partial (replicated parameter, reduced over the group by the caller's DDP).
    """
    group = as_metp_group(group)
    seq, d, kern, kb, cu, freqs, head_norm = prepare_attention(
        x, qkv_weight, proj_weight, group=group, num_heads=num_heads,
        num_query_groups=num_query_groups, causal=causal, layout=layout,
        rotary_pos_emb=rotary_pos_emb, qkv_bias=qkv_bias, proj_bias=proj_bias, kernel=kernel,
        head_block=head_block, cu_seqlens=cu_seqlens, rope_per_document=rope_per_document,
        context_group=context_group, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, q_norm_bias=q_norm_bias,
        k_norm_bias=k_norm_bias, label=label)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if agreement_checks_enabled():  # over the sequence ring: every rank of every METP group
        check_group_agrees(seq, op_label("metp_attention", label), label=label, x=x,
                           qkv_weight=qkv_weight, proj_weight=proj_weight, qkv_bias=qkv_bias,
                           proj_bias=proj_bias, rotary_pos_emb=rotary_pos_emb,
                           num_heads=num_heads, num_query_groups=num_query_groups,
                           causal=bool(causal), layout=layout, softmax_scale=float(scale),
                           kernel=kern.name, head_block=kb, grad_reduce_dtype=grad_reduce_dtype,
                           cu_seqlens=None if cu is None else cu_seqlens_digest(cu),
                           rope_per_document=bool(rope_per_document),
                           qk_norm=qk_norm, qk_norm_eps=float(qk_norm_eps) if qk_norm else None,
                           q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                           q_norm_bias=q_norm_bias, k_norm_bias=k_norm_bias,
                           runs_kv_ring=keep is None or keep.runs_ring,
                           recompute_core=bool(recompute_core), softmax_offset=softmax_offset,
                           needs_grad=needs_grad(x, qkv_weight, proj_weight, qkv_bias, proj_bias,
                                                 q_norm_weight, k_norm_weight))
    if keep is not None and recompute_core:
        raise ValueError(f"{op_label(label)}: keep= (--metp-keep-attention-output) and "
                         "recompute_core (--recompute-granularity selective, core_attn) do not "
                         "go together: the one keeps the attention outputs the other re-forms")
    geo = HeadGeometry(num_heads, num_query_groups, d, group.size)
    return _METPAttentionFunction.apply(x, qkv_weight, qkv_bias, proj_weight, proj_bias, freqs,
                                        group, geo, bool(causal), layout, float(scale), kern,
                                        label, kb, grad_reduce_dtype, cu, seq, head_norm,
                                        q_norm_weight, q_norm_bias, k_norm_weight, k_norm_bias,
                                        keep, bool(recompute_core), softmax_offset)
