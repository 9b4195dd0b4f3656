"""The one switch that makes the METP ops take their CUDA code paths on CPU (fake) tensors.

The instruments run the real ops on CPU fake tensors and must see what a GPU allocates or
launches. Every op with a CUDA branch asks this module (:func:`emulating_cuda`,
:func:`gpu_path`), and every instrument flips it here (:func:`emulate_cuda`,
:func:`cuda_emulated`). It has two parts, on together by default:

``"matmul"``
    :mod:`._accum`'s fp32-accumulating GEMMs take their CUDA branch
    (``addmm(acc, a, b, out_dtype=fp32, out=acc)``: one GEMM, no fp32 temporary, no fp32 operand
    copies), so memory measured on fake tensors is a GPU's (``metp measure``'s
    :func:`~megatron_metp.tools.cuda_accounting.cuda_kernels`, the memory benchmarks).
``"kernels"``
    the GPU code paths for every tensor: ``torch_flash`` calls the CUDA flash ops with their
    layouts (:mod:`.attention_kernels`), METP attention picks its head-group block as on a GPU
    (:func:`~megatron_metp.ops.attention.head_block_size`), SwiGLU runs as Megatron's fused
    functions (:mod:`.activations`): what the launch-counting benchmark counts.

The memory instruments turn on ``"matmul"`` only: their figures are checked against
``metp plan``, which models one head group per block (what a CPU run does), not a GPU's
head-group blocks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict

import torch

#: the parts of the CUDA code paths that can be emulated
PARTS = ("matmul", "kernels")

_on: Dict[str, bool] = {part: False for part in PARTS}


def _check(part: str) -> None:
    if part not in _on:
        raise ValueError(f"CUDA emulation part must be one of {PARTS}, got {part!r}")


def emulating_cuda(part: str) -> bool:
    """Whether the ops take their CUDA code path of ``part`` (``"matmul"`` or ``"kernels"``) for
    every tensor."""
    _check(part)
    return _on[part]


def gpu_path(t: torch.Tensor) -> bool:
    """Whether the ops take their GPU code paths (``"kernels"``) for ``t``: a CUDA tensor, or
    the emulation is on."""
    return t.is_cuda or _on["kernels"]


def emulate_cuda(*, matmul: bool = True, kernels: bool = True) -> Callable[[], None]:
    """Turn on the emulation of the chosen parts (the others keep their state); returns a
    callable that puts those parts back as they were before the call."""
    chosen = [part for part, on in (("matmul", matmul), ("kernels", kernels)) if on]
    before = {part: _on[part] for part in chosen}
    for part in chosen:
        _on[part] = True

    def undo() -> None:
        _on.update(before)

    return undo


@contextlib.contextmanager
def cuda_emulated(*, matmul: bool = True, kernels: bool = True):
    """:func:`emulate_cuda` for the duration of a ``with`` block."""
    undo = emulate_cuda(matmul=matmul, kernels=kernels)
    try:
        yield
    finally:
        undo()
