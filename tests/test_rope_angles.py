"""Exact RoPE angles (:func:`megatron_metp.ops.rope.rope_angles`) against an exact reference,
with Megatron's fp32 recipe as the negative control (issue 29)."""

import math

import mpmath
import pytest
import torch

from megatron_metp.ops.rope import MAX_POSITION, megatron_angles, rope_angles

#: Llama-3's base, head dim 128: the highest frequency is 1 rad per position.
INV_FREQ = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
AROUND = (1 << 22, 1 << 24, 25_000_001, MAX_POSITION)


def _positions(centre: int) -> torch.Tensor:
    return torch.arange(max(0, centre - 4), min(centre + 4, MAX_POSITION + 1), dtype=torch.int64)


def _exact_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor):
    """cos/sin of pos · inv_freq (the fp32 values as exact rationals) at 50 digits."""
    mpmath.mp.dps = 50
    cos = torch.empty(pos.shape[0], inv_freq.shape[0], dtype=torch.float64)
    sin = torch.empty_like(cos)
    for i, p in enumerate(pos.tolist()):
        for j, f in enumerate(inv_freq.tolist()):
            t = mpmath.mpf(p) * mpmath.mpf(f)  # exact: ≤ 55 bits at 50 digits
            cos[i, j], sin[i, j] = float(mpmath.cos(t)), float(mpmath.sin(t))
    return cos, sin


def _err(angles: torch.Tensor, ref) -> float:
    """Largest |cos − ref|, |sin − ref| of ``angles [n, 1, 1, 2r]`` (both halves), with cos/sin
    taken in fp32 as the model's tables are."""
    a = angles[:, 0, 0]
    r = a.shape[1] // 2
    assert torch.equal(a[:, :r], a[:, r:])  # Megatron's [θ | θ] layout
    return max(float((torch.cos(a[:, :r]).double() - ref[0]).abs().max()),
               float((torch.sin(a[:, :r]).double() - ref[1]).abs().max()))


@pytest.mark.parametrize("centre", AROUND)
def test_exact_angles_past_fp32_integers(centre):
    pos = _positions(centre)
    ref = _exact_cos_sin(pos, INV_FREQ)
    exact = rope_angles(pos, INV_FREQ)
    assert exact.shape == (pos.shape[0], 1, 1, 128) and exact.dtype == torch.float32
    assert _err(exact, ref) <= 1e-6
    # Negative control: Megatron's recipe (fp32 arange + offset, fp32 outer product) fails it.
    assert _err(megatron_angles(pos.shape[0], int(pos[0]), INV_FREQ), ref) > 1e-2


def test_megatron_angles_is_megatrons_recipe():
    """The negative control above is Megatron's own arithmetic: bit-identical to
    ``RotaryEmbedding.get_freqs_non_repeated`` (the body of ``get_emb``) for runs of positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000,
                             use_cpu_initialization=True)
    assert torch.equal(rotary.inv_freq, INV_FREQ)
    for offset in (0, 1000, (1 << 24) - 2, 20_000_001):
        ours = megatron_angles(5, offset, rotary.inv_freq)
        theirs = rotary.get_freqs_non_repeated(5, offset)
        assert torch.equal(ours[:, 0, 0, :64], theirs)
    # The collision the issue reports: fp32 positions past 2^24.
    pos = megatron_angles(5, 20_000_001, torch.ones(1))[:, 0, 0, 0].tolist()
    assert pos == [20000000.0, 20000000.0, 20000002.0, 20000004.0, 20000004.0]


def test_agree_below_2_22_within_fp32_rounding():
    """Below 2^22 the two recipes differ only by the fp32 rounding of pos · inv_freq (at most
    half its ulp), and rope_angles reduces mod 2π: compare modulo 2π."""
    pos = torch.tensor([0, 1, 2, 4095, 4096, 4097, 123_457, (1 << 22) - 1])
    exact = rope_angles(pos, INV_FREQ)[:, 0, 0, :64].double()
    meg = torch.cat([megatron_angles(1, p, INV_FREQ) for p in pos.tolist()])[:, 0, 0, :64].double()
    diff = torch.remainder(meg - exact + math.pi, 2 * math.pi) - math.pi
    half_ulp = torch.outer(pos.double(), INV_FREQ.double()).float().double()
    half_ulp = (torch.nextafter(half_ulp.float(), torch.tensor(math.inf)).double() - half_ulp) / 2
    assert bool((diff.abs() <= half_ulp + 1e-6).all())
    assert torch.equal(exact[:3], meg[:3])  # small positions: same bits


def test_rope_angles_refuses_bad_input():
    with pytest.raises(ValueError, match="positions must lie"):
        rope_angles(torch.tensor([MAX_POSITION + 1]), INV_FREQ)
    with pytest.raises(ValueError, match="positions must lie"):
        rope_angles(torch.tensor([-1]), INV_FREQ)
    with pytest.raises(ValueError, match="int64"):
        rope_angles(torch.tensor([1.0]), INV_FREQ)
    with pytest.raises(ValueError, match="fp32"):
        rope_angles(torch.tensor([1]), INV_FREQ.double())


def test_rope_angles_chunks_agree():
    """More rows than one chunk: every chunk is the same computation."""
    pos = torch.arange((1 << 15) + 7, dtype=torch.int64) * 65_519
    a = rope_angles(pos, INV_FREQ[:4])
    b = torch.cat([rope_angles(pos[i:i + 1000], INV_FREQ[:4]) for i in range(0, pos.shape[0], 1000)])
    assert torch.equal(a, b)
