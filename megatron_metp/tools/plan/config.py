"""``metp plan --config``: the model and job fields of a config file (``key=value``, YAML-like
``key: value``, or the repo's ``configs/*.sh`` with their ``source``d model files)."""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

from .config_flags import flag_values

#: config keys → Model fields / Job fields (``--config`` files: key=value, YAML ``key: value``
#: or the repo's ``configs/*.sh`` with ``: "${KEY:=value}"`` lines and ``source`` of a model file)
_MODEL_KEYS = {
    "hidden": "hidden", "hidden_size": "hidden",
    "layers": "layers", "num_layers": "layers",
    "heads": "heads", "num_attention_heads": "heads", "num_heads": "heads",
    "query_groups": "query_groups", "num_query_groups": "query_groups",
    "ffn": "ffn", "ffn_hidden_size": "ffn",
    "vocab": "vocab", "vocab_size": "vocab", "padded_vocab_size": "vocab",
    "seq": "seq", "seq_length": "seq", "seq_len": "seq",
    "swiglu": "swiglu", "untie": "untie", "untie_embeddings": "untie",
    "untie_embeddings_and_output_weights": "untie", "tied": "tied",
    "kv_channels": "kv_channels", "qk_layernorm": "qk_layernorm",
    "add_qkv_bias": "add_qkv_bias",
    "num_experts": "experts", "moe_router_topk": "topk", "moe_ffn_hidden_size": "moe_ffn",
    "moe_layer_freq": "moe_layer_freq",
}
_JOB_KEYS = {
    "tp": "tp", "tensor_model_parallel_size": "tp",
    "metp": "metp", "metp_parallel_size": "metp",
    "pp": "pp", "pipeline_model_parallel_size": "pp",
    "dp": "dp",
    "micro_batch": "micro_batch", "micro_batch_size": "micro_batch",
    "vocab_parallel": "vocab_parallel", "metp_vocab_parallel": "vocab_parallel",
    "ep": "ep", "expert_model_parallel_size": "ep",
    "moe_token_dispatcher": "moe_dispatcher", "moe_token_dispatcher_type": "moe_dispatcher",
    "global_batch": "global_batch", "global_batch_size": "global_batch",
    # token tiles (scripts/pretrain_gpt.sh: METP_MLP_TOKEN_TILE -> --metp-mlp-token-tile)
    "metp_mlp_token_tile": "mlp_token_tile", "mlp_token_tile": "mlp_token_tile",
    "metp_moe_token_tiles": "moe_tile_count",
}
#: ``pretrain_gpt.py`` flags in a config's ``EXTRA_ARGS`` / ``MOE_ARGS`` → Job fields (the last
#: occurrence wins, as in Megatron-LM's argument parser)
_FLAG_KEYS = {"--metp-mlp-token-tile": "mlp_token_tile",
              "--metp-moe-token-tiles": "moe_tile_count"}


def _coerce(v: str):
    v = v.strip().strip('"').strip("'")
    low = v.lower()
    if low in ("true", "yes", "on", "1") and low != "1":
        return True
    if low in ("false", "no", "off", "none", ""):
        return False if low != "none" else None
    try:
        return int(float(v)) if re.fullmatch(r"[0-9.eE+-]+", v) else v
    except ValueError:
        return v


def _logical_lines(text: str) -> List[str]:
    """The non-empty lines of a config, comments dropped, a bash array assignment that spans
    lines (``EXTRA_ARGS=(a b`` ... ``c)``) joined into one line."""
    out: List[str] = []
    open_parens = 0
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip() if not raw.strip().startswith("#") else ""
        if not line:
            continue
        if open_parens > 0:
            out[-1] += " " + line
        else:
            out.append(line)
        if open_parens > 0 or re.match(r'^(?:export\s+)?[A-Za-z_][A-Za-z0-9_]*\+?=\(', line):
            open_parens += line.count("(") - line.count(")")
    return out


