"""Account on CPU fake tensors as a GPU run would: the CUDA kernels' saved tensors and temporaries.

The fake-rank harness (:mod:`megatron_metp.tools.fakerank`) runs CPU kernels on fake tensors.
Where a CPU kernel keeps different tensors for backward than its CUDA counterpart, or allocates
different temporaries, the measured bytes would be the CPU's, not a GPU's. :func:`cuda_kernels`
switches each such op to a stand-in that computes the same values and allocates what the CUDA
kernel allocates (``docs/cpu-cuda-kernels.md`` lists every difference found, with the bytes):

``rms_norm`` (``torch.nn.RMSNorm``, ``F.rms_norm``, Megatron's ``WrappedTorchNorm``)
    CPU: a composite; autograd records the fp32 up-cast, the squared mean, the ``rsqrt`` and two
    products, keeping two fp32 ``[rows, h]`` tensors (and one bf16) per norm. CUDA: one fused
    kernel (``_fused_rms_norm``) that keeps the input, the weight and one fp32 ``rstd`` per row.
    Stand-in: :class:`CudaRMSNorm`, saving exactly ``(x, weight, rstd[rows])``; its row-chunked
    fp32 work is bounded by :data:`CHUNK_BYTES` per temporary.

METP's fp32-accumulating matmul (``ops._accum.mm_acc``)
    CPU: fp32 copies of both operands, then an fp32 ``addmm``. CUDA: one fp32 product
    (``mm(out_dtype=float32)``) added into the accumulator. Stand-in: the CUDA branch
    (:func:`megatron_metp.ops._accum.emulate_cuda_branch`).

``layer_norm`` (``torch.nn.LayerNorm``, ``F.layer_norm``) with a 16-bit input
    Both keep the input, weight, bias and a mean and rstd per row; CPU keeps the statistics in
    the input's dtype, CUDA in fp32 (4 bytes a row more per norm). Stand-in:
    :class:`CudaLayerNorm`, which keeps fp32 statistics.

``F.dropout`` in training (``0 < p < 1``)
    CPU keeps the scaled noise in the input's dtype; CUDA (``native_dropout``) a bool mask.
    Stand-in: ``torch.native_dropout``, whose CPU kernel keeps the bool mask as CUDA does.

Megatron's fused activations (``fusions.fused_bias_swiglu`` / ``fused_bias_gelu``: SwiGLU and
bias-GeLU, forward and backward, compiled by ``torch.compile``)
    On a GPU each runs as one compiled kernel that allocates only its output. Under the
    measurement's dispatch modes ``torch.compile`` does not run, so the CPU evaluates them eagerly
    and holds every intermediate (SwiGLU's backward: two extra ``[tokens, F/t]`` tensors).
    Stand-in: the same functions evaluated in row chunks of ≤ :data:`CHUNK_BYTES` per fp32
    temporary, writing into one output: the output is the only full-size allocation.

Found equal (nothing to do, ``docs/cpu-cuda-kernels.md``): softmax, SiLU/GeLU/SwiGLU,
embedding, cross-entropy, the unfused RoPE, matmuls, and ``scaled_dot_product_attention``'s
flash path without dropout (output + fp32 log-sum-exp; CUDA's flash kernel adds a 16-byte RNG
state per call). Not covered: SDPA *with* dropout (on CPU it falls back to the math path and keeps
fp32 scores; the configs and METP run without attention dropout), Transformer Engine's kernels
(absent here).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

#: bytes of one fp32 temporary of the row-chunked stand-ins (a CUDA kernel keeps its rows in
#: registers/shared memory; a bounded chunk keeps the CPU's temporaries out of the peak)
CHUNK_BYTES = 8 * 2 ** 20


def _chunks(rows: int, n: int):
    step = max(1, CHUNK_BYTES // (4 * max(1, n)))
    for i in range(0, rows, step):
        yield i, min(rows, i + step)


class CudaRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps for backward what CUDA's fused kernel keeps.

    Forward, rows ``x_i`` of ``x [..., n]``: ``rstd_i = 1/sqrt(mean(x_i²) + eps)``,
    ``y_i = (x_i · rstd_i) · w`` (fp32 inside, rounded once to ``x.dtype``).
    Saved: ``x``, ``w``, ``rstd`` (fp32 ``[rows]``).
    Backward, ``g = dy·w``, ``x̂ = x·rstd``: ``dx = rstd·(g − x̂·mean(g·x̂))``,
    ``dw = Σ_rows dy·x̂`` (fp32 sum, rounded to ``w.dtype``).
    """

    @staticmethod
    def forward(ctx, x, weight, eps, n):
        rows = x.numel() // n
        x2 = x.reshape(rows, n)
        out = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        w32 = weight.float() if weight is not None else None
        for i, j in _chunks(rows, n):
            xc = x2[i:j].float()
            r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
            rstd[i:j] = r.squeeze(-1)
            y = xc * r
            if w32 is not None:
                y = y * w32
            out[i:j] = y.to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.n = n
        return out.view_as(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        n = ctx.n
        rows = x.numel() // n
        x2, g2 = x.reshape(rows, n), grad_out.reshape(rows, n)
        dx = torch.empty_like(x2)
        dw = torch.zeros(n, dtype=torch.float32, device=x.device) if weight is not None else None
        w32 = weight.float() if weight is not None else None
        for i, j in _chunks(rows, n):
            r = rstd[i:j].unsqueeze(-1)
            xhat = x2[i:j].float() * r
            g = g2[i:j].float()
            if w32 is not None:
                dw += (g * xhat).sum(0)
                g = g * w32
            dx[i:j] = (r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        dwt = dw.to(weight.dtype) if weight is not None else None
        return dx.view_as(x), dwt, None, None


class CudaLayerNorm(torch.autograd.Function):
    """LayerNorm that keeps what CUDA's kernel keeps: ``x``, ``w``, ``b`` and fp32 ``mean`` and
    ``rstd`` per row (CPU keeps them in ``x.dtype`` for 16-bit inputs).

    Forward: ``y = (x − mean)·rstd·w + b`` over the last ``len(normalized_shape)`` dims, by
    ``torch.native_layer_norm``; backward: ``aten.native_layer_norm_backward``.
    """

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean.float(), rstd.float())
        ctx.shape, ctx.stat_dtype = list(normalized_shape), mean.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad_out, x, ctx.shape, mean.to(ctx.stat_dtype), rstd.to(ctx.stat_dtype), weight,
            bias, mask)
        return dx, None, dw, db, None


