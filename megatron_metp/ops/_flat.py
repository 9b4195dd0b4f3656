"""Pack several tensors into one flat buffer so one ring step moves them as one message."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class FlatLayout:
    """Shapes of a fixed list of tensors (``None`` entries allowed) laid out back to back."""

    def __init__(self, shapes: Sequence[Optional[torch.Size]]):
        self.shapes = [None if s is None else torch.Size(s) for s in shapes]
        self.offsets = []
        n = 0
        for s in self.shapes:
            self.offsets.append(n)
            n += 0 if s is None else s.numel()
        self.numel = n

    @classmethod
    def of(cls, tensors: Sequence[Optional[torch.Tensor]]) -> "FlatLayout":
        return cls([None if t is None else t.shape for t in tensors])

    def pack(self, tensors: Sequence[Optional[torch.Tensor]], dtype=None, device=None) -> torch.Tensor:
        """A new flat buffer holding copies of ``tensors`` (cast to ``dtype`` if given)."""
        ref = next(t for t in tensors if t is not None)
        out = torch.empty(self.numel, dtype=dtype or ref.dtype, device=device or ref.device)
        for t, view in zip(tensors, self.unpack(out)):
            if t is not None:
                view.copy_(t)
        return out

    def zeros(self, dtype, device) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=dtype, device=device)

    def unpack(self, flat: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """Views into ``flat`` with the recorded shapes (``None`` where the input was ``None``)."""
        return [None if s is None else flat[o:o + s.numel()].view(s)
                for s, o in zip(self.shapes, self.offsets)]
