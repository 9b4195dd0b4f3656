"""Tiny models of every supported Hugging Face family, saved by the installed transformers
(4.57.6 in .venv, 5.x in .venv-019) with the same deterministic weights whatever its version.

:func:`save_tiny` builds the family's config with the installed transformers, lets its
``save_pretrained`` write the checkpoint layout it writes, overwrites every saved tensor with
:func:`weight` (a function of the tensor's name and shape only, not of the library's random
initialisation), loads that with ``from_pretrained`` and saves it again: the second folder is a
checkpoint as that transformers writes it, holding the same tensors in any version.
``tests/data/hf_configs/make_fixtures.py`` keeps the ``config.json`` each version writes.
"""

from __future__ import annotations

import copy
import os
import tempfile
import zlib

import torch

#: shared: vocabulary 102, 4 heads in 2 K/V groups (both divisible by METP 2), RoPE base 1e6
BASE = dict(vocab_size=102, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=False)
#: the issue's YaRN: factor 4, original context 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
#: family id -> (config class, model class, config fields beyond BASE)
FAMILIES = {
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_scaling=YARN)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # Mistral: head_dim 16 != hidden / heads (as Mistral-Nemo), no window
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
}


def classes(family: str):
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    return getattr(transformers, cfg_cls), getattr(transformers, model_cls), extra


def weight(name: str, shape) -> torch.Tensor:
    """The deterministic fp32 value of saved tensor ``name``: norms ``1 + 0.2·n``, biases
    ``0.5·n``, q/k projections ``0.3·n`` (sharp attention), the rest ``0.1·n``, ``n`` standard
    normal from a generator seeded by the name's CRC-32."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1 + 0.2 * n
    if name.endswith(".bias"):
        return 0.5 * n
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0.3 * n
    return 0.1 * n


def _read(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def save_tiny(path: str, family: str, **change) -> dict:
    """Save the tiny ``family`` model with the installed transformers to ``path``; returns its
    tensors as saved (each equal to :func:`weight` of its name)."""
    from safetensors.torch import save_file

    cfg_cls, model_cls, extra = classes(family)
    # a copy: transformers 5 writes rope_theta into the rope_scaling dict it is given
    cfg = cfg_cls(**copy.deepcopy({**BASE, **extra, **change}), dtype="float32")
    model = model_cls(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        names = _read(tmp)
        save_file({k: weight(k, v.shape) for k, v in names.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = model_cls.from_pretrained(tmp, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    saved = _read(path)
    for k, v in saved.items():
        assert torch.equal(v, weight(k, v.shape)), f"{family}: {k} was not saved as written"
    return saved


def reference(path: str, family: str, ids: torch.Tensor, seq: int):
    """transformers' logits of ``ids[:, :seq]`` and its loss of predicting ``ids[:, 1:]``."""
    model = classes(family)[1].from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids[:, :seq]).logits, model(ids, labels=ids).loss.item()
