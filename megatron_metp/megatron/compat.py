"""What differs between the supported megatron-core lines (0.16.x for Megatron-LM core_v0.16.1,
0.19.x for core_v0.19.0) where the METP layers and the CPU shims meet them; the one place that
knows. Each helper detects the installed wheel's API (not its version number) and returns what the
caller needs, so no other module branches on the release.

Megatron-LM (``megatron.training``) differences are in ``megatron_metp/megatron_lm/releases.py``.
"""

from __future__ import annotations

import functools

__all__ = ["write_results_queue_name", "mlp_submodules", "layer_mlp", "get_batch_on_this_cp_rank",
           "checkpoint_whole_files"]


def write_results_queue_name(filesystem_async) -> str:
    """The attribute of ``megatron.core.dist_checkpointing.strategies.filesystem_async`` that
    creates the (multiprocessing) write-results queue: ``_get_write_results_queue()`` in 0.16,
    ``get_write_results_queue(mp_mode='spawn')`` in 0.19."""
    for name in ("get_write_results_queue", "_get_write_results_queue"):
        if hasattr(filesystem_async, name):
            return name
    raise AttributeError("megatron-core's filesystem_async has no write-results queue factory "
                         "(neither get_write_results_queue nor _get_write_results_queue)")


def mlp_submodules(layer_mlp):
    """The ``MLPSubmodules`` of a ``TransformerLayerSubmodules.mlp`` entry: a ``ModuleSpec``
    in 0.16, ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` in 0.19."""
    if isinstance(layer_mlp, functools.partial):
        return layer_mlp.keywords["submodules"]
    return layer_mlp.submodules


def layer_mlp(layer_mlp, module: type, params: dict):
    """A ``TransformerLayerSubmodules.mlp`` entry that builds ``module(config=..., submodules=...,
    **params)`` with ``layer_mlp``'s submodules, in the form the installed ``TransformerLayer``
    calls: a ``ModuleSpec`` (0.16: ``build_module(spec, config=...)``) or a callable taking
    ``(config=, pg_collection=, is_mtp_layer=, name=)`` (0.19; ``TransformerLayer`` re-wraps only
    ``MLP``/``TEFusedMLP`` specs, not subclasses)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(layer_mlp, functools.partial):
        return functools.partial(_build_layer_mlp, module=module,
                                 submodules=layer_mlp.keywords["submodules"], params=dict(params))
    return ModuleSpec(module=module, params={**(layer_mlp.params or {}), **params},
                      submodules=layer_mlp.submodules)


def _build_layer_mlp(*, module, submodules, params, config, pg_collection=None,
                     is_mtp_layer=False, name=None, **_unused):
    del pg_collection, is_mtp_layer  # METP's MLP takes its groups from params
    return module(config=config, submodules=submodules, name=name, **params)


def get_batch_on_this_cp_rank(batch, cp_group):
    """megatron-core's ``get_batch_on_this_cp_rank(batch, cp_group=)``, the dual-chunk split of
    every ``[b, s]`` tensor of ``batch`` over ``cp_group``: 0.19 adds a required ``is_hybrid_cp``
    (False here: METP runs on the plain context-parallel group)."""
    import inspect

    from megatron.core import utils

    fn = utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(fn).parameters:
        return fn(batch, is_hybrid_cp=False, cp_group=cp_group)
    return fn(batch, cp_group=cp_group)


def checkpoint_whole_files() -> tuple:
    """The files ``dist_checkpointing.save`` (torch_dist) writes beside the ``.distcp`` shards:
    ``.metadata``, ``metadata.json`` and, in 0.16, ``common.pt`` (the common state); 0.19 stores
    the common state as a ``ShardedObject`` inside rank 0's shard instead (it still reads a
    legacy ``common.pt``)."""
    from megatron.core.dist_checkpointing import serialization

    if hasattr(serialization, "_legacy_common_state_exists"):  # 0.19: common state in a shard
        return (".metadata", "metadata.json")
    return (".metadata", "metadata.json", "common.pt")
