"""Rotary position embedding in Megatron's non-interleaved form, and its transpose.

``freqs`` ``[n, 1, 1, r]`` are Megatron's RoPE angles for this rank's tokens (``RotaryEmbedding``
output, ``emb = [θ | θ]``); the first ``r`` channels of each head rotate:
``t' = t·cos + rotate_half(t)·sin`` with ``rotate_half([t1 | t2]) = [−t2 | t1]``, i.e. per half
``t1' = t1·cos₁ − t2·sin₁``, ``t2' = t2·cos₂ + t1·sin₂``. Because both halves share their angles
the map is a rotation, and its transpose (for backward) is the same map with ``−sin``.

The ``cos``/``sin`` tables (:func:`rope_tables`) are computed once per op call and shared by
its rotations (METP attention: once per forward and once per backward, not twice per head group;
they are not kept between calls, so nothing is stored across layers): one kernel per table, the
angle's cosine rounded straight into the table's dtype. Three kernels per rotation: one product
``t·cos`` over all ``r`` rotated channels (both halves at once: ``cos`` is ``[cos₁ | cos₂]``),
then one ``addcmul_`` per half for the ``sin`` terms (the halves swap sources, which no strided
view can express), all written into the output; plus one copy of the unrotated channels if
``r < d``. Every element sees the same operations in the same order as with a product per half
(bit-identical results).
"""

from __future__ import annotations

from typing import Optional

import torch

def rope_tables(freqs: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)`` of ``freqs`` in ``dtype``: compute them once per op call and pass them to
    every :func:`apply_rope` of that call (``tables=``). Each is one kernel: computed at
    ``freqs``' precision and rounded once into ``dtype`` (no ``freqs``-sized fp32 temporary
    and separate cast)."""
    if freqs.dtype == dtype:
        return torch.cos(freqs), torch.sin(freqs)
    out = [torch.empty(freqs.shape, dtype=dtype, device=freqs.device) for _ in range(2)]
    return torch.cos(freqs, out=out[0]), torch.sin(freqs, out=out[1])


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, *, transpose: bool = False,
               out: Optional[torch.Tensor] = None, tables=None) -> torch.Tensor:
    """``t [n, b, heads..., d]`` rotated by ``freqs [n, 1, 1, r]`` (``r ≤ d``, even; any number
    of head dims between the batch and the channels).

    ``out``: where to write (any strides, ``t``'s shape, not overlapping ``t``; its dtype may be
    narrower than ``t``'s: each product is rounded into it); default new. ``tables``: ``(cos,
    sin)`` from :func:`rope_tables` (else computed here, in ``t``'s dtype)."""
    r = freqs.shape[-1]
    h = r // 2
    cos, sin = tables if tables is not None else rope_tables(freqs, t.dtype)
    if t.dim() != cos.dim():
        shape = (cos.shape[0],) + (1,) * (t.dim() - 2) + (r,)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
    if out is None:
        out = torch.empty_like(t)
    x1, x2 = t[..., :h], t[..., h:r]
    o1, o2 = out[..., :h], out[..., h:r]
    s1, s2 = (-1.0, 1.0) if not transpose else (1.0, -1.0)
    torch.mul(t[..., :r], cos, out=out[..., :r])  # both halves' cos terms in one kernel
    o1.addcmul_(x2, sin[..., :h], value=s1)
    o2.addcmul_(x1, sin[..., h:], value=s2)
    if r < t.shape[-1]:
        out[..., r:].copy_(t[..., r:])
    return out
