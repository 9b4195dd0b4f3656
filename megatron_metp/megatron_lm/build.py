"""The METP ``GPTModel`` Megatron-LM's ``pretrain_gpt.py`` builds.

The patched ``pretrain_gpt.py`` builds its model through
``partial(model_provider, wrap_gpt_builder(gpt_builder))`` (core_v0.19.0: through
:func:`.releases.route_model_provider`): with ``--metp-parallel-size`` > 1 the builder makes the
METP layer spec's ``GPTModel`` (:func:`build_metp_gpt_model`), otherwise it calls ``gpt_builder``
unchanged; ``--metp-offload-activations`` attaches the offloader either way.
"""

from __future__ import annotations

import functools
from typing import Callable

from .flags import CP_OUTER, metp_enabled
from .last_seen import remember_groups
from .parallel_state import check_metp_parallel_state, check_placement_once
from .timeouts import megatron_lm_timeout_s

__all__ = ["wrap_gpt_builder", "build_metp_gpt_model"]


def wrap_gpt_builder(gpt_builder: Callable) -> Callable:
    """A builder with ``gpt_builder``'s signature that builds a METP ``GPTModel`` when
    ``args.metp_parallel_size > 1`` and otherwise calls ``gpt_builder`` unchanged."""

    @functools.wraps(gpt_builder)
    def builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        if not metp_enabled(args):
            model = gpt_builder(args, pre_process, post_process, vp_stage, config=config,
                                pg_collection=pg_collection)
        else:
            model = build_metp_gpt_model(args, pre_process, post_process, vp_stage,
                                         config=config, pg_collection=pg_collection)
            from ..megatron.streaming import prepare_recompute

            prepare_recompute(model.decoder)
        n_off = getattr(args, "metp_offload_activations", False)
        if n_off:
            from ..runtime.offload import ActivationOffloader

            ActivationOffloader(layers=None if n_off is True else n_off).attach(model.decoder)
        return model

    builder.metp_wrapped_builder = gpt_builder
    return builder


def _config_from_args(args):
    if getattr(args, "yaml_cfg", None) is not None:
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        return core_transformer_config_from_yaml(args, "language_model")
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def build_metp_gpt_model(args, pre_process, post_process, vp_stage=None, config=None,
                         pg_collection=None):
    """megatron-core ``GPTModel`` with the METP layer spec, built like ``gpt_builders.py``
    builds the stock one (same model arguments taken from ``args``)."""
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel

    from ..megatron.gpu_stack import select_norm
    from ..megatron.groups import METPGroups
    from ..megatron.init import initialize_like_tp
    from ..megatron.spec import get_gpt_layer_metp_spec
    from ..megatron.vocab import METPGPTModel

    if config is None:
        config = _config_from_args(args)
    check_metp_parallel_state(args)
    groups = METPGroups.from_parallel_state(timeout_s=megatron_lm_timeout_s(args),
                                            context_parallel_size=getattr(args, CP_OUTER, 1))
    check_placement_once(groups)
    remember_groups(groups)  # the pre-save agreement check of Megatron-LM's --save
    vocab_parallel = bool(getattr(args, "metp_vocab_parallel", False))
    if vocab_parallel and args.padded_vocab_size % groups.shards:
        raise ValueError(f"--metp-vocab-parallel: the padded vocabulary ({args.padded_vocab_size}) "
                         f"is not divisible by TP x METP = {groups.shards}; validate_args did not "
                         f"fold METP into --make-vocab-size-divisible-by (apply all of patches/)")
    weight_ring = not getattr(args, "metp_disable_weight_ring", False)
    kernel = getattr(args, "metp_attention_kernel", "auto")
    layer_kwargs = dict(
        weight_ring=weight_ring, normalization=args.normalization,
        kernel=None if kernel in (None, "auto") else kernel,
        keep_intermediate=bool(getattr(args, "metp_keep_intermediate", False)),
        norm=select_norm(getattr(args, "transformer_impl", "local"), args.normalization).module)
    if config.num_moe_experts:  # Megatron's MoELayer, experts over the METP ring (EP = p)
        from ..megatron.moe import (fold_expert_parallel_into_config,
                                    get_gpt_decoder_block_metp_spec)

        # validate_metp_args gave args (so this config) EP = p; a --yaml-cfg config gets it here
        fold_expert_parallel_into_config(config, groups.metp.size)
        spec = get_gpt_decoder_block_metp_spec(config, groups, vp_stage=vp_stage, **layer_kwargs)
    else:
        spec = get_gpt_layer_metp_spec(groups, qk_layernorm=bool(getattr(args, "qk_layernorm",
                                                                          False)),
                                       **layer_kwargs)
    if not dist.is_initialized() or dist.get_rank() == 0:
        mode = "METP (weight ring + K/V ring)" if weight_ring else "ring self-attention"
        cp_note = (f", context-parallel (outer) {groups.metp.sequence_ring.size // groups.metp.size}"
                   f" (K/V ring over {groups.metp.sequence_ring.size} ranks)"
                   if groups.metp.context is not None else "")
        print(f"building GPT model with {mode}: METP size {groups.metp.size}{cp_note}, TP size "
              f"{groups.tp_size}, attention kernel {kernel}, vocabulary "
              f"{'sharded over TP x METP' if vocab_parallel else 'sharded over TP only'}",
              flush=True)
    cls, extra = (METPGPTModel, {"metp_groups": groups}) if vocab_parallel else (GPTModel, {})
    model = cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        **extra,
    )
    from ..megatron.rope import use_angles_of_args

    use_angles_of_args(model, args)  # exact RoPE angles, this rank's tokens only
    if weight_ring:  # the same global weights as stock TP of size TP x METP
        initialize_like_tp(model, groups)
    if getattr(args, "reset_attention_mask", False):  # packed documents: boundaries from EOD
        from ..megatron.packing import DocumentBoundaries

        DocumentBoundaries(groups.metp.sequence_ring, full_rope=weight_ring,
                           layout=getattr(args, "metp_packed_layout", "dual_chunk")).attach(model)
    return model
