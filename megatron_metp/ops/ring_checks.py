"""Input checks of the ring attention (:mod:`.ring_attention`): shapes, dtypes, devices and
layouts that cannot be computed, and packed-sequence boundaries, each a ``ValueError`` naming
the argument."""

from __future__ import annotations

from ..runtime.groups import METPGroup
from . import documents
from .sequence import LAYOUTS


def check_attention_inputs(q, k, v, group: METPGroup, causal: bool, layout: str) -> None:
    """ValueErrors for shapes/dtypes/devices/layouts that cannot be computed (``[n, b, h, d]``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be this rank's tokens [s/p, b, heads, d], "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    n, b, hq, d = q.shape
    if min(n, b, hq, d, k.shape[2]) == 0:
        raise ValueError(f"q/k/v must not be empty: q has shape {tuple(q.shape)}, k/v "
                         f"{tuple(k.shape)} [tokens, batch, heads, head dim] on rank "
                         f"{group.rank}; give every rank at least one token (sequence length "
                         f"≥ 2 × METP size)")
    if k.shape[0] != n or k.shape[1] != b:
        raise ValueError(f"k/v hold {tuple(k.shape[:2])} tokens×batch but q holds {(n, b)}")
    if k.shape[3] != d:
        raise ValueError(f"head dims differ: q has {d}, k/v have {k.shape[3]}")
    if hq % k.shape[2]:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({k.shape[2]}) for GQA/MQA")
    if causal and layout == "dual_chunk" and n % 2:
        raise ValueError(f"layout='dual_chunk' needs an even number of local tokens (the sequence "
                         f"split into 2·p = {2 * group.size} chunks), got {n} on rank {group.rank}; "
                         f"make the sequence length divisible by {2 * group.size}")
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point, got {q.dtype}")


def shape_layout(layout: str) -> str:
    """The plain layout whose shape rules ``layout`` follows (``balanced``: ``dual_chunk``'s,
    an even number of local tokens)."""
    return "dual_chunk" if layout == "balanced" else layout


def check_packed(cu_seqlens, s: int, causal: bool, layout: str, p: int):
    """``cu_seqlens`` checked (a tuple of ints, :func:`documents.check_cu_seqlens`), or ``None``;
    packed sequences need ``causal=True``; ``layout='balanced'`` needs them
    (:func:`documents.check_layout`)."""
    if cu_seqlens is None:
        if layout == "balanced":
            documents.check_layout(layout, None, p)
        return None
    if not causal:
        raise ValueError("cu_seqlens (packed documents) needs causal=True: each query attends "
                         "causally within its own document")
    cu = documents.check_cu_seqlens(cu_seqlens, s)
    documents.check_layout(layout, cu, p)
    return cu
