"""Every ``config.json`` key of a supported family: mapped, checked, harmless, or refused.

:func:`check_keys` runs on the canonical config (:func:`.versions.canonical`: transformers
4.x names) before any tensor is read. Per family (:func:`family_keys`) a key is

* **mapped**: it becomes a Megatron-LM flag or decides a weight's layout (:data:`MAPPED`);
* **checked**: it must hold a value METP reproduces (:data:`CHECKED`: the value; the check is
  here, or where the key is read, naming key and value);
* **harmless**: it does not change the model's weights or logits (:data:`HARMLESS`, with the
  reason);

and any other key is refused, naming it, its value and what would be needed. The RoPE settings
inside ``rope_scaling`` / ``rope_parameters`` are checked per ``rope_type``
(:data:`ROPE_KEYS`). The table is printed in docs/huggingface.md ("transformers 5 and the
config.json keys").
"""

from __future__ import annotations

from .errors import HFConfigError
from .yarn import YARN_KEYS

_SHAPE = "the model's shape (Megatron flag of the same name)"
#: key -> what it maps to (every family has these)
MAPPED = {
    "model_type": "the family (one of the eleven)",
    "architectures": "must hold the family's causal LM (LlamaForCausalLM, ...)",
    "vocab_size": "the embedding and output rows (Megatron pads them)",
    "hidden_size": "--hidden-size",
    "intermediate_size": "--ffn-hidden-size (Mixtral: --moe-ffn-hidden-size)",
    "num_hidden_layers": "--num-layers",
    "num_attention_heads": "--num-attention-heads",
    "num_key_value_heads": "--num-query-groups",
    "head_dim": "--kv-channels",
    "rms_norm_eps": "--norm-epsilon",
    "rope_theta": "--rotary-base (5.x: rope_parameters.rope_theta)",
    "rope_scaling": "--use-rope-scaling (llama3) or --position-embedding-type yarn (5.x: "
                    "rope_parameters)",
    "max_position_embeddings": "--max-position-embeddings",
    "tie_word_embeddings": "--untie-embeddings-and-output-weights when false",
    "torch_dtype": "the checkpoint dtype (5.x: dtype)",
    "dtype": "the checkpoint dtype (4.x: torch_dtype)",
}
#: family-specific mapped keys
MAPPED_BY_FAMILY = {
    "mistral": {"sliding_window": "caps --max-position-embeddings (see Sliding windows)"},
    "qwen2": {"sliding_window": "as Mistral's, where use_sliding_window / layer_types use it",
              "max_window_layers": "which layers slide, through layer_types (a file without "
                                   "layer_types: the window counts for every layer)"},
    "qwen3_moe": {"sliding_window": "as Mistral's, when use_sliding_window",
                  "num_experts": "--num-experts (5.x: num_local_experts)",
                  "num_experts_per_tok": "--moe-router-topk",
                  "moe_intermediate_size": "--moe-ffn-hidden-size",
                  "decoder_sparse_step": "--moe-layer-freq (with mlp_only_layers)",
                  "mlp_only_layers": "--moe-layer-freq",
                  "norm_topk_prob": "--moe-router-pre-softmax when false",
                  "output_router_logits": "--moe-aux-loss-coeff 0 when false",
                  "router_aux_loss_coef": "--moe-aux-loss-coeff when output_router_logits"},
    "mixtral": {"sliding_window": "as Mistral's",
                "num_local_experts": "--num-experts",
                "num_experts_per_tok": "--moe-router-topk",
                "output_router_logits": "--moe-aux-loss-coeff 0 when false",
                "router_aux_loss_coef": "--moe-aux-loss-coeff when output_router_logits"},
}
MAPPED_BY_FAMILY["qwen3"] = dict(MAPPED_BY_FAMILY["qwen2"])
MAPPED_BY_FAMILY["qwen2_moe"] = {
    **MAPPED_BY_FAMILY["qwen2"], **{k: v for k, v in MAPPED_BY_FAMILY["qwen3_moe"].items()
                                    if k != "sliding_window"},
    "shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size (with "
                                       "--moe-shared-expert-gate: shared_expert_gate)",
    "num_experts": "--num-experts",
    "qkv_bias": "--add-qkv-bias when true (the default)"}
MAPPED_BY_FAMILY["gpt_oss"] = {
    **{k: v for k, v in MAPPED_BY_FAMILY["mixtral"].items() if k != "sliding_window"},
    "sliding_window": "caps --max-position-embeddings on the layer_types that slide (see "
                      "Sliding windows)",
    "layer_types": "'sliding_attention' layers take the sliding-window rule",
    "attention_bias": "--add-bias-linear (must be true: the experts and router have biases)",
    "swiglu_limit": "--activation-func-clamp-value (4.x: 7.0 in the code)",
    "swiglu_alpha": "must be 1.702 (--quick-geglu's constant)"}
