"""How to launch a planned job: the ``scripts/pretrain_gpt.sh`` environment, Megatron-LM's flags
and a ``configs/*.sh``-style file, from a :class:`~.model.Model`, a :class:`~.model.Job` and a
mode (``metp plan``'s fit hint, ``metp plan --reach``'s best layouts, ``--write-config``).

Each setting is one ``(VARIABLE, value, Megatron-LM flags)`` triple of :func:`settings`: the
variable is what ``scripts/pretrain_gpt.sh`` reads, the flags what it then passes to
``pretrain_gpt.py`` for that value. The layout of a mode on ``W = tp·metp`` GPUs per stage:

==========  ====================================================================
``tp``      ``TP=W``, no SP                ``tp-sp``  ``TP=W`` + ``--sequence-parallel``
``cp``      ``TP=t`` (+SP) × ``CP=metp``   ``ring``   ``CP=W`` (TP 1)
``metp``    ``TP=t``, ``METP=p``, ``CP=c`` (METP × CP), ``--metp-vocab-parallel`` with the split
==========  ====================================================================

The world is ``TP·METP·CP·PP·DP`` GPUs, on nodes of 8 (``GPUS_PER_NODE``, ``NNODES``). The model's
geometry comes from ``configs/models/<name>.sh`` when the repository has that file (it also sets
what the plan does not model: the norm, the RoPE base, the linear biases); a value of the plan that
differs from the file's is set explicitly before it.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from .mla import mla_flags
from .config import KEEP_FLAG, null_tokenizer_eod, read_config
from .partial import resolve_keep, resolve_offload
from .recipe import merge_recipe, recipe_flags
from .model import KEEP_AUTO, Job, Model, canonical, layout
from .moe import layer_freq_arg

#: the repository's model files (``configs/models/<name>.sh``)
MODELS_DIR = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "configs",
                          "models")
#: Megatron's optimizer CPU offload, all of it (``metp plan --optimizer-cpu-offload``)
OPTIMIZER_OFFLOAD_ARGS = ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
                          "--use-precision-aware-optimizer")  # Megatron-LM asserts the last

Setting = Tuple[str, str, List[str]]

#: ``scripts/pretrain_gpt.sh``'s own defaults (a launch line leaves these out; its
#: ``SEQUENCE_PARALLEL`` default, 1 when TP > 1 and METP = 1, is checked in :func:`launch_line`)
LAUNCHER_DEFAULTS = {"NNODES": "1", "GPUS_PER_NODE": "8", "TP": "1", "METP": "1", "CP": "1",
                     "PP": "1", "MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "8",
                     "DISTRIBUTED_OPTIMIZER": "1",
                     "SWIGLU": "0", "UNTIE_EMBEDDINGS": "0", "QK_LAYERNORM": "0",
                     "ADD_QKV_BIAS": "0"}


def model_file(model: Model) -> Optional[str]:
    """``configs/models/<name>.sh`` of the model's name, when the repository has it; for a model
    read from a ``--config`` (named by the config: its file name in ``configs/``, else its path)
    the model file that config sources."""
    path = os.path.normpath(os.path.join(MODELS_DIR, f"{model.name}.sh"))
    if os.path.isfile(path):
        return path
    cfg = _config_of(model)
    return _sourced_model_file(cfg) if cfg else None


def _config_of(model: Model) -> Optional[str]:
    """The ``--config`` a model was read from (it names the model: its file name in ``configs/``,
    else its path); ``None`` for a preset."""
    if not model.name.endswith(".sh"):
        return None
    cfg = model.name if os.path.isabs(model.name) else os.path.join(MODELS_DIR, os.pardir,
                                                                      model.name)
    return os.path.normpath(cfg) if os.path.isfile(cfg) else None


def _planned_eod(model: Model) -> int:
    """The end-of-document token a ``--config``'s plan adds to its ``VOCAB_SIZE``
    (:func:`.config.null_tokenizer_eod`), which a launch line's ``VOCAB_SIZE`` leaves out."""
    cfg = _config_of(model)
    return (null_tokenizer_eod(read_config(cfg)) or 0) if cfg else 0


