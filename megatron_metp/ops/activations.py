"""Activations of the MLP's ``f`` with explicit derivatives, matching Megatron's choices.

``gelu``: ``f(z) = z·Φ(z)`` (exact erf GeLU, ``torch.nn.functional.gelu``: Megatron's default
``activation_func`` when bias-GeLU fusion is off).
``swiglu``: ``z = [z_g | z_u]`` along the last dim (gate then up, Megatron's ``gated_linear_unit``
layout of ``linear_fc1``'s output); ``f(z) = silu(z_g) · z_u``.

Backward functions return ``dz`` from ``z`` and ``da = dL/df(z)`` with the same ATen kernels
autograd uses, so results are bit-identical to differentiating the forward. On the GPU code path
SwiGLU runs as Megatron's compiled ``swiglu`` / ``swiglu_back`` (what its own MLP uses with
``--bias-swiglu-fusion``: one kernel each, the same values up to rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "swiglu")


def fc1_rows_per_ffn(activation: str) -> int:
    """``linear_fc1`` output rows per FFN unit: 2 for gated units (gate + up), else 1."""
    return 2 if activation == "swiglu" else 1


def _fused_swiglu(z: torch.Tensor):
    """Megatron's compiled SwiGLU module (``megatron.core.fusions.fused_bias_swiglu``: one
    kernel each way on a GPU) for ``z`` on the GPU code path, else ``None`` (eager ops)."""
    from .cuda_emulation import gpu_path

    if not gpu_path(z):
        return None
    try:
        from megatron.core.fusions import fused_bias_swiglu
    except Exception:  # noqa: BLE001 - no megatron-core: the eager ops
        return None
    return fused_bias_swiglu


def forward(activation: str, z: torch.Tensor) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(z)
    if activation == "swiglu":
        fused = _fused_swiglu(z)
        if fused is not None:
            return fused.swiglu(z)
        zg, zu = torch.chunk(z, 2, dim=-1)
        return F.silu(zg) * zu
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def backward(activation: str, z: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """``dz = da · f'(z)`` (for swiglu, ``[dz_g | dz_u]``)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(da, z)
    if activation == "swiglu":
        fused = _fused_swiglu(z)
        if fused is not None:
            return fused.swiglu_back(da, z)
        zg, zu = torch.chunk(z, 2, dim=-1)
        dzu = da * F.silu(zg)
        dzg = torch.ops.aten.silu_backward(da * zu, zg)
        return torch.cat([dzg, dzu], dim=-1)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
