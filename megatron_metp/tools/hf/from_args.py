"""A Hugging Face ``config.json`` from the arguments a Megatron-LM run saved with its checkpoint.

``hf export`` of a model trained from scratch has no Hugging Face config to start from; the
checkpoint's saved ``args`` (:func:`megatron_metp.megatron_lm.saved_args.read_saved_args`) say
what was trained. :func:`hf_config_from_args` picks the family the way the import tells them
apart (:mod:`.families`):

==========================================  =========  ===========================================
saved args                                  family     extra ``config.json`` fields
==========================================  =========  ===========================================
``num_experts`` and ``qk_layernorm``        qwen3_moe  ``num_experts``, ``moe_intermediate_size``,
                                                       ``mlp_only_layers``, ``norm_topk_prob``
``num_experts`` (every layer MoE)           mixtral    ``num_local_experts``, ``sliding_window``
``num_experts``, a gated shared expert      qwen2_moe  as qwen3_moe, ``shared_expert_intermediate_
                                                       size``, ``qkv_bias``
``num_experts``, the sigmoid router         glm4_moe   ``n_routed_experts``, ``n_shared_experts``,
                                                       ``first_k_dense_replace``, ``n_group``, ...
``num_experts``, ``quick_geglu`` or         gpt_oss    ``num_local_experts``, ``swiglu_limit``,
``softmax_type`` learnable                             ``layer_types`` (all ``full_attention``)
``qk_layernorm``                            qwen3      ``head_dim``
``add_qkv_bias``                            qwen2      (q/k/v biases)
``window_size = (W - 1, 0)``                mistral    ``sliding_window = W``
none of these                               llama
==========================================  =========  ===========================================

and fills ``vocab_size`` (Megatron's padded vocabulary: every row of the embedding is exported,
so the softmax runs over the same rows as Megatron's and the losses are equal), ``hidden_size``,
``intermediate_size``, heads, K/V heads, ``head_dim``, ``rope_theta``, ``rms_norm_eps``,
``tie_word_embeddings``, ``max_position_embeddings`` and ``rope_scaling`` (``llama3`` for
``--use-rope-scaling``, ``yarn`` for ``--position-embedding-type yarn``).

The dict is in transformers 4.x's names (``rope_theta``, ``rope_scaling``); ``hf export``
writes it in the installed transformers' layout (:func:`.versions.export_layout`).

There is no second table of names: the config is then read back by the import's own
:func:`~.config.geometry_from_hf` and :func:`~.config.megatron_args`, and each flag those
give must equal the saved value (:func:`check_against_args`), so the written config builds the
model that was trained. A model with no Hugging Face family (LayerNorm, GeLU, biases on every
layer, learned absolute positions, shared experts, ...) is refused first, every mismatch named
at once. The MoE flags are compared by :func:`moe_args_problems` (which layers are MoE,
expanded from either form of ``--moe-layer-freq``).

Export with ``--hf-config`` compares the saved arguments with that config: the MoE flags
(:func:`moe_args_problems`), DeepSeek's MLA flags (:func:`mla_args_problems`) and gpt-oss's
model flags, every one its config implies (:func:`gpt_oss_args_problems`).
"""

from __future__ import annotations

import math
from typing import List

from .config import MEGATRON_LLAMA3_ROPE, HFConfigError, LlamaGeometry, geometry_from_hf, \
    megatron_args
from .families import FAMILIES
from .moe import (EXTRA_MOE_FLAGS, MOE_FLAGS, moe_config_from_args, moe_family_of_args,
                  moe_family_problems, saved_moe_layers)
from .yarn import mscale_factor

__all__ = ["hf_config_from_args", "check_against_args", "family_problems", "moe_args_problems",
           "mla_args_problems", "gpt_oss_args_problems"]

