"""Per-head norm of queries and keys (Megatron's ``--qk-layernorm``) inside the METP attention.

Megatron's ``SelfAttention`` normalises every query head and every key head over its ``d``
channels after the QKV projection and before RoPE (``q_layernorm``/``k_layernorm``: torch's
``RMSNorm`` or ``LayerNorm`` of width ``d``, weights ``[d]`` shared by all heads). METP computes
``Q_g``/``K_g`` of head group ``g`` as the group's weights pass, and recomputes them in backward,
so the norm runs there too:

Forward, per head (``q̃`` one query head's ``[d]`` projection, ``ε`` the norm epsilon)::

    RMSNorm:    q = q̃ · rsqrt(mean(q̃²) + ε) · w_q
    LayerNorm:  q = (q̃ − mean(q̃)) · rsqrt(var(q̃) + ε) · w_q + b_q

(the same for keys with ``w_k``/``b_k``), then RoPE. Backward: ``dq̃ = ∂norm/∂q̃ᵀ·dq`` from the
recomputed pre-norm ``q̃`` (kept for the one head-group block being differentiated), and
``dw_q = Σ_{tokens, heads} dq ⊙ q̂`` (``q̂`` the normalised ``q̃``), ``db_q = Σ dq``.

The norm weights are replicated on every METP rank (and TP rank). Each rank's gradient is the
partial sum over *its own tokens* (and, with TP, its own heads); nothing travels the METP ring
for them: Megatron reduces them where it reduces every replicated parameter under context
parallelism (its DDP over DP×CP, the METP group being the CP group), and
``finalize_model_grads`` sums ``q_layernorm``/``k_layernorm`` gradients over TP as it does for
stock TP.

The math is torch's own ``F.rms_norm``/``F.layer_norm`` (what Megatron's local norms call), and
backward is that function's autograd, so the forward is bit-identical to stock Megatron's and the
gradients differ only by summation order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

#: the ``--normalization`` kinds a per-head norm takes
KINDS = ("RMSNorm", "LayerNorm")


class HeadNorm:
    """The per-head q/k norm of one attention call: ``kind`` (``"RMSNorm"``/``"LayerNorm"``),
    ``eps`` and the replicated ``[d]`` weights (``q_bias``/``k_bias`` for ``LayerNorm`` only,
    may be ``None``)."""

    def __init__(self, kind: str, eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 q_bias: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None):
        self.kind, self.eps = kind, float(eps)
        self.q_weight, self.k_weight, self.q_bias, self.k_bias = q_weight, k_weight, q_bias, k_bias

    def tensors(self):
        """``(q_weight, q_bias, k_weight, k_bias)`` (biases may be ``None``)."""
        return self.q_weight, self.q_bias, self.k_weight, self.k_bias

    def _norm(self, t, w, b):
        d = t.shape[-1]
        if self.kind == "RMSNorm":
            return F.rms_norm(t, (d,), w, self.eps)
        return F.layer_norm(t, (d,), w, b, self.eps)

    def norm_one(self, which: str, pre: torch.Tensor) -> torch.Tensor:
        """The queries' (``which="q"``) or the keys' (``"k"``) norm of ``pre [..., d]`` (any
        strides), new."""
        if which == "q":
            return self._norm(pre, self.q_weight, self.q_bias)
        return self._norm(pre, self.k_weight, self.k_bias)

    def backward_one(self, which: str, pre, grad, acc: list) -> None:
        """Overwrite ``grad`` (the gradient of the normalised queries, ``which="q"``, or keys,
        ``"k"``; any strides) with the gradient of ``pre``, and add the weight (and bias)
        gradients into ``acc`` (``[dq_w, dq_b, dk_w, dk_b]``, entries ``None`` until the first
        block)."""
        j = 0 if which == "q" else 1
        w, b = (self.q_weight, self.q_bias) if j == 0 else (self.k_weight, self.k_bias)
        with torch.enable_grad():
            leaf = pre.detach().requires_grad_()
            wl = w.detach().requires_grad_()
            bl = None if b is None else b.detach().requires_grad_()
            out = self._norm(leaf, wl, bl)
            ins = (leaf, wl) if bl is None else (leaf, wl, bl)
            grads = torch.autograd.grad(out, ins, grad)
        grad.copy_(grads[0])
        for k, g in enumerate(grads[1:]):
            slot = 2 * j + k
            acc[slot] = g if acc[slot] is None else acc[slot].add_(g)


def check_head_norm(kind, eps, q_weight, k_weight, q_bias, k_bias, d: int, x) -> Optional[HeadNorm]:
    """Validate the q/k norm arguments of :func:`~megatron_metp.ops.metp_attention` (``ValueError``
    naming the argument); ``None`` when ``kind`` is ``None``."""
    tensors = (("q_norm_weight", q_weight), ("k_norm_weight", k_weight),
               ("q_norm_bias", q_bias), ("k_norm_bias", k_bias))
    if kind is None:
        given = [name for name, t in tensors if t is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without qk_norm; pass qk_norm="
                             f"'RMSNorm' or 'LayerNorm' (Megatron's --qk-layernorm)")
        return None
    if kind not in KINDS:
        raise ValueError(f"qk_norm must be one of {KINDS} or None, got {kind!r}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"qk_norm_eps must be a number > 0, got {eps!r}")
    if q_weight is None or k_weight is None:
        raise ValueError("qk_norm needs q_norm_weight and k_norm_weight ([head dim] each)")
    if kind == "RMSNorm" and (q_bias is not None or k_bias is not None):
        raise ValueError("qk_norm='RMSNorm' has no bias; drop q_norm_bias/k_norm_bias")
    if kind == "LayerNorm" and (q_bias is None) != (k_bias is None):
        raise ValueError("qk_norm='LayerNorm' takes both q_norm_bias and k_norm_bias or neither")
    for name, t in tensors:
        if t is None:
            continue
        if tuple(t.shape) != (d,):
            raise ValueError(f"{name} must be [head dim = {d}] (replicated), got {tuple(t.shape)}")
        if t.device != x.device or t.dtype != x.dtype:
            raise ValueError(f"{name} is {t.dtype} on {t.device} but x is {x.dtype} on "
                             f"{x.device}")
    return HeadNorm(kind, eps, q_weight, k_weight, q_bias, k_bias)


def head_norm_grads(norm: Optional[HeadNorm], acc: Sequence) -> tuple:
    """The four gradients the attention Function returns for the norm tensors (``None`` where
    there is no tensor)."""
    if norm is None:
        return (None, None, None, None)
    return tuple(None if t is None else (g if g is not None else torch.zeros_like(t))
                 for t, g in zip(norm.tensors(), (acc[0], acc[1], acc[2], acc[3])))
