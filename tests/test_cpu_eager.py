"""Shim (l) of the megatron-core CPU shims (``megatron_metp.megatron.cpu_eager``): Megatron's
``jit_fuser`` functions run eagerly on CPU ranks, without inductor generating and compiling C++."""

from __future__ import annotations

import torch

from megatron_metp.megatron.cpu_eager import eager_compile


def test_eager_compile_returns_the_function_as_decorator_and_factory():
    def f(x):
        return x + 1

    assert eager_compile(f) is f
    assert eager_compile(mode="max-autotune")(f) is f


def test_jit_fused_functions_run_uncompiled_with_the_shims_on(cpu_shims, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from megatron.core.activations import quick_gelu  # jit_fuser (torch.compile) at import

    import torch._dynamo
    from torch._dynamo.utils import counters

    before = sum(counters["stats"].values())
    x = torch.randn(3, 5)
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    assert torch.compile(quick_gelu) is quick_gelu  # (torch.compile itself is the shim's)
    assert sum(counters["stats"].values()) == before  # no frame handed to dynamo
    assert not any(tmp_path.iterdir())  # no C++ generated


def test_negative_control_without_the_shims_dynamo_compiles(tmp_path, monkeypatch):
    """The counters above can move: a compiled function does hand its frame to dynamo."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    import torch._dynamo
    from torch._dynamo.utils import counters

    before = sum(counters["stats"].values())
    compiled = torch.compile(lambda x: x * torch.sigmoid(1.702 * x), backend="eager")
    x = torch.randn(3, 5)
    assert torch.allclose(compiled(x), x * torch.sigmoid(1.702 * x))
    assert sum(counters["stats"].values()) > before
    torch._dynamo.reset()
