"""Mixture-of-Experts GPT with METP: METP attention around Megatron's stock ``MoELayer``.

Layout on rank ``r`` of a METP group of ``p`` ranks (× ``c`` under METP × CP):

* attention (and the dense MLP of a layer without experts, ``--moe-layer-freq``) is METP's: weights
  sharded over the METP group, tokens ``[s/(p·c), b, h]`` in Megatron's dual-chunk CP order;
* a MoE layer is Megatron's own ``MoELayer`` (router, ``allgather`` or ``alltoall`` token
  dispatcher, ``SequentialMLP`` experts) with expert parallelism ``EP = p``: Megatron's
  expert-model-parallel group is the METP group (:mod:`.parallel` folds it), so this rank holds
  experts ``r·E/p … (r+1)·E/p − 1`` whole (``[h, f′]`` / ``[f′, h]``, no TP inside an expert).
  Tokens enter it sequence-sharded exactly as under Megatron's context parallelism, so routing,
  dispatch and the router's aux / sequence-aux / z losses are computed as stock computes them over
  the sequence ranks.

Gradients: an expert weight is marked ``allreduce = False`` by Megatron when
``config.expert_model_parallel_size > 1`` (:func:`moe_config_fields` sets it to ``p``;
:mod:`.moe_checks` refuses anything else), so DDP reduces it over the expert data-parallel
group (``c × DP``) — where METP-sharded weights reduce too — and scales it ``1/|DP×CP|`` like
every other gradient.
"""

from __future__ import annotations

import re
from typing import Optional

from .groups import METPGroups

__all__ = ["moe_config_fields", "fold_expert_parallel_into_config",
           "get_gpt_decoder_block_metp_spec", "global_expert_name", "is_expert_param"]


def moe_config_fields(*, num_experts: Optional[int], topk: int = 2,
                      ffn_hidden_size: Optional[int] = None, layer_freq=1,
                      metp_parallel_size: int = 1,
                      expert_model_parallel_size: Optional[int] = None) -> dict:
    """The ``TransformerConfig`` fields of a MoE model run with METP of size ``p``:
    ``num_moe_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``, ``moe_layer_freq`` and
    ``expert_model_parallel_size``: ``p``, or ``expert_model_parallel_size`` when given (a
    multiple of ``p``: EP wider than the METP group, :mod:`.wide_ep`); empty without experts."""
    if not num_experts:
        return {}
    out = {"num_moe_experts": num_experts, "moe_router_topk": topk, "moe_layer_freq": layer_freq,
           "expert_model_parallel_size": expert_model_parallel_size or metp_parallel_size}
    if ffn_hidden_size is not None:
        out["moe_ffn_hidden_size"] = ffn_hidden_size
    return out


def fold_expert_parallel_into_config(config, metp_parallel_size: int):
    """Give a MoE ``TransformerConfig`` built from Megatron-LM's ``args`` (which keep
    ``--expert-model-parallel-size`` 1: the hooks fold EP = p into ``parallel_state`` only) its
    ``expert_model_parallel_size = p`` (a multiple of p given with ``--expert-model-parallel-size``
    stays: EP wider than the METP group, :mod:`.wide_ep`), then refuse what :mod:`.moe_checks`
    lists (an EP not a multiple of p included). Returns ``config`` (changed in place); a config without experts is
    returned as it is."""
    from .moe_checks import check_moe_config

    if not getattr(config, "num_moe_experts", None):
        return config
    if (config.expert_model_parallel_size or 1) == 1:
        config.expert_model_parallel_size = metp_parallel_size
    check_moe_config(config, metp_parallel_size)
    return config


