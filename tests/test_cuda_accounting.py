"""The fake-rank harness accounts as CUDA kernels do (``megatron_metp.tools.cuda_accounting``).

* The CUDA-faithful RMSNorm computes what ``F.rms_norm`` computes (fp32, values and gradients).
* Under ``cuda_kernels()`` it keeps for backward exactly what CUDA's fused kernel keeps: the input,
  the weight and one fp32 ``rstd`` per row; the CPU composite (negative control) keeps more.
* Under fake tensors + MemTracker the forward of a norm stores only those bytes.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_metp.tools.cuda_accounting import CudaRMSNorm, cuda_kernels, cuda_rms_norm


def _saved(fn, *inputs):
    """Storages autograd saves during ``fn()``: ``{storage ptr: (nbytes, dtype, shape)}``, the
    storages of ``inputs`` (its inputs and parameters) excluded."""
    skip = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    got = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            got[ptr] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return got


@pytest.mark.parametrize("shape,affine", [((7, 3, 16), True), ((5, 12), False), ((2, 4, 33), True)])
def test_rms_norm_values_and_gradients(shape, affine):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64).float().requires_grad_()
    w = (torch.rand(shape[-1]) + 0.5).requires_grad_() if affine else None
    g = torch.randn(shape)
    ref = F.rms_norm(x, (shape[-1],), w, 1e-5)
    ref_grads = torch.autograd.grad(ref, [x] + ([w] if affine else []), g)
    with cuda_kernels():
        y = F.rms_norm(x, (shape[-1],), w, 1e-5)   # routed to the stand-in
    assert y.grad_fn is not None and "CudaRMSNorm" in type(y.grad_fn).__name__
    grads = torch.autograd.grad(y, [x] + ([w] if affine else []), g)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        assert (a - b).norm() / b.norm() <= 1e-5
    # a negative control: a wrong epsilon is caught by the same comparison
    bad = cuda_rms_norm(x, (shape[-1],), w, 1e-1)
    assert (bad - ref).norm() / ref.norm() > 1e-3


def test_rms_norm_saves_what_cuda_saves():
    rows, h = 48, 32
    x = torch.randn(rows, h, dtype=torch.bfloat16, requires_grad=True)
    norm = torch.nn.RMSNorm(h, dtype=torch.bfloat16)
    with cuda_kernels():
        saved = _saved(lambda: norm(x), x, norm.weight)
    # CUDA's _fused_rms_norm keeps input, weight (excluded above) and rstd[rows] in fp32
    assert sorted(saved.values(), key=str) == [(rows * 4, torch.float32, (rows,))]
    cpu = _saved(lambda: norm(x), x, norm.weight)
    cpu_bytes = sum(v[0] for v in cpu.values())
    # negative control: the CPU composite keeps at least an fp32 copy of the input on top
    assert cpu_bytes >= rows * 4 + rows * h * 4, cpu


def test_stand_in_stores_only_input_and_rstd_under_memtracker():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.tools import fakerank as FR

    rows, h = 1024, 256

    class Scale(torch.nn.Module):
        """Baseline: keeps its input and returns one new tensor, as every norm does."""

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(h, dtype=torch.bfloat16))

        def forward(self, x):
            return x * self.weight

    def stored(make, cuda):
        with FakeTensorMode():
            mod = make()
            x = torch.empty(rows, h, dtype=torch.bfloat16, requires_grad=True)
            trk = FR.tracker()
            with FR.measuring(trk, cuda=cuda):
                y = mod(x)
                after = FR.snap(trk, "current")["cat"].get("ACT", 0)
                y.float().sum().backward()
        return after

    base = stored(Scale, True)
    def rms():
        return torch.nn.RMSNorm(h, dtype=torch.bfloat16)

    assert stored(rms, True) - base == rows * 4                  # + rstd, nothing else
    assert stored(rms, False) - base >= rows * 4 + rows * h * 4  # CPU: fp32 copies kept


def test_cpu_branch_of_matmul_is_restored():
    from megatron_metp.ops.cuda_emulation import emulating_cuda

    assert not emulating_cuda("matmul")
    with cuda_kernels():
        assert emulating_cuda("matmul")
    assert not emulating_cuda("matmul")
    with cuda_kernels(matmul=False):
        assert not emulating_cuda("matmul")


def test_direct_apply_matches_module_path():
    x = torch.randn(3, 8, requires_grad=True)
    y = CudaRMSNorm.apply(x, None, 1e-6, 8)
    assert torch.allclose(y, F.rms_norm(x, (8,), None, 1e-6), rtol=1e-5, atol=1e-6)


def test_layer_norm_keeps_fp32_statistics_and_equal_values():
    torch.manual_seed(0)
    rows, h = 40, 24
    x = torch.randn(rows, h).bfloat16().requires_grad_()
    norm = torch.nn.LayerNorm(h, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    g = torch.randn(rows, h).bfloat16()
    ref = norm(x)
    ref_grads = torch.autograd.grad(ref, [x, norm.weight, norm.bias], g)
    with cuda_kernels():
        saved = _saved(lambda: norm(x), x, norm.weight, norm.bias)
        y = norm(x)
    grads = torch.autograd.grad(y, [x, norm.weight, norm.bias], g)
    assert torch.equal(y, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # CUDA: mean and rstd per row in fp32 (the input, weight and bias are excluded above)
    assert sorted(saved.values(), key=str) == [(rows * 4, torch.float32, (rows, 1))] * 2
    cpu = _saved(lambda: norm(x), x, norm.weight, norm.bias)  # negative control: bf16 stats
    assert {v[1] for v in cpu.values()} == {torch.bfloat16}


def test_dropout_keeps_a_bool_mask():
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    with cuda_kernels():
        saved = _saved(lambda: F.dropout(x, 0.25, True), x)
        y = F.dropout(x, 0.25, True)
    assert [v[1] for v in saved.values()] == [torch.bool]
    kept = y != 0
    assert torch.allclose(y[kept].float(), (x[kept] / 0.75).float(), rtol=1e-2)
    (g,) = torch.autograd.grad(y.float().sum(), [x])
    assert torch.equal(g != 0, kept)
    cpu = _saved(lambda: F.dropout(x, 0.25, True), x)  # negative control: bf16 noise
    assert [v[1] for v in cpu.values()] == [torch.bfloat16]
    with cuda_kernels():  # evaluation and p = 0 are untouched
        assert torch.equal(F.dropout(x, 0.25, False), x) and torch.equal(F.dropout(x, 0.0), x)


def test_megatron_fused_activations_are_chunked_and_equal(monkeypatch):
    """Megatron's compiled SwiGLU / bias-GeLU (forward and backward) run as row-chunked eager
    stand-ins under cuda_kernels(): same values, only the output allocated in full."""
    from megatron.core.fusions import fused_bias_gelu as G
    from megatron.core.fusions import fused_bias_swiglu as S

    from megatron_metp.tools import cuda_accounting as CA

    torch.manual_seed(0)
    y = torch.randn(3, 37, 2 * 24)
    g = torch.randn(3, 37, 24)
    bias = torch.randn(2 * 24)
    yg, gg, bg = torch.randn(5, 9, 16), torch.randn(5, 9, 16), torch.randn(16)
    eager = lambda f: getattr(f, "_torchdynamo_orig_callable", f)  # noqa: E731
    ref = {"swiglu": eager(S.swiglu)(y), "swiglu_back": eager(S.swiglu_back)(g, y),
           "bias_swiglu": eager(S.bias_swiglu)(y, bias),
           "bias_swiglu_back": eager(S.bias_swiglu_back)(g, y, bias),
           "bias_gelu": eager(G.bias_gelu)(bg, yg), "bias_gelu_back": eager(G.bias_gelu_back)(gg, bg, yg)}
    originals = (S.swiglu, S.swiglu_back, G.bias_gelu)
    monkeypatch.setattr(CA, "CHUNK_BYTES", 4 * 48 * 5)  # 5 rows per chunk: 111 and 45 rows
    with cuda_kernels():
        assert S.swiglu is not originals[0]
        got = {"swiglu": S.swiglu(y), "swiglu_back": S.swiglu_back(g, y),
               "bias_swiglu": S.bias_swiglu(y, bias),
               "bias_swiglu_back": S.bias_swiglu_back(g, y, bias),
               "bias_gelu": G.bias_gelu(bg, yg), "bias_gelu_back": G.bias_gelu_back(gg, bg, yg)}
    assert (S.swiglu, S.swiglu_back, G.bias_gelu) == originals  # restored
    for k in ref:  # (bias_swiglu's reference calls the compiled swiglu: not bit-identical)
        assert got[k].shape == ref[k].shape, k
        assert torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6), k
    # negative control: a chunked evaluation that drops the last chunk is caught
    broken = CA._row_chunked(lambda t: eager(S.swiglu)(t) * (t.shape[0] == 5), (0,))
    assert not torch.equal(broken(y), ref["swiglu"])


def test_one_cuda_emulation_switch_reaches_every_op():
    """ops/cuda_emulation.py is the one switch: its "kernels" part turns on the GPU paths of the
    block kernels and the head-group blocks together, its "matmul" part mm_acc's CUDA branch;
    each undo puts back only what it turned on; an unknown part is refused."""
    from megatron_metp.ops.attention import head_block_size
    from megatron_metp.ops.attention_kernels import TorchFlashKernel
    from megatron_metp.ops.cuda_emulation import cuda_emulated, emulate_cuda, emulating_cuda

    q, cpu = torch.empty(1, 2, 4, 8), torch.device("cpu")
    assert TorchFlashKernel.takes_mask(q) and head_block_size(4, 1, 8, cpu, "auto") == 1
    with cuda_emulated():
        assert emulating_cuda("matmul") and emulating_cuda("kernels")
        assert not TorchFlashKernel.takes_mask(q) and head_block_size(4, 1, 8, cpu, "auto") == 4
    assert not emulating_cuda("matmul") and not emulating_cuda("kernels")
    undo_k = emulate_cuda(matmul=False)
    undo_m = emulate_cuda(kernels=False)
    assert emulating_cuda("matmul") and head_block_size(4, 1, 8, cpu, "auto") == 4
    undo_k()  # out of order: the matmul part stays on
    assert emulating_cuda("matmul") and not emulating_cuda("kernels")
    assert TorchFlashKernel.takes_mask(q)
    undo_m()
    assert not emulating_cuda("matmul")
    with pytest.raises(ValueError, match="one of"):
        emulating_cuda("gemm")
