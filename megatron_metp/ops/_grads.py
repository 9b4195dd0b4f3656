"""Handing a METP weight shard's complete gradient to autograd, or straight to Megatron's buffer.

A METP op's weight gradient arrives complete at the shard's owner in the ring's wire dtype
(fp32 by default, bf16 where Megatron reduces gradients in bf16). Returning it to autograd
rounds it to the parameter's dtype (bf16) before Megatron's DDP adds it to its ``main_grad``
buffer. Where the parameter has Megatron's ``main_grad`` (and DDP's ``grad_added_to_main_grad``
flag), :func:`weight_grad` adds it into ``main_grad`` directly, as Megatron's own linears do with
``gradient_accumulation_fusion``, and returns Megatron's placeholder (DDP's hook then skips its
add): no rounding step in between.
"""

from __future__ import annotations

from typing import Optional

import torch


def main_grad_of(w: torch.Tensor) -> Optional[torch.Tensor]:
    """Megatron DDP's ``main_grad`` buffer view of ``w``, or ``None``."""
    mg = getattr(w, "main_grad", None)
    if mg is None or not hasattr(w, "grad_added_to_main_grad") or mg.shape != w.shape:
        return None
    return mg


def wire_dtype(*weights, default=torch.float32) -> torch.dtype:
    """The dtype a weight-gradient ring should use for ``weights``: their ``main_grad``'s
    (Megatron's ``grad_reduce_in_fp32`` / ``--grad-reduce-in-bf16`` decide it), else
    ``default``."""
    for w in weights:
        mg = None if w is None else main_grad_of(w)
        if mg is not None:
            return mg.dtype
    return default


def weight_grad(w: Optional[torch.Tensor], g: Optional[torch.Tensor]):
    """What the op returns to autograd for weight ``w`` whose complete gradient is ``g``."""
    if w is None or g is None:
        return None
    mg = main_grad_of(w)
    if mg is None:
        if g.dtype == w.dtype and g.stride() == w.stride():
            return g
        return torch.empty_like(w).copy_(g)  # w's dtype and layout, one kernel
    mg.add_(g.view_as(mg))
    w.grad_added_to_main_grad = True
    if getattr(w, "zero_out_wgrad", False):
        return torch.zeros_like(w)
    return torch.empty_like(w)  # Megatron's placeholder: DDP's hook does not add it
