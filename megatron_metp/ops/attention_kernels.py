"""Block attention kernels behind one interface: ``forward`` → ``(out, lse)``, ``backward`` → grads.

A ring step attends one block of queries to one block of keys/values. Every kernel here works on
``q [b, hq, n, d]``, ``k, v [b, hkv, m, d]`` (heads first; ``hq`` a multiple of ``hkv`` for GQA/MQA)
with one of two masks: ``causal=False`` (no mask) or ``causal=True`` (square block, query ``i``
sees keys ``≤ i``: the diagonal block of a causal ring), and, for packed sequences
(:mod:`.documents`), an optional boolean ``mask [n, m]`` (``True``: visible) on the kernels whose
``takes_mask(q)`` is true (``reference``; ``torch_flash`` on CPU, as an additive ``0/−inf`` mask).
A masked row with no visible key gives ``out = 0``, ``lse = −inf``; in backward its
probabilities are ``exp(−inf − lse) = 0``. The GPU kernels (``cudnn``, ``flash_attn_3``,
``flash_attn``) and CUDA ``torch_flash`` take no mask: the packed plan gives them full/causal pieces per document instead (exact, more launches).

* ``forward(q, k, v, causal, scale, mask=None) -> (out, lse)``: ``out = softmax(q·kᵀ·scale)·v`` and
  ``lse = log Σ_keys exp(q·kᵀ·scale)`` (natural log, fp32, ``[b, hq, n]``).
* ``backward(dout, q, k, v, out, lse, causal, scale, workspace=None, mask=None) -> (dq, dk, dv)`` where ``out`` and ``lse``
  are the *final* (merged over all blocks) output and log-sum-exp of these query rows, so that
  ``P = exp(q·kᵀ·scale − lse)`` are this block's true probabilities and
  ``dS = P ⊙ (dout·vᵀ − rowsum(dout ⊙ out))``, ``dq = dS·k·scale``, ``dk = dSᵀ·q·scale``,
  ``dv = Pᵀ·dout``. Grads of ``k, v`` come back with ``hkv`` heads (summed over each group).

Kernels, in the order the choice falls back to where no rate decides (``select_kernel``;
:mod:`.kernel_choice` probes, chooses by the rates of :mod:`.kernel_rates`, logs and records the
choice, :func:`chosen_kernel`): ``cudnn`` (torch's SDPA cuDNN ops), ``flash_attn_3``
(FlashAttention-3, Hopper), ``flash_attn`` (FlashAttention-2) — the GPU adapters of
:mod:`.gpu_kernels` — then ``torch_flash`` (PyTorch's fused flash kernel that returns the
log-sum-exp: CUDA, or the CPU variant) and ``reference`` (plain PyTorch, fp32, materialises the
``n×m`` block scores). Override with the ``kernel=`` argument of the ops or
``METP_ATTENTION_KERNEL``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cuda_emulation import gpu_path
from .gpu_kernels import CudnnKernel, FlashAttn3Kernel, FlashAttnKernel
from .kernel_choice import (KERNELS, available_kernels, chosen_kernel,  # noqa: F401 (ops API)
                            kernel_names, select_name)
from .kernel_layout import expand_kv, fold_heads, fold_kv, gqa_fold, last_dim_dense, unfold_heads


def _causal_mask(n: int, m: int, device) -> torch.Tensor:
    return torch.ones(n, m, dtype=torch.bool, device=device).tril()


class ReferenceKernel:
    """Plain PyTorch in fp32; materialises the block's scores (the unfused path). Takes a
    boolean ``mask [n, m]`` (``True``: visible); rows with no visible key give ``out = 0`` and
    ``lse = −inf`` (no NaN), which :func:`lse.merge_masked_` folds in as nothing."""

    name = "reference"

    @staticmethod
    def takes_mask(q) -> bool:
        return True

    @staticmethod
    def _scores(q, k, causal, scale, mask):
        s = torch.matmul(q.float(), expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
        if causal:
            s.masked_fill_(~_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
        return s

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, mask=None):
        hq = q.shape[1]
        s = ReferenceKernel._scores(q, k, causal, scale, mask)
        lse = torch.logsumexp(s, dim=-1)
        shift = lse if mask is None else lse.masked_fill(lse == float("-inf"), 0.0)
        out = torch.matmul(torch.exp(s - shift.unsqueeze(-1)), expand_kv(v, hq).float())
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float, workspace=None, mask=None):
        hq, hkv = q.shape[1], k.shape[1]
        qf, kf, vf = q.float(), expand_kv(k, hq).float(), expand_kv(v, hq).float()
        s = ReferenceKernel._scores(q, k, causal, scale, mask)
        prob = torch.exp(s - lse.unsqueeze(-1))
        do = dout.float()
        dv = torch.matmul(prob.transpose(-1, -2), do)
        delta = (do * out.float()).sum(-1, keepdim=True)
        ds = prob * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, kf) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
        return dq, fold_kv(dk, hkv), fold_kv(dv, hkv)


def _additive(mask, dtype):
    """Boolean ``mask`` → the additive ``0 / −inf`` mask the CPU flash kernel takes (``dtype``)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask,
                                                                                 float("-inf"))


