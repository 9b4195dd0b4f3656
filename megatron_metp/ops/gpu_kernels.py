"""GPU block kernels that return the log-sum-exp: cuDNN (torch's SDPA backend), FlashAttention-3,
FlashAttention-2, behind :mod:`.attention_kernels`' interface.

Every adapter takes heads-first ``q [b, hq, n, d]``, ``k, v [b, hkv, m, d]`` and gives
``forward → (out [b, hq, n, d], lse [b, hq, n] fp32, natural log)`` — the convention of the
ring's merge (:mod:`.lse`: ``lse = log Σ_keys exp(q·kᵀ·scale)``) — and
``backward(dout, q, k, v, out, lse, ...) → (dq, dk [b, hkv, m, d], dv)`` from the *merged*
``out`` and ``lse`` of the rows (so ``P = exp(q·kᵀ·scale − lse)`` is the block's true share).
Masks: ``causal`` (square block, query ``i`` sees keys ``≤ i``) or none; none of these kernels
takes a boolean mask (``takes_mask`` is false): packed sequences run as full/causal pieces per
document (:mod:`.documents`).

What each library returns, and what the adapter does with it:

==================  ==========================  ======================  =========================
kernel              layout in / out             log-sum-exp             GQA
==================  ==========================  ======================  =========================
``cudnn``           ``[b, h, n, d]``            ``[b, h, n, 1]`` fp32,  full block: query heads
(``aten._scaled_    (heads first, as ours)      natural log (torch's    folded into rows (no K/V
dot_product_cudnn_                              own context-parallel    copy); causal piece: K/V
attention``)                                    ring merges it as the   expanded locally
                                                flash kernel's)
``flash_attn_3``    ``[b, n, h, d]``            ``[b, h, n]`` fp32,     native (``hkv`` heads in,
(``flash_attn_      (tokens first)              natural log             ``dK/dV`` per K/V head)
interface``)
``flash_attn``      ``[b, n, h, d]``            ``[b, h, n]`` fp32,     native
(flash-attn ≥ 2.7)                              natural log
==================  ==========================  ======================  =========================

The library entry points are looked up at call time through :func:`cudnn_ops`,
:func:`fa3_ops` and :func:`fa2_ops`: the CPU tests replace them with emulations that have the
libraries' signatures and output layouts (``tests/test_kernel_choice.py``), so each adapter's
layout and log-sum-exp handling is checked against the fp32 reference without a GPU. The
numerics of the real kernels are measured by ``benchmarks/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import torch

from .kernel_layout import expand_kv, fold_heads, fold_kv, gqa_fold, unfold_heads


def cudnn_ops():
    """``(forward, backward)``: torch's cuDNN attention ops (schema of torch ≥ 2.5)."""
    return (torch.ops.aten._scaled_dot_product_cudnn_attention,
            torch.ops.aten._scaled_dot_product_cudnn_attention_backward)


def fa3_ops():  # pragma: no cover - needs the FlashAttention-3 (hopper) package
    """``(forward, backward)`` of FlashAttention-3 (``flash_attn_interface``)."""
    from flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    return _flash_attn_forward, _flash_attn_backward


def fa2_ops():  # pragma: no cover - needs the flash-attn package
    """``(forward, backward)`` of FlashAttention-2 (``flash_attn``, ≥ 2.7 interface)."""
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    return _flash_attn_forward, _flash_attn_backward


def _lse_rows(lse: torch.Tensor, b: int, h: int, n: int, kernel: str) -> torch.Tensor:
    """A library's log-sum-exp as ``[b, h, n]`` fp32: ``[b, h, n]`` as is, ``[b, h, n, 1]``
    (cuDNN's) without its last dim; any other layout is refused, naming the kernel."""
    if tuple(lse.shape) == (b, h, n, 1):
        lse = lse.squeeze(-1)
    if tuple(lse.shape) != (b, h, n):
        raise RuntimeError(f"attention kernel {kernel!r} returned a log-sum-exp of shape "
                           f"{tuple(lse.shape)}, expected {(b, h, n)} or {(b, h, n, 1)}: this "
                           f"library version is not supported (METP_ATTENTION_KERNEL picks "
                           f"another)")
    return lse if lse.dtype == torch.float32 else lse.float()


def _refuse_mask(name: str, mask) -> None:
    if mask is not None:
        raise ValueError(f"{name} takes no attention mask; the packed-sequence plan cuts its "
                         f"blocks into full/causal pieces for it instead")


