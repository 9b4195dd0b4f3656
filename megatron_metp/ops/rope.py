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

The angles themselves: :func:`rope_angles` computes them exactly for int64 positions (up to
2^31 − 1) and this rank's tokens only; :func:`megatron_angles` is Megatron's fp32 recipe, for
comparisons (``docs/positions.md``); which of the two a model uses: :mod:`.rope_recipe`.
"""

from __future__ import annotations

from typing import Optional, Tuple

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


# --- Exact angles ---------------------------------------------------------------------------
#
# Megatron's ``RotaryEmbedding`` forms positions as an fp32 ``arange`` and θ = pos · inv_freq as
# an fp32 product: past 2^24 neighbouring positions collide, and well before that θ is rounded by
# half an fp32 ulp of pos·inv_freq (≈ 0.12 rad at 4M positions for inv_freq ≈ 1). Here θ is
# computed exactly and reduced modulo 2π before its single rounding to fp32:
#
#   inv_freq fp32 has 24 significant bits: split it exactly into f = f_hi + f_lo, each with at
#   most 12 significant bits (``_split_inv_freq``). A position below 2^31 times either half has
#   ≤ 43 significant bits, so both products are exact in fp64; each is reduced modulo 2π on its
#   own (``_mod_2pi_``: fmod by fp64(2π), exact, then corrected by k·(2π − fp64(2π))), and their
#   sum is reduced once more and rounded once to fp32: |error| ≤ 2^-22 rad (half an ulp of 2π in
#   fp32) plus ~1e-15 from the fp64 steps, for every position below 2^31 (refused above 2^31 − 1:
#   what is tested). No table: the only memory is the fp64 working set of one chunk of rows.

#: ``inv_freq`` is split into halves of this many significant bits (fp32 has 24).
_HALF_BITS = 12
#: The largest position :func:`rope_angles` accepts (tested up to it).
MAX_POSITION = (1 << 31) - 1
_TWO_PI = 6.283185307179586  # fp64(2π), just below 2π
_TWO_PI_LO = 2.4492935982947064e-16  # 2π − fp64(2π)
#: Positions per chunk: bounds the fp64 temporaries at ~4 × 8 bytes × this × r (32 MiB at r = 64).
_CHUNK = 1 << 14

def _mod_2pi_(x: torch.Tensor) -> torch.Tensor:
    """``x mod 2π`` for fp64 ``x ≥ 0`` below ~2^53, in ``[0, 2π)``; ``x`` is overwritten.
    ``fmod`` by fp64(2π) is exact; the quotient ``k`` (an exact integer) times the tail
    ``2π − fp64(2π)`` is then subtracted, and one wrap keeps the result non-negative."""
    r = torch.fmod(x, _TWO_PI)
    k = x.sub_(r).div_(_TWO_PI).round_()  # exact: x − r is k·fp64(2π) up to one rounding
    r.sub_(k.mul_(_TWO_PI_LO))
    return r.add_((r < 0).to(r.dtype).mul_(_TWO_PI))


def _split_inv_freq(inv_freq: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``(f_hi, f_lo)`` with ``f_hi + f_lo == inv_freq`` exactly, each ``[r]`` with at most
    12 significant bits (fp32's 24-bit significand cut in two)."""
    f = inv_freq.to(device=device, dtype=torch.float64)
    mant, expo = torch.frexp(f)  # f = mant · 2^expo, mant in [0.5, 1): mant · 2^24 an integer
    scale = torch.ldexp(torch.ones_like(f), expo - 24)
    m24 = mant * float(1 << 24)
    hi = torch.floor(m24 / float(1 << _HALF_BITS)) * float(1 << _HALF_BITS)
    return hi * scale, (m24 - hi) * scale


