"""Rotary position embedding in Megatron's non-interleaved form, and its transpose.

``freqs`` ``[n, 1, 1, r]`` are Megatron's RoPE angles for this rank's tokens (``RotaryEmbedding``
output, ``emb = [θ | θ]``); the first ``r`` channels of each head rotate:
``t' = t·cos + rotate_half(t)·sin`` with ``rotate_half([t1 | t2]) = [−t2 | t1]``, i.e. per half
``t1' = t1·cos₁ − t2·sin₁``, ``t2' = t2·cos₂ + t1·sin₂``. Because both halves share their angles
the map is a rotation, and its transpose (for backward) is the same map with ``−sin``.

The ``cos``/``sin`` tables (:func:`rope_tables`) are computed once per op call and shared by
its rotations (METP attention: once per forward and once per backward, not twice per head group;
they are not kept between calls, so nothing is stored across layers). Four kernels per rotation
(a product and an ``addcmul_`` per half, written into the output), plus one copy of the
unrotated channels if ``r < d``.
"""

from __future__ import annotations

from typing import Optional

import torch

def rope_tables(freqs: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)`` of ``freqs`` in ``dtype``: compute them once per op call and pass them to
    every :func:`apply_rope` of that call (``tables=``)."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


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
    torch.mul(x1, cos[..., :h], out=o1)
    o1.addcmul_(x2, sin[..., :h], value=s1)
    torch.mul(x2, cos[..., h:], out=o2)
    o2.addcmul_(x1, sin[..., h:], value=s2)
    if r < t.shape[-1]:
        out[..., r:].copy_(t[..., r:])
    return out
