"""Reading the model tensors of a Megatron ``torch_dist`` checkpoint without building a model.

Megatron-LM's ``--ckpt-format torch_dist`` save (and ``hf import``'s) is a ``dist_checkpointing``
directory whose tensors are global: ``decoder.layers.<key>`` stacked ``[L, ...]`` over the
layers when every layer is alike, ``decoder.layers.<i>.<key>`` per layer when they differ (dense
and MoE layers mixed: megatron-core's ``non_homogeneous_layers``), and a MoE layer's experts
stacked ``[E, ...]`` by global expert index (``mlp.experts.experts.linear_fc{1,2}.weight``,
whatever the expert-parallel size of the run that saved it). :func:`megatron_params_from_checkpoint`
turns either form into the per-layer ``named_parameters()`` names of an EP = 1 model.

The ``.metadata`` pickle is checked against an allow-list before torch unpickles it; tensor data
is read with ``weights_only``; ``_extra_state`` byte objects and ``common.pt`` are never read.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Iterable, List, Optional

import torch

from .config import HFConfigError

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(load: str, iteration: Optional[int] = None) -> str:
    """The ``dist_checkpointing`` directory of ``load``: ``load`` itself if it is one, else the
    one ``latest_checkpointed_iteration.txt`` (or ``iteration``) names."""
    if not os.path.isdir(load):
        raise HFConfigError(f"--load {load!r} is not a directory")
    if iteration is None and os.path.isfile(os.path.join(load, "metadata.json")):
        return load
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            raise HFConfigError(f"{load!r} has no {TRACKER} and is not a checkpoint directory "
                                f"itself; pass the --save directory of the run (or --iteration)")
        with open(tracker) as f:
            tag = f.read().strip()
        sub = "release" if tag == "release" else f"iter_{int(tag):07d}"
    else:
        sub = f"iter_{iteration:07d}"
    path = os.path.join(load, sub)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise HFConfigError(f"{path!r} is not a torch_dist checkpoint (no metadata.json); "
                            f"Megatron-LM's --ckpt-format torch_dist writes one")
    return path


#: stacked layer keys of the checkpoint → the per-layer parameter name (TE-style norm keys)
_LAYER_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",          # Qwen2
    "self_attention.q_layernorm.weight": "self_attention.q_layernorm.weight",    # Qwen3
    "self_attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
    # gpt-oss: the attention output's bias and the sinks
    "self_attention.linear_proj.bias": "self_attention.linear_proj.bias",
    "self_attention.core_attention.softmax_offset": "self_attention.core_attention.softmax_offset",
    # DeepSeek's multi-latent attention (q_layernorm: its query latent's norm)
    **{f"self_attention.{k}.weight": f"self_attention.{k}.weight" for k in (
        "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
        "linear_kv_up_proj", "kv_layernorm")},
}
_TOP_KEYS = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
             "output_layer.weight")


def checked_metadata(path: str) -> None:
    """Refuse a ``.metadata`` pickle that references anything but torch's checkpoint classes
    (the allow-list of :mod:`megatron_metp.megatron.checkpoint`), before torch unpickles it."""
    from ...megatron.checkpoint import CheckpointError, check_metadata_pickle

    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        raise HFConfigError(f"{path!r} has no .metadata: not a torch_dist checkpoint")
    try:
        check_metadata_pickle(meta_file)
    except CheckpointError as exc:
        raise HFConfigError(str(exc)) from exc


def read_checkpoint_tensors(path: str, keys: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """Global tensors of a ``dist_checkpointing`` (``torch_dist``) directory, by checkpoint key
    (``decoder.layers.*`` stacked ``[num_layers, ...]``). ``.metadata`` is checked against an
    allow-list before torch unpickles it; tensor data is read with ``weights_only``; byte
    objects (``_extra_state``) and ``common.pt`` are never read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checked_metadata(path)
    reader = FileSystemReader(path)
    md = reader.read_metadata().state_dict_metadata
    wanted = set(keys) if keys is not None else None
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
          if isinstance(m, TensorStorageMetadata) and (wanted is None or k in wanted)}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, that is the intent
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return sd


#: MoE layer keys (megatron-core's ``MoELayer``; experts stacked ``[E, ...]`` by global index)
_MOE_KEYS = {
    "mlp.router.weight": "mlp.router.weight",
    "mlp.experts.experts.linear_fc1.weight": "mlp.experts.local_experts.{j}.linear_fc1.weight",
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.local_experts.{j}.linear_fc2.weight",
    # the shared expert (Qwen2-MoE, GLM-4.5), its gate (Qwen2-MoE), the router bias (GLM-4.5)
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_experts.gate_weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    # gpt-oss: the router's and the experts' biases
    "mlp.router.bias": "mlp.router.bias",
    "mlp.experts.experts.linear_fc1.bias": "mlp.experts.local_experts.{j}.linear_fc1.bias",
    "mlp.experts.experts.linear_fc2.bias": "mlp.experts.local_experts.{j}.linear_fc2.bias"}


def checkpoint_tensor_keys(path: str) -> List[str]:
    """The tensor keys of a ``dist_checkpointing`` directory (``.metadata`` checked first)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checked_metadata(path)
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return [k for k, m in md.items() if isinstance(m, TensorStorageMetadata)]


def _split_layer_key(key: str):
    """``decoder.layers.3.mlp...`` → ``(3, "mlp...")`` (one layer: a model whose layers differ,
    e.g. dense and MoE); ``decoder.layers.mlp...`` → ``(None, "mlp...")`` (stacked over
    layers)."""
    rest = key[len("decoder.layers."):]
    head, _, tail = rest.partition(".")
    return (int(head), tail) if head.isdigit() else (None, rest)


def megatron_params_from_checkpoint(path: str, num_layers: int) -> Dict[str, torch.Tensor]:
    """The model tensors of a checkpoint as full per-layer ``named_parameters()`` names (EP = 1
    names for the experts: ``mlp.experts.local_experts.<global index>``)."""
    known = set(_LAYER_KEYS) | set(_MOE_KEYS)
    keys = [k for k in checkpoint_tensor_keys(path) if k in _TOP_KEYS or (
        k.startswith("decoder.layers.") and _split_layer_key(k)[1] in known)]
    raw = read_checkpoint_tensors(path, keys)
    out = {k: raw[k] for k in _TOP_KEYS if k in raw}
    for key in keys:
        if key in _TOP_KEYS:
            continue
        t = raw[key]
        layer, sub = _split_layer_key(key)
        if layer is None and t.shape[0] != num_layers:
            raise HFConfigError(f"checkpoint tensor {key} stacks {t.shape[0]} layers, the "
                                f"config has {num_layers}")
        per_layer = {layer: t} if layer is not None else dict(enumerate(t))
        for i, ti in per_layer.items():
            if i >= num_layers:
                raise HFConfigError(f"checkpoint tensor {key} is of layer {i}, the config has "
                                    f"{num_layers} layers")
            name = _LAYER_KEYS.get(sub) or _MOE_KEYS[sub]
            if "{j}" not in name:
                out[f"decoder.layers.{i}.{name}"] = ti.clone()
                continue
            for j in range(ti.shape[0]):  # experts by global index
                out[f"decoder.layers.{i}.{name.format(j=j)}"] = ti[j].clone()
    return out


__all__ = ["TRACKER", "checkpoint_dir", "checkpoint_tensor_keys", "read_checkpoint_tensors",
           "megatron_params_from_checkpoint"]
