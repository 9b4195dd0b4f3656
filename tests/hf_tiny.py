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


def read_tensors(path: str) -> dict:
    """The tensors of ``path/model.safetensors``."""
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
        names = read_tensors(tmp)
        save_file({k: weight(k, v.shape) for k, v in names.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = model_cls.from_pretrained(tmp, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    saved = read_tensors(path)
    for k, v in saved.items():
        assert torch.equal(v, weight(k, v.shape)), f"{family}: {k} was not saved as written"
    return saved


def reference(path: str, family: str, ids: torch.Tensor, seq: int):
    """transformers' logits of ``ids[:, :seq]`` and its loss of predicting ``ids[:, 1:]``."""
    return model_reference(classes(family)[1], path, ids, seq)


def model_reference(model_cls, path: str, ids: torch.Tensor, seq: int):
    """:func:`reference` of the ``model_cls`` (a ``*ForCausalLM``) saved in ``path``."""
    model = model_cls.from_pretrained(path, dtype=torch.float32,
                                      attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids[:, :seq]).logits, model(ids, labels=ids).loss.item()


def import_each(root, families, make, reference, ids, *, seed: int, metp: int) -> dict:
    """For each family: ``make(hf_dir, family, seed)`` saves a tiny model, which is imported
    (``--make-vocab-size-divisible-by 1`` for METP ``metp``) and run in transformers
    (``reference(hf_dir, family, ids)`` gives its logits and loss). Returns ``{"ids", "root",
    family: namespace(hf_dir, ckpt, geometry, logits, loss)}``."""
    from types import SimpleNamespace

    from tests.harness import run_ranks
    from tests.test_hf import _import_on_a_rank

    out = {"ids": ids, "root": root}
    for i, family in enumerate(families):
        hf_dir, ckpt = str(root / f"hf-{family}"), str(root / f"ckpt-{family}")
        make(hf_dir, family, seed + i)
        geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                             {"make_vocab_size_divisible_by": 1, "metp_parallel_size": metp})[0]
        logits, loss = reference(hf_dir, family, ids)
        out[family] = SimpleNamespace(hf_dir=hf_dir, ckpt=ckpt, geometry=geometry,
                                      logits=logits, loss=loss)
    return out


def import_made(root, families, make, model_class, *, seed: int, metp: int) -> dict:
    """:func:`import_each` of the models ``make(hf_dir, family, seed)`` saves, on the batch of
    ``tests/test_hf.py``, transformers' reference from ``model_class(family)`` (logits of all
    but the last token)."""
    from tests.test_hf import _batch

    return import_each(root, families, make,
                       lambda d, f, ids: model_reference(model_class(f), d, ids, ids.shape[1] - 1),
                       _batch(), seed=seed, metp=metp)


def reimport(exported: str, ckpt: str, out: str):
    """``exported`` (an export of ``ckpt``) imported again into ``out`` without vocabulary
    padding: the tensors of ``ckpt`` and of ``out``."""
    from megatron_metp.tools import hf as H
    from tests.harness import run_ranks
    from tests.test_hf import _import_on_a_rank

    run_ranks(_import_on_a_rank, 1, exported, out, {"make_vocab_size_divisible_by": 1})
    return tuple(H.read_checkpoint_tensors(H.checkpoint_dir(d)) for d in (ckpt, out))


def saved_configs(family: str) -> dict:
    """``{transformers version: the config.json it wrote for family}`` as kept in
    tests/data/hf_configs/ (make_fixtures.py), each checked to be in its version's layout."""
    import json

    from megatron_metp.tools.hf import versions as V

    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_configs")
    out = {}
    for version in ("4.57.6", "5.25.0"):
        with open(os.path.join(data, version, f"{family}.json")) as f:
            out[version] = json.load(f)
        assert V.source_layout(out[version]) == int(version[0]), (version, family)
    return out


def randomise(model, *, norm: float = 0.2, bias: float = 0.5, router_bias: float = 0.3,
              qk_gain: float = 1.0) -> None:
    """What transformers initialises to constants made random (in place, from torch's RNG):
    norm weights ``1 + norm·n``, biases ``bias·n`` (gpt-oss's expert biases too), GLM's router
    bias ``router_bias·n``, gpt-oss's attention sinks ``n``; q/k projections times ``qk_gain``
    (sharper attention)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + norm * torch.randn_like(p))
            elif name.endswith("self_attn.sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith((".bias", "_proj_bias")):
                p.copy_(bias * torch.randn_like(p))
            elif qk_gain != 1.0 and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(router_bias * torch.randn_like(b))