def cuda_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm`` with CUDA's saved tensors (see :class:`CudaLayerNorm`)."""
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    return CudaLayerNorm.apply(x, shape, weight, bias, eps)


def _default_eps(x: torch.Tensor) -> float:
    return torch.finfo(x.dtype).eps if x.is_floating_point() else 1e-6


def cuda_rms_norm(x, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` with CUDA's saved tensors (see :class:`CudaRMSNorm`)."""
    n = int(math.prod(normalized_shape if isinstance(normalized_shape, (list, tuple, torch.Size))
                      else (normalized_shape,)))
    return CudaRMSNorm.apply(x, weight, _default_eps(x) if eps is None else eps, n)


def _row_chunked(fn, row_args):
    """``fn`` evaluated in row chunks of the tensors at positions ``row_args`` (same leading
    dims), the chunks written into one output: what a fused kernel allocates."""

    def run(*args):
        first = args[row_args[0]]
        rows = first.numel() // first.shape[-1]
        width = max(args[i].shape[-1] for i in row_args)
        flat = list(args)
        for i in row_args:
            flat[i] = args[i].reshape(rows, args[i].shape[-1])
        out = None
        for i, j in _chunks(rows, width):
            part = list(flat)
            for k in row_args:
                part[k] = flat[k][i:j]
            res = fn(*part)
            if out is None:
                out = torch.empty(rows, res.shape[-1], dtype=res.dtype, device=res.device)
            out[i:j] = res
        return out.view(*first.shape[:-1], out.shape[-1])

    return run


#: Megatron's compiled elementwise fusions: (module, function, positions of the row tensors)
_FUSED = (("megatron.core.fusions.fused_bias_swiglu", "swiglu", (0,)),
          ("megatron.core.fusions.fused_bias_swiglu", "swiglu_back", (0, 1)),
          ("megatron.core.fusions.fused_bias_swiglu", "bias_swiglu", (0,)),
          ("megatron.core.fusions.fused_bias_swiglu", "bias_swiglu_back", (0, 1)),
          ("megatron.core.fusions.fused_bias_gelu", "bias_gelu", (1,)),
          ("megatron.core.fusions.fused_bias_gelu", "bias_gelu_back", (0, 2)))


@contextlib.contextmanager
def _fused_activations():
    import importlib

    saved = []
    try:
        for modname, name, rows in _FUSED:
            try:
                mod = importlib.import_module(modname)
            except ImportError:  # not a Megatron process
                continue
            orig = getattr(mod, name)
            eager = getattr(orig, "_torchdynamo_orig_callable", orig)
            saved.append((mod, name, orig))
            setattr(mod, name, _row_chunked(eager, rows))
        yield
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)


_ORIGINAL = {"rms_norm": F.rms_norm, "layer_norm": F.layer_norm, "dropout": F.dropout}


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    return cuda_rms_norm(input, normalized_shape, weight, eps)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    if input.dtype in (torch.bfloat16, torch.float16):
        return cuda_layer_norm(input, normalized_shape, weight, bias, eps)
    return _ORIGINAL["layer_norm"](input, normalized_shape, weight, bias, eps)


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if training and 0.0 < p < 1.0 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return _ORIGINAL["dropout"](input, p, training, inplace)


@contextlib.contextmanager
def _functional_stand_ins():
    """``torch.nn.functional.rms_norm`` / ``layer_norm`` / ``dropout`` (what ``torch.nn.RMSNorm``,
    ``LayerNorm`` and ``Dropout`` call) replaced for the process while inside, so that a forward
    re-run inside autograd's backward (activation recompute) uses them too: a dispatch or
    function mode is thread-local and does not reach the backward."""
    saved = {name: getattr(F, name) for name in _ORIGINAL}
    F.rms_norm, F.layer_norm, F.dropout = _rms_norm, _layer_norm, _cuda_dropout
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


@contextlib.contextmanager
def cuda_kernels(matmul: bool = True):
    """Inside: CPU (fake) tensors allocate and keep what the CUDA kernels would.

    ``matmul=False`` keeps ``mm_acc``'s CPU branch (for measuring what a CPU run holds)."""
    from ..ops._accum import emulate_cuda_branch

    undo = emulate_cuda_branch() if matmul else None
    try:
        with _fused_activations(), _functional_stand_ins():
            yield
    finally:
        if undo is not None:
            undo()
