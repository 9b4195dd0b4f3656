"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3, and the MoE Qwen3-MoE and
Mixtral: :mod:`.moe`) in and out of Megatron/METP (``torch_dist``) checkpoints.

::

    python -m megatron_metp.tools.hf import --hf-dir HF_DIR --out CKPT [--metp-parallel-size 2]
    python -m megatron_metp.tools.hf export --load CKPT --out HF_OUT [--hf-config HF_DIR]
    python -m megatron_metp.tools.hf flags --hf-dir HF_DIR      # the Megatron-LM flags only

``import`` reads ``config.json`` + ``*.safetensors`` (one file or a sharded index), checks the
config (:mod:`.config`) and the files and tensors (:mod:`.weights_check`: truncated or
garbled files, the index, names, shapes, dtypes, non-finite values), re-lays them out (:mod:`.layout`), puts them into a
stock megatron-core ``GPTModel`` (TP = 1, local layer spec, same geometry) and saves its
``sharded_state_dict`` with ``dist_checkpointing`` as Megatron-LM's ``torch_dist`` save lays it
out::

    CKPT/latest_checkpointed_iteration.txt    "release"
    CKPT/release/                             dist_checkpointing save of {"model": ...,
                                              "checkpoint_version": 3.0, "iteration": 0}
    CKPT/hf/                                  the source config.json (+ tokenizer files)
    CKPT/metp_hf.json                         the geometry and the Megatron-LM flags
    CKPT/megatron_args.txt, CKPT/model.sh     the flags, and a scripts/pretrain_gpt.sh model file

METP's layers keep Megatron's parameter names and shard on its TP axis, so the checkpoint loads
into ``pretrain_gpt.py --load CKPT --finetune`` (or ``--pretrained-checkpoint CKPT``) at any METP
size and TP that divide the heads, groups and FFN and pad the vocabulary alike, and into stock
TP; :func:`load_model_weights` does the same model load on CPU ranks (the tests use it at
METP = 2 and 3; ``tests/test_hf_megatron_lm.py`` runs ``pretrain_gpt.py`` itself). Megatron pads the vocabulary to a multiple of
``--make-vocab-size-divisible-by × TP × METP`` (this project's patch pads a METP run as stock TP
of size ``TP × METP``): give the converter the run's numbers (the padded rows are zeros).

