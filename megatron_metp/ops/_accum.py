"""``acc += a @ b`` with one rounding: how every METP op sums its ring partials."""

from __future__ import annotations

import torch

# None: not tried yet on CUDA; the first CUDA call finds out whether mm(out_dtype=) has a kernel.
_cuda_out_dtype_ok = None
# Memory measurement on CPU fake tensors: take the CUDA branch (see emulate_cuda_branch).
_emulate_cuda = False


def emulate_cuda_branch():
    """Make :func:`mm_acc` take its CUDA branch (``torch.mm(..., out_dtype=)``: one fp32 product,
    no fp32 operand copies) for every tensor, so that memory measured on CPU fake tensors is what
    a GPU allocates. Returns a callable that undoes it."""
    global _emulate_cuda
    before = _emulate_cuda
    _emulate_cuda = True

    def undo():
        global _emulate_cuda
        _emulate_cuda = before

    return undo


def mm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with the product rounded once, into ``acc``'s dtype.

    For 16-bit operands and an fp32 ``acc`` the product is formed in fp32 (``out_dtype`` on CUDA
    where torch has it, an fp32 matmul elsewhere), so summing ``p`` ring partials rounds no more
    often than stock TP's single matmul does.
    """
    global _cuda_out_dtype_ok
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if _emulate_cuda:
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
        return
    if a.is_cuda and _cuda_out_dtype_ok is not False:
        try:
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
            _cuda_out_dtype_ok = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _cuda_out_dtype_ok = False
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
