"""gpt-oss (``model_type`` ``gpt_oss``, ``GptOssForCausalLM``): what differs from Mixtral, and
the Megatron flags and weights it converts to.

=====================================  ==================================================
transformers                           Megatron
=====================================  ==================================================
q/k/v and o_proj biases, expert and    ``--add-bias-linear`` (every linear layer; gpt-oss
router biases                          has no dense MLP)
``self_attn.sinks [n]``: a per-head    ``--softmax-type learnable``:
logit in the softmax's denominator     ``self_attention.core_attention.softmax_offset``
expert ``(up + 1)·g·σ(α·g)`` with      ``--quick-geglu --glu-linear-offset 1.0
``g = min(gate, L)``,                  --activation-func-clamp-value L`` (``α`` = 1.702 =
``up = clamp(up, -L, L)``              quick-GeLU's; ``L`` = ``swiglu_limit``, 7.0 in 4.x)
``layer_types`` alternating            METP attends over the whole sequence: converts for
``sliding_attention`` (window ``W``)   sequences of at most ``W`` tokens (``--seq-length``,
                                       :mod:`.families`), where the window never binds
=====================================  ==================================================

Experts are stored stacked: ``P = model.layers.i.mlp.``; ``P experts.gate_up_proj [E, h, 2f]``
with gate and up **interleaved** in its last axis (gate = columns ``0, 2, 4, …``, up = ``1, 3,
…``), ``P experts.gate_up_proj_bias [E, 2f]`` likewise, ``P experts.down_proj [E, f, h]``,
``P experts.down_proj_bias [E, h]``; the router ``P router.weight [E, h]`` and
``P router.bias [E]``. Megatron's expert ``j``: ``linear_fc1.weight [2f, h]`` = ``[gate; up]``
(the transpose of the de-interleaved columns), ``linear_fc1.bias [2f]``, ``linear_fc2.weight
[h, f]`` = ``down_proj[j]ᵀ``, ``linear_fc2.bias [h]``. Routing is Mixtral's (softmax over the
top-k logits, :mod:`.moe`), with the router bias added to the logits on both sides.

Export of a Megatron-LM run's save: with a ``gpt_oss`` ``--hf-config``, every model flag that
config implies must be the run's saved value (:func:`.from_args.gpt_oss_args_problems`; a
mismatch names the flag and the field, :data:`FIELD_OF_FLAG`) and the switches it has none of
(:data:`OFF_SWITCHES`) must be off. Without one, saved arguments with ``--quick-geglu`` or
``--softmax-type learnable`` are written as ``gpt_oss`` (:func:`gpt_oss_saved_problems`,
:func:`gpt_oss_config_from_args`): every layer ``full_attention``, the model Megatron trained
(METP attends over the whole sequence; an import's sliding layers come back with
``--hf-config``).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .errors import HFConfigError

Tensor = torch.Tensor
#: quick-GeLU's constant (megatron-core's ``quick_gelu``: ``x·σ(1.702·x)``)
QUICK_GELU_ALPHA = 1.702


def gpt_oss_fields(cfg: dict) -> dict:
    """The :class:`~.config.LlamaGeometry` fields of a ``gpt_oss`` config beyond Mixtral's;
    refuses what Megatron cannot reproduce, naming the field."""
    if cfg.get("attention_bias", True) is not True:
        raise HFConfigError(f"config.json: attention_bias = {cfg['attention_bias']!r} for "
                            f"gpt_oss: the experts and router have biases, so the converted run "
                            f"has --add-bias-linear, which biases the attention too; only "
                            f"attention_bias true converts")
    alpha = cfg.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise HFConfigError(f"config.json: swiglu_alpha = {alpha!r}: Megatron's --quick-geglu "
                            f"is x·sigmoid({QUICK_GELU_ALPHA}·x); only {QUICK_GELU_ALPHA} "
                            f"converts")
    limit = cfg.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise HFConfigError(f"config.json: swiglu_limit = {limit!r} must be a number > 0")
    return {"linear_bias": True, "qkv_bias": True, "quick_geglu": True,
            "glu_linear_offset": 1.0, "activation_func_clamp_value": float(limit),
            "softmax_type": "learnable"}


#: Megatron-LM flag -> the ``config.json`` field (or gpt-oss feature) it comes from, for the
#: export's messages (:func:`.from_args.gpt_oss_args_problems`); 5.x: ``rope_parameters`` for
#: ``rope_scaling`` and ``rope_theta``
FIELD_OF_FLAG = {
    "--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size",
    "--num-attention-heads": "num_attention_heads",
    "--group-query-attention": "num_key_value_heads", "--num-query-groups": "num_key_value_heads",
    "--kv-channels": "head_dim", "--norm-epsilon": "rms_norm_eps",
    "--untie-embeddings-and-output-weights": "tie_word_embeddings",
    "--add-bias-linear": "attention_bias (and the experts' and router's biases)",
    "--add-qkv-bias": "attention_bias",
    "--quick-geglu": f"the experts' g·sigmoid(swiglu_alpha·g), swiglu_alpha {QUICK_GELU_ALPHA}",
    "--glu-linear-offset": "the experts' (up + 1)",
    "--activation-func-clamp-value": "swiglu_limit",
    "--softmax-type": "self_attn.sinks", "--rotary-base": "rope_theta",
    "--position-embedding-type": "rope_scaling",
    "--rotary-scaling-factor": "rope_scaling.factor",
    "--yarn-original-max-position-embeddings": "rope_scaling.original_max_position_embeddings",
    "--yarn-beta-fast": "rope_scaling.beta_fast", "--yarn-beta-slow": "rope_scaling.beta_slow",
    "--no-yarn-correction-range-round-to-int": "rope_scaling.truncate",
    "--mscale": "rope_scaling.mscale / attention_factor",
    "--mscale-all-dim": "rope_scaling.mscale_all_dim"}
#: saved switches that a gpt_oss model has none of: (attribute, flag)
OFF_SWITCHES = (("swiglu", "--swiglu"), ("squared_relu", "--squared-relu"),
                ("qk_layernorm", "--qk-layernorm"), ("use_rope_scaling", "--use-rope-scaling"),
                ("window_size", "--window-size"))


def is_gpt_oss_args(a: dict) -> bool:
    """Saved MoE arguments the export writes as ``gpt_oss``: the experts' quick-GeGLU or the
    attention sinks."""
    return bool(a.get("quick_geglu")) or a.get("softmax_type") == "learnable"


def gpt_oss_saved_problems(a: dict, layers: Sequence[int]) -> List[str]:
    """Why saved arguments that :func:`is_gpt_oss_args` picks are no ``gpt_oss`` model (empty
    if they are), each naming the flag; ``layers``: 0/1 per layer, 1 = MoE."""
    out = [f"{flag} {a.get(name)!r}: gpt-oss has {what} ({fix})"
           for name, flag, want, what, fix in (
               ("quick_geglu", "--quick-geglu", True, "the experts' clamped quick-GeGLU",
                "train with --quick-geglu"),
               ("softmax_type", "--softmax-type", "learnable", "attention sinks",
                "train with --softmax-type learnable"),
               ("add_bias_linear", "--add-bias-linear", True, "biases on every linear layer",
                "train with --add-bias-linear"),
               ("glu_linear_offset", "--glu-linear-offset", 1.0, "the experts' (up + 1)",
                "train with --glu-linear-offset 1.0"))
           if a.get(name) != want]
    clamp = a.get("activation_func_clamp_value")
    if not clamp or clamp <= 0:
        out.append(f"--activation-func-clamp-value {clamp!r}: gpt-oss clamps the experts' "
                   f"gate and up (swiglu_limit; train with --activation-func-clamp-value 7.0)")
    if not all(layers):
        out.append(f"--moe-layer-freq {a.get('moe_layer_freq')!r}: gpt-oss has experts in "
                   f"every layer")
    for name, flag, why in (("moe_router_pre_softmax", "--moe-router-pre-softmax",
                             "gpt-oss renormalises its top-k"),
                            ("qk_layernorm", "--qk-layernorm", "gpt-oss has no q/k norms"),
                            ("window_size", "--window-size", "gpt-oss's windows slide on "
                             "alternate layers (layer_types), not on every one")):
        if a.get(name):
            out.append(f"{flag} {a[name]!r}: {why}")
    return out


def gpt_oss_config_from_args(a: dict) -> dict:
    """The gpt-oss ``config.json`` fields of saved arguments :func:`gpt_oss_saved_problems`
    accepts (besides the MoE's): every layer ``full_attention`` (no window: Megatron's model);
    ``sliding_window`` then slides no layer, but transformers builds its mask whatever the
    layer types, so it is ``max_position_embeddings`` (a window that never binds)."""
    return dict(attention_bias=True, swiglu_alpha=QUICK_GELU_ALPHA,
                swiglu_limit=float(a["activation_func_clamp_value"]),
                layer_types=["full_attention"] * a["num_layers"],
                sliding_window=a["max_position_embeddings"])


def gpt_oss_flags(g) -> List[str]:
    """Megatron-LM flags of the MLP and attention variant (in place of ``--swiglu``)."""
    return ["--quick-geglu", "--glu-linear-offset", repr(g.glu_linear_offset),
            "--activation-func-clamp-value", repr(g.activation_func_clamp_value),
            "--softmax-type", g.softmax_type]


def gpt_oss_config_kwargs(g) -> dict:
    """``TransformerConfig`` fields of the variant (empty for the other families)."""
    if not g.quick_geglu:
        return {}
    from megatron.core.activations import quick_gelu

    return dict(activation_func=quick_gelu, glu_linear_offset=g.glu_linear_offset,
                activation_func_clamp_value=g.activation_func_clamp_value,
                softmax_type=g.softmax_type)


def _p(i: int) -> str:
    return f"model.layers.{i}.mlp."


def _t(i: int) -> str:
    return f"decoder.layers.{i}.mlp."


def hf_gpt_oss_shapes(g, i: int) -> Dict[str, tuple]:
    """transformers' names and shapes of layer ``i``'s MoE block and attention extras."""
    h, f, E, p = g.hidden_size, g.moe_ffn_hidden_size, g.num_experts, _p(i)
    a = f"model.layers.{i}.self_attn."
    return {p + "router.weight": (E, h), p + "router.bias": (E,),
            p + "experts.gate_up_proj": (E, h, 2 * f), p + "experts.gate_up_proj_bias": (E, 2 * f),
            p + "experts.down_proj": (E, f, h), p + "experts.down_proj_bias": (E, h),
            a + "o_proj.bias": (h,), a + "sinks": (g.num_attention_heads,)}


def megatron_gpt_oss_shapes(g, i: int) -> Dict[str, tuple]:
    """Megatron's names (EP = 1) and shapes of the same tensors."""
    h, f, E, t = g.hidden_size, g.moe_ffn_hidden_size, g.num_experts, _t(i)
    a = f"decoder.layers.{i}.self_attention."
    out = {t + "router.weight": (E, h), t + "router.bias": (E,),
           a + "linear_proj.bias": (h,), a + "core_attention.softmax_offset":
           (g.num_attention_heads,)}
    for j in range(E):
        e = f"{t}experts.local_experts.{j}."
        out.update({e + "linear_fc1.weight": (2 * f, h), e + "linear_fc1.bias": (2 * f,),
                    e + "linear_fc2.weight": (h, f), e + "linear_fc2.bias": (h,)})
    return out