def _sourced_model_file(config: str, depth: int = 0) -> Optional[str]:
    """The ``configs/models/*.sh`` of the repository that ``config`` sources (directly, or
    through a config it sources); ``None`` if none."""
    base = os.path.dirname(config)
    with open(config, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        m = re.match(r'^\s*(?:source|\.)\s+(.+?)\s*$', line.split("#", 1)[0])
        if not m:
            continue
        target = m.group(1).strip().strip('"').strip("'")
        for pat in ('$(dirname "${BASH_SOURCE[0]}")', "$(dirname ${BASH_SOURCE[0]})"):
            target = target.replace(pat, base)
        named = re.search(r'models/([A-Za-z0-9_.-]+)\.sh$', target)
        if named and os.path.isfile(os.path.join(MODELS_DIR, named.group(1) + ".sh")):
            return os.path.normpath(os.path.join(MODELS_DIR, named.group(1) + ".sh"))
        target = target if os.path.isabs(target) else os.path.join(base, target)
        if depth < 4 and target.endswith(".sh") and os.path.isfile(target):
            found = _sourced_model_file(target, depth + 1)
            if found:
                return found
    return None


def _flag(on: bool, *flags: str) -> List[str]:
    return list(flags) if on else []


def geometry(model: Model) -> List[Setting]:
    """The model's settings (``NUM_LAYERS`` ... ``SEQ_LENGTH``)."""
    out: List[Setting] = [
        ("NUM_LAYERS", str(model.layers), ["--num-layers", str(model.layers)]),
        ("HIDDEN_SIZE", str(model.hidden), ["--hidden-size", str(model.hidden)]),
        ("FFN_HIDDEN_SIZE", str(model.ffn), ["--ffn-hidden-size", str(model.ffn)]),
        ("NUM_ATTENTION_HEADS", str(model.heads), ["--num-attention-heads", str(model.heads)]),
    ]
    if model.query_groups and model.query_groups != model.heads:
        out.append(("NUM_QUERY_GROUPS", str(model.query_groups),
                    ["--group-query-attention", "--num-query-groups", str(model.query_groups)]))
    if model.kv_channels:
        out.append(("KV_CHANNELS", str(model.kv_channels),
                    ["--kv-channels", str(model.kv_channels)]))
    out += [
        ("SWIGLU", str(int(model.swiglu)), _flag(model.swiglu, "--swiglu")),
        ("UNTIE_EMBEDDINGS", str(int(not model.tied)),
         _flag(not model.tied, "--untie-embeddings-and-output-weights")),
        ("QK_LAYERNORM", str(int(model.qk_layernorm)), _flag(model.qk_layernorm, "--qk-layernorm")),
        ("ADD_QKV_BIAS", str(int(model.add_qkv_bias)), _flag(model.add_qkv_bias, "--add-qkv-bias")),
        # the tokenizer's (NullTokenizer: --vocab-size; without the end-of-document token that
        # Megatron's NullTokenizer adds at core_v0.16.1 and a --config's plan counts)
        ("VOCAB_SIZE", str(model.vocab - _planned_eod(model)), []),
    ]
    if model.moe:  # their flags travel in EXTRA_ARGS (:func:`moe_flags`)
        out += [("NUM_EXPERTS", str(model.experts), []), ("MOE_ROUTER_TOPK", str(model.topk), []),
                ("MOE_FFN_HIDDEN_SIZE", str(model.moe_ffn or model.ffn), []),
                ("MOE_LAYER_FREQ", layer_freq_arg(model), [])]
    out += [
        ("SEQ_LENGTH", str(model.seq), ["--seq-length", str(model.seq),
                                        "--max-position-embeddings", str(model.seq)]),
    ]
    return out


def global_batch(job: Job) -> int:
    """The global batch the plan's iteration trains: micro-batch × DP × the iteration's
    micro-batches (``--microbatches``, else PP, as :func:`.step_time.step_time` counts them)."""
    return job.micro_batch * job.dp * (job.microbatches or job.pp)


def job_settings(job: Job, mode: str) -> List[Setting]:
    """The layout and the training options of ``mode`` (see the module's table); ``ValueError``
    for mode ``alst`` (ALST's recipe, not a Megatron-LM job)."""
    if mode == "alst":
        raise ValueError("mode alst is ALST's published recipe (DeepSpeed), not a Megatron-LM job")
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    if mode == "metp":
        tp, metp, cp = lay.t, lay.p, lay.cp
    else:  # stock: TP t, the K/V ring (cp, ring) over c
        tp, metp, cp = lay.t, 1, lay.c
    world = tp * metp * cp * job.pp * job.dp
    per_node = min(8, world) if world % min(8, world) == 0 else world
    out: List[Setting] = [
        ("NNODES", str(world // per_node), []), ("GPUS_PER_NODE", str(per_node), []),
        ("TP", str(tp), ["--tensor-model-parallel-size", str(tp)]),
        ("METP", str(metp), ["--metp-parallel-size", str(metp)]),
        ("CP", str(cp), _flag(cp > 1, "--context-parallel-size", str(cp))),
        ("PP", str(job.pp), ["--pipeline-model-parallel-size", str(job.pp)]),
        ("SEQUENCE_PARALLEL", str(int(lay.sp)), _flag(lay.sp, "--sequence-parallel")),
        ("MICRO_BATCH_SIZE", str(job.micro_batch), ["--micro-batch-size", str(job.micro_batch)]),
        ("GLOBAL_BATCH_SIZE", str(global_batch(job)), ["--global-batch-size",
                                                       str(global_batch(job))]),
        ("DISTRIBUTED_OPTIMIZER", str(int(job.distributed_optimizer)),
         _flag(job.distributed_optimizer, "--use-distributed-optimizer")),
    ]
    if lay.vocab:
        out.append(("METP_VOCAB_PARALLEL", "1", ["--metp-vocab-parallel"]))
    if job.keep_intermediate and mode == "metp":
        out.append(("METP_KEEP_INTERMEDIATE", "1", ["--metp-keep-intermediate"]))
    if job.kernel == "unfused":  # METP: fp32 block scores; stock: Megatron's local spec
        out.append(("METP_ATTENTION_KERNEL", "reference", ["--metp-attention-kernel", "reference"])
                   if mode == "metp" else
                   ("TRANSFORMER_IMPL", "local", ["--transformer-impl", "local"]))
    if job.recompute != "none":
        out.append(("RECOMPUTE_GRANULARITY", job.recompute,
                    ["--recompute-granularity", job.recompute]))
        if job.recompute == "full":
            out += [("RECOMPUTE_METHOD", job.recompute_method,
                     ["--recompute-method", job.recompute_method]),
                    ("RECOMPUTE_NUM_LAYERS", str(job.recompute_num_layers),
                     ["--recompute-num-layers", str(job.recompute_num_layers)])]
    if job.offload:
        out.append(("METP_OFFLOAD_ACTIVATIONS", "1", ["--metp-offload-activations"]))
        if job.offload_layers is not None:
            out.append(("METP_OFFLOAD_LAYERS", str(job.offload_layers),
                        ["--metp-offload-activations", str(job.offload_layers)]))
        if not job.offload_prefetch:
            out.append(("METP_OFFLOAD_PREFETCH", "0", []))
    if job.mlp_token_tile is not None and mode == "metp":  # the tiles the plan assumed
        out.append(("METP_MLP_TOKEN_TILE", str(job.mlp_token_tile),
                    ["--metp-mlp-token-tile", str(job.mlp_token_tile)]))
    if job.optimizer_offload:
        out.append(("EXTRA_ARGS", " ".join(OPTIMIZER_OFFLOAD_ARGS), list(OPTIMIZER_OFFLOAD_ARGS)))
    if job.moe_tile_count is not None and mode == "metp":  # (pretrain_gpt.sh: no variable)
        flags = ["--metp-moe-token-tiles", str(job.moe_tile_count)]
        out.append(("EXTRA_ARGS", " ".join(flags), flags))
    if job.keep_attention_output is not None and mode == "metp":  # (.keep; no variable)
        if job.keep_attention_output == KEEP_AUTO:
            raise ValueError("kept attention without a count: resolve it first "
                             "(.partial.resolve_keep; launch.settings does)")
        flags = [KEEP_FLAG, str(job.keep_attention_output)]
        out.append(("EXTRA_ARGS", " ".join(flags), flags))
    return out


def moe_flags(model: Model, job: Job, mode: str) -> List[str]:
    """A MoE model's ``pretrain_gpt.py`` flags (``scripts/pretrain_gpt.sh`` takes them in
    ``EXTRA_ARGS``, as the ``configs/*-moe.sh`` do): experts, top-k, expert FFN, MoE layer
    frequency, dispatcher; stock modes add ``--expert-model-parallel-size`` (METP sets EP = p
    itself; a wider EP, a multiple of p, is given); then the rest of the model file's recipe (:func:`.recipe.recipe_flags`: the
    load-balancing loss and its coefficient, ...), which the plan does not set itself."""
    if not model.moe:
        return []
    out = ["--num-experts", str(model.experts), "--moe-router-topk", str(model.topk)]
    if model.moe_ffn:
        out += ["--moe-ffn-hidden-size", str(model.moe_ffn)]
    out += ["--moe-layer-freq", layer_freq_arg(model)]
    if model.moe_shared_ffn:
        out += ["--moe-shared-expert-intermediate-size", str(model.moe_shared_ffn)]
    out += ["--moe-token-dispatcher-type", job.moe_dispatcher]
    if job.moe_grouped_gemm:
        out.append("--moe-grouped-gemm")
    if canonical(mode, job)[0] != "metp" and (job.ep or 1) > 1 or \
            canonical(mode, job)[0] == "metp" and (job.ep or 1) > job.metp:  # wider than METP
        out += ["--expert-model-parallel-size", str(job.ep)]
    return merge_recipe(out, recipe_flags(model_file(model)))


def settings(model: Model, job: Job, mode: str) -> List[Setting]:
    """Every setting of the job: :func:`geometry`, then :func:`job_settings`; a MoE model's
    flags (:func:`moe_flags`) join ``EXTRA_ARGS``. Kept attention without a count is launched
    with the count the plan chooses (:func:`.partial.resolve_keep`)."""
    if job.keep_attention_output == KEEP_AUTO:
        chosen = resolve_keep(model, resolve_offload(model, job, mode), mode)
        job = replace(job, keep_attention_output=chosen.keep_attention_output)
    out = geometry(model) + job_settings(job, mode)
    moe = moe_flags(model, job, mode) + mla_flags(model)
    if model.moe:
        out.append(("MOE_TOKEN_DISPATCHER", job.moe_dispatcher, []))
        if canonical(mode, job)[0] != "metp" and (job.ep or 1) > 1:
            out.append(("EP", str(job.ep), []))
    extra = [f for name, _, fl in out if name == "EXTRA_ARGS" for f in fl]
    if moe or sum(x[0] == "EXTRA_ARGS" for x in out) > 1:  # one EXTRA_ARGS array
        out = [x for x in out if x[0] != "EXTRA_ARGS"]
        out.append(("EXTRA_ARGS", " ".join(moe + extra), moe + extra))
    return _one_extra_args(out)


def _one_extra_args(out: List[Setting]) -> List[Setting]:
    """The settings with every ``EXTRA_ARGS`` entry joined into one (the last place of one)."""
    extra = [x for x in out if x[0] == "EXTRA_ARGS"]
    if len(extra) < 2:
        return out
    flags = [f for _, _, fl in extra for f in fl]
    return [x for x in out if x[0] != "EXTRA_ARGS"] + [("EXTRA_ARGS", " ".join(flags), flags)]


def megatron_flags(model: Model, job: Job, mode: str) -> List[str]:
    """``pretrain_gpt.py``'s arguments for these settings (``--bf16`` included; no data,
    tokenizer or schedule arguments)."""
    flags: List[str] = []
    for name, _, f in settings(model, job, mode):
        if name == "METP_OFFLOAD_LAYERS":  # --metp-offload-activations N replaces the bare flag
            flags.remove("--metp-offload-activations")
        flags += f
    return flags + ["--bf16"]


def _model_file_values(model: Model) -> Dict[str, str]:
    path = model_file(model)
    if path is None:
        return {}
    return {k.upper(): str(int(v) if isinstance(v, bool) else v)
            for k, v in read_config(path).items()}


def launch_line(model: Model, job: Job, mode: str) -> str:
    """One command line: the settings as environment variables (those the model file already
    gives left out) and the model file as the config. On one node ``scripts/pretrain_gpt.sh
    --config FILE``; on several, ``CONFIG=FILE sbatch --nodes=N scripts/slurm/pretrain_gpt.sbatch``
    (Slurm starts one torchrun per node and sets ``NNODES``; the script also needs
    ``MEGATRON_LM_DIR`` or ``CONTAINER_IMAGE`` and names them when missing)."""
    path = model_file(model)
    given = dict(LAUNCHER_DEFAULTS, **_model_file_values(model))
    every = settings(model, job, mode)
    values = {name: value for name, value, _ in every}
    given["SEQUENCE_PARALLEL"] = str(int(values["TP"] != "1" and values["METP"] == "1"))
    nnodes = int(values["NNODES"])
    env = [f"{name}={shlex.quote(value)}" for name, value, _ in every
           if given.get(name) != value and not (name == "NNODES" and nnodes > 1)]
    config = f"configs/models/{os.path.basename(path)}" if path else \
        "configs/models/tiny.sh"  # every geometry value is set above
    if nnodes > 1:
        return " ".join(env + [f"CONFIG={config}"]) + \
            f" sbatch --nodes={nnodes} scripts/slurm/pretrain_gpt.sbatch"
    return " ".join(env) + " scripts/pretrain_gpt.sh --config " + config


def config_text(model: Model, job: Job, mode: str, title: str) -> str:
    """A ``configs/*.sh``-style file of the job (``: "${VAR:=value}"`` defaults, the environment
    wins): every geometry value (``metp plan --config FILE`` reads them), then the model file
    for what the plan does not model (norm, RoPE base, biases), then the layout and options."""
    lines = ["# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, "
             "which reads these", f"# {title}",
             "# Values here are defaults: anything already set in the environment wins."]
    extra = None
    for name, value, _ in geometry(model):
        lines.append(f': "${{{name}:={value}}}"')
    if model_file(model):
        lines += ["# shellcheck source=/dev/null",
                  f'source "${{METP_DIR:?}}/configs/models/{os.path.basename(model_file(model))}"']
    for name, value, _ in settings(model, job, mode)[len(geometry(model)):]:
        if name == "EXTRA_ARGS":
            extra = value
            continue
        lines.append(f': "${{{name}:={value}}}"')
    if extra:
        lines.append(f"EXTRA_ARGS=({extra})")
    return "\n".join(lines) + "\n"


__all__ = ["LAUNCHER_DEFAULTS", "MODELS_DIR", "OPTIMIZER_OFFLOAD_ARGS", "config_text", "geometry",
           "global_batch", "job_settings",
           "launch_line", "megatron_flags", "model_file", "settings"]
