"""Token layouts of a METP group: which global positions rank ``r`` of ``p`` holds.

``dual_chunk`` (Megatron's context-parallel order): the sequence is cut into ``2p`` equal chunks
and rank ``r`` holds chunks ``r`` and ``2p−1−r``, so causal attention costs every rank the same.
It is the split ``megatron.core.utils.get_batch_on_this_cp_rank`` makes and the one Megatron's
RoPE slicing assumes. ``contiguous``: rank ``r`` holds the ``r``-th of ``p`` equal slices.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .layouts import LAYOUTS


def _check(layout: str, s: int, size: int, what: str = "sequence length") -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    parts = 2 * size if layout == "dual_chunk" else size
    if s % parts:
        raise ValueError(f"{what} {s} is not divisible by {parts} (= {'2·' if layout == 'dual_chunk' else ''}"
                         f"METP size {size}) for layout={layout!r}; pad the sequence or change "
                         f"--seq-length / --metp-parallel-size")


def shard_sequence(x: torch.Tensor, rank: int, size: int, *, layout: str = "dual_chunk",
                   seq_dim: int = 0) -> torch.Tensor:
    """This rank's tokens of the full sequence ``x`` (a copy-free view where possible)."""
    s = x.shape[seq_dim]
    _check(layout, s, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if layout == "contiguous":
        return x.narrow(seq_dim, rank * (s // size), s // size)
    chunks = x.chunk(2 * size, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=seq_dim)


def unshard_sequence(parts: Sequence[torch.Tensor], *, layout: str = "dual_chunk",
                     seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``parts[r]`` is rank ``r``'s tokens."""
    size = len(parts)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        return torch.cat(list(parts), dim=seq_dim)
    n = parts[0].shape[seq_dim]
    if n % 2:
        raise ValueError(f"dual_chunk parts must hold an even number of tokens, got {n}")
    chunks = [None] * (2 * size)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=seq_dim)
        chunks[r], chunks[2 * size - 1 - r] = first, second
    return torch.cat(chunks, dim=seq_dim)


def local_positions(rank: int, size: int, local_len: int, *, layout: str = "dual_chunk",
                    device=None) -> torch.Tensor:
    """Global positions (int64) of this rank's ``local_len`` tokens, in local order."""
    s = local_len * size
    _check(layout, s, size, what="global sequence length")
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    c = local_len // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device)])