def _theta(pos: torch.Tensor, halves) -> torch.Tensor:
    """fp64 ``[n, r]`` angles of int64 ``pos [n]``: ``pos · f_hi`` and ``pos · f_lo`` (exact in
    fp64) each reduced mod 2π, summed (in ``[0, 4π)``) and wrapped once into ``[0, 2π)``."""
    f_hi, f_lo = halves
    p = pos.to(torch.float64)[:, None]  # exact: |pos| < 2^31
    theta = _mod_2pi_(p * f_hi)
    theta += _mod_2pi_(p * f_lo)
    turns = torch.floor(theta / _TWO_PI)  # 0 or 1 (each reduced angle is below 2π)
    theta.sub_(turns * _TWO_PI)
    return theta.sub_(turns.mul_(_TWO_PI_LO))  # the tail 2π − fp64(2π) of each turn


def exact_theta(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``positions [n] · inv_freq [r] mod 2π`` in fp64, ``[n, r]``, in ``[0, 2π)`` (up to a
    ~1e-15 rad wrap), within ~1e-15 rad of the exact value: the angles before
    :func:`rope_angles`' single rounding to fp32. ``inv_freq = f_hi + f_lo`` (12 significant
    bits each): both products with a position are exact in fp64 and reduced mod 2π on their own,
    then summed and reduced once more. No range check (:func:`rope_angles` does it): int64 ``positions`` in ``[0, 2^31)``."""
    pos = positions.to(torch.int64)
    return _theta(pos, _split_inv_freq(inv_freq, pos.device))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, *,
                bounds: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """RoPE angles ``[n, 1, 1, 2r]`` (fp32, Megatron's non-interleaved ``[θ | θ]`` layout) of
    integer ``positions [n]`` (int64, ``0 ≤ pos ≤ 2^31 − 1``) and fp32 ``inv_freq [r]`` (the
    model's own, after any scaling): ``θ[i, j] = positions[i] · inv_freq[j] mod 2π``, computed
    exactly (:func:`exact_theta`) and rounded once to fp32, so ``cos``/``sin`` of the result are
    within ~3e-7 of the exact values at any position. Only the given positions are formed (this
    rank's tokens, not a whole-sequence table), on ``positions``' device, in chunks of ``2^14``
    rows (fp64 working set ~4 × 2^14 × r × 8 bytes, ~32 MiB at r = 64, whatever ``n``; no
    table). ``bounds``:
    ``(lowest, highest)`` position when the caller knows them as ints (checked instead of
    reading ``positions``: no device sync, and it works on fake tensors, e.g. in the dry run).

    Below 2^22 positions this agrees with Megatron's fp32 recipe (``arange`` in fp32, fp32
    product) within that recipe's own rounding; above, Megatron's angles drift by up to half an
    fp32 ulp of ``pos·inv_freq`` (``docs/positions.md``)."""
    if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be a 1-D int64 tensor [n], got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be a 1-D fp32 tensor [r], got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    n, r = positions.shape[0], inv_freq.shape[0]
    out = torch.empty((n, 1, 1, 2 * r), dtype=torch.float32, device=positions.device)
    if n == 0:
        return out
    lo_pos, hi_pos = bounds if bounds is not None else (int(positions.min()),
                                                        int(positions.max()))
    if lo_pos < 0 or hi_pos > MAX_POSITION:
        raise ValueError(f"positions must lie in [0, 2^31 - 1 = {MAX_POSITION}], got "
                         f"[{lo_pos}, {hi_pos}]")
    halves = _split_inv_freq(inv_freq, positions.device)
    for a in range(0, n, _CHUNK):
        rows = out[a:a + _CHUNK, 0, 0]
        rows[:, :r].copy_(_theta(positions[a:a + _CHUNK].to(torch.int64), halves))
        rows[:, r:].copy_(rows[:, :r])
    return out


def megatron_angles(length: int, offset: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Megatron's fp32 recipe for positions ``offset … offset + length − 1``, ``[length, 1, 1,
    2r]``: the arithmetic of ``RotaryEmbedding.get_emb(length, offset)`` (an fp32 ``arange``
    plus ``offset`` in fp32, times fp32 ``inv_freq``, ``[θ | θ]``), bit for bit, without a
    Megatron module: for comparisons and the error tables (``docs/positions.md``)."""
    seq = torch.arange(length, device=inv_freq.device, dtype=torch.float32) + offset
    theta = torch.outer(seq, inv_freq.to(torch.float32))
    return torch.cat((theta, theta), dim=-1)[:, None, None, :]
