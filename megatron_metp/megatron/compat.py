"""What differs between the supported megatron-core lines (0.16.x for Megatron-LM core_v0.16.1,
0.19.x for core_v0.19.0) where the METP layers and the CPU shims meet them; the one place that
knows. Each helper detects the installed wheel's API (not its version number) and returns what the
caller needs, so no other module branches on the release.

Megatron-LM (``megatron.training``) differences are in ``megatron_metp/megatron_lm/releases.py``.
"""

from __future__ import annotations

import functools
from typing import Callable

__all__ = ["write_results_queue_name", "mlp_submodules", "layer_mlp", "get_batch_on_this_cp_rank",
           "checkpoint_whole_files", "common_load_strategy_base", "dist_checkpointing_load"]


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


def common_load_strategy_base() -> type:
    """The base class of a ``dist_checkpointing`` common-state load strategy: 0.16's
    ``TorchCommonLoadStrategy`` (reads ``common.pt``); 0.19 has none (``load()`` takes no common
    strategy), so ``object``."""
    from megatron.core.dist_checkpointing.strategies import common

    return getattr(common, "TorchCommonLoadStrategy", object)


def dist_checkpointing_load(sharded_state_dict, checkpoint_dir: str, sharded_strategy,
                            common_strategy, load_bytes: Callable):
    """``dist_checkpointing.load`` with the caller's strategies, in the installed signature.

    0.16 takes both strategies. 0.19 takes the sharded one only and reads the common state (a
    ``ShardedObject`` in rank 0's shard, or a legacy ``common.pt``) in
    ``serialization.load_common_state_dict``, through torch's ``DefaultLoadPlanner``, which
    unpickles byte objects in full. For the duration of this call that function is replaced by
    one that reads the object with ``load_bytes(io.BytesIO) -> object`` (the caller's restricted
    unpickler) and a legacy ``common.pt`` with ``common_strategy.load_common``."""
    import inspect

    from megatron.core.dist_checkpointing import serialization

    if "common_strategy" in inspect.signature(serialization.load).parameters:  # 0.16
        return serialization.load(sharded_state_dict, checkpoint_dir, sharded_strategy,
                                  common_strategy)
    original = serialization.load_common_state_dict

    def load_common_state_dict(directory):
        return _load_common_state(str(directory), common_strategy, load_bytes)

    serialization.load_common_state_dict = load_common_state_dict
    try:
        return serialization.load(sharded_state_dict, checkpoint_dir, sharded_strategy)
    finally:
        serialization.load_common_state_dict = original


def _load_common_state(directory: str, common_strategy, load_bytes: Callable):
    """0.19's common state of the checkpoint in ``directory``, read without a full unpickle."""
    import io
    import os

    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.validation import verify_checkpoint
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    verify_checkpoint(directory)
    if os.path.isfile(os.path.join(directory, "common.pt")):  # a legacy (0.16) checkpoint
        return common_strategy.load_common(directory)

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    got = {}  # dcp.load writes its own copy of the state dict back over the caller's

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            got[read_item.dest_index.fqn] = load_bytes(value)

    dcp.load({key: io.BytesIO()}, storage_reader=dcp.FileSystemReader(directory),
             planner=_Planner(flatten_state_dict=False), no_dist=True)
    if key not in got:
        raise KeyError(f"{directory!r} holds no {key!r} (megatron-core's common state)")
    return got[key][0]
