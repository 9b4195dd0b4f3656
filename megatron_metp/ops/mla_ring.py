"""The K/V ring of multi-latent attention for one head group: the latent travels, not K and V.

Rank ``r`` of the sequence ring (``p`` ranks; ``p·c`` under METP × CP) holds its queries
``q [b, H, n, dn+dr]`` (heads-first, RoPE applied) and its tokens' latent ``L [n, b, C]``
(:mod:`.mla_latent`: ``C = kv_lora_rank + qk_pos_emb_head_dim`` values per token). At step
``t`` it holds the latent of rank ``j = (r − t) mod p``, up-projects the head group's keys and
values from the key rows the causal plan needs (:func:`ring_blocks.block_plan`; with
``dual_chunk`` a block below the diagonal needs only its first chunk) and attends to them with the
block kernel, folding ``(out_b, lse_b)`` into fp32 accumulators (:func:`lse.merge_`), exactly as
:func:`ring_attention.ring_attention_forward` folds K/V blocks.

Backward: the latents rotate again (rank ``r`` visits ``r−1, …, r+1`` and its own last); at
each block it re-forms K/V from the latent, runs the kernel's backward, adds the head group's
``dW_kv`` contribution locally (:func:`mla_latent.latent_grads`) and adds ``dL`` (fp32, ``C``
per token) into the block's travelling sum, which arrives complete at the block's owner. One
batched exchange per step carries the next step's latent and the previous block's ``dL`` sum,
posted before the step's kernels, in the same order on every rank.

Packed documents (``cu``, :mod:`.documents`): a block runs the document pieces of
:func:`ring_attention.kernel_pieces` (full, causal or masked rectangles; none: skipped), K/V
up-projected once per block over the key rows its pieces span; the pieces fold into
zero/``−inf`` accumulators (:func:`lse.merge_masked_`) and the forward ring stops after
:func:`documents.forward_steps` steps, as :mod:`.ring_attention` does; the
backward ring is unchanged (every ``dL`` sum travels home).

Traffic per rank and head group: forward ``p−1`` latent blocks ``[n, b, C]`` (x's dtype);
backward ``p−1`` latent blocks and ``p−1`` fp32 ``dL`` blocks. Against the heads' K/V
(``[n, b, H·(dn+dr+dv)]`` per block) that is ``C/(H·(dn+dr+dv))`` of the bytes per head group.
Saved for backward (by the caller): only ``L``, the output and the fp32 log-sum-exp.
"""

from __future__ import annotations

import torch

from ..runtime.groups import METPGroup
from ..runtime.ring import RingExchanger
from . import documents
from . import lse as lse_ops
from .mla_latent import MLAGeometry, expand_latent, latent_grads
from .ring_attention import kernel_pieces


def _record(seq: METPGroup, kernel) -> None:
    seq.stats.blocks[kernel.name] = seq.stats.blocks.get(kernel.name, 0) + 1


def _span(pieces) -> slice:
    """The key rows a block's pieces span (K/V up-projected once for all of them)."""
    return slice(min(pc.keys.start for pc in pieces), max(pc.keys.stop for pc in pieces))


def _shift(rows: slice, by: int) -> slice:
    return slice(rows.start - by, rows.stop - by)


def _mask(pc, device):
    return {"mask": documents.piece_mask(pc, device)} if pc.masked else {}


def latent_ring_forward(q, latent, wkv, geo: MLAGeometry, seq: METPGroup, causal: bool,
                        layout: str, scale: float, kernel, cu=None):
    """``q [b, H, n, dn+dr]``, ``L [n, b, C]``, ``W_kv [H·(dn+dv), kvr]`` →
    ``(out [b, H, n, dv_kernel] fp32, lse [b, H, n] fp32)``. ``L`` is not modified (the ring
    circulates a copy). ``cu``: checked document boundaries (tuple) or ``None``."""
    p, r, n = seq.size, seq.rank, latent.shape[0]
    steps = documents.forward_steps(cu, n, p, layout) if cu is not None and p > 1 else p
    if steps > 1:
        ring = RingExchanger(seq.kv_ring, "MLA latent (fwd)")
        blocks = ring.circulate(latent.clone(), steps=steps)
    else:
        blocks = [(0, latent)]
    out = lse = None
    if cu is not None:
        out, lse = lse_ops.new_accumulators(q.shape[:3] + (geo.dv_kernel,), q.device)
    for t, lat in blocks:
        pieces = kernel_pieces(r, (r - t) % p, n, p, causal, layout, cu, kernel, q)
        if not pieces:
            continue
        span = _span(pieces)
        k, v = expand_latent(lat[span], wkv, geo)
        for pc in pieces:
            ks = _shift(pc.keys, span.start)
            o_b, l_b = kernel.forward(q[:, :, pc.rows], k[:, :, ks], v[:, :, ks], pc.causal,
                                      scale, **_mask(pc, q.device))
            _record(seq, kernel)
            if cu is not None:
                lse_ops.merge_masked_(out[:, :, pc.rows], lse[:, :, pc.rows], o_b, l_b)
            elif out is None:  # t = 0, the own block: every query row
                out, lse = lse_ops.start(o_b, l_b)
            else:
                lse_ops.merge_(out[:, :, pc.rows], lse[:, :, pc.rows], o_b, l_b)
    return out, lse


