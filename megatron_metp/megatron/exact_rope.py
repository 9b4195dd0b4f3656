"""Exact RoPE angles for this rank's tokens only: :class:`ExactRotaryEmbedding`, Megatron's
``RotaryEmbedding`` whose ``forward`` returns ``[s/P, 1, 1, 2r]`` from
:func:`megatron_metp.ops.rope.rope_angles`, and :func:`angles_of`, the angles of given positions
from a module's own ``inv_freq``. Why and when a model takes them: :mod:`.rope` (which switches a
built model over, :func:`~.rope.use_exact_angles`); YaRN's subclass: :mod:`.yarn`.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ..ops.rope import rope_angles
from ..ops.sequence import local_positions


def angles_of(rotary, positions: torch.Tensor, bounds) -> torch.Tensor:
    """Angles ``[n, 1, 1, 2r]`` of int64 ``positions [n]`` (``bounds``: their lowest and highest
    value) from ``rotary``'s own ``inv_freq`` (YaRN's scaled one for
    :class:`~.yarn.ExactYarnRotaryEmbedding`), on the device Megatron's ``get_emb`` would use."""
    inv_freq = rotary.exact_inv_freq()
    return rope_angles(positions.to(inv_freq.device), inv_freq, bounds=bounds)


def _move_inv_freq(rotary) -> None:
    # as Megatron's get_emb: inv_freq is built on the CPU and moved once to the current device
    if rotary.inv_freq.device.type == "cpu" and torch.cuda.is_available():
        rotary.inv_freq = rotary.inv_freq.to(device=torch.cuda.current_device())


class ExactRotaryEmbedding(RotaryEmbedding):
    """Megatron's ``RotaryEmbedding`` whose ``forward`` returns exact angles for this rank's
    tokens only (module docstring). Built by :func:`use_exact_angles` from a constructed
    ``RotaryEmbedding``; same attributes (``inv_freq``, ``cp_group``, ...)."""

    def exact_inv_freq(self) -> torch.Tensor:
        """The fp32 ``inv_freq [r]`` the angles are formed from (Megatron's own)."""
        _move_inv_freq(self)
        return self.inv_freq

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> torch.Tensor:
        """``[max_seq_len / P, 1, 1, 2r]``: the angles of this rank's dual-chunk share of
        positions ``offset … offset + max_seq_len − 1`` over ``cp_group`` (default: the
        module's; ``P`` its size), as Megatron's ``forward`` after its CP slice. With
        ``packed_seq`` (THD) the whole run, as Megatron's (METP's packed documents do not take
        this path: :mod:`.packing` builds per-document rows)."""
        group = cp_group if cp_group is not None else self.cp_group
        size = group.size() if group is not None and not packed_seq else 1
        rank = group.rank() if size > 1 else 0
        key = (int(max_seq_len), int(offset), rank, size)
        cached = getattr(self, "_metp_last", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        _move_inv_freq(self)
        dev = self.inv_freq.device
        pos = (local_positions(rank, size, max_seq_len // size, layout="dual_chunk", device=dev)
               if size > 1 else torch.arange(max_seq_len, device=dev)) + offset
        emb = angles_of(self, pos, (offset, offset + max_seq_len - 1))
        self._metp_last = (key, emb)
        return emb