def _renames(i: int):
    a, b = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    return ((_p(i) + "router.weight", _t(i) + "router.weight"),
            (_p(i) + "router.bias", _t(i) + "router.bias"),
            (a + "o_proj.bias", b + "linear_proj.bias"),
            (a + "sinks", b + "core_attention.softmax_offset"))


def gpt_oss_hf_to_megatron(hf: Dict[str, Tensor], g, i: int) -> Dict[str, Tensor]:
    """Layer ``i``: transformers → Megatron (module docstring)."""
    out = {m: hf[k].clone() for k, m in _renames(i)}
    p = _p(i) + "experts."
    gu, gub = hf[p + "gate_up_proj"], hf[p + "gate_up_proj_bias"]
    for j in range(g.num_experts):
        e = f"{_t(i)}experts.local_experts.{j}."
        gate_up = torch.cat([gu[j, :, 0::2], gu[j, :, 1::2]], 1)  # [h, 2f]: gate | up
        out[e + "linear_fc1.weight"] = gate_up.t().contiguous()
        out[e + "linear_fc1.bias"] = torch.cat([gub[j, 0::2], gub[j, 1::2]]).contiguous()
        out[e + "linear_fc2.weight"] = hf[p + "down_proj"][j].t().contiguous()
        out[e + "linear_fc2.bias"] = hf[p + "down_proj_bias"][j].clone()
    return out