def _refuse_mask_on_cuda():
    raise ValueError("torch_flash on CUDA takes no attention mask; the packed-sequence plan "
                     "(cu_seqlens) cuts its blocks into full/causal pieces for it instead")


class TorchFlashKernel:
    """PyTorch's fused flash-attention kernels (they return the log-sum-exp).

    CPU: ``_scaled_dot_product_flash_attention_for_cpu``; CUDA: ``_scaled_dot_product_flash_attention``.
    GQA: a full block folds the query heads of each K/V head into rows (:func:`gqa_fold`: no
    K/V copy); a causal or masked block expands K/V locally for the kernel (never before
    sending).
    """

    name = "torch_flash"

    @staticmethod
    def takes_mask(q) -> bool:
        """The CPU kernel takes an additive mask; the CUDA one does not."""
        return not gpu_path(q)

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, mask=None):
        hq = q.shape[1]
        cuda = gpu_path(q)
        if mask is not None and cuda:
            _refuse_mask_on_cuda()
        if gqa_fold(q, k, causal, mask):
            out, lse = TorchFlashKernel.forward(fold_heads(q, k.shape[1]), k, v, False, scale)
            return unfold_heads(out, hq), unfold_heads(lse, hq)
        q = last_dim_dense(q) if cuda else q.contiguous()
        k, v = expand_kv(k, hq), expand_kv(v, hq)
        k, v = (last_dim_dense(k), last_dim_dense(v)) if cuda else (k.contiguous(), v.contiguous())
        if cuda:
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else _additive(mask, q.dtype),
            scale=scale)
        if mask is not None:  # rows with no visible key: the kernel gives lse 0, out 0
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float, workspace=None, mask=None):
        """``workspace``: a dict the caller keeps over a ring's blocks (the CUDA kernel's unused
        RNG-state arguments are made once there, not per block). ``out``/``dout`` in ``q``'s
        dtype and ``lse`` contiguous are used as given (no copies); others are converted."""
        hq, hkv = q.shape[1], k.shape[1]
        if gqa_fold(q, k, causal, mask):
            f = lambda t: fold_heads(t if t.dtype == q.dtype else t.to(q.dtype), hkv)  # noqa: E731
            dq, dk, dv = TorchFlashKernel.backward(f(dout), f(q), k, v, f(out),
                                                   fold_heads(lse, hkv), False, scale,
                                                   workspace)
            return unfold_heads(dq, hq), dk, dv
        cuda = gpu_path(q)
        dense = last_dim_dense if cuda else (lambda t: t.contiguous())
        q = dense(q)
        ke, ve = dense(expand_kv(k, hq)), dense(expand_kv(v, hq))
        out = dense(out if out.dtype == q.dtype else out.to(q.dtype))
        dout = dense(dout if dout.dtype == q.dtype else dout.to(q.dtype))
        lse = lse if lse.is_contiguous() else lse.contiguous()
        if mask is not None and cuda:
            _refuse_mask_on_cuda()
        if cuda:
            n, m = q.shape[2], k.shape[2]
            ws = workspace if workspace is not None else {}
            if "rng" not in ws:
                ws["rng"] = (torch.empty(0, device=q.device, dtype=torch.int32),
                             torch.zeros((), device=q.device, dtype=torch.int64))
            empty, zero = ws["rng"]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse, empty, empty, n, m, 0.0, causal,
                zero, zero, scale=scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, ke, ve, out, lse, 0.0, causal,
                attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
        return dq, fold_kv(dk, hkv), fold_kv(dv, hkv)


_BY_NAME = {"cudnn": CudnnKernel, "flash_attn_3": FlashAttn3Kernel, "flash_attn": FlashAttnKernel,
            "torch_flash": TorchFlashKernel, "reference": ReferenceKernel}
assert tuple(_BY_NAME) == KERNELS


def select_kernel(device: torch.device, dtype: torch.dtype = torch.float32,
                  requested: Optional[str] = None, head_dim: Optional[int] = None):
    """The kernel class for ``dtype`` tensors on ``device`` (head dim ``head_dim`` when given):
    ``requested`` (or ``METP_ATTENTION_KERNEL``) if given and available, else the fastest
    available by rate (:mod:`.kernel_rates`; else the first available); the choice is recorded and logged once (:mod:`.kernel_choice`). Raises
    ``ValueError`` for an unknown or unavailable request, naming what is available."""
    return _BY_NAME[select_name(device, dtype, requested, head_dim)]
