"""RoPE of multi-latent attention (DeepSeek-V2/V3): the rotated part of each query head and the
one RoPE key shared by all heads, and its transpose.

DeepSeek's checkpoints store the ``r = qk_pos_emb_head_dim`` rotated channels interleaved
(pairs ``(t[2i], t[2i+1])`` rotate together). Megatron's MLA first gathers them into the
non-interleaved form, ``u = [t[0::2] | t[1::2]]`` (the permutation ``P``), and then rotates
``u`` as every other RoPE here does (:func:`rope.apply_rope`, ``[θ | θ]`` angles), with YaRN's
attention factor ``m`` (DeepSeek's ``mscale``; 1 without YaRN) folded into the tables::

    forward   t' = m·R(θ)·P·t             t [n, b, heads..., r] → t' [n, b, heads..., r]
    backward  dt = Pᵀ·R(θ)ᵀ·(m·dt')       (R(θ)ᵀ = R(−θ); Pᵀ interleaves the halves back)

The output stays in the gathered order, for the query's and the key's RoPE parts alike, so
their dot product is that of the model. Angles: ``freqs [n, 1, 1, r]``, this rank's tokens,
from the exact recipe (:func:`rope.rope_angles`) or any other (YaRN's scaled ``inv_freq``).
"""

from __future__ import annotations

import torch

from .rope import apply_rope, rope_tables


def mla_rope_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """``(m·cos θ, m·sin θ)`` in ``dtype`` (``freqs [n, 1, 1, r]``): formed at ``freqs``'
    precision and rounded once, as Megatron's MLA RoPE forms ``(cos(θ)·m).to(dtype)``."""
    if mscale == 1.0:
        return rope_tables(freqs, dtype)
    return ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))


def mla_rope(t: torch.Tensor, freqs: torch.Tensor, tables) -> torch.Tensor:
    """``m·R(θ)·P·t`` (module docstring): ``t [n, b, heads..., r]`` (any strides; interleaved
    channel pairs) → a new tensor of the same shape in the non-interleaved order."""
    gathered = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    return apply_rope(gathered, freqs, tables=tables, out=gathered.new_empty(gathered.shape))


def mla_rope_transpose(g: torch.Tensor, freqs: torch.Tensor, tables) -> torch.Tensor:
    """``Pᵀ·R(θ)ᵀ·(m·g)``: the gradient of :func:`mla_rope`'s input from its output's ``g``."""
    rot = apply_rope(g.contiguous(), freqs, tables=tables, transpose=True)
    half = rot.shape[-1] // 2
    out = torch.empty_like(rot)
    out[..., 0::2] = rot[..., :half]
    out[..., 1::2] = rot[..., half:]
    return out