#: Megatron-LM flags of :func:`~.config.megatron_args` whose ``args`` attribute is not the flag
#: name with dashes as underscores: flag -> (attribute, value the flag sets)
_DEST = {"--disable-bias-linear": ("add_bias_linear", False),
         "--norm-epsilon": ("layernorm_epsilon", None),
         "--no-yarn-correction-range-round-to-int": ("yarn_correction_range_round_to_int", False)}
#: flags that shape training only (or the vocabulary padding, exported whole): not compared
_NOT_COMPARED = {"--make-vocab-size-divisible-by", "--attention-dropout", "--hidden-dropout"}


#: MoE families whose own config.json settles what the from-args rules refuse (their flags are
#: compared with it by :func:`moe_args_problems`): family -> the saved settings it may have
_OWN_FEATURES = {"qwen2_moe": set(), "glm4_moe": {"rotary_percent", "together"},
                 # DeepSeek: the MLA flags are compared with the config by mla_args_problems
                 "deepseek_v2": {"multi_latent_attention"},
                 "deepseek_v3": {"multi_latent_attention"},
                 # gpt-oss: its flags are compared with the config by gpt_oss_args_problems
                 "gpt_oss": {"softmax_type", "swiglu", "add_bias_linear"}}


def family_problems(a: dict, family: str = None) -> List[str]:
    """Why the saved ``args`` ``a`` have no Hugging Face Llama-family model (empty if they do),
    each naming the flag and what the family uses (MoE: :func:`.moe.moe_family_problems`).
    ``family``: the ``model_type`` of the config.json the export was given; ``qwen2_moe`` and
    ``glm4_moe`` (shared experts, sigmoid router, partial RoPE) are then checked against that
    config by :func:`moe_args_problems` instead (``gpt_oss``: :func:`gpt_oss_args_problems`)."""
    own = _OWN_FEATURES.get(family)
    out = moe_family_problems(a) if own is None else []
    if own is None and family is None and a.get("num_experts"):  # written from the arguments
        own = _OWN_FEATURES.get(moe_family_of_args(a))  # (moe_family_of_args)
    own = own or set()
    fam = "Hugging Face Llama-family models (llama, mistral, qwen2, qwen3)"
    norm = a.get("normalization", "LayerNorm")
    if norm != "RMSNorm":
        out.append(f"--normalization {norm}: {fam} use RMSNorm (train with --normalization "
                   f"RMSNorm, NORMALIZATION=RMSNorm in scripts/pretrain_gpt.sh)")
    if not a.get("swiglu", False) and "swiglu" not in own:
        act = ("squared ReLU (--squared-relu)" if a.get("squared_relu") else
               "GeLU (Megatron's default without --swiglu)")
        out.append(f"the MLP is {act}: {fam} use SwiGLU, SiLU(x W_gate) * (x W_up) "
                   f"(train with --swiglu, SWIGLU=1)")
    if a.get("add_bias_linear", True) and "add_bias_linear" not in own:
        out.append(f"biases on every linear layer (--add-bias-linear, Megatron's default): {fam} "
                   f"have none (Qwen2: on q, k, v only) (train with --disable-bias-linear, "
                   f"DISABLE_BIAS_LINEAR=1)")
    pos = a.get("position_embedding_type", "learned_absolute")
    if pos not in ("rope", "yarn"):
        out.append(f"--position-embedding-type {pos}: {fam} use rotary embeddings (rope)")
    for name, flag, bad in (
            ("rotary_percent", "--rotary-percent", lambda v: v not in (None, 1, 1.0)),
            ("rotary_interleaved", "--rotary-interleaved", bool),
            ("layernorm_zero_centered_gamma", "--apply-layernorm-1p", bool),
            ("apply_residual_connection_post_layernorm",
             "--apply-residual-connection-post-layernorm", bool),
            ("multi_latent_attention", "--multi-latent-attention", bool),
            ("qk_l2_norm", "--qk-l2-norm", bool),
            ("attention_output_gate", "--attention-output-gate", bool),
            ("softmax_type", "--softmax-type", lambda v: v not in (None, "vanilla")),
            ("window_attn_skip_freq", "--window-attn-skip-freq", lambda v: v is not None)):
        v = a.get(name)
        if name in own:
            continue
        if v is not None and bad(v):
            hint = (" (a DeepSeek-V2/V3 config.json is not written from saved arguments: "
                    "pass --hf-config with the model's own)"
                    if name == "multi_latent_attention" else "")
            out.append(f"{flag} {v!r}: no Hugging Face Llama-family model has it{hint}")
    window = a.get("window_size")
    if window is not None and (len(window) != 2 or window[1] not in (0, -1) or window[0] < 0):
        out.append(f"--window-size {tuple(window)}: only a causal window (W - 1, 0) has a "
                   f"Hugging Face form (Mistral's sliding_window W)")
    features = [f for f, on in (("--qk-layernorm (qwen3)", a.get("qk_layernorm")),
                                ("--add-qkv-bias (qwen2)", a.get("add_qkv_bias")),
                                ("--window-size (mistral)", window is not None)) if on]
    if len(features) > 1 and "together" not in own:
        out.append(f"{' and '.join(features)} together: no one Hugging Face family has both")
    return out


