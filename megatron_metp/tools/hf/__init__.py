"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
Qwen2-MoE, GLM-4.5, gpt-oss) in and out of Megatron/METP (``torch_dist``) checkpoints:
``python -m megatron_metp.tools.hf`` / ``metp hf`` (docs/huggingface.md). One module per concern:

========================  ======================================================================
:mod:`.cli`               the command line (``import``, ``export``, ``flags``): :func:`main`
:mod:`.convert`           :func:`import_hf`, :func:`export_hf`, :func:`build_model`,
                          :func:`load_model_weights`, :func:`read_safetensors`
:mod:`.config`            config.json -> the geometry and the Megatron-LM flags
:mod:`.errors`            :class:`HFConfigError`, the error every module raises
:mod:`.families`          what tells the families apart; fields refused naming them
:mod:`.keys`              every config.json key mapped, checked, harmless or refused
:mod:`.versions`          transformers 4.x and 5.x config layouts
:mod:`.yarn`              YaRN rope scaling
:mod:`.moe`               Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5: experts, routing, the MoE flags
:mod:`.layout`            Hugging Face <-> Megatron tensor names and layouts
:mod:`.moe_layout`        the same for the experts and the router
:mod:`.weights_check`     the safetensors files and tensors checked on the way in
:mod:`.checkpoint`        the tensors of a ``torch_dist`` checkpoint, read without a model
:mod:`.from_args`         a config.json from a checkpoint's saved Megatron-LM arguments
:mod:`.tokenizer_export`  the tokenizer files an export writes
:mod:`.output`            an output folder written whole or not at all
========================  ======================================================================

The names below are :mod:`.convert`'s and :mod:`.cli`'s, imported on first use (importing a
light module such as :mod:`.config` does not import torch). Patch a name where it is looked up
(``megatron_metp.tools.hf.convert``), not here.
"""

from __future__ import annotations

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {**{name: "convert" for name in (
    "import_hf", "export_hf", "build_model", "load_model_weights", "read_safetensors",
    "checkpoint_dir", "checkpoint_tensor_keys", "read_checkpoint_tensors",
    "megatron_params_from_checkpoint", "megatron_shapes")}, "main": "cli"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
