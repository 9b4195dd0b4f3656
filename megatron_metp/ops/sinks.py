"""Attention sinks (Megatron's ``softmax_type`` ``off-by-one`` / ``learnable``; gpt-oss) merged
into the K/V ring's log-sum-exp.

A sink is one extra logit ``σ_h`` per head in every row's softmax denominator, with a value of
zero: for query row ``i`` of head ``h`` with scores ``s_ij`` and values ``v_j``::

    O'_i = Σ_j e^{s_ij} v_j / (Σ_j e^{s_ij} + e^{σ_h})            LSE'_i = logaddexp(LSE_i, σ_h)

The ring's result ``(O_i, LSE_i)`` over every key is already normalised, so the sink is one more
log-sum-exp merge, of a block whose output is zero and whose log-sum-exp is ``σ_h``, done once
per row after the ring (not per ring step, nor per rank: that would add it ``p`` times)::

    O'_i = O_i · e^{LSE_i − LSE'_i} = O_i · sigmoid(LSE_i − σ_h)

Backward: with ``(O', LSE')`` saved, the ring's flash-style backward ``dS_ij = P_ij (dP_ij −
D_i)``, ``P_ij = e^{s_ij − LSE'_i}``, ``D_i = rowsum(dO'_i ⊙ O'_i)`` is already the gradient of
the sink softmax for ``q, k, v`` (the sink column has ``dP = 0``); the sink's own gradient is::

    dσ_h = Σ_i P_sink,i · (0 − D_i) = −Σ_i e^{σ_h − LSE'_i} · D_i

summed over this rank's rows and the batch; the caller's reduction (Megatron's DDP over the
sequence ranks, as for a norm weight) adds the other ranks' rows. ``off-by-one`` is ``σ = 0``,
fixed.
"""

from __future__ import annotations

import torch

__all__ = ["add_sink_", "sink_grad"]


def add_sink_(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """In place: fold the sinks ``sink [H]`` into heads-first ``out [b, H, n, d]`` (any dtype,
    any strides) and its ``lse [b, H, n]`` (fp32 from the ring; the sinks are taken in its
    dtype)."""
    s = sink.detach().to(lse.dtype).view(1, -1, 1)
    keep = torch.sub(lse, s).sigmoid_()  # e^{LSE − LSE'}
    out.mul_(keep.unsqueeze(-1).to(out.dtype))
    torch.logaddexp(lse, s.expand_as(lse), out=lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              sink: torch.Tensor) -> torch.Tensor:
    """``dσ [H]`` in ``lse``'s dtype (fp32) of this rank's rows: heads-first ``dout``, ``out``
    ``[b, H, n, d]`` (``out`` and ``lse [b, H, n]`` after :func:`add_sink_`)."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # D_i   [b, H, n]
    p_sink = torch.exp(sink.detach().to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2))
