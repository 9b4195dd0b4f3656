"""Forked children compile with TorchInductor after their parent did (Megatron's ``jit_fuser``
kernels, e.g. the fused bias-SwiGLU that ``benchmarks/gpu_check.py`` and ``metp measure`` run in
forked children). A fork inherits inductor's state but not its compile-pool threads, so a child
used to wait forever on the pool's future; children now compile in their own process."""

import torch

from megatron_metp.tools import fakerank as FR
from tests.harness import run_ranks


def _compile_swiglu(shape):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    x = torch.randn(*shape, requires_grad=True)
    b = torch.randn(shape[-1], requires_grad=True)
    bias_swiglu_impl(x, b).sum().backward()
    return tuple(x.grad.shape)


def _rank_compiles(rank, world):
    return _compile_swiglu((3, 1, 16))


def test_children_compile_after_the_parent_compiled_with_its_worker_pool():
    assert _compile_swiglu((5, 2, 16)) == (5, 2, 16)  # this process: inductor's pool exists now
    assert FR.map_isolated(_compile_swiglu, [((4, 3, 16),)], timeout=120) == [{"ok": (4, 3, 16)}]
    assert run_ranks(_rank_compiles, 2, timeout=120) == [(3, 1, 16)] * 2