def latent_ring_backward(dout, q, latent, wkv, out, lse, geo: MLAGeometry, seq: METPGroup,
                         causal: bool, layout: str, scale: float, kernel, dwkv: torch.Tensor,
                         cu=None):
    """Grads of :func:`latent_ring_forward`: ``(dq [b, H, n, dn+dr] fp32, dL [n, b, C] fp32)``,
    ``dL`` complete (every rank's queries) for this rank's own latent; this rank's
    contribution to ``dW_kv`` (its queries against every block) is added into ``dwkv``
    (fp32). ``dout``, ``out``: ``[b, H, n, dv_kernel]`` in ``q``'s dtype."""
    p, r, n = seq.size, seq.rank, latent.shape[0]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    workspace = {}

    def block(lat, j):
        """dq += block ``j``'s; returns ``(key rows, dL rows)`` or ``None`` (fully masked)."""
        pieces = kernel_pieces(r, j, n, p, causal, layout, cu, kernel, q)
        if not pieces:
            return None
        span = _span(pieces)
        k, v = expand_latent(lat[span], wkv, geo)
        dk = dv = None
        for pc in pieces:
            ks, qs = _shift(pc.keys, span.start), pc.rows
            dq_b, dk_b, dv_b = kernel.backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks],
                                               v[:, :, ks], out[:, :, qs],
                                               lse[:, :, qs].contiguous(), pc.causal, scale,
                                               workspace, **_mask(pc, q.device))
            _record(seq, kernel)
            dq[:, :, qs] += dq_b
            if len(pieces) == 1:
                dk, dv = dk_b.float(), dv_b.float()
                break
            if dk is None:
                dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
                dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            dk[:, :, ks] += dk_b
            dv[:, :, ks] += dv_b
        return span, latent_grads(dk, dv, lat[span], wkv, dwkv, geo)

    def add(acc, got):
        if got is not None:
            acc[got[0]] += got[1]

    shape = (n,) + tuple(latent.shape[1:])
    if p == 1:
        acc = torch.zeros(shape, dtype=torch.float32, device=q.device)
        add(acc, block(latent, r))
        return dq, acc
    ring = RingExchanger(seq.kv_ring, "MLA latent + dL (bwd)")
    held = ring.start(latent, torch.empty_like(latent), step=0).wait()  # block r−1
    spare = torch.empty_like(latent)
    sums = [torch.zeros(shape, dtype=torch.float32, device=q.device), None]
    cur = 0  # sums[cur]: the sum of the block being worked on (after this step's wait)
    for t in range(p):
        last = t == p - 1
        j = r if last else (r - 1 - t) % p
        sends, recvs = [], []
        prefetch = not last and t + 1 <= p - 2
        if prefetch:  # the next step's latent (prev's current one)
            sends.append(held)
            recvs.append(spare)
        if t >= 1:  # the previous block's sum on to next; this block's sum in from prev
            if sums[1 - cur] is None:
                sums[1 - cur] = torch.empty_like(sums[cur])
            sends.append(sums[cur])
            recvs.append(sums[1 - cur])
        step = ring.exchange(sends, recvs, step=t + 1) if sends else None
        got = block(latent if last else held, j)  # overlaps the exchange
        if step is not None:
            step.wait()
        if t >= 1:
            cur = 1 - cur
        add(sums[cur], got)
        if prefetch:
            held, spare = spare, held
    return dq, sums[cur]
