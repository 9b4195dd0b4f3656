"""The Hugging Face model families the converter takes, and the fields that differ between them.

=========  ======================  ==========================================================
family     architecture            what differs from ``llama`` (and the Megatron flag)
=========  ======================  ==========================================================
llama      ``LlamaForCausalLM``    —
mistral    ``MistralForCausalLM``  ``sliding_window``: null, or at least the sequence (see below)
qwen2      ``Qwen2ForCausalLM``    bias on q, k and v (``--add-qkv-bias``), none elsewhere
qwen3      ``Qwen3ForCausalLM``    per-head RMSNorm of q and k before RoPE (``--qk-layernorm``)
qwen3_moe  ``Qwen3MoeForCausalLM`` Qwen3's attention, MoE MLPs (:mod:`.moe`)
mixtral    ``MixtralForCausalLM``  Mistral's attention, MoE MLPs in every layer (:mod:`.moe`)
qwen2_moe  ``Qwen2MoeForCausalLM`` Qwen2's attention (q/k/v bias unless ``qkv_bias`` false),
                                   MoE MLPs with a gated shared expert (:mod:`.moe`)
glm4_moe   ``Glm4MoeForCausalLM``  q/k/v bias when ``attention_bias`` (``--add-qkv-bias``),
                                   q/k norms when ``use_qk_norm`` (``--qk-layernorm``), RoPE
                                   over ``partial_rotary_factor`` of each head
                                   (``--rotary-percent``), leading dense layers, a shared
                                   expert and a sigmoid router (:mod:`.moe`)
gpt_oss    ``GptOssForCausalLM``   biases everywhere, attention sinks, the experts' clamped
                                   quick-GeGLU, alternating sliding windows (:mod:`.gpt_oss`)
deepseek_  ``DeepseekV2ForCausalLM`` multi-latent attention (:mod:`.deepseek`), leading dense
v2, v3     ``DeepseekV3ForCausalLM`` layers, a shared expert; V2 a softmax router, V3 GLM-4.5's
                                   sigmoid router (:mod:`.moe`)
=========  ======================  ==========================================================

All four: ``head_dim`` may differ from ``hidden_size / num_attention_heads`` (``--kv-channels``;
Qwen3 sets it, e.g. 64 heads of 128 at hidden 5120 for Qwen3-32B).

Sliding windows: Megatron's METP layers attend causally over the whole sequence. A window ``W``
changes nothing while every sequence is at most ``W`` tokens, so a model with one converts when
``W >= max_position_embeddings``, or when the run's sequence length is given
(``--seq-length S`` with ``S <= W``): the converted run's ``--max-position-embeddings`` is then
``min(max_position_embeddings, W)``, and Megatron-LM refuses any ``--seq-length`` above it.

:func:`family_fields` checks every family-specific field before anything is read and raises
:class:`~.config.HFConfigError` naming the field, its value and the reason.
"""

from __future__ import annotations

from typing import Optional

from .deepseek import DEEPSEEK_FAMILIES
from .errors import HFConfigError
from .moe import MOE_FAMILIES, MOE_MARKERS, moe_family_hint

#: dense model_type → the causal-LM architecture that converts
DENSE_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: every model_type that converts (the MoE ones: :mod:`.moe`)
FAMILIES = {**DENSE_FAMILIES, **MOE_FAMILIES}

_DENSE_ONLY = ("mixture-of-experts fields in a dense family's config (only model_type "
               "'qwen3_moe', 'mixtral', 'qwen2_moe', 'glm4_moe', 'gpt_oss', 'deepseek_v2' and "
               "'deepseek_v3' convert as MoE)")
#: fields of other variants that no METP layer implements, refused whenever set (MoE fields in a
#: dense family, soft-capping, other attention forms): field → why
UNSUPPORTED_FIELDS = {
    **{name: _DENSE_ONLY for name in MOE_MARKERS},
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2): the K/V ring's softmax "
                              "is not capped",
    "final_logit_softcapping": "final logit soft-capping (Gemma 2): Megatron's output layer "
                               "has none",
    "query_pre_attn_scalar": "a softmax scale other than 1/sqrt(head_dim) (Gemma 2)",
    "kv_lora_rank": "multi-latent attention, which converts for model_type 'deepseek_v2' and "
                    "'deepseek_v3' only",
    "q_lora_rank": "multi-latent attention, which converts for model_type 'deepseek_v2' and "
                   "'deepseek_v3' only",
}


def _err(msg: str):
    return HFConfigError(msg)