MAPPED_BY_FAMILY["glm4_moe"] = {
    "n_routed_experts": "--num-experts", "num_experts_per_tok": "--moe-router-topk",
    "moe_intermediate_size": "--moe-ffn-hidden-size",
    "n_shared_experts": "--moe-shared-expert-intermediate-size (x moe_intermediate_size)",
    "first_k_dense_replace": "--moe-layer-freq (the leading dense layers)",
    "n_group": "--moe-router-num-groups (when topk_group < n_group)",
    "topk_group": "--moe-router-group-topk", "norm_topk_prob": "must be true when "
    "num_experts_per_tok > 1 (megatron-core's sigmoid router renormalises)",
    "routed_scaling_factor": "--moe-router-topk-scaling-factor",
    "use_qk_norm": "--qk-layernorm", "attention_bias": "--add-qkv-bias (q/k/v only)",
    "partial_rotary_factor": "--rotary-percent",
    "output_router_logits": "must be false (GLM-4.5 trains without an auxiliary loss: "
                            "the expert bias balances the load)",
    "router_aux_loss_coef": "unused while output_router_logits is false"}

_MLA = {
    "kv_lora_rank": "--kv-lora-rank (with --multi-latent-attention --qk-layernorm)",
    "q_lora_rank": "--q-lora-rank (null: no query latent, the flag left out)",
    "qk_nope_head_dim": "--qk-head-dim", "qk_rope_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim",
    "head_dim": "must be qk_rope_head_dim (transformers writes its RoPE width there)",
    "qk_head_dim": "must be qk_nope_head_dim + qk_rope_head_dim",
    "num_key_value_heads": "must be num_attention_heads (MLA has no grouped K/V)",
    "rope_scaling": "--rope-type rope, or --rope-type yarn --rotary-scaling-factor --mscale "
                    "--mscale-all-dim (5.x: rope_parameters)",
    "n_routed_experts": "--num-experts", "num_experts_per_tok": "--moe-router-topk",
    "moe_intermediate_size": "--moe-ffn-hidden-size",
    "n_shared_experts": "--moe-shared-expert-intermediate-size (x moe_intermediate_size)",
    "first_k_dense_replace": "--moe-layer-freq (the leading dense layers)",
    "moe_layer_freq": "must be 1 (DeepSeek's own config.json; transformers ignores it)",
    "routed_scaling_factor": "--moe-router-topk-scaling-factor",
    "output_router_logits": "must be false (5.x; no auxiliary loss is converted)"}
MAPPED_BY_FAMILY["deepseek_v2"] = {
    **_MLA, "topk_method": "'greedy', or 'group_limited_greedy': --moe-router-num-groups "
                           "--moe-router-group-topk (when num_experts_per_tok = topk_group)",
    "n_group": "--moe-router-num-groups (group_limited_greedy)",
    "topk_group": "--moe-router-group-topk (group_limited_greedy)",
    "norm_topk_prob": "must be false (transformers' DeepSeek-V2 never renormalises; the router "
                      "is --moe-router-pre-softmax)",
    "scoring_func": "must be 'softmax' (DeepSeek's own config.json)"}
MAPPED_BY_FAMILY["deepseek_v3"] = {
    **_MLA, **{k: MAPPED_BY_FAMILY["glm4_moe"][k] for k in ("n_group", "topk_group",
                                                             "norm_topk_prob")},
    "topk_method": "must be 'noaux_tc' (DeepSeek's own config.json): "
                   "--moe-router-score-function sigmoid --moe-router-enable-expert-bias",
    "scoring_func": "must be 'sigmoid' (DeepSeek's own config.json)",
    "rope_interleave": "must be true (Megatron's MLA rotates interleaved pairs)"}