def _rope_scaling(a: dict):
    if a.get("position_embedding_type") == "yarn":
        f = float(a["rotary_scaling_factor"])
        m, mad = float(a.get("mscale", 1.0)), float(a.get("mscale_all_dim", 0.0))
        rs = {"rope_type": "yarn", "factor": f,
              "original_max_position_embeddings": a["yarn_original_max_position_embeddings"],
              "beta_fast": float(a.get("yarn_beta_fast", 32.0)),
              "beta_slow": float(a.get("yarn_beta_slow", 1.0)),
              "truncate": bool(a.get("yarn_correction_range_round_to_int", True))}
        if m and mad:  # transformers' and Megatron's attention factor agree
            rs.update(mscale=m, mscale_all_dim=mad)
        elif m != 1.0 or mad:  # Megatron's g(f, m) / g(f, mad), as transformers' explicit factor
            rs["attention_factor"] = mscale_factor(f, m) / mscale_factor(f, mad)
        return rs
    if a.get("use_rope_scaling"):
        return {"rope_type": "llama3", "factor": float(a["rope_scaling_factor"]),
                **MEGATRON_LLAMA3_ROPE}
    return None


def hf_config_from_args(a: dict) -> dict:
    """The ``config.json`` (a dict) of the model the saved ``args`` ``a`` describe; raises
    :class:`~.config.HFConfigError` listing every reason when it has no Hugging Face family,
    or when the config would not rebuild the saved flags."""
    problems = family_problems(a)
    if problems:
        raise HFConfigError("the checkpoint's model has no Hugging Face family (its saved "
                            "Megatron-LM arguments): " + "; ".join(problems))
    missing = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                           "padded_vocab_size", "max_position_embeddings") if a.get(k) is None]
    if missing:
        raise HFConfigError(f"the checkpoint's saved arguments lack {missing}; pass --hf-config")
    heads, hidden = a["num_attention_heads"], a["hidden_size"]
    window = a.get("window_size")
    family = ("qwen3" if a.get("qk_layernorm") else "qwen2" if a.get("add_qkv_bias") else
              "mistral" if window is not None else "llama")
    moe = moe_config_from_args(a, window) if a.get("num_experts") else {}
    family = moe.get("model_type", family)
    cfg = {
        "architectures": [FAMILIES[family]], "model_type": family,
        "vocab_size": a["padded_vocab_size"], "hidden_size": hidden,
        "intermediate_size": a["ffn_hidden_size"], "num_hidden_layers": a["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": (a.get("num_query_groups") or heads)
        if a.get("group_query_attention") else heads,
        "head_dim": a.get("kv_channels") or hidden // heads,
        "hidden_act": "silu", "rms_norm_eps": float(a.get("layernorm_epsilon", 1e-5)),
        "rope_theta": float(a.get("rotary_base", 10000)), "rope_scaling": _rope_scaling(a),
        "max_position_embeddings": a["max_position_embeddings"],
        "tie_word_embeddings": not a.get("untie_embeddings_and_output_weights", False),
        "attention_dropout": 0.0, "initializer_range": float(a.get("init_method_std", 0.02)),
        "use_cache": True,
        "torch_dtype": "bfloat16" if a.get("bf16") else "float16" if a.get("fp16") else "float32",
    }
    cfg.update(moe)
    if family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif family in ("mixtral", "glm4_moe", "gpt_oss"):
        pass  # moe_config_from_args wrote Mixtral's sliding_window, gpt-oss's layer_types
    elif family == "mistral":
        cfg["sliding_window"] = int(window[0]) + 1  # transformers: q - k < W; Megatron: <= left
    else:
        cfg.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=a["num_layers"])
    check_against_args(cfg, a)
    return cfg


