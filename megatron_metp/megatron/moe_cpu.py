"""Shim (j) of :mod:`.cpu`: megatron-core's MoE layer on CPU, only where it assumes CUDA.

Applied by :func:`megatron_metp.megatron.cpu.enable` (and undone by ``disable``):

* ``moe_utils.te_general_gemm``: megatron-core 0.16.1 binds it only when Transformer Engine
  imports, yet the router's gating GEMM (``RouterGatingLinearFunction``) reads it
  unconditionally; without TE it is set to ``None`` (0.19 does that itself), so the router runs
  ``torch.mm`` / ``torch.addmm`` as written for that case.
* ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream``: the alltoall dispatcher creates one
  ``torch.cuda.Stream()`` (class-wide, on first construction) for its device-to-host copies of
  the split sizes and waits on an event it records there. On CPU the class attribute is set
  beforehand to a host stand-in whose ``record_event()`` returns an event that is already
  complete (the "copies" are no-ops: the split sizes live on the CPU already).
* ``token_dispatcher.maybe_move_tensor_to_cpu``: on the GPU it turns the alltoall split sizes
  into numpy arrays on their way to the host; a CPU tensor it returns as it is, and
  ``all_to_all_single`` refuses a tensor of split sizes. The shim converts a CPU tensor when
  ``as_numpy=True`` too, and calls the original otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cpu_stream import CpuStream


class _HostEvent:
    """A completed event (the dispatcher only synchronises on it): CPU work is ordered."""

    def synchronize(self) -> None:
        pass


class _HostStream(CpuStream):
    """The alltoall dispatcher's device-to-host stream on CPU."""

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()


def patch_moe(patch: Callable) -> None:
    """Apply the MoE shims with ``patch(owner, name, value)`` (which records the original)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        patch(moe_utils, "te_general_gemm", None)
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    patch(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_host)
    a2a = token_dispatcher.MoEAlltoAllTokenDispatcher
    if a2a.cuda_dtoh_stream is None:
        patch(a2a, "cuda_dtoh_stream", _HostStream())
