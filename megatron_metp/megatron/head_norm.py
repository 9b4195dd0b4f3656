"""Megatron's ``--qk-layernorm`` in the METP attention: the ``q_layernorm``/``k_layernorm``
modules Megatron's ``SelfAttention`` builds (from the spec, :func:`~.spec.get_gpt_layer_metp_spec`
with ``qk_layernorm=True``) handed to :func:`megatron_metp.ops.metp_attention` as its per-head
norm (:mod:`megatron_metp.ops.head_norm`), which applies them inside the head-group loop.

The norm weights stay ordinary (replicated) parameters under their Megatron names
(``self_attention.q_layernorm.weight`` …): Megatron's DDP reduces their gradients over DP×CP
(the METP group is the CP group) and ``finalize_model_grads`` sums them over TP, exactly as for
stock TP, so checkpoints and optimizer states map one to one.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.identity_op import IdentityOp


def norm_kind(module, config) -> str:
    if isinstance(module, torch.nn.RMSNorm):
        return "RMSNorm"
    if isinstance(module, torch.nn.LayerNorm):
        return "LayerNorm"
    name = type(module).__name__
    if name == "FusedLayerNorm" and config.normalization == "LayerNorm" and \
            not getattr(config, "layernorm_zero_centered_gamma", False):  # apex's, same math
        return "LayerNorm"
    raise ValueError(f"--qk-layernorm with METP takes torch's RMSNorm/LayerNorm (Megatron's local "
                     f"norms) as q_layernorm/k_layernorm, got {name}; build the layer with "
                     f"get_gpt_layer_metp_spec(..., qk_layernorm=True)")


def head_norm_kwargs(attn) -> dict:
    """The ``qk_norm`` keyword arguments of :func:`~megatron_metp.ops.metp_attention` for a
    ``SelfAttention``'s ``q_layernorm``/``k_layernorm`` (``{}`` without ``--qk-layernorm``).

    Raises ``ValueError`` when ``config.qk_layernorm`` and the modules disagree (a layer spec
    without the norms would otherwise skip them silently)."""
    config = attn.config
    qn, kn = attn.q_layernorm, attn.k_layernorm
    present = [m is not None and not isinstance(m, IdentityOp) for m in (qn, kn)]
    if not getattr(config, "qk_layernorm", False):
        if any(present):
            raise ValueError("q_layernorm/k_layernorm built without config.qk_layernorm; pass "
                             "--qk-layernorm or a spec without them")
        return {}
    if getattr(config, "qk_l2_norm", False):
        raise ValueError("--qk-l2-norm is not supported with --metp-parallel-size (use "
                         "--qk-layernorm)")
    if not all(present):
        raise ValueError("--qk-layernorm: the layer spec has no q_layernorm/k_layernorm; build it "
                         "with get_gpt_layer_metp_spec(..., qk_layernorm=True)")
    kind = norm_kind(qn, config)
    if norm_kind(kn, config) != kind:
        raise ValueError("q_layernorm and k_layernorm must be the same kind of norm")
    eps = getattr(qn, "eps", None)
    if isinstance(eps, (tuple, list)):
        eps = eps[0]
    if eps is None:
        eps = config.layernorm_epsilon
    return {"qk_norm": kind, "qk_norm_eps": float(eps),
            "q_norm_weight": qn.weight, "k_norm_weight": kn.weight,
            "q_norm_bias": getattr(qn, "bias", None) if kind == "LayerNorm" else None,
            "k_norm_bias": getattr(kn, "bias", None) if kind == "LayerNorm" else None}