def read_config(path: str, _seen: Optional[set] = None,
                _into: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """Key/values of a config file: ``key=value`` / ``key: value`` lines (YAML-like, one level),
    ``export KEY=value``, and bash ``: "${KEY:=value}"`` defaults (the environment's ``KEY`` wins
    over such a default, as in bash); ``source FILE`` lines (the repo's
    ``configs/*.sh`` source ``models/*.sh``) are followed relative to the file, as bash runs them
    (a sourced ``:=`` default does not replace a value set before). Keys are lowered
    and ``-`` becomes ``_``; unknown keys are kept (:func:`from_config` refuses them in a
    ``key=value`` / YAML file; a ``configs/*.sh`` also sets the launcher's own variables)."""
    _seen = _seen or set()
    path = os.path.abspath(path)
    if path in _seen:
        return {} if _into is None else _into
    _seen.add(path)
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    out: Dict[str, object] = {} if _into is None else _into  # a sourced file sees what is set
    base = os.path.dirname(path)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    for line in _logical_lines(text):
        m = re.match(r'^(?:source|\.)\s+(.+)$', line)
        if m:
            target = m.group(1).strip()
            for pat in ('$(dirname "${BASH_SOURCE[0]}")', "$(dirname ${BASH_SOURCE[0]})",
                        '$(dirname "$0")', "$(dirname $0)"):
                target = target.replace(pat, base)
            target = target.strip('"').strip("'")
            if not os.path.isabs(target):
                target = os.path.join(base, target)
            if os.path.isfile(target):
                read_config(target, _seen, out)
            continue
        for m in re.finditer(r'\$\{([A-Za-z_][A-Za-z0-9_]*):?=([^}]*)\}', line):
            # a default: the environment wins, as in bash (and scripts/pretrain_gpt.sh)
            out.setdefault(m.group(1).lower(), _coerce(os.environ.get(m.group(1)) or m.group(2)))
        if line.startswith(":"):
            continue
        m = re.match(r'^(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*[:=]\s*(.*)$', line)
        if m and not m.group(2).startswith("="):
            out[m.group(1).lower().replace("-", "_")] = _coerce(m.group(2))
    return out


def from_config(path: str) -> Tuple[Dict[str, object], Dict[str, object]]:
    """``(model fields, job fields)`` found in a config file (see :func:`read_config`)."""
    kv = read_config(path)
    if not path.endswith(".sh"):  # a launcher config sets the launcher's variables too
        unknown = sorted(k for k in kv if k not in _MODEL_KEYS and k not in _JOB_KEYS)
        if unknown:
            raise ValueError(f"--config {path}: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(set(_MODEL_KEYS) | set(_JOB_KEYS)))}")
    model, job = {}, {}
    for k, v in kv.items():
        if k in _MODEL_KEYS and v is not None:
            model[_MODEL_KEYS[k]] = v
        elif k in _JOB_KEYS and v is not None:
            job[_JOB_KEYS[k]] = v
    if "untie" in model:
        model["tied"] = not bool(model.pop("untie"))
    if "tied" in model:
        model["tied"] = bool(model["tied"])
    for key in ("swiglu", "qk_layernorm", "add_qkv_bias"):
        if model.get(key) is not None:
            model[key] = bool(model[key])
    if model.get("kv_channels") in (False, "", 0):  # KV_CHANNELS= (unset in a configs/*.sh)
        model.pop("kv_channels")
    if "vocab_parallel" in job:
        job["vocab_parallel"] = bool(job["vocab_parallel"])
    for key in ("mlp_token_tile", "moe_tile_count"):
        if job.get(key) is False:  # METP_MLP_TOKEN_TILE= (unset in a configs/*.sh)
            job.pop(key)
    if path.endswith(".sh"):
        _launcher_settings(kv, model, job)
    return model, job


def _selective_modules(extra: List[str], job: Dict) -> None:
    """A config's ``EXTRA_ARGS`` ``--recompute-activations`` (selective) and
    ``--recompute-modules``: ``metp plan --recompute selective`` plans Megatron's default module,
    ``core_attn``; other modules are refused naming them (``megatron/selective.py`` says which
    run with METP layers)."""
    if "--recompute-activations" in extra and not job.get("recompute"):
        job["recompute"] = "selective"
    if "--recompute-modules" not in extra:
        return
    i = len(extra) - 1 - extra[::-1].index("--recompute-modules")
    mods = []
    for word in extra[i + 1:]:
        if word.startswith("--"):
            break
        mods.append(word)
    if job.get("recompute") == "selective" and mods != ["core_attn"]:
        raise ValueError(f"--recompute-modules {' '.join(mods)} in the config's EXTRA_ARGS: "
                         f"metp plan plans selective recompute as Megatron's default module, "
                         f"core_attn, only; plan the job with --recompute-modules core_attn (or "
                         f"without the flag), or with RECOMPUTE_GRANULARITY=full")


#: Megatron-LM's kept-attention flag (``--metp-keep-attention-output [N]``)
KEEP_FLAG = "--metp-keep-attention-output"


def keep_flag(argv: List[str], layers: int) -> Optional[int]:
    """``Job.keep_attention_output`` of ``--metp-keep-attention-output [N]`` in ``argv`` (a
    config's ``EXTRA_ARGS`` split; the last occurrence wins): ``N``, or ``layers`` (every layer)
    for the bare flag; ``None`` without it. ``ValueError`` naming the flag for an ``N`` that is
    not a positive integer (a word that is not a flag after it is its value, as argparse reads
    ``nargs="?"``; a bash expansion such as ``${EXTRA_ARGS[@]...}`` after it is not)."""
    out: Optional[int] = None
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if name != KEEP_FLAG:
            continue
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = "" if nxt.startswith("--") or nxt.startswith("$") else nxt
        if value == "":
            out = layers
            continue
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{KEEP_FLAG} {value!r} in the config's EXTRA_ARGS: N is a "
                             f"positive number of layers per pipeline stage (e.g. {KEEP_FLAG} "
                             f"30), or no N for every layer")
        out = int(value)
    return out