``export`` reads the model tensors of any such checkpoint (ours, or one Megatron-LM saved after
training: ``--load`` is the save directory, ``--iteration`` picks one) straight from the
``torch_dist`` files (:mod:`.checkpoint`), without building a model or unpickling anything
beyond the checked ``.metadata``, drops the padded rows and writes ``model.safetensors`` +
``config.json`` that the family's ``*ForCausalLM.from_pretrained`` reads, and the run's Hugging
Face tokenizer files (:mod:`.tokenizer_export`). Both write their output folder whole or not
at all (:mod:`.output`). The config comes
from ``--hf-config``, else
``CKPT/hf/`` (an import's), else it is written from the Megatron-LM arguments the checkpoint saved
(a model trained from scratch, :mod:`.from_args`: llama, mistral, qwen2 or qwen3, every row of
Megatron's padded vocabulary kept). A model with no Hugging Face family (LayerNorm, GeLU, biases,
...) is refused naming each mismatch. Every written file is mode 0644.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from typing import Dict, Optional

import torch

from .checkpoint import (TRACKER, checked_metadata, checkpoint_dir,  # noqa: F401
                         checkpoint_tensor_keys, megatron_params_from_checkpoint,
                         read_checkpoint_tensors)
from .config import (HFConfigError, LlamaGeometry, geometry_from_hf, gpt_model_kwargs,
                     megatron_args, pretrain_gpt_sh_model, read_hf_config,
                     set_yarn_config, transformer_config_kwargs)
from .layout import hf_to_megatron, megatron_shapes, megatron_to_hf
from .moe_layout import FP32_BUFFERS
from .deepseek import DEEPSEEK_FAMILIES
from .from_args import gpt_oss_args_problems, mla_args_problems, moe_args_problems
from .moe import MOE_FAMILIES
from .output import staged_dir
from .tokenizer_export import TOKENIZER_FILES, plan_tokenizer
from .weights_check import checkpoint_files, read_checked_safetensors, read_header
from .versions import export_layout

META = "metp_hf.json"
#: files copied along with config.json (when present) so that export can restore them
SIDE_FILES = ("generation_config.json",) + TOKENIZER_FILES


# ---------------------------------------------------------------- safetensors in and out

def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:
        raise HFConfigError("the Hugging Face converter needs the safetensors package: "
                            "pip install safetensors") from exc
    return safetensors.torch


def read_safetensors(hf_dir: str) -> Dict[str, torch.Tensor]:
    """All tensors of ``hf_dir``: ``model.safetensors``, or the files a
    ``model.safetensors.index.json`` lists, each file's header checked first (a truncated or
    garbled file is refused naming it: :mod:`.weights_check`). ``import`` reads through
    :func:`.weights_check.read_checked_safetensors` (names, shapes, dtypes and values
    checked against config.json too)."""
    load_file = _safetensors().load_file
    files, _ = checkpoint_files(hf_dir)
    out: Dict[str, torch.Tensor] = {}
    for path in files:
        read_header(path)
        out.update(load_file(path))
    return out


# ---------------------------------------------------------------- the Megatron model

def check_release(g: LlamaGeometry) -> None:
    """Refuse a geometry the installed megatron-core cannot build as the model: MLA without a
    query latent on 0.19 (:func:`megatron_metp.megatron.mla.fuses_query_norm`)."""
    if g.multi_latent_attention and g.q_lora_rank is None:
        from ...megatron.mla import fuses_query_norm

        if fuses_query_norm():
            raise HFConfigError(
                "config.json: q_lora_rank = null (no query latent, DeepSeek-V2-Lite's form) "
                "with this megatron-core (0.19): under --qk-layernorm (which the latent kv norm "
                "needs) it puts an RMSNorm on the query projection that the model does not "
                "have, so no Megatron model of this release holds it; convert and train with "
                "megatron-core 0.16 (Megatron-LM core_v0.16.1), whose MLA applies no query "
                "norm without a query latent")


def build_model(g: LlamaGeometry, *, groups=None, vocab_parallel: bool = False,
                moe_token_dispatcher: str = "allgather", weight_ring: bool = True):
    """The megatron-core ``GPTModel`` this geometry converts to, on the initialised parallel
    state: the stock local layer spec with ``groups=None``, METP's spec with ``groups``
    (:class:`megatron_metp.megatron.groups.METPGroups`; exact RoPE angles unless
    ``$METP_ROPE_RECIPE=megatron``, :mod:`megatron_metp.megatron.rope`), ``METPGPTModel``
    (vocabulary on the ring) with ``vocab_parallel``. A MoE geometry (``qwen3_moe``,
    ``mixtral``) gets megatron-core's ``MoELayer`` in its MoE layers (stock: Megatron's decoder
    block spec; METP: :func:`megatron_metp.megatron.moe.get_gpt_decoder_block_metp_spec`, the
    experts sharded over the METP ranks) with the expert-parallel size of the parallel state
    and Megatron's ``moe_token_dispatcher`` (``allgather`` or ``alltoall``); ``weight_ring=False``
    with ``groups``: the ring self-attention baseline (weights replicated, the K/V ring). Weights
    are left uninitialised (load them)."""
    from megatron.core import parallel_state as ps
    from .deepseek import config_class

    tp = ps.get_tensor_model_parallel_world_size()
    metp = ps.get_context_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    cfg = config_class(g)(**transformer_config_kwargs(g, tp=tp, metp=metp, ep=ep,
                                                      dispatcher=moe_token_dispatcher))
    set_yarn_config(cfg, g)
    if groups is None and vocab_parallel:
        raise ValueError("vocab_parallel needs the METP groups")
    from ...megatron.build import build_metp_gpt
    from ...megatron.settings import METPSettings
    from ...ops.rope_recipe import rope_recipe

    # METP's default angles (plain RoPE and YaRN) unless $METP_ROPE_RECIPE=megatron
    settings = METPSettings(mode="tp", tp=tp) if groups is None else \
        METPSettings(mode="metp" if weight_ring else "ring", metp=groups.metp.size,
                     tp=groups.tp_size,
                     vocab_parallel=vocab_parallel, rope_recipe=rope_recipe(),
                     rope_recipe_source="METP_ROPE_RECIPE=megatron")
    model_kwargs = gpt_model_kwargs(g)
    check_release(g)
    if groups is None and g.multi_latent_attention:
        # stock MLA: megatron-core's local DotProductAttention takes no separate k/v head dims;
        # the model saves and loads weights, its forward is not run (mla.without_core_attention)
        from ...megatron.mla import without_core_attention

        model_kwargs["spec_transform"] = without_core_attention
    return build_metp_gpt(cfg, groups, settings, normalization="RMSNorm",
                          pre_process=ps.is_pipeline_first_stage(),
                          post_process=ps.is_pipeline_last_stage(), **model_kwargs)


@contextlib.contextmanager
def _single_process_megatron():
    """A one-rank gloo world and Megatron's parallel state at TP = PP = 1 (if none is set up),
    with the CPU shims of :mod:`megatron_metp.megatron.cpu` on a machine without CUDA."""
    import torch.distributed as dist

    own_world = not dist.is_initialized()
    tmp = None
    if own_world:
        tmp = tempfile.mkdtemp(prefix="metp_hf_")
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"the Hugging Face import runs on one process; this one is rank "
                           f"{dist.get_rank()} of {dist.get_world_size()}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not")
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ...megatron import cpu

    if not torch.cuda.is_available():
        cpu.enable()
    own_ps = not ps.model_parallel_is_initialized()
    if own_ps:
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    elif ps.get_tensor_model_parallel_world_size() != 1 or \
            ps.get_pipeline_model_parallel_world_size() != 1:
        raise RuntimeError("the Hugging Face import builds the model at TP = PP = 1")
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        if own_ps:
            ps.destroy_model_parallel()
        if own_world:
            dist.destroy_process_group()
            shutil.rmtree(tmp, ignore_errors=True)