def check_family(cfg: dict) -> str:
    """The family of ``cfg`` (its ``model_type``), refusing other types and architectures."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        hint = moe_family_hint(cfg)
        raise _err(f"config.json: model_type {model_type!r} is not supported: the converter takes "
                   f"{', '.join(repr(f) for f in FAMILIES)} ({', '.join(FAMILIES.values())})"
                   f"{'; ' + hint if hint else ''}; see docs/huggingface.md for the fields of "
                   f"each")
    archs = cfg.get("architectures")
    want = FAMILIES[model_type]
    if archs and want not in archs:
        raise _err(f"config.json: architectures {archs!r} has no {want!r}; only the causal-LM "
                   f"head converts")
    for name, why in UNSUPPORTED_FIELDS.items():
        if model_type in MOE_FAMILIES and name in MOE_MARKERS:
            continue  # read by moe.moe_fields
        if model_type in DEEPSEEK_FAMILIES and name in ("kv_lora_rank", "q_lora_rank"):
            continue  # read by deepseek.mla_fields
        if cfg.get(name) not in (None, 0, False, 0.0):
            raise _err(f"config.json: {name} = {cfg[name]!r} is not supported: {why}")
    return model_type


def _window(cfg: dict, family: str) -> Optional[int]:
    """The sliding window that applies to some layer, or ``None``."""
    if family == "mistral":
        w = cfg.get("sliding_window")
    elif family == "qwen3_moe":  # every layer, when use_sliding_window
        w = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    elif family in ("qwen2", "qwen3", "qwen2_moe", "gpt_oss"):
        types = cfg.get("layer_types") or []
        sliding = any(t == "sliding_attention" for t in types)
        w = cfg.get("sliding_window") if (cfg.get("use_sliding_window") or sliding) else None
        if cfg.get("use_sliding_window") and not sliding and types:
            w = None  # every layer is full attention (max_window_layers >= num_hidden_layers)
    else:
        w = cfg.get("sliding_window")
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise _err(f"config.json: sliding_window = {w!r} must be null or an integer >= 1")
    return w


def family_fields(cfg: dict, family: str, *, hidden: int, heads: int, max_pos: int,
                  seq_length: Optional[int] = None) -> dict:
    """``{head_dim, qk_layernorm, qkv_bias, sliding_window, max_position_embeddings}`` of a
    family's ``config.json``, every field that cannot convert refused (naming it)."""
    # DeepSeek's head_dim is its RoPE width (deepseek.mla_fields checks it)
    head_dim = None if family in DEEPSEEK_FAMILIES else cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise _err(f"config.json: hidden_size {hidden} is not divisible by "
                       f"num_attention_heads {heads} and no head_dim is given")
        head_dim = hidden // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise _err(f"config.json: head_dim = {head_dim!r} must be an even integer >= 2 (RoPE "
                   f"rotates pairs of channels)")
    qkv_bias, qk_norm = False, family in ("qwen3", "qwen3_moe")
    if family == "qwen2":
        qkv_bias = True  # Qwen2Attention: bias on q_proj, k_proj, v_proj, none on o_proj
    own = {"qwen2_moe": "qkv_bias", "glm4_moe": "attention_bias",
           "gpt_oss": "attention_bias"}.get(family)  # gpt_oss: .gpt_oss
    if own:  # Qwen2-MoE's qkv_bias (default true), GLM-4.5's attention_bias: q/k/v only
        qkv_bias = cfg.get(own, family in ("qwen2_moe", "gpt_oss"))
        if not isinstance(qkv_bias, bool):
            raise _err(f"config.json: {own} = {qkv_bias!r} must be true or false")
    if family == "glm4_moe":
        qk_norm = cfg.get("use_qk_norm", False)
        if not isinstance(qk_norm, bool):
            raise _err(f"config.json: use_qk_norm = {qk_norm!r} must be true or false")
    for name in ("attention_bias", "mlp_bias"):
        if name != own and cfg.get(name, False):
            raise _err(f"config.json: {name} = true is not supported: Megatron has no bias on "
                       f"the attention output without biases on every linear layer "
                       f"(--add-bias-linear); only Qwen2's q/k/v bias (--add-qkv-bias) converts")
    window = _window(cfg, family)
    if window is not None and window < max_pos:
        if seq_length is None or seq_length > window:
            got = "" if seq_length is None else f" (--seq-length {seq_length} is longer)"
            raise _err(f"config.json: sliding_window = {window} is shorter than "
                       f"max_position_embeddings {max_pos}{got}: METP attends over the whole "
                       f"sequence; convert for sequences of at most {window} tokens with "
                       f"--seq-length S (S <= {window}: the window never binds), or use a model "
                       f"without a window (sliding_window null)")
        max_pos = min(max_pos, window)
    return {"head_dim": head_dim, "qk_layernorm": qk_norm, "qkv_bias": qkv_bias,
            "sliding_window": window, "max_position_embeddings": max_pos}
