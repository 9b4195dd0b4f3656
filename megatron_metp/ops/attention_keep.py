"""Kept attention outputs: a METP attention call hands its ``O_g`` and ``LSE_g`` to a later re-run.

A flash-style attention backward needs ``Q, K, V``, the output ``O``, ``dO`` and the fp32
log-sum-exp, never the forward's intermediates. Under a full recompute (Megatron's
``tensor_parallel.checkpoint``: the layer's forward runs once without autograd, then again inside
the backward with it) the second forward of :func:`~megatron_metp.ops.metp_attention` would run
every head group's K/V ring again only to re-form ``O_g`` and ``LSE_g``. With an
:class:`AttentionKeep`:

* the first forward (``sink``): runs as usual and hands ``sink(outs, lses)`` every head-group
  block's output ``O_i [s/p, b, kb·A/p·d]`` (the activation dtype) and its log-sum-exp
  ``LSE_i [b, kb·A/p, s/p]`` (fp32), ``p/kb`` of each;
* the re-run (``kept = (outs, lses)``): runs **no K/V ring and no Q/K/V projection**; only the
  output projections' weights pass (``y = Σ_i O_i·Wo_iᵀ + bo``, the same GEMMs and order as the
  plain forward, so ``y`` is bit-identical), and it saves ``x``, ``O_i`` and ``LSE_i`` for its
  backward, which is the usual one: ``Q/K/V`` re-formed from ``x`` block by block (projection,
  q/k norm, RoPE) and the ring backward run from ``O``, ``dO`` and the LSE.

Where the kept tensors wait between the two (device or pinned host memory) and which re-run takes
which is the caller's business (Megatron's modules: :mod:`megatron_metp.megatron.keep_attention`).
Memory per kept call: ``O``, ``s/p · b · (A/p)·d`` elements of the activation dtype (the size of
the layer input with ``A·d = h``), and ``LSE``, ``b · (A/p) · s/p`` fp32 values (``4/(2d)`` of
``O`` in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

Kept = Tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


@dataclass
class AttentionKeep:
    """What one :func:`~megatron_metp.ops.metp_attention` call does with its attention outputs.

    ``sink``: called once, after the forward's last head-group block, with the lists
    ``(outs, lses)`` (the tensors themselves: the call does not write them again). ``kept``: the
    ``(outs, lses)`` an earlier forward of the same call (same ``x``, weights and options) handed
    to its sink; this forward then runs no K/V ring. Exactly one of the two is given."""

    sink: Optional[Callable[[List[torch.Tensor], List[torch.Tensor]], None]] = None
    kept: Optional[Kept] = None

    def __post_init__(self):
        if (self.sink is None) == (self.kept is None):
            raise ValueError("AttentionKeep takes exactly one of sink= (the forward that keeps "
                             "its attention outputs) and kept= (the re-run that uses them)")

    @property
    def runs_ring(self) -> bool:
        """Whether the call runs its K/V rings (the keeping forward) or not (the re-run)."""
        return self.kept is None


def check_kept(kept: Kept, blocks: int, n: int, b: int, heads: int, d: int, like: torch.Tensor
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``kept`` as two lists, after checking them against the call: ``blocks`` head-group blocks,
    each ``O [n, b, heads·d]`` of ``like``'s dtype and device and ``LSE [b, heads, n]`` fp32
    (``heads`` = query heads of one block). ``ValueError`` naming what differs (kept by a call
    with another shape, block size or dtype)."""
    outs, lses = (list(t) for t in kept)
    if len(outs) != blocks or len(lses) != blocks:
        raise ValueError(f"kept attention outputs: {len(outs)} outputs and {len(lses)} "
                         f"log-sum-exps for a call of {blocks} head-group blocks (kept by a "
                         f"call with another head_block?)")
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != (n, b, heads * d) or o.dtype != like.dtype or \
                o.device != like.device:
            raise ValueError(f"kept attention output of block {i} is {tuple(o.shape)} "
                             f"{o.dtype} on {o.device}; this call forms [{n}, {b}, "
                             f"{heads * d}] {like.dtype} on {like.device}")
        if tuple(lse.shape) != (b, heads, n) or lse.dtype != torch.float32 or \
                lse.device != like.device:
            raise ValueError(f"kept log-sum-exp of block {i} is {tuple(lse.shape)} {lse.dtype} "
                             f"on {lse.device}; this call forms [{b}, {heads}, {n}] "
                             f"torch.float32 on {like.device}")
    return outs, lses