def _write_checkpoint(g: LlamaGeometry, params: Dict[str, torch.Tensor], ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    model = build_model(g)
    names = dict(model.named_parameters())
    names.update((k, b) for k, b in model.named_buffers() if k.endswith(".expert_bias"))
    if set(names) != set(params):
        raise RuntimeError(f"megatron-core's GPTModel has parameters {sorted(set(names) ^ set(params))[:6]} "
                           f"the re-layout does not (or the reverse): megatron-core version?")
    with torch.no_grad():
        for name, p in names.items():
            if tuple(p.shape) != tuple(params[name].shape):
                raise RuntimeError(f"{name}: model {list(p.shape)} vs converted "
                                   f"{list(params[name].shape)}")
            p.copy_(params[name].to(p.dtype))  # expert_bias: fp32 in megatron-core
    os.makedirs(ckpt_dir)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0,
                             "iteration": 0}, ckpt_dir)


# ---------------------------------------------------------------- import

def _check_out(out_dir: str, force: bool, keep) -> None:
    """``out_dir`` may be written (replaced with ``force``), and is not one of the inputs
    ``keep`` nor a folder holding one (``--force`` would delete it)."""
    out = os.path.realpath(out_dir)
    for src in keep:
        src = os.path.realpath(src)
        if src == out or src.startswith(out + os.sep):
            raise HFConfigError(f"--out {out_dir!r} is (or holds) the input {src!r}; write to "
                                f"another directory")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) \
            and not force:
        raise HFConfigError(f"--out {out_dir!r} exists and is not empty; choose a new directory "
                            f"or pass --force to replace it")