def _like_q(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == q.dtype else t.to(q.dtype)


class CudnnKernel:
    """cuDNN fused attention through torch's SDPA cuDNN ops (the kernel Transformer Engine's
    fused attention and torch's SDPA call on Hopper). ``lse`` comes as ``[b, h, n, 1]``."""

    name = "cudnn"

    @staticmethod
    def takes_mask(q) -> bool:
        return False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, mask=None):
        _refuse_mask("cudnn", mask)
        hq, hkv = q.shape[1], k.shape[1]
        if gqa_fold(q, k, causal, mask):
            out, lse = CudnnKernel.forward(fold_heads(q, hkv), k, v, False, scale)
            return unfold_heads(out, hq), unfold_heads(lse, hq)
        q = q.contiguous()
        k, v = expand_kv(k, hq).contiguous(), expand_kv(v, hq).contiguous()
        fwd, _ = cudnn_ops()
        res = fwd(q, k, v, None, True, 0.0, bool(causal), False, scale=scale)
        b, _, n, _ = q.shape
        return res[0], _lse_rows(res[1], b, hq, n, "cudnn")

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float, workspace=None, mask=None):
        """``workspace``: a dict kept over a ring's blocks (the unused dropout seed/offset
        tensors are made once there)."""
        _refuse_mask("cudnn", mask)
        hq, hkv = q.shape[1], k.shape[1]
        if gqa_fold(q, k, causal, mask):
            f = lambda t: fold_heads(_like_q(t, q), hkv)  # noqa: E731
            dq, dk, dv = CudnnKernel.backward(f(dout), f(q), k, v, f(out), fold_heads(lse, hkv),
                                              False, scale, workspace)
            return unfold_heads(dq, hq), dk, dv
        q = q.contiguous()
        ke, ve = expand_kv(k, hq).contiguous(), expand_kv(v, hq).contiguous()
        out, dout = _like_q(out, q).contiguous(), _like_q(dout, q).contiguous()
        lse4 = lse.float().contiguous().unsqueeze(-1)  # the forward's [b, h, n, 1]
        ws = workspace if workspace is not None else {}
        if "philox" not in ws:
            ws["philox"] = torch.zeros((), dtype=torch.int64, device=q.device)
        _, bwd = cudnn_ops()
        seed = ws["philox"]
        dq, dk, dv = bwd(dout, q, ke, ve, out, lse4, seed, seed, None, None, None,
                         q.shape[2], k.shape[2], 0.0, bool(causal), scale=scale)
        return dq, fold_kv(dk, hkv), fold_kv(dv, hkv)


def _tokens_first(*ts):
    """``[b, h, n, d]`` → ``[b, n, h, d]`` (contiguous), the flash-attn layout."""
    return tuple(t.transpose(1, 2).contiguous() for t in ts)


def _flash_forward(name: str, call, q, k, v, mask):
    """A flash-attn style forward: ``call(qt, kt, vt)`` on tokens-first tensors returns
    ``(out [b, n, h, d], lse [b, h, n], ...)``; back to heads first."""
    _refuse_mask(name, mask)
    res = call(*_tokens_first(q, k, v))
    b, hq, n, _ = q.shape
    return res[0].transpose(1, 2), _lse_rows(res[1], b, hq, n, name)


def _flash_backward(name: str, call, dout, q, k, v, out, lse, mask):
    """A flash-attn style backward: ``call(dout, q, k, v, out, lse, dq, dk, dv)`` on
    tokens-first tensors fills ``dq, dk, dv`` (``dk, dv`` with the ``hkv`` K/V heads)."""
    _refuse_mask(name, mask)
    qt, kt, vt = _tokens_first(q, k, v)
    dot, ot = _tokens_first(_like_q(dout, q), _like_q(out, q))
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    call(dot, qt, kt, vt, ot, lse.float().contiguous(), dq, dk, dv)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlashAttn3Kernel:
    """FlashAttention-3 (Hopper, ``flash_attn_interface``): native GQA, ``[b, n, h, d]``."""

    name = "flash_attn_3"

    @staticmethod
    def takes_mask(q) -> bool:
        return False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, mask=None):
        fwd = fa3_ops()[0]
        return _flash_forward("flash_attn_3", lambda qt, kt, vt: fwd(
            qt, kt, vt, softmax_scale=scale, causal=bool(causal)), q, k, v, mask)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float, workspace=None, mask=None):
        bwd = fa3_ops()[1]
        return _flash_backward("flash_attn_3", lambda do, qt, kt, vt, ot, ls, dq, dk, dv: bwd(
            do, qt, kt, vt, ot, ls, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            is_causal=bool(causal)), dout, q, k, v, out, lse, mask)


class FlashAttnKernel:
    """Dao-AILab flash-attn 2 (≥ 2.7 interface): native GQA, ``[b, n, h, d]``."""

    name = "flash_attn"

    @staticmethod
    def takes_mask(q) -> bool:
        """No mask argument: packed sequences run as full/causal pieces per document."""
        return False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, mask=None):
        fwd = fa2_ops()[0]
        return _flash_forward("flash_attn", lambda qt, kt, vt: fwd(
            qt, kt, vt, 0.0, scale, causal=bool(causal), window_size_left=-1,
            window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False),
            q, k, v, mask)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float, workspace=None, mask=None):
        bwd = fa2_ops()[1]
        return _flash_backward("flash_attn", lambda do, qt, kt, vt, ot, ls, dq, dk, dv: bwd(
            do, qt, kt, vt, ot, ls, dq, dk, dv, 0.0, scale, bool(causal), -1, -1, 0.0, None,
            False), dout, q, k, v, out, lse, mask)