def _equal(saved, want) -> bool:
    if isinstance(saved, bool) or isinstance(want, bool):
        return bool(saved) == bool(want)
    if isinstance(saved, (int, float)) and not isinstance(saved, bool):
        try:
            w = float(want)
        except (TypeError, ValueError):
            return False
        return math.isclose(float(saved), w, rel_tol=1e-12, abs_tol=0.0)
    return str(saved) == str(want)


def _flag_diffs(cfg: dict, a: dict, skip=()):
    """``(geometry, diffs)``: import ``cfg`` as ``hf import`` would (its geometry and Megatron-LM
    flags) and list each model flag (not in ``skip``) whose saved value in ``a`` differs, as
    ``(flag, value, attribute, saved)`` (``value`` True for a switch)."""
    g = geometry_from_hf(cfg, make_vocab_size_divisible_by=1, seq_length=1)
    flags = megatron_args(g)
    diffs, i = [], 0
    while i < len(flags):
        flag = flags[i]
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") \
            else True
        i += 1 if value is True else 2
        if flag in _NOT_COMPARED or flag in MOE_FLAGS or flag in skip:  # MoE: moe_args_problems
            continue
        if flag == "--ffn-hidden-size" and g.num_experts and all(g.moe_layers):
            continue  # no dense MLP: the width sizes no layer
        name, fixed = _DEST.get(flag, (flag[2:].replace("-", "_"), None))
        want = fixed if fixed is not None else value
        if flag == "--max-position-embeddings":  # the import caps it at a window (none in METP)
            want = cfg["max_position_embeddings"]
        if name not in a or not _equal(a[name], want):
            diffs.append((flag, value, name, a.get(name, "<absent>")))
    return g, diffs


def check_against_args(cfg: dict, a: dict) -> LlamaGeometry:
    """Import ``cfg`` as ``hf import`` would (its geometry and Megatron-LM flags) and check that
    every model flag equals the saved ``args`` ``a``; returns the geometry."""
    g, found = _flag_diffs(cfg, a)
    diffs = [f"{flag}{'' if value is True else ' ' + value} (saved: {name} = {have!r})"
             for flag, value, name, have in found]
    if g.num_experts:
        diffs += moe_args_problems(cfg, a)
    if diffs:
        raise HFConfigError("the Hugging Face config written from the checkpoint's saved "
                            "arguments would not rebuild its model: " + "; ".join(diffs) +
                            "; pass --hf-config")
    return g


