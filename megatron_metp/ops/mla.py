"""METP multi-latent attention (DeepSeek-V2/V3 MLA): the head-group loop of :mod:`.attention`
around a K/V ring that carries each token's compressed latent instead of the heads' K and V.

Names as in :mod:`.mla_latent` (``A`` heads, ``H = A/p`` per head group, ``kvr``, ``dn``,
``dr``, ``dv``, ``C = kvr + dr``); ``h`` hidden, ``ql`` = ``q_lora_rank``.

Layout on rank ``r`` of the METP group (``p`` ranks; the sequence ring has ``p·c`` under CP):

* ``x``, ``y``: this rank's tokens ``[n, b, h]`` (``layout`` order, causal dual-chunk balance);
* head-sharded (Megatron TP shard ``r``, travelling the weight loop by head group as
  :mod:`.attention`'s ``linear_qkv``/``linear_proj`` do): ``q_up_weight`` ``[H·(dn+dr), ql]``
  (``linear_q_up_proj``; without a query latent ``linear_q_proj`` ``[H·(dn+dr), h]``),
  ``kv_up_weight`` ``[H·(dn+dv), kvr]`` (``linear_kv_up_proj``), ``proj_weight``
  ``[h, H·dv]`` (``linear_proj``);
* replicated: ``q_down_weight`` ``[ql, h]``, ``q_norm_weight`` ``[ql]``, ``kv_down_weight``
  ``[C, h]``, ``kv_norm_weight`` ``[kvr]`` and ``proj_bias`` ``[h]``. Why: every head group needs
  the *whole* latent of every token (it is what the ring carries), so a sharded down-projection
  would have to be gathered before the head loop, every layer, forward and backward; replicated,
  it is applied once to this rank's own tokens with no traffic, exactly as stock Megatron TP
  keeps it (``parallel_mode="duplicated"``). Size: DeepSeek-V3 has ``ql·h + C·h`` = 11.0M +
  4.1M parameters per layer there, against 172.0M head-sharded (``/p`` each). Their gradients
  (and the norms') are this rank's token partials, summed over the group by the caller's DDP
  like any replicated parameter's.

Forward (autograd runs the local part; :class:`_MLAFunction` the rings)::

    q_in = RMSNorm(x·W_dqᵀ)·γ_q   (or x)          [c ‖ k_raw] = x·W_dkvᵀ
    c = RMSNorm(c)·γ_kv,   k_pe = m·R(θ)·P·k_raw  (:mod:`.mla_rope`)      L = [c ‖ k_pe]
    for head group g = 0 … p−1 (weights of g from their owner):
        q_g = q_in·W_uq,gᵀ → [n, b, H, dn+dr];  q_g[..., dn:] ← m·R(θ)·P·q_g[..., dn:]
        O_g = latent_ring(q_g, L, W_kv,g)      (:mod:`.mla_ring`: L travels, K/V re-formed)
        y  += O_g·W_o,gᵀ
    y += b_o

Backward (head groups in the same order, weights broadcast again)::

    dO_g = dy·W_o,g                          dW_o,g = Σ_r dyᵀ·O_g
    (dq_g, dL_g, dW_kv,g) = latent_ring backward   (dL travels home on the ring, fp32)
    dq_g[..., dn:] ← Pᵀ·R(θ)ᵀ·m·dq_g[..., dn:]
    dW_uq,g = Σ_r dq_gᵀ·q_in                 dq_in += dq_g·W_uq,g              dL += dL_g
    dc = dL[..., :kvr]                       dk_raw = Pᵀ·R(θ)ᵀ·m·dL[..., kvr:]

Each rank's fp32 ``(dW_uq,g, dW_kv,g, dW_o,gᵀ)`` is reduced to owner ``g`` in one message while
the next head group computes. Softmax scale: ``1/sqrt(dn+dr)`` by default; with YaRN pass
DeepSeek's ``mscale(s, mscale_all_dim)²/sqrt(dn+dr)`` as ``softmax_scale`` and the rotation
factor ``mscale(s, mscale)/mscale(s, mscale_all_dim)`` as ``rope_mscale`` (what megatron-core's
``MLASelfAttention`` and ``YarnRotaryEmbedding`` compute), with YaRN's angles.

Head-group blocks (``head_block`` = ``kb``, a divisor of ``p``): the loop runs ``p/kb`` blocks
of ``kb`` head groups, each one weight fetch (per-group broadcasts; one all-gather per piece at
``kb = p``) and one latent ring for its ``kb·A/p`` heads. Since the latent does not depend on the
head group, ``kb = p`` sends it round once per layer: ``C`` values per token per ring step for
every head together (DeepSeek-V3: 576 against stock CP's ``A·(dn+dr+dv)`` = 40,960 for K and
V), where ``kb = 1`` sends it ``p`` times (``p·C``; per head-group ring step ``C`` against that
group's ``A/p·(dn+dr+dv)``). What ``kb = p`` costs: every head's ``q``/``kv`` up-projection
and output projection resident at once (all-gathered), and each block's up-projected K/V of
every head (``[m, b, A·(dn+dr+dv)]``) at once, which ``kb = 1`` keeps to ``1/p`` of it.

Saved for backward: ``q_in`` ``[n, b, ql]`` (or ``x``), ``L`` ``[n, b, C]``, every block's
``O`` ``[n, b, H·dv]`` and fp32 log-sum-exp; autograd's local part keeps ``x`` and the
pre-norm latents. No rank holds the heads' K/V of another rank's tokens between ring steps,
nor (``kb < p``) whole weights. Traffic per rank and call (``W``: one head group's three
shards): forward ``(p−1)·W`` received and ``(p/kb)(P−1)`` latent blocks ``[n, b, C]`` sent
(``P`` ranks in the sequence ring); backward ``(p−1)·W`` received, ``(p−1)·W`` fp32 sent to the
owners and ``(p/kb)(P−1)`` latent and as many fp32 ``dL`` blocks.

Packed documents (``cu_seqlens``): the latent ring runs the document pieces of
:mod:`.documents` (:mod:`.mla_ring`), RoPE positions restart per document.

Not done here: kept attention / selective recompute of the core (no such arguments), per-rank
per-document angles (``rope_per_document``), a GPU-tuned ``head_block="auto"``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..runtime.agree import (agreement_checks_enabled, check_group_agrees, needs_grad, op_label,
                             refuse_together)
from ..runtime.finite import check_finite
from ..runtime.groups import METPGroup, as_metp_group
from ..runtime.ring import RingExchanger
from ._first_order import first_order_only
from ._flat import FlatLayout
from ._grads import weight_grad
from .attention_kernels import select_kernel
from .attention_weights import block_pieces, deliver_flat, deliver_grads, keep_owned
from .mla_latent import MLAGeometry
from .mla_ring import latent_ring_backward, latent_ring_forward
from .mla_rope import mla_rope, mla_rope_tables, mla_rope_transpose
from .documents import PACKED_LAYOUTS, cu_seqlens_digest, document_positions
from .ring_checks import check_packed, shape_layout
from .sequence import local_positions

#: kernels that take a value head dim different from the query/key one (others get v padded)
_ANY_V_DIM = ("reference",)


def _queries(q_in2, WQ, geo: MLAGeometry, n, b, freqs, tables):
    """Head group queries, heads-first ``[b, H, n, dn+dr]``, their RoPE part rotated."""
    q = torch.mm(q_in2, WQ.t()).view(n, b, geo.heads_local, geo.dq)
    q[..., geo.dn:] = mla_rope(q[..., geo.dn:], freqs, tables)
    return q.permute(1, 2, 0, 3).contiguous()


def _heads_first_v(t, geo: MLAGeometry, n, b):
    """``[n·b, H·dv]`` → ``[b, H, n, dv_kernel]`` (zero-padded with ``geo.pad``)."""
    t = t.view(n, b, geo.heads_local, geo.dv).permute(1, 2, 0, 3)
    if not geo.pad:
        return t.contiguous()
    out = t.new_zeros(b, geo.heads_local, n, geo.dq)
    out[..., :geo.dv] = t
    return out


class _MLAFunction(torch.autograd.Function):
    """``y = Σ_g latent_ring(q_g, L, W_kv,g)·W_o,gᵀ`` from ``q_in [n, b, ql]``, ``c [n, b, kvr]``
    and ``k_raw [n, b, dr]`` (module docstring); gradients of those three and of the three
    head-sharded weights."""

    @staticmethod
    def forward(ctx, q_in, c, k_raw, wq, wkv, wo, freqs, group: METPGroup, seq: METPGroup,
                geo: MLAGeometry, causal, layout, scale, kernel, mscale, label, kb, cu):
        check_finite(f"{label} (forward)", group, q_in=q_in, latent=c, rope_key=k_raw,
                     q_up_weight=wq, kv_up_weight=wkv, proj_weight=wo)
        n, b = q_in.shape[:2]
        N = n * b
        tables = mla_rope_tables(freqs, q_in.dtype, mscale)
        latent = torch.cat((c, mla_rope(k_raw, freqs, tables)), dim=-1).contiguous()
        q_in2 = q_in.reshape(N, -1)
        acc_dtype = torch.float32 if q_in.dtype in (torch.float16, torch.bfloat16) else q_in.dtype
        y, outs, lses = None, [], []
        for _, (WQ, WKV, WOT) in block_pieces(group, (wq, wkv, wo.t()), "fwd", kb,
                                              what="MLA weights"):
            q = _queries(q_in2, WQ, geo, n, b, freqs, tables)
            o, lse = latent_ring_forward(q, latent, WKV, geo, seq, causal, layout, scale, kernel,
                                         cu)
            o = o[..., :geo.dv].permute(2, 0, 1, 3).reshape(N, -1).to(q_in.dtype)
            outs.append(o)
            lses.append(lse)
            part = torch.mm(o.to(acc_dtype), WOT.to(acc_dtype))
            y = part if y is None else y.add_(part)
        ctx.save_for_backward(q_in, latent, wq, wkv, wo, freqs, *outs, *lses)
        ctx.args = (group, seq, geo, causal, layout, scale, kernel, mscale, label, kb, cu)
        return y.to(q_in.dtype).view(n, b, -1)

    @staticmethod
    @first_order_only("metp_mla_attention")
    def backward(ctx, grad_y):
        group, seq, geo, causal, layout, scale, kernel, mscale, label, kb, cu = ctx.args
        check_finite(f"{label} (backward)", group, grad_output=grad_y)
        p, r = group.size, group.rank
        saved = ctx.saved_tensors
        q_in, latent, wq, wkv, wo, freqs = saved[:6]
        nb = geo.blocks
        outs, lses = saved[6:6 + nb], saved[6 + nb:6 + 2 * nb]
        n, b = q_in.shape[:2]
        N = n * b
        dt = q_in.dtype
        acc_dtype = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        tables = mla_rope_tables(freqs, dt, mscale)
        q_in2 = q_in.reshape(N, -1)
        gy = grad_y.reshape(N, -1).to(dt)
        grad_layout = FlatLayout([(kb * wq.shape[0], wq.shape[1]),
                                  (kb * wkv.shape[0], wkv.shape[1]),
                                  (kb * wo.shape[1], wo.shape[0])])
        grad_ring = RingExchanger(group, "MLA weight grads (bwd)")
        dq_in = torch.zeros(N, q_in.shape[-1], dtype=acc_dtype, device=q_in.device)
        d_lat = None
        acc, in_flight = [None, None, None], []
        for g, (WQ, WKV, WOT) in block_pieces(group, (wq, wkv, wo.t()), "bwd", kb,
                                              what="MLA weights"):
            flat = torch.empty(grad_layout.numel, dtype=torch.float32, device=q_in.device)
            g_wq, g_wkv, g_wot = grad_layout.unpack(flat)
            q = _queries(q_in2, WQ, geo, n, b, freqs, tables)
            d_o = torch.mm(gy, WOT.t())  # [N, H·dv]
            torch.mm(outs[g].t().float(), gy.float(), out=g_wot)
            g_wkv.zero_()
            dq, dl = latent_ring_backward(_heads_first_v(d_o, geo, n, b), q, latent, WKV,
                                          _heads_first_v(outs[g], geo, n, b), lses[g], geo,
                                          seq, causal, layout, scale, kernel, g_wkv, cu)
            d_lat = dl if d_lat is None else d_lat.add_(dl)
            dq = dq.permute(2, 0, 1, 3)  # [n, b, H, dn+dr]
            dq[..., geo.dn:] = mla_rope_transpose(dq[..., geo.dn:], freqs, tables)
            dq = dq.reshape(N, -1)
            torch.mm(dq.t(), q_in2.float(), out=g_wq)
            dq_in.addmm_(dq.to(acc_dtype), WQ.to(acc_dtype))
            if p == 1:
                acc = [g_wq, g_wkv, g_wot]
                continue
            acc = keep_owned(in_flight, r, acc)
            if kb == 1:  # one reduce of the three pieces back to back
                in_flight = deliver_flat(grad_ring, g, flat)
            else:
                in_flight = deliver_grads(grad_ring, group, kb, g, (g_wq, g_wkv, g_wot))
        acc = keep_owned(in_flight, r, acc)
        if p > 1 and kb == 1:
            acc = grad_layout.unpack(acc[0])
        dwq, dwkv, dwot = acc
        dc = d_lat[..., :geo.kvr].to(dt)
        dk_raw = mla_rope_transpose(d_lat[..., geo.kvr:], freqs, tables).to(dt)
        return (dq_in.to(dt).view(n, b, -1), dc, dk_raw, weight_grad(wq, dwq),
                weight_grad(wkv, dwkv), weight_grad(wo, dwot.t()),
                None, None, None, None, None, None, None, None, None, None, None, None)


def _check(x, w: dict, group: METPGroup, seq: METPGroup, geo: MLAGeometry, q_lora_rank,
           layout, causal, freqs):
    """Shapes, dtypes and devices of the inputs against the geometry; a ``ValueError`` naming
    the argument and the fix."""
    p, P = group.size, seq.size
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout must be one of {PACKED_LAYOUTS}, got {layout!r}")
    layout = shape_layout(layout)
    if x.dim() != 3:
        raise ValueError(f"x must be this rank's tokens [s/p, b, h], got {tuple(x.shape)}")
    n, b, h = x.shape
    for name, v in (("num_heads", geo.heads), ("kv_lora_rank", geo.kvr),
                    ("qk_head_dim", geo.dn), ("qk_pos_emb_head_dim", geo.dr),
                    ("v_head_dim", geo.dv)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if geo.dr % 2:
        raise ValueError(f"qk_pos_emb_head_dim must be even (RoPE rotates pairs), got {geo.dr}")
    if geo.heads % p:
        raise ValueError(f"num_heads ({geo.heads}) is not divisible by the METP group size {p}; "
                         f"choose a METP size that divides the number of heads")
    if seq is not group and (P % p or any(g not in seq.ranks for g in group.ranks)):
        raise ValueError(f"context_group {seq.name!r} (global ranks {list(seq.ranks)}) must "
                         f"contain every rank of the METP group {group.name!r} "
                         f"({list(group.ranks)}) and have a multiple of {p} ranks")
    H = geo.heads_local
    ql = q_lora_rank
    expect = {"q_up_weight": (H * geo.dq, geo.q_in), "kv_down_weight": (geo.latent, h),
              "kv_norm_weight": (geo.kvr,), "kv_up_weight": (H * (geo.dn + geo.dv), geo.kvr),
              "proj_weight": (h, H * geo.dv), "proj_bias": (h,)}
    if ql is not None:
        expect.update(q_down_weight=(ql, h), q_norm_weight=(ql,))
    elif w.get("q_down_weight") is not None or w.get("q_norm_weight") is not None:
        raise ValueError("q_down_weight/q_norm_weight given without q_lora_rank: pass "
                         "q_lora_rank (--q-lora-rank) or drop them (q_up_weight is then "
                         "linear_q_proj's shard [(A/p)·(dn+dr), h])")
    for name, shape in expect.items():
        t = w.get(name)
        if t is None:
            if name == "proj_bias":
                continue
            raise ValueError(f"{name} is required ({shape}) for this geometry")
        if tuple(t.shape) != shape:
            sharded = name in ("q_up_weight", "kv_up_weight", "proj_weight")
            raise ValueError(f"{name} must be {'this rank’s head-group shard ' if sharded else ''}"
                             f"{list(shape)} (num_heads={geo.heads}, METP size {p}, "
                             f"kv_lora_rank={geo.kvr}, qk_head_dim={geo.dn}, "
                             f"qk_pos_emb_head_dim={geo.dr}, v_head_dim={geo.dv}, "
                             f"q_lora_rank={ql}, hidden {h}), got {list(t.shape)}")
        if t.device != x.device or t.dtype != x.dtype:
            raise ValueError(f"{name} is {t.dtype} on {t.device} but x is {x.dtype} on "
                             f"{x.device}")
    if causal and layout == "dual_chunk" and n % 2:
        raise ValueError(f"layout='dual_chunk' needs an even number of local tokens, got {n}; "
                         f"make the sequence length divisible by {2 * P}")
    if freqs is None:
        raise ValueError("rotary_pos_emb is required: MLA rotates qk_pos_emb_head_dim channels "
                         "of every query head and the shared key")
    if freqs.dim() != 4 or freqs.shape[0] not in (n, n * P) or freqs.shape[-1] != geo.dr:
        raise ValueError(f"rotary_pos_emb must be the RoPE angles [s/p={n} or s={n * P}, 1, 1, "
                         f"qk_pos_emb_head_dim={geo.dr}], got {tuple(freqs.shape)}")


def metp_mla_attention(x: torch.Tensor, *, q_up_weight: torch.Tensor,
                       kv_down_weight: torch.Tensor, kv_norm_weight: torch.Tensor,
                       kv_up_weight: torch.Tensor, proj_weight: torch.Tensor, group,
                       num_heads: int, kv_lora_rank: int, qk_head_dim: int,
                       qk_pos_emb_head_dim: int, v_head_dim: int,
                       rotary_pos_emb: torch.Tensor,
                       q_lora_rank: Optional[int] = None,
                       q_down_weight: Optional[torch.Tensor] = None,
                       q_norm_weight: Optional[torch.Tensor] = None,
                       proj_bias: Optional[torch.Tensor] = None, norm_eps: float = 1e-5,
                       causal: bool = True, layout: str = "dual_chunk",
                       softmax_scale: Optional[float] = None, rope_mscale: float = 1.0,
                       kernel: Optional[str] = None, head_block: int = 1,
                       cu_seqlens=None, context_group=None,
                       label: str = "metp_mla_attention") -> torch.Tensor:
    """The METP multi-latent attention block (before the residual), module docstring.

    Args:
        x: ``[s/p, b, h]`` this rank's tokens in ``layout`` order (``[s/(p·c), b, h]`` under CP).
        q_up_weight: this rank's head group of ``linear_q_up_proj`` ``[(A/p)·(dn+dr), ql]`` (per
            head ``dn`` then ``dr`` rows); without ``q_lora_rank``, ``linear_q_proj``'s
            ``[(A/p)·(dn+dr), h]``.
        q_down_weight, q_norm_weight: replicated ``[ql, h]`` and ``[ql]`` (with ``q_lora_rank``).
        kv_down_weight: replicated ``[kvr+dr, h]`` (``linear_kv_down_proj``: latent rows, then
            the RoPE key's, DeepSeek's interleaved channel pairs).
        kv_norm_weight: replicated ``[kvr]``. norm_eps: both RMSNorms' epsilon.
        kv_up_weight: this rank's head group of ``linear_kv_up_proj`` ``[(A/p)·(dn+dv), kvr]``.
        proj_weight: this rank's ``linear_proj`` columns ``[h, (A/p)·dv]``; proj_bias ``[h]``.
        group: the METP group (:class:`METPGroup`, a ProcessGroup, or ``None`` for p = 1).
        num_heads, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim, q_lora_rank:
            the model's (Megatron's flags of the same names).
        rotary_pos_emb: RoPE angles ``[s/p, 1, 1, dr]`` of this rank's tokens or ``[s, 1, 1,
            dr]`` of the whole sequence (this rank's rows are selected), Megatron's ``[θ | θ]``
            layout; exact angles: :func:`rope.rope_angles`; YaRN: its scaled ``inv_freq``.
        softmax_scale: default ``1/sqrt(dn+dr)``; rope_mscale: YaRN's factor on cos/sin
            (module docstring; 1 without YaRN).
        head_block: ``kb``, head groups per block of the outer loop (a divisor of ``p``; 1 by
            default): each block is one weight fetch and *one* latent ring for its
            ``kb·A/p`` heads. ``kb = p``: a single ring for every head, ``C`` values per token
            per step for the whole layer instead of ``p·C``, at the cost of every head's
            up-/output-projection weights and a block's K/V for every head resident at once
            (docs/mla.md). The result does not depend on ``kb``.
        cu_seqlens: packed documents, as in :func:`attention.metp_attention` (cumulative
            document lengths of the global sequence; attention causal within each document,
            RoPE positions restarting per document, ``rotary_pos_emb`` then the
            whole-sequence table ``[s, 1, 1, dr]``; layouts ``dual_chunk``, ``contiguous`` or
            ``balanced``, shard with :func:`documents.shard_documents`).
        causal, layout, kernel, context_group, label: as in :func:`attention.metp_attention`
            (the latent ring runs over ``context_group``'s ``p·c`` ranks; weights stay in
            ``group``).

    Returns ``y [s/p, b, h]``. Gradients: the head-sharded weights' are complete over
    ``group``'s tokens (under CP the caller sums them over the ``c`` METP groups); the
    replicated ones' are this rank's token partials.
    """
    group = as_metp_group(group)
    seq = group.sequence_ring if context_group is None else as_metp_group(context_group)
    weights = dict(q_up_weight=q_up_weight, kv_down_weight=kv_down_weight,
                   kv_norm_weight=kv_norm_weight, kv_up_weight=kv_up_weight,
                   proj_weight=proj_weight, proj_bias=proj_bias, q_down_weight=q_down_weight,
                   q_norm_weight=q_norm_weight)
    try:
        kb = int(head_block) if isinstance(head_block, int) else 0
        if kb < 1 or group.size % kb:
            raise ValueError(f"head_block must be a divisor of the METP group size "
                             f"{group.size}, got {head_block!r}")
        geo = MLAGeometry(int(num_heads), group.size, int(kv_lora_rank), int(qk_head_dim),
                          int(qk_pos_emb_head_dim), int(v_head_dim),
                          int(q_lora_rank) if q_lora_rank is not None else x.shape[-1])
        _check(x, weights, group, seq, geo, q_lora_rank, layout, causal, rotary_pos_emb)
        kern = select_kernel(x.device, x.dtype, kernel, head_dim=geo.dq)
        geo = dataclasses.replace(geo, blocks=group.size // kb,
                                  pad=geo.dv != geo.dq and kern.name not in _ANY_V_DIM)
        n, P = x.shape[0], seq.size
        cu = check_packed(cu_seqlens, n * P, causal, layout, P)
        freqs = rotary_pos_emb
        if cu is not None:
            if freqs.shape[0] != n * P:
                raise ValueError(f"rotary_pos_emb with cu_seqlens must be the whole-sequence "
                                 f"table [s={n * P}, 1, 1, r] (positions restart at each "
                                 f"document start), got {tuple(freqs.shape)}")
            freqs = freqs.index_select(0, document_positions(cu, seq.rank, P, n, layout,
                                                             device=x.device))
        elif freqs.shape[0] != n:
            freqs = freqs.index_select(0, local_positions(seq.rank, P, n, layout=layout,
                                                          device=x.device))
    except ValueError as exc:
        refuse_together(seq, op_label("metp_mla_attention", label), exc)
        raise
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(geo.dq)
    if agreement_checks_enabled():
        check_group_agrees(seq, op_label("metp_mla_attention", label), label=label, x=x,
                           **weights, rotary_pos_emb=rotary_pos_emb, geometry=repr(geo),
                           q_lora_rank=q_lora_rank, norm_eps=float(norm_eps),
                           causal=bool(causal), layout=layout, softmax_scale=float(scale),
                           rope_mscale=float(rope_mscale), kernel=kern.name, head_block=kb,
                           cu_seqlens=None if cu is None else cu_seqlens_digest(cu),
                           needs_grad=needs_grad(x, *(t for t in weights.values()
                                                      if t is not None)))
    # the local part (no communication): down-projections and their norms
    if q_lora_rank is not None:
        q_in = F.rms_norm(F.linear(x, q_down_weight), (q_lora_rank,), q_norm_weight, norm_eps)
    else:
        q_in = x
    c, k_raw = F.linear(x, kv_down_weight).split([geo.kvr, geo.dr], dim=-1)
    c = F.rms_norm(c, (geo.kvr,), kv_norm_weight, norm_eps)
    y = _MLAFunction.apply(q_in, c, k_raw, q_up_weight, kv_up_weight, proj_weight, freqs, group,
                           seq, geo, bool(causal), layout, float(scale), kern,
                           float(rope_mscale), label, kb, cu)
    return y if proj_bias is None else y + proj_bias