def _write_import(stage: str, hf_dir: str, g: LlamaGeometry, params, out_dir: str, *,
                  tp: int, metp: int) -> None:
    """Write the import's files (module docstring) into ``stage``, which becomes ``out_dir``."""
    with _single_process_megatron():
        _write_checkpoint(g, params, os.path.join(stage, "release"))
    with open(os.path.join(stage, TRACKER), "w") as f:
        f.write("release")
    side = os.path.join(stage, "hf")
    os.makedirs(side)
    shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(side, "config.json"))
    for name in SIDE_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(side, name))
    flags = megatron_args(g)
    with open(os.path.join(stage, META), "w") as f:
        json.dump({"source": os.path.abspath(hf_dir), "geometry": g.to_json(),
                   "megatron_args": flags, "tensor_model_parallel_size": tp,
                   "metp_parallel_size": metp}, f, indent=1)
    with open(os.path.join(stage, "megatron_args.txt"), "w") as f:
        f.write(" ".join(flags) + "\n")
    with open(os.path.join(stage, "model.sh"), "w") as f:
        f.write(pretrain_gpt_sh_model(g, os.path.abspath(out_dir), tp=tp, metp=metp))


def import_hf(hf_dir: str, out_dir: str, *, make_vocab_size_divisible_by: int = 128,
              tensor_model_parallel_size: int = 1, metp_parallel_size: int = 1,
              force: bool = False, seq_length: Optional[int] = None,
              log=print) -> LlamaGeometry:
    """Convert ``hf_dir`` into the Megatron ``torch_dist`` checkpoint ``out_dir`` (layout in the
    module docstring). Every check runs before anything is written."""
    cfg = read_hf_config(hf_dir)
    g = geometry_from_hf(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                         tensor_model_parallel_size=tensor_model_parallel_size,
                         metp_parallel_size=metp_parallel_size, seq_length=seq_length)
    _check_out(out_dir, force, keep=(hf_dir,))
    check_release(g)  # before a weight is read
    hf = read_checked_safetensors(hf_dir, g, cfg)  # files, index, names, shapes, dtypes, values
    params = hf_to_megatron(hf, g)
    dtype = hf["model.embed_tokens.weight"].dtype
    if str(dtype).replace("torch.", "") != g.dtype:
        g = dataclasses.replace(g, dtype=str(dtype).replace("torch.", ""))
    del hf
    with staged_dir(out_dir) as stage:  # out_dir appears whole, or is left as it was
        _write_import(stage, hf_dir, g, params, out_dir,
                      tp=tensor_model_parallel_size, metp=metp_parallel_size)
    flags = megatron_args(g)
    attn = (f"{g.num_attention_heads} heads of multi-latent attention (kv latent "
            f"{g.kv_lora_rank}, query latent {g.q_lora_rank or 'none'})"
            if g.multi_latent_attention else
            f"{g.num_attention_heads} heads / {g.num_query_groups} K/V groups")
    log(f"wrote {out_dir}: {g.num_layers} layers, hidden {g.hidden_size}, {attn}, FFN "
        f"{g.ffn_hidden_size}, vocabulary {g.vocab_size} padded to {g.padded_vocab_size} "
        f"(multiple of {g.vocab_multiple}), {'tied' if g.tie_embeddings else 'untied'}, {g.dtype}")
    log("pretrain_gpt.py flags: " + " ".join(flags) + f" --load {out_dir} --finetune (or "
        f"--pretrained-checkpoint {out_dir} next to the run's own --load/--save)")
    log(f"scripts/pretrain_gpt.sh model file: {os.path.join(out_dir, 'model.sh')}")
    if g.padded_vocab_size > g.vocab_size:
        log(f"note: Megatron's softmax runs over all {g.padded_vocab_size} rows; the "
            f"{g.padded_vocab_size - g.vocab_size} zero rows give logit 0 and enter the loss's "
            f"normaliser, so its loss is not Hugging Face's (the first {g.vocab_size} logits are). "
            f"A --make-vocab-size-divisible-by whose multiple (x TP x METP) divides "
            f"{g.vocab_size} avoids the padding")
    return g


