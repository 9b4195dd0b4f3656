"""Shim (l) of :mod:`megatron_metp.megatron.cpu`: Megatron's ``jit_fuser`` functions run eagerly.

megatron-core decorates a few element-wise functions with ``jit_fuser`` (``torch.compile`` on
torch >= 2.2): the GLU of ``GroupedMLP`` and its ``activation_func_with_probs``, ``quick_gelu``
(gpt-oss), the router's expert-bias update, the fused bias activations. On a CUDA device that
fuses them with Triton; on CPU ranks torch's inductor instead generates C++ and compiles it with
the machine's C++ compiler, seconds per function and shape on first use, and a compiler a
pip-only machine need not have. The shim makes the CPU ranks run them as plain eager functions:

* before megatron-core is imported, ``torch.compile`` is :func:`eager_compile`, which returns the
  function it is given (as a decorator and as a decorator factory), so ``jit_fuser`` wraps
  nothing and the compiler (``torch._dynamo``, ``torch._inductor``: about 1.3 s of imports per
  rank) is never loaded;
* functions compiled before the shim was enabled (megatron-core imported earlier in the same
  process) run uncompiled through ``torch._dynamo.config.disable``.

The values are the same functions' values: only the fusion (one kernel instead of several) is
lost, which on a CPU rank changes nothing but speed. Memory instruments that account saved
tensors as CUDA does (:mod:`megatron_metp.tools.cuda_accounting`) count Megatron's unfused
activations, as they did before this shim.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["eager_compile", "patch_compile"]


def eager_compile(model=None, **_options):
    """``torch.compile(model, ...)`` → ``model``; ``torch.compile(...)`` → a decorator that
    returns its function unchanged."""
    if model is None:
        return lambda fn: fn
    return model


def patch_compile(patch) -> None:
    """Apply shim (l) with ``patch(owner, name, value)`` (recorded, undone by ``disable()``)."""
    patch(torch, "compile", eager_compile)
    if "torch._dynamo" in sys.modules:  # functions compiled already: run them uncompiled
        patch(sys.modules["torch._dynamo"].config, "disable", True)
