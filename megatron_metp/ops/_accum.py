"""``acc += a @ b`` with one rounding: how every METP op sums its ring partials."""

from __future__ import annotations

import torch

from .cuda_emulation import emulating_cuda

# Per CUDA device index: whether ``addmm(..., out_dtype=, out=)`` has a kernel there (probed once
# on tiny tensors, so that a failure of a real call, an out-of-memory say, is never taken for a
# missing kernel).
_cuda_out_dtype_ok: dict = {}


def _out_dtype_supported(a: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """Does this CUDA device run ``addmm(out_dtype=acc_dtype, out=)`` for ``a.dtype`` operands?
    Probed once per (device, dtypes) on 2×2 tensors; any error of the probe means no."""
    key = (a.device.index, a.dtype, acc_dtype)
    ok = _cuda_out_dtype_ok.get(key)
    if ok is None:
        try:
            x = torch.zeros(2, 2, dtype=a.dtype, device=a.device)
            acc = torch.zeros(2, 2, dtype=acc_dtype, device=a.device)
            torch.addmm(acc, x, x, out_dtype=acc_dtype, out=acc)
            ok = True
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _cuda_out_dtype_ok[key] = ok
    return ok


def mm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with the product rounded once, into ``acc``'s dtype.

    For 16-bit operands and an fp32 ``acc`` the product is formed in fp32 and added in place by
    the GEMM itself (``addmm(out_dtype=fp32, out=acc)`` on CUDA: one kernel, ``beta = 1``), or by
    an fp32 matmul of fp32 operand copies elsewhere, so summing ``p`` ring partials rounds no more
    often than stock TP's single matmul does.
    """
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if emulating_cuda("matmul") or (a.is_cuda and _out_dtype_supported(a, acc.dtype)):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        return
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def mm_new(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as a new ``dtype`` tensor rounded once (the first partial of a sum: no zero fill
    and no add). 16-bit operands with an fp32 ``dtype``: ``mm(out_dtype=)`` on CUDA, an fp32
    matmul of fp32 copies elsewhere."""
    if dtype == a.dtype:
        return torch.mm(a, b)
    if emulating_cuda("matmul") or (a.is_cuda and _out_dtype_supported(a, dtype)):
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a.to(dtype), b.to(dtype))


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` written into ``out`` (any strides a GEMM can write, e.g. a column slice),
    rounded once into ``out``'s dtype; no zero fill beforehand, no temporary on CUDA."""
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if emulating_cuda("matmul") or (a.is_cuda and _out_dtype_supported(a, out.dtype)):
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)
