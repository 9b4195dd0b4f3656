"""The METP ``GPTModel`` Megatron-LM's ``pretrain_gpt.py`` builds.

The patched ``pretrain_gpt.py`` builds its model through
``partial(model_provider, wrap_gpt_builder(gpt_builder))`` (core_v0.19.0: through
:func:`.releases.route_model_provider`): with ``--metp-parallel-size`` > 1 the builder makes the
METP layer spec's ``GPTModel`` (:func:`build_metp_gpt_model`), otherwise it calls ``gpt_builder``
unchanged; ``--metp-offload-activations`` attaches the offloader either way.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from .flags import CP_OUTER, metp_enabled
from .last_seen import remember_groups
from .parallel_state import check_metp_parallel_state, check_placement_once
from .settings_args import metp_settings
from .timeouts import megatron_lm_timeout_s

__all__ = ["wrap_gpt_builder", "build_metp_gpt_model", "wire_ddp", "wire_wide_expert_parallel"]


def wrap_gpt_builder(gpt_builder: Callable, spec_transform: Optional[Callable] = None) -> Callable:
    """A builder with ``gpt_builder``'s signature that builds a METP ``GPTModel`` when
    ``args.metp_parallel_size > 1`` (:func:`build_metp_gpt_model`; ``spec_transform`` goes to
    the builder) and otherwise calls ``gpt_builder`` unchanged (with the offloader of
    ``--metp-offload-activations`` attached)."""

    @functools.wraps(gpt_builder)
    def builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        if metp_enabled(args):
            return build_metp_gpt_model(args, pre_process, post_process, vp_stage, config=config,
                                        pg_collection=pg_collection,
                                        spec_transform=spec_transform)
        model = gpt_builder(args, pre_process, post_process, vp_stage, config=config,
                            pg_collection=pg_collection)
        from ..megatron.build import attach_offloader

        attach_offloader(model, metp_settings(args))  # the stock baseline of the same job
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
                         pg_collection=None, spec_transform: Optional[Callable] = None):
    """megatron-core ``GPTModel`` with the METP layer spec, built by
    :func:`megatron_metp.megatron.build.build_metp_gpt` from :func:`.settings_args.metp_settings`
    with the model arguments ``gpt_builders.py`` takes from ``args`` for the stock one."""
    import torch.distributed as dist

    from ..megatron.build import build_metp_gpt
    from ..megatron.groups import METPGroups

    if config is None:
        config = _config_from_args(args)
    check_metp_parallel_state(args)
    groups = METPGroups.from_parallel_state(timeout_s=megatron_lm_timeout_s(args),
                                            context_parallel_size=getattr(args, CP_OUTER, 1))
    check_placement_once(groups)
    remember_groups(groups)  # the pre-save agreement check of Megatron-LM's --save
    settings = metp_settings(args)
    if settings.vocab_parallel and args.padded_vocab_size % groups.shards:
        raise ValueError(f"--metp-vocab-parallel: the padded vocabulary ({args.padded_vocab_size}) "
                         f"is not divisible by TP x METP = {groups.shards}; validate_args did not "
                         f"fold METP into --make-vocab-size-divisible-by (apply all of patches/)")
    if config.num_moe_experts:
        from ..megatron.moe import fold_expert_parallel_into_config

        # validate_metp_args gave args (so this config) EP = p; a --yaml-cfg config gets it here
        fold_expert_parallel_into_config(config, groups.metp.size)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return build_metp_gpt(
        config, groups, settings, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, seq_length=args.seq_length,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, normalization=args.normalization,
        spec_transform=spec_transform, vp_stage=vp_stage,
        log=(lambda line: print(line, flush=True)) if rank0 else None,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling, pg_collection=pg_collection)


def wire_ddp(model) -> None:
    """Called by the patched ``setup_model_and_optimizer`` right after Megatron-LM wraps the
    model chunks (``model``: their list) in DDP, before the optimizer is built: with METP,
    :func:`wire_wide_expert_parallel`, and each chunk's overlapped parameter all-gather
    (``--overlap-param-gather``) made to wait for the weights METP modules read from their
    submodules (:func:`megatron_metp.megatron.param_gather.cover_submodule_weights`). Nothing
    otherwise (METP off, or chunks not wrapped: ``--skip-train``)."""
    import torch.distributed as dist
    from megatron.training import get_args

    from ..megatron.param_gather import cover_submodule_weights

    wire_wide_expert_parallel(model)
    if not metp_enabled(get_args()):
        return
    covered = sum(cover_submodule_weights(chunk)
                  for chunk in (model if isinstance(model, list) else [model]))
    if covered and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"> METP: --overlap-param-gather: {covered} METP modules wait for their "
              "submodules' weights", flush=True)


def wire_wide_expert_parallel(model) -> int:
    """Called by :func:`wire_ddp`: with ``--expert-model-parallel-size`` wider than
    ``--metp-parallel-size``, each chunk's DDP sums its METP-sharded gradients over their
    replicas before it reduces the expert buffers over expert-DP, and marks them for the grad
    norm
    (:func:`megatron_metp.megatron.wide_ep.sum_metp_shards_over_replicas`). Nothing otherwise
    (METP off, a dense model, EP = p, or chunks not wrapped: ``--skip-train``). Returns how many
    parameters it covers."""
    from megatron.training import get_args

    from ..megatron.groups import METPGroups
    from ..megatron.wide_ep import sum_metp_shards_over_replicas

    args = get_args()
    p = getattr(args, "metp_parallel_size", 1) or 1
    if not metp_enabled(args) or not getattr(args, "num_experts", None) or \
            (getattr(args, "expert_model_parallel_size", 1) or 1) <= p:
        return 0
    groups = METPGroups.from_parallel_state(timeout_s=megatron_lm_timeout_s(args),
                                            context_parallel_size=getattr(args, CP_OUTER, 1))
    return sum(sum_metp_shards_over_replicas(chunk, groups.ep_replicas)
               for chunk in (model if isinstance(model, list) else [model])
               if hasattr(chunk, "expert_parallel_bucket_groups"))

