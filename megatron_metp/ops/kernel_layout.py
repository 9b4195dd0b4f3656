"""Layout helpers the block kernels share (:mod:`.attention_kernels`, :mod:`.gpu_kernels`).

Tensors are heads-first: ``q [b, hq, n, d]``, ``k, v [b, hkv, m, d]``, ``hq`` a multiple of
``hkv`` (GQA/MQA: query head ``i`` uses K/V head ``i // (hq/hkv)``).
"""

from __future__ import annotations

import torch


def last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is dense (all the CUDA flash kernels need: they take the
    other strides as given), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """``[b, hkv, m, d]`` → ``[b, hq, m, d]``: query head ``i`` uses KV head ``i // (hq/hkv)``."""
    hkv = t.shape[1]
    return t if hkv == hq else t.repeat_interleave(hq // hkv, dim=1)


def fold_kv(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """Inverse of :func:`expand_kv` for gradients: sum the query heads of each KV head."""
    b, hq, m, d = t.shape
    return t if hkv == hq else t.view(b, hkv, hq // hkv, m, d).sum(2)


def fold_heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[b, hq, n(, d)]`` → ``[b, hkv, (hq/hkv)·n(, d)]``: the query heads of each K/V head laid
    end to end as rows (query head ``i`` uses K/V head ``i // (hq/hkv)``, so a contiguous
    ``t`` folds as a view)."""
    b, hq, n = t.shape[:3]
    return t.contiguous().view(b, hkv, (hq // hkv) * n, *t.shape[3:])


def unfold_heads(t: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of :func:`fold_heads` (a view where the layout allows, else a copy)."""
    b, hkv, rows = t.shape[:3]
    return t.reshape(b, hq, rows * hkv // hq, *t.shape[3:])


def gqa_fold(q, k, causal: bool, mask) -> bool:
    """Whether a call takes GQA by folding query heads into rows instead of expanding K/V: a
    full (non-causal, unmasked) block, where every row attends every key on its own, so the
    ``hq/hkv`` query heads of one K/V head are just more rows of it (no K/V copy per query head,
    ``dK/dV`` come out per K/V head). A causal block's mask is aligned to its rows, so it keeps
    the expansion (the streaming layer's causal pieces are one query tile's square)."""
    return not causal and mask is None and k.shape[1] < q.shape[1]