def get_gpt_decoder_block_metp_spec(config, groups: METPGroups, *, vp_stage=None, pp_rank=None,
                                    normalization: Optional[str] = None,
                                    norm: Optional[type] = None,
                                    moe_token_tiles: Optional[int] = None, **metp_spec_kwargs):
    """A ``TransformerBlockSubmodules`` for this pipeline stage of a MoE GPT with METP.

    Megatron's ``get_gpt_decoder_block_spec`` (local backend) decides which layers have experts
    (``config.moe_layer_freq``) and which layers this stage builds; each dense layer becomes
    :func:`~.spec.get_gpt_layer_metp_spec`'s, each MoE layer the same with Megatron's ``MoELayer``
    as its MLP. ``metp_spec_kwargs`` go to ``get_gpt_layer_metp_spec`` (``kernel``,
    ``keep_intermediate``, ``mlp_token_tile`` for the dense layers' METP MLP; ``weight_ring`` must
    stay on; ``qk_layernorm`` defaults to the config's). ``moe_token_tiles``: token tiles of
    every MoE layer (:class:`~.moe_tiles.TiledMoELayer`; ``None``: the override
    ``METP_MOE_TOKEN_TILES``, else auto from the tile budget). Refuses (``ValueError``) what
    :mod:`.moe_checks` lists."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .moe_checks import check_moe_config
    from .moe_tiles import tiled_moe_spec
    from .spec import get_gpt_layer_metp_spec

    check_moe_config(config, groups.metp.size)
    if not metp_spec_kwargs.get("weight_ring", True):
        raise ValueError("--num-experts with the ring self-attention baseline "
                         "(--metp-disable-weight-ring) is not supported; run MoE with the METP "
                         "weight ring")
    qk = bool(metp_spec_kwargs.pop("qk_layernorm", getattr(config, "qk_layernorm", False)))
    stock = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=normalization, vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    dense = get_gpt_layer_metp_spec(groups, normalization=normalization, norm=norm,
                                    qk_layernorm=qk, **metp_spec_kwargs)
    moe_mlp = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                       moe_grouped_gemm=config.moe_grouped_gemm,
                                       normalization=normalization,
                                       qk_layernorm=qk).submodules.mlp
    moe = get_gpt_layer_metp_spec(groups, normalization=normalization, norm=norm,
                                  qk_layernorm=qk, **metp_spec_kwargs)
    # a fresh METP layer spec (it holds process groups); the MoELayer with token tiles
    # (:mod:`.moe_tiles`: one tile, stock's forward, when the rank's tokens fit the budget)
    if getattr(config, "moe_shared_expert_intermediate_size", None):
        # the shared expert: METP's MLP of its width (:mod:`.shared_expert`)
        from .compat import mlp_submodules
        from .shared_expert import shared_expert_spec

        sub = mlp_submodules(moe_mlp)  # the MoESubmodules (a ModuleSpec's or a partial's)
        sub.shared_experts = shared_expert_spec(
            sub.shared_experts, groups,
            keep_intermediate=bool(metp_spec_kwargs.get("keep_intermediate", False)),
            token_tile=metp_spec_kwargs.get("mlp_token_tile"))
    moe.submodules.mlp = tiled_moe_spec(moe_mlp, moe_token_tiles=moe_token_tiles)

    def has_experts(layer_spec) -> bool:
        mlp = layer_spec.submodules.mlp  # a ModuleSpec (0.16) or a functools.partial (0.19)
        module = getattr(mlp, "module", None) or getattr(mlp, "func", None)
        module = getattr(module, "__self__", module)  # MLP.as_mlp_submodule (0.19's dense)
        return isinstance(module, type) and issubclass(module, MoELayer)

    stock.layer_specs = [moe if has_experts(s) else dense for s in stock.layer_specs]
    if norm is not None:
        stock.layer_norm = norm
    return stock


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.)(\d+)\.")


def global_expert_name(model, name: str) -> str:
    """``…mlp.experts.local_experts.<local>.…`` → ``<global>`` expert index (this rank holds
    ``local_expert_indices`` of the layer's ``MoELayer``); other names unchanged. ``name`` is a
    parameter name of ``model`` with its local layer index."""
    m = _LOCAL_EXPERT.match(name)
    if m is None:
        return name
    layer = model.decoder.layers[int(m.group(2))]
    glob = layer.mlp.local_expert_indices[int(m.group(3))]
    return f"{m.group(1)}{glob}." + name[m.end():]


def is_expert_param(param) -> bool:
    """A parameter Megatron reduces over the expert data-parallel group (``allreduce=False``):
    expert weights and METP-sharded weights alike."""
    return not getattr(param, "allreduce", True)