_OFF = (None, 0, 0.0, False)
#: key -> (the values METP reproduces, in words; the values, or None where the key's reader
#: checks it with its own message)
CHECKED = {
    "hidden_act": ("'silu' (--swiglu)", None),
    "attention_dropout": ("0.0 (no attention dropout in METP)", None),
    "partial_rotary_factor": ("1.0 or null (RoPE over the whole head)", None),
    "attention_bias": ("false (only Qwen2's q/k/v bias converts)", None),
    "mlp_bias": ("false (Megatron --disable-bias-linear)", None),
    "layer_types": ("'full_attention', or 'sliding_attention' under the sliding-window rule",
                    None),
    "use_sliding_window": ("false, or a window the sequence never reaches", None),
    "router_jitter_noise": ("0.0 (Mixtral)", None),
    "pretraining_tp": ("1 (Llama's split matmuls for tensor-parallel pretraining)", (1,)),
    "pruned_heads": ("{} (no pruned attention heads)", ({},)),
    "chunk_size_feed_forward": ("0 (the MLP over the whole sequence at once)", (0,)),
    "is_encoder_decoder": ("false (decoder-only)", (False,)),
    "add_cross_attention": ("false (no cross-attention)", (False,)),
    "tie_encoder_decoder": ("false (no encoder)", (False,)),
    "cross_attention_hidden_size": ("null (no cross-attention)", (None,)),
    # other variants' features (families.UNSUPPORTED_FIELDS refuses them when set)
    "attn_logit_softcapping": ("null or 0 (Gemma 2's soft-capping)", _OFF),
    "final_logit_softcapping": ("null or 0 (Gemma 2's soft-capping)", _OFF),
    "query_pre_attn_scalar": ("null (Gemma 2's softmax scale)", _OFF),
    "kv_lora_rank": ("null (DeepSeek's multi-latent attention)", _OFF),
    "q_lora_rank": ("null (DeepSeek's multi-latent attention)", _OFF),
}
_GEN = "a generation (decoding) setting that 4.x kept in config.json; no effect on the logits"
_TOK = "a token id for generation and the tokenizer; not a weight, no effect on the logits"
_OUT = "what the forward returns (format only), not its values"
_CLS = "a sequence-classification head's labels; the causal LM has none"
#: key -> why it changes neither weights nor logits
HARMLESS = {
    "transformers_version": "the version that wrote the file",
    "_name_or_path": "where the config was loaded from",
    "use_cache": "the key/value cache of generation",
    "initializer_range": "random initialisation only; the weights are read from the safetensors",
    "_attn_implementation_autoset": "transformers' attention-kernel bookkeeping",
    "bos_token_id": _TOK, "eos_token_id": _TOK, "pad_token_id": _TOK, "sep_token_id": _TOK,
    "decoder_start_token_id": _TOK, "forced_bos_token_id": _GEN, "forced_eos_token_id": _GEN,
    "output_attentions": _OUT, "output_hidden_states": _OUT, "return_dict": _OUT,
    "torchscript": "tracing for TorchScript (ties weights by cloning); same values",
    "id2label": _CLS, "label2id": _CLS, "num_labels": _CLS, "problem_type": _CLS,
    "finetuning_task": _CLS,
    "tokenizer_class": "the tokenizer's class (tokenizer files travel separately)",
    "prefix": "a text-generation pipeline prompt prefix", "task_specific_params": _GEN,
    "is_decoder": "read by encoder models only; these families' attention is always causal",
    "use_bfloat16": "TensorFlow/Flax only (4.x)", "tf_legacy_loss": "TensorFlow only (4.x)",
    **{k: _GEN for k in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens")},
}
#: family-specific harmless keys
HARMLESS_BY_FAMILY = {
    "qwen3_moe": {"max_window_layers": "not read by transformers' Qwen3-MoE (its window, when "
                                       "use_sliding_window, applies to every layer)",
                  },
    "glm4_moe": {"num_nextn_predict_layers": "multi-token-prediction layers, which "
                                             "transformers' model neither builds nor loads "
                                             "(their tensors, if present, are refused)"},
    "deepseek_v2": {k: v for k, v in {
        "aux_loss_alpha": "the weight of DeepSeek's auxiliary balance loss in training; "
                          "transformers' model computes none and it changes no weight or logit "
                          "(the converted run has --moe-aux-loss-coeff 0)",
        "seq_aux": "whether that loss is per sequence; as aux_loss_alpha",
        "ep_size": "DeepSeek's own code's expert-parallel size for inference; no weight or "
                   "logit",
        "auto_map": "the remote-code classes of DeepSeek's repository (trust_remote_code); the "
                    "conversion follows the keys, not that code"}.items()},
}
HARMLESS_BY_FAMILY["deepseek_v3"] = {**HARMLESS_BY_FAMILY["deepseek_v2"],
                                     **HARMLESS_BY_FAMILY["glm4_moe"]}
#: family-specific checked keys (beyond CHECKED, which every family may carry)
_FAMILY_CHECKED = {"qwen2": ("layer_types", "use_sliding_window"),
                   "qwen3": ("layer_types", "use_sliding_window"),
                   "qwen2_moe": ("layer_types", "use_sliding_window"),
                   "qwen3_moe": ("use_sliding_window",), "mixtral": ("router_jitter_noise",)}
_ONLY_SOME = {"layer_types", "use_sliding_window", "router_jitter_noise"}
#: family -> checked keys of that family alone, as CHECKED
CHECKED_BY_FAMILY = {
    "llama": {"sliding_window": ("null (transformers' Llama has no sliding window: a set one "
                                 "means a model of another family)", (None,))},
}

#: rope_type -> the keys its rope_scaling / rope_parameters may hold (the values: .config,
#: .yarn)
ROPE_KEYS = {"default": {"rope_type", "type"},
             "llama3": {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"},
             "yarn": set(YARN_KEYS)}


def family_keys(family: str) -> dict:
    """``{"mapped": {key: what}, "checked": {key: value}, "harmless": {key: why}}`` of one
    family."""
    mapped = {**MAPPED, **MAPPED_BY_FAMILY.get(family, {})}
    checked = {k: v[0] for k, v in CHECKED.items() if k not in _ONLY_SOME}
    checked.update({k: CHECKED[k][0] for k in _FAMILY_CHECKED.get(family, ())})
    checked.update({k: v[0] for k, v in CHECKED_BY_FAMILY.get(family, {}).items()})
    checked = {k: v for k, v in checked.items() if k not in mapped}
    harmless = dict(HARMLESS)
    harmless.update(HARMLESS_BY_FAMILY.get(family, {}))
    return {"mapped": mapped, "checked": checked,
            "harmless": harmless}


def _err(msg: str):
    return HFConfigError(msg)


def check_keys(cfg: dict, family: str, *, rope_source: str = "rope_scaling") -> None:
    """Refuse any key of the canonical ``cfg`` that ``family`` neither maps, checks nor knows to
    be harmless, and the checked keys checked here whose value METP cannot reproduce."""
    table = family_keys(family)
    known = set(table["mapped"]) | set(table["checked"]) | set(table["harmless"])
    unknown = sorted(k for k in cfg if k not in known and not k.startswith("_rope_source"))
    if unknown:
        shown = ", ".join(f"{k} = {cfg[k]!r}" for k in unknown)
        raise _err(f"config.json: {shown}: not a key of a {family!r} config that the converter "
                   f"maps, checks or knows to be harmless (docs/huggingface.md lists them), so "
                   f"it could change the model unseen; a model that needs it cannot convert "
                   f"until the converter implements it; if it is truly inert, delete it from "
                   f"config.json")
    for key, (want, allowed) in {**CHECKED, **CHECKED_BY_FAMILY.get(family, {})}.items():
        if key in cfg and allowed is not None and key in table["checked"] and \
                not any(cfg[key] == a and type(cfg[key]) is type(a) for a in allowed):
            raise _err(f"config.json: {key} = {cfg[key]!r} is not supported: it must be {want}")
    rs = cfg.get("rope_scaling")
    if isinstance(rs, dict):
        kind = rs.get("rope_type", rs.get("type", "default"))
        extra = sorted(set(rs) - ROPE_KEYS.get(kind, set(rs)))
        if extra:
            raise _err(f"config.json: {rope_source} has {extra} besides the keys of rope_type "
                       f"{kind!r} {sorted(ROPE_KEYS[kind])}: it cannot be reproduced; remove "
                       f"them")


def markdown_table() -> str:
    """The key table as docs/huggingface.md prints it (tests/test_hf_versions.py checks that
    the doc holds exactly this): the keys of every family, then each family's own."""
    fams = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe",
            "glm4_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")
    tables = {f: family_keys(f) for f in fams}
    kinds = ("mapped", "checked", "harmless")
    # common: the same in every family, or mapped by a family instead (its own row below)
    common = {kind: {k: v for k, v in tables["llama"][kind].items()
                     if all(tables[f][kind].get(k) == v or k in tables[f]["mapped"]
                            for f in fams)}
              for kind in kinds}
    rows = ["| key | kind | maps to / must be / why harmless |", "|---|---|---|"]
    for kind in kinds:
        by_why = {}
        for k, v in common[kind].items():
            by_why.setdefault(v, []).append(k)
        for v, keys in by_why.items():
            rows.append(f"| {', '.join(f'`{k}`' for k in keys)} | {kind} | {v} |")
    out = ["Every family (where a family maps a key, its own row below says how):", ""] + rows
    for f in fams:
        own = [f"| `{k}` | {kind} | {v} |" for kind in kinds
               for k, v in tables[f][kind].items() if common[kind].get(k) != v]
        if own:
            out += ["", f"`{f}` also:", "", "| key | kind | maps to / must be / why |",
                    "|---|---|---|"] + own
    return "\n".join(out) + "\n"
