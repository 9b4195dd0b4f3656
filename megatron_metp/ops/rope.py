"""Rotary position embedding in Megatron's non-interleaved form, and its transpose.

``freqs`` ``[n, 1, 1, r]`` are Megatron's RoPE angles for this rank's tokens (``RotaryEmbedding``
output, ``emb = [θ | θ]``); the first ``r`` channels of each head rotate:
``t' = t·cos + rotate_half(t)·sin`` with ``rotate_half([t1 | t2]) = [−t2 | t1]``. Because both
halves share their angles the map is a rotation, and its transpose (for backward) is the same map
with ``−sin``.
"""

from __future__ import annotations

import torch


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, *, transpose: bool = False) -> torch.Tensor:
    """``t [n, b, heads, d]`` rotated by ``freqs [n, 1, 1, r]`` (``r ≤ d``, even)."""
    r = freqs.shape[-1]
    rot, rest = t[..., :r], t[..., r:]
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs).to(t.dtype)
    if transpose:
        sin = -sin
    x1, x2 = torch.chunk(rot, 2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