def load_model_weights(model, load: str, iteration: Optional[int] = None) -> None:
    """Load the weights of the checkpoint ``load`` into ``model`` (any TP / METP layout, on every
    rank of its groups) as Megatron-LM's ``load_checkpoint`` does for the model part: the
    model's ``sharded_state_dict()`` filled by ``dist_checkpointing.load``, then
    ``load_state_dict``. The ``.metadata`` pickle is checked first; ``_extra_state`` objects
    (empty for these layers) are not read."""
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(load, iteration)
    checked_metadata(path)
    template = {k: v for k, v in model.sharded_state_dict().items()
                if not k.endswith("._extra_state")}
    loaded = dist_checkpointing.load({"model": template}, path)["model"]
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise HFConfigError(f"{path!r} does not match the model: missing {missing[:5]}, "
                            f"unexpected {list(unexpected)[:5]}")


# ---------------------------------------------------------------- export

def _find_hf_config(load: str, hf_config: Optional[str]) -> Optional[str]:
    """The directory of the config.json to export with: ``--hf-config``, else ``LOAD/hf/`` (an
    import's), else ``None`` (the config is written from the checkpoint's saved arguments)."""
    if hf_config is not None:
        cand = hf_config if os.path.isdir(hf_config) else os.path.dirname(hf_config) or "."
        if not os.path.isdir(hf_config) and os.path.basename(hf_config) != "config.json":
            raise HFConfigError(f"--hf-config {hf_config!r}: pass a directory holding "
                                f"config.json, or the config.json itself")
        return cand
    side = os.path.join(load, "hf")
    if os.path.isfile(os.path.join(side, "config.json")):
        return side
    return None


def _export_config(path: str, cfg_dir: Optional[str]):
    """config.json to export the checkpoint directory ``path`` with: read from ``cfg_dir``, or
    written from the checkpoint's saved Megatron-LM arguments (:mod:`.from_args`), and those
    arguments (``None`` if it has none). A model whose saved arguments have no Hugging Face
    family is refused either way, naming why."""
    from ...megatron_lm.saved_args import read_saved_args
    from .from_args import family_problems, hf_config_from_args

    saved = read_saved_args(path)
    if cfg_dir is None:
        if saved is None:
            raise HFConfigError(f"{path!r} holds no saved Megatron-LM arguments (and its --load "
                                f"has no hf/config.json from an import); pass --hf-config with "
                                f"the Hugging Face model's config.json")
        return hf_config_from_args(saved), saved
    cfg = read_hf_config(cfg_dir)
    problems = family_problems(saved, cfg.get("model_type")) if saved is not None else []
    family = cfg.get("model_type")
    if saved is not None and family in MOE_FAMILIES:
        problems += moe_args_problems(cfg, saved)
        if family in DEEPSEEK_FAMILIES:
            problems += mla_args_problems(cfg, saved)
        elif family == "gpt_oss":
            problems += gpt_oss_args_problems(cfg, saved)
    elif saved is not None and saved.get("num_experts"):
        problems.append(f"--num-experts {saved['num_experts']}: config.json is a dense "
                        f"{cfg.get('model_type')!r}; pass the MoE model's config.json")
    if problems:
        raise HFConfigError(f"{path!r} was trained as a model with no Hugging Face family "
                            f"(its saved Megatron-LM arguments), whatever config.json says: "
                            + "; ".join(problems))
    return cfg, saved


def _write_file(path: str, write) -> None:
    """``write(path)``, then mode 0644 whatever the umask or the writer chose (safetensors
    writes 0600)."""
    write(path)
    os.chmod(path, 0o644)