def gpt_oss_args_problems(cfg: dict, saved: dict) -> List[str]:
    """Where a ``gpt_oss`` ``config.json`` differs from a checkpoint's saved Megatron-LM
    arguments (empty when they agree): every model flag the config implies (biases,
    ``--quick-geglu``, ``--glu-linear-offset``, ``--activation-func-clamp-value``,
    ``--softmax-type``, the shape, RoPE / YaRN; ``--max-position-embeddings`` aside, which a
    sliding window caps) and the switches it has none of (:data:`.gpt_oss.OFF_SWITCHES`), each
    naming the flag and the config field (:data:`.gpt_oss.FIELD_OF_FLAG`). The MoE flags:
    :func:`moe_args_problems`."""
    from .gpt_oss import FIELD_OF_FLAG, OFF_SWITCHES

    _, found = _flag_diffs(cfg, saved, skip=("--max-position-embeddings",))
    out = [f"{flag}{'' if value is True else ' ' + value} (config.json "
           f"{FIELD_OF_FLAG.get(flag, flag[2:].replace('-', '_'))}): saved {name} = {have!r}"
           for flag, value, name, have in found]
    return out + [f"{flag} {saved[name]!r}: config.json (gpt_oss) has none"
                  for name, flag in OFF_SWITCHES if saved.get(name)]


def mla_args_problems(cfg: dict, saved: dict) -> List[str]:
    """Where a DeepSeek ``config.json``'s multi-latent attention differs from a checkpoint's
    saved Megatron-LM arguments (empty when they agree), each naming the flag."""
    from .deepseek import mla_flags

    g = geometry_from_hf(cfg, make_vocab_size_divisible_by=1, seq_length=1)
    if not saved.get("multi_latent_attention"):
        return [f"--multi-latent-attention: the run has none, config.json ({g.family}) has it"]
    flags, out, i = mla_flags(g), [], 1
    want = {"q_lora_rank": g.q_lora_rank, "qk_layernorm": True,
            "rope_type": "yarn" if g.mla_yarn else "rope"}
    while i < len(flags):
        flag, value = flags[i], flags[i + 1] if i + 1 < len(flags) else None
        if value is None or value.startswith("--"):
            i += 1
            continue
        want[flag[2:].replace("-", "_")] = value
        i += 2
    for name, value in want.items():
        have = saved.get(name)
        if name == "rope_type" and have is None:
            have = "yarn"  # Megatron's MLA default
        if not (have is None and value is None) and (have is None or value is None or
                                                        not _equal(have, value)):
            out.append(f"--{name.replace('_', '-')}: saved {have!r}, config.json implies "
                       f"{value!r}")
    return out


def moe_args_problems(cfg: dict, saved: dict) -> List[str]:
    """Where the MoE of a MoE family's ``config.json`` differs from a checkpoint's saved
    Megatron-LM arguments (empty when they agree): experts, top-k, expert width, which layers
    are MoE, the routing normalisation, the shared expert, the sigmoid router's settings and
    ``--rotary-percent``, each naming the flag."""
    g = geometry_from_hf(cfg, make_vocab_size_divisible_by=1, seq_length=1)
    if not saved.get("num_experts"):
        return [f"--num-experts: the run has no experts, config.json ({g.family}) has "
                f"{g.num_experts}"]
    saved_layers = saved_moe_layers(saved, g.num_layers)
    out = []
    for flag, have, want in (
            ("--num-experts", saved.get("num_experts"), g.num_experts),
            ("--moe-router-topk", saved.get("moe_router_topk"), g.moe_router_topk),
            ("--moe-ffn-hidden-size",  # Megatron-LM: the dense width when not given
             saved.get("moe_ffn_hidden_size") or saved.get("ffn_hidden_size"),
             g.moe_ffn_hidden_size),
            ("--moe-layer-freq", saved_layers, list(g.moe_layers)),
            ("--moe-router-pre-softmax", bool(saved.get("moe_router_pre_softmax")),
             g.moe_router_pre_softmax),
            *((flag, saved.get(name) or None, getattr(g, name) or None)
              for name, flag in EXTRA_MOE_FLAGS if name != "moe_router_score_function"),
            ("--moe-router-score-function", saved.get("moe_router_score_function") or
             "softmax", g.moe_router_score_function),
            ("--rotary-percent", float(saved.get("rotary_percent") or 1.0), g.rotary_percent)):
        if have != want:
            out.append(f"{flag}: saved {have!r}, config.json implies {want!r}")
    return out
