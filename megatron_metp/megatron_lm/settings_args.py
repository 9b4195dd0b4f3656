"""Megatron-LM's ``args`` as :class:`megatron_metp.megatron.settings.METPSettings`: the one
place the METP flags are turned into the settings the builder, the checks and the ops use.

Works on ``args`` before and after ``validate_metp_args`` maps METP onto Megatron's
context-parallel size (after it, ``args.context_parallel_size`` is ``p·c`` and the outer factor
``c`` is kept in ``args.metp_context_parallel_outer``).
"""

from __future__ import annotations

from ..megatron.settings import METPSettings
from .flags import CP_OUTER, MAPPED


def _flag(args, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def metp_settings(args) -> METPSettings:
    """The :class:`METPSettings` of Megatron-LM ``args`` (mode ``tp`` without
    ``--metp-parallel-size`` > 1); not checked here (:meth:`METPSettings.problems`)."""
    from ..ops.rope_recipe import rope_recipe

    p = _flag(args, "metp_parallel_size", 1)
    c = getattr(args, CP_OUTER, 1) if getattr(args, MAPPED, False) else \
        _flag(args, "context_parallel_size", 1)
    if p == 1:
        mode = "tp"
    else:
        mode = "ring" if getattr(args, "metp_disable_weight_ring", False) else "metp"
    kernel = _flag(args, "metp_attention_kernel", "auto")
    offload = _flag(args, "metp_offload_activations", False)
    return METPSettings(
        mode=mode, metp=p if mode != "tp" else 1, context=c if mode != "tp" else 1,
        tp=_flag(args, "tensor_model_parallel_size", 1),
        pp=_flag(args, "pipeline_model_parallel_size", 1),
        kernel=None if kernel == "auto" else kernel,
        vocab_parallel=bool(getattr(args, "metp_vocab_parallel", False)),
        keep_intermediate=bool(getattr(args, "metp_keep_intermediate", False)),
        mlp_token_tile=getattr(args, "metp_mlp_token_tile", None),
        moe_token_tiles=getattr(args, "metp_moe_token_tiles", None),
        offload_activations=offload,
        keep_attention_output=getattr(args, "metp_keep_attention_output", None),
        rope_recipe=rope_recipe(bool(getattr(args, "metp_rope_fp32_recipe", False))),
        transformer_impl=_flag(args, "transformer_impl", "local"),
        packed=bool(getattr(args, "reset_attention_mask", False)),
        packed_layout=_flag(args, "metp_packed_layout", "dual_chunk"))