def export_hf(load: str, out_dir: str, *, hf_config: Optional[str] = None,
              iteration: Optional[int] = None, dtype: Optional[str] = None,
              tokenizer: Optional[str] = None, force: bool = False,
              log=print, transformers_layout: Optional[int] = None) -> LlamaGeometry:
    """Write ``out_dir/model.safetensors`` + ``config.json`` (in the layout of the installed
    transformers, or of ``transformers_layout``: :mod:`.versions`) + the tokenizer files
    (:mod:`.tokenizer_export`: ``tokenizer``, else the run's ``--tokenizer-model``, else the
    import's) from the Megatron checkpoint ``load``; ``hf_config`` (a directory or its
    config.json) is optional (module docstring). Every check runs before anything is written,
    and ``out_dir`` appears whole or not at all (:mod:`.output`)."""
    save_file = _safetensors().save_file
    cfg_dir = _find_hf_config(load, hf_config)
    path = checkpoint_dir(load, iteration)
    cfg, saved = _export_config(path, cfg_dir)
    # seq_length=1: export only re-lays tensors (a sliding window cannot bind; the config is copied)
    g = geometry_from_hf(cfg, make_vocab_size_divisible_by=1, seq_length=1)
    _check_out(out_dir, force, keep=(load,) + ((cfg_dir,) if cfg_dir is not None else ()) +
               ((tokenizer,) if tokenizer is not None else ()))
    tok = plan_tokenizer(saved, cfg_dir, tokenizer, g.vocab_size, out_dir)
    mg = megatron_params_from_checkpoint(path, g.num_layers)
    emb = mg.get("embedding.word_embeddings.weight")
    if emb is None:
        raise HFConfigError(f"{path!r} holds no embedding.word_embeddings.weight")
    if emb.shape[0] < g.vocab_size:
        raise HFConfigError(f"the checkpoint's embedding has {emb.shape[0]} rows, fewer than "
                            f"config.json's vocab_size {g.vocab_size}: wrong --hf-config?")
    if g.tie_embeddings and "output_layer.weight" in mg:
        raise HFConfigError("config.json has tie_word_embeddings = true but the checkpoint has "
                            "an output_layer.weight (trained with "
                            "--untie-embeddings-and-output-weights): wrong --hf-config?")
    if not g.tie_embeddings and "output_layer.weight" not in mg:
        raise HFConfigError("config.json has tie_word_embeddings = false but the checkpoint has "
                            "no output_layer.weight (a tied model): wrong --hf-config?")
    g = dataclasses.replace(g, padded_vocab_size=int(emb.shape[0]))
    hf = megatron_to_hf(mg, g)
    # default: the embedding's dtype for every tensor (an import keeps the norms of a bf16
    # model in megatron-core's fp32 norm parameters; the values are the bf16 ones)
    target = getattr(torch, dtype) if dtype is not None else emb.dtype
    hf = {k: v.to(torch.float32 if k.endswith(FP32_BUFFERS) else target) for k, v in hf.items()}
    written = str(target).replace("torch.", "")
    cfg, layout = export_layout(dict(cfg), transformers_layout)  # versions
    cfg["dtype" if "dtype" in cfg or layout == 5 else "torch_dtype"] = written

    def dump(p):
        with open(p, "w") as f:
            json.dump(cfg, f, indent=2)
    with staged_dir(out_dir) as stage:  # out_dir appears whole, or is left as it was
        _write_file(os.path.join(stage, "model.safetensors"),
                    lambda p: save_file({k: v.contiguous() for k, v in hf.items()}, p,
                                        metadata={"format": "pt"}))
        _write_file(os.path.join(stage, "config.json"), dump)
        if cfg_dir is not None and os.path.isfile(os.path.join(cfg_dir, "generation_config.json")):
            src = os.path.join(cfg_dir, "generation_config.json")
            _write_file(os.path.join(stage, "generation_config.json"),
                        lambda p: shutil.copyfile(src, p))
        for name in tok.files:
            src = os.path.join(tok.source, name)
            _write_file(os.path.join(stage, name), lambda p, s=src: shutil.copyfile(s, p))
    source = "config.json from " + (cfg_dir if cfg_dir is not None else "its saved arguments")
    log(f"wrote {out_dir}: {len(hf)} tensors ({written}) from {path}, vocabulary rows "
        f"{g.padded_vocab_size} -> {g.vocab_size}, {g.family} {source}, in transformers "
        f"{layout}.x's config.json layout")
    log(tok.line)
    return g


__all__ = ["import_hf", "export_hf", "build_model", "load_model_weights", "read_safetensors",
           "checkpoint_dir", "checkpoint_tensor_keys",
           "read_checkpoint_tensors", "megatron_params_from_checkpoint", "megatron_shapes"]