def microbatches(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per iteration of a config's global batch: ``global / (micro-batch × DP)``
    (Megatron's count); ``ValueError`` naming ``GLOBAL_BATCH_SIZE`` when it does not divide."""
    global_batch, per = int(global_batch), int(micro_batch) * int(dp)
    if global_batch < 1 or global_batch % per:
        raise ValueError(f"GLOBAL_BATCH_SIZE={global_batch} in the config: Megatron needs a "
                         f"multiple of micro-batch × DP = {micro_batch} × {dp} = {per}; set "
                         f"GLOBAL_BATCH_SIZE to one (e.g. {per * max(1, global_batch // per)})")
    return global_batch // per


def _launcher_settings(kv: Dict[str, object], model: Dict[str, object],
                       job: Dict[str, object]) -> None:
    """What ``scripts/pretrain_gpt.sh`` adds when it launches a ``configs/*.sh`` of this repo, so
    that the plan is the plan of the job it starts: its defaults (tied embeddings, no SwiGLU,
    FFN 4·hidden), the distributed optimizer (unless ``DISTRIBUTED_OPTIMIZER=0``), ``RECOMPUTE_GRANULARITY`` /
    ``RECOMPUTE_METHOD`` / ``RECOMPUTE_NUM_LAYERS``, ``METP_OFFLOAD_ACTIVATIONS`` and
    ``METP_OFFLOAD_LAYERS``, the attention kernel
    (``TRANSFORMER_IMPL=local`` stock layers run Megatron's unfused ``DotProductAttention``;
    METP layers the flash block kernel unless ``METP_ATTENTION_KERNEL=reference``),
    ``METP_KEEP_INTERMEDIATE``, ``--optimizer-cpu-offload`` and ``--metp-keep-attention-output
    [N]`` (:func:`keep_flag`) in ``EXTRA_ARGS``, a stock ``CP``
    as the ring size (plan it with ``--modes ring``),
    data parallelism from ``NNODES × GPUS_PER_NODE`` (default 1 × 8),
    ``GLOBAL_BATCH_SIZE`` (default 8: the iteration's micro-batches, :func:`microbatches`),
    and Megatron's ``NullTokenizer`` (mock data, no ``TOKENIZER_TYPE``), which adds an
    end-of-document token to ``VOCAB_SIZE`` (default 32000) at core_v0.16.1, not at core_v0.19.0
    (the release of the installed megatron-core)."""
    precision = str(kv.get("precision") or "bf16")
    if precision != "bf16":
        raise ValueError(f"PRECISION={precision} in the config: metp plan and metp measure model "
                         f"bf16 mixed-precision training (bf16 weights and activations, fp32 "
                         f"gradients and optimizer state); plan it as bf16 with PRECISION=bf16 in "
                         f"the environment (e.g. PRECISION=bf16 metp plan --config ...)")
    model.setdefault("tied", True)  # UNTIE_EMBEDDINGS=0
    model.setdefault("swiglu", False)  # SWIGLU=0
    if "hidden" in model:
        model.setdefault("ffn", 4 * int(model["hidden"]))  # FFN_HIDDEN_SIZE=4·HIDDEN_SIZE
    job.setdefault("distributed_optimizer", str(kv.get("distributed_optimizer", 1)) != "0")
    metp = int(job.get("metp") or 1)
    if metp > 1:  # the METP layers' block kernel: reference = fp32 block scores
        if kv.get("metp_attention_kernel") == "reference":
            job["kernel"] = "unfused"
    elif kv.get("transformer_impl") == "local":  # Megatron's local spec: DotProductAttention
        job["kernel"] = "unfused"
    if kv.get("metp_keep_intermediate"):
        job["keep_intermediate"] = True
    if kv.get("recompute_granularity"):
        job["recompute"] = str(kv["recompute_granularity"])
        if job["recompute"] == "full":
            job["recompute_method"] = str(kv.get("recompute_method") or "uniform")
            job["recompute_num_layers"] = int(kv.get("recompute_num_layers") or 1)
    if kv.get("metp_offload_activations") not in (None, False, 0, 1, True):
        raise ValueError(f"METP_OFFLOAD_ACTIVATIONS={kv['metp_offload_activations']} in the "
                         f"config: use 0 or 1 (every layer); to offload N layers per pipeline "
                         f"stage set METP_OFFLOAD_ACTIVATIONS=1 METP_OFFLOAD_LAYERS=N")
    if kv.get("metp_offload_activations"):
        job["offload"] = True
        if str(kv.get("metp_offload_prefetch", "1")) == "0":
            job["offload_prefetch"] = False
        if kv.get("metp_offload_layers"):  # --metp-offload-activations N
            job["offload_layers"] = int(kv["metp_offload_layers"])
    elif kv.get("metp_offload_layers"):
        raise ValueError(f"METP_OFFLOAD_LAYERS={kv['metp_offload_layers']} in the config without "
                         f"METP_OFFLOAD_ACTIVATIONS=1: the layers to offload need the offload; "
                         f"set METP_OFFLOAD_ACTIVATIONS=1 or drop METP_OFFLOAD_LAYERS")
    extra = str(kv.get("extra_args") or "").strip("()").split() + \
        str(kv.get("moe_args") or "").strip("()").split() + \
        str(kv.get("mla_args") or "").strip("()").split()  # a DeepSeek config's MLA_ARGS
    if "--optimizer-cpu-offload" in extra:
        job["optimizer_offload"] = True  # EXTRA_ARGS=(--optimizer-cpu-offload ...)
    job.update(flag_values(extra, _FLAG_KEYS))  # after METP_MLP_TOKEN_TILE, as the launcher
    _selective_modules(extra, job)
    keep = keep_flag(extra, int(model.get("layers") or 0))
    if keep is not None:  # --metp-keep-attention-output [N] in EXTRA_ARGS / MOE_ARGS
        job["keep_attention_output"] = keep
    if "--moe-grouped-gemm" in extra:  # a MoE config's MOE_ARGS / EXTRA_ARGS
        job["moe_grouped_gemm"] = True
    from .mla import config_fields, layer_freq  # MLA and DeepSeekMoE flags (.mla)

    if isinstance(model.get("moe_layer_freq"), str):  # MOE_LAYER_FREQ="([0]*k+[1]*m)"
        model.update(layer_freq(model["moe_layer_freq"]))
    model.update(config_fields(extra, kv))
    cp = int(kv.get("cp") or 1)
    if cp > 1 and int(job.get("metp") or 1) == 1:  # a stock context-parallel twin: plan it as
        job["metp"] = cp                           # mode ring (K/V ring over CP, weights whole)
    elif cp > 1:  # METP × CP: CP the outer factor of Megatron's CP group of METP·CP ranks
        job["cp"] = cp
    job.setdefault("global_batch", 8)  # scripts/pretrain_gpt.sh's GLOBAL_BATCH_SIZE default
    world = int(kv.get("nnodes") or 1) * int(kv.get("gpus_per_node") or 8)
    per_replica = int(job.get("tp") or 1) * int(job.get("metp") or 1) * \
        int(job.get("cp") or 1) * int(job.get("pp") or 1)
    if "dp" not in job and world % per_replica == 0:
        job["dp"] = world // per_replica
    eod = null_tokenizer_eod(kv)
    if eod is not None:
        model["vocab"] = int(model.get("vocab") or kv.get("vocab_size") or 32000) + eod


def null_tokenizer_eod(kv: Dict[str, object]) -> Optional[int]:
    """The end-of-document token Megatron's ``NullTokenizer`` (mock data, no ``TOKENIZER_TYPE``)
    adds to a config's ``VOCAB_SIZE``: 1 at core_v0.16.1, 0 at core_v0.19.0 (the installed
    megatron-core's release); ``None`` for a config with another tokenizer."""
    tokenizer = kv.get("tokenizer_type") or ("HuggingFaceTokenizer" if kv.get("data_path")
                                             else "NullTokenizer")
    if tokenizer != "NullTokenizer":
        return None
    from ...megatron_lm.releases import for_megatron_core  # +1 eod at core_v0.16.1 only

    return int(for_megatron_core().null_tokenizer_adds_eod)