def gpt_oss_megatron_to_hf(mg: Dict[str, Tensor], g, i: int) -> Dict[str, Tensor]:
    """Inverse of :func:`gpt_oss_hf_to_megatron`."""
    out = {k: mg[m].clone() for k, m in _renames(i)}
    E, f = g.num_experts, g.moe_ffn_hidden_size
    fc1 = [mg[f"{_t(i)}experts.local_experts.{j}.linear_fc1.weight"] for j in range(E)]
    b1 = [mg[f"{_t(i)}experts.local_experts.{j}.linear_fc1.bias"] for j in range(E)]
    gu = torch.stack([w.t() for w in fc1])                           # [E, h, 2f]: gate | up
    gub = torch.stack(b1)                                            # [E, 2f]
    p = _p(i) + "experts."
    out[p + "gate_up_proj"] = torch.stack([gu[:, :, :f], gu[:, :, f:]], -1).reshape(
        gu.shape).contiguous()
    out[p + "gate_up_proj_bias"] = torch.stack([gub[:, :f], gub[:, f:]], -1).reshape(
        gub.shape).contiguous()
    out[p + "down_proj"] = torch.stack(
        [mg[f"{_t(i)}experts.local_experts.{j}.linear_fc2.weight"].t() for j in range(E)]
    ).contiguous()
    out[p + "down_proj_bias"] = torch.stack(
        [mg[f"{_t(i)}experts.local_experts.{j}.linear_fc2.bias"] for j in range(E)]).contiguous()
    return out
