"""Mixture-of-experts fields of a Hugging Face ``config.json`` (``qwen3_moe``, ``mixtral``) and
the Megatron MoE they convert to.

Names: ``E`` experts, ``k`` experts per token, ``f'`` an expert's FFN width, ``z = x W_r^T``
the router logits ``[T, E]`` of ``T`` tokens, ``L`` layers.

=============  ==============================================  ===================================
family         routing (transformers)                          Megatron (``TopKRouter``)
=============  ==============================================  ===================================
``mixtral``    ``p = softmax(z)``, top-k of ``p``,             top-k of ``z``, softmax over those
               divided by their sum = softmax over the top-k   ``k`` logits (no
               logits                                          ``--moe-router-pre-softmax``)
``qwen3_moe``  ``p = softmax(z)``, top-k of ``p``; with        ``norm_topk_prob``: as Mixtral;
               ``norm_topk_prob`` divided by their sum         without: ``--moe-router-pre-softmax``
                                                               (softmax over all ``E``, top-k)
=============  ==============================================  ===================================

Both pick the same experts (softmax is monotonic). Which layers are MoE: Mixtral all of them;
Qwen3-MoE layer ``i`` (from 0) when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
``mlp_only_layers``, the others dense SwiGLU MLPs of width ``intermediate_size``. Megatron's
``--moe-layer-freq N`` makes layers ``i % N == 0`` MoE, so a pattern other than "all" is
printed as the list (``--moe-layer-freq [0,1,0,1]``), which megatron-core then checkpoints per
layer (``decoder.layers.<i>.…``) instead of stacked.

Top-1 routing (``num_experts_per_tok`` 1): megatron-core refuses a top-1 softmax router
without ``--moe-router-pre-softmax``, which weights the expert by ``softmax(z)`` over all ``E``.
That is Qwen3-MoE's routing with ``norm_topk_prob`` false (converted); renormalised top-1
(Mixtral, Qwen3-MoE with ``norm_topk_prob`` true) weights it by exactly 1, which no Megatron
router gives, and is refused naming ``num_experts_per_tok``.

Refused (naming the field): ``router_jitter_noise`` ≠ 0 (transformers scales the experts' input
too, Megatron's ``--moe-input-jitter-eps`` only the router's), ``num_experts_per_tok`` > ``E``,
no MoE layer at all, and ``E`` not divisible by the METP size (the experts are sharded over the
METP ranks: EP = METP). Any other MoE family (``qwen2_moe`` with its shared expert,
``deepseek_v3`` with its grouped sigmoid router, ...) is refused by :mod:`.families`.
"""

from __future__ import annotations

from typing import List, Optional

from .errors import HFConfigError

#: MoE model_type → the causal-LM architecture that converts
MOE_FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

#: config.json fields that mark a mixture-of-experts model (of any family)
MOE_MARKERS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _err(msg: str):
    return HFConfigError(msg)


def _pos_int(cfg: dict, name: str, default=None) -> int:
    v = cfg.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(f"config.json: {name} = {v!r} must be an integer >= 1")
    return v


def moe_layers(cfg: dict, family: str, num_layers: int) -> List[int]:
    """1 for a MoE layer, 0 for a dense one, per layer (transformers' rule per family)."""
    if family == "mixtral":
        return [1] * num_layers
    step = _pos_int(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                          for i in dense):
        raise _err(f"config.json: mlp_only_layers = {dense!r} must be a list of layer indices")
    bad = [i for i in dense if not 0 <= i < num_layers]
    if bad:
        raise _err(f"config.json: mlp_only_layers {bad} are not layers of a "
                   f"{num_layers}-layer model (0 .. {num_layers - 1})")
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def moe_fields(cfg: dict, family: str, *, num_layers: int, hidden: int,
               metp_parallel_size: int) -> dict:
    """The :class:`~.config.LlamaGeometry` MoE fields of a ``qwen3_moe`` / ``mixtral``
    config: ``num_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``, ``moe_layers``
    (0/1 per layer), ``moe_router_pre_softmax``, ``moe_aux_loss_coeff``; every field that cannot
    convert refused."""
    if family == "mixtral":
        experts = _pos_int(cfg, "num_local_experts", 8)
        ffn = _pos_int(cfg, "intermediate_size")
        jitter = cfg.get("router_jitter_noise", 0.0) or 0.0
        if jitter != 0:
            raise _err(f"config.json: router_jitter_noise = {jitter!r} is not supported: "
                       f"transformers multiplies the experts' input by the noise too, "
                       f"Megatron's --moe-input-jitter-eps only the router's; set it to 0.0")
        pre_softmax = False
    else:
        experts = _pos_int(cfg, "num_experts")
        ffn = _pos_int(cfg, "moe_intermediate_size")
        norm = cfg.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise _err(f"config.json: norm_topk_prob = {norm!r} must be true or false")
        pre_softmax = not norm
    topk = _pos_int(cfg, "num_experts_per_tok", 2)
    if topk > experts:
        raise _err(f"config.json: num_experts_per_tok {topk} is more than the {experts} experts")
    if topk == 1 and not pre_softmax:
        what = "norm_topk_prob true" if family == "qwen3_moe" else "Mixtral"
        raise _err(f"config.json: num_experts_per_tok = 1 with {what}: transformers weights "
                   f"each token's one expert by 1 (its top-1 probability divided by itself); "
                   f"megatron-core's top-1 softmax router takes only --moe-router-pre-softmax, "
                   f"which weights it by the softmax probability, so the logits would differ "
                   f"(Qwen3-MoE top-1 with norm_topk_prob false converts)")
    if experts % metp_parallel_size:
        raise _err(f"config.json: {experts} experts are not divisible by --metp-parallel-size "
                   f"{metp_parallel_size}: METP shards the experts over its ranks (expert "
                   f"parallel size = METP size); choose a METP size that divides {experts}")
    layers = moe_layers(cfg, family, num_layers)
    if not any(layers):
        raise _err("config.json: decoder_sparse_step / mlp_only_layers leave no MoE layer: "
                   "convert it as the dense model it is (model_type qwen3)")
    coeff = cfg.get("router_aux_loss_coef", 0.0) if cfg.get("output_router_logits") else 0.0
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
        raise _err(f"config.json: router_aux_loss_coef = {coeff!r} must be a number >= 0")
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_layers": tuple(layers), "moe_router_pre_softmax": pre_softmax,
            "moe_aux_loss_coeff": float(coeff)}


#: the flags of :func:`moe_flags`
MOE_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq",
             "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
             "--moe-router-pre-softmax")


def moe_layer_freq(layers) -> object:
    """Megatron's ``moe_layer_freq``: ``1`` when every layer is MoE, else the 0/1 list."""
    layers = [int(v) for v in layers]
    return 1 if all(layers) else layers


def moe_flags(g) -> List[str]:
    """Megatron-LM flags of the geometry's MoE (empty for a dense model)."""
    if not g.num_experts:
        return []
    freq = moe_layer_freq(g.moe_layers)
    out = ["--num-experts", str(g.num_experts), "--moe-router-topk", str(g.moe_router_topk),
           "--moe-ffn-hidden-size", str(g.moe_ffn_hidden_size),
           "--moe-layer-freq", str(freq).replace(" ", ""),
           "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", repr(g.moe_aux_loss_coeff)]
    if g.moe_router_pre_softmax:
        out.append("--moe-router-pre-softmax")
    return out


def moe_config_kwargs(g, *, ep: int = 1, dispatcher: str = "allgather") -> dict:
    """``TransformerConfig`` MoE fields of the geometry (empty for a dense model): dropless
    (no capacity factor), SequentialMLP experts (no grouped GEMM), ``ep`` expert-parallel
    ranks. The auxiliary loss coefficient is the config's (it adds to the gradients, not to the
    loss the model returns)."""
    if not g.num_experts:
        return {}
    return dict(num_moe_experts=g.num_experts, moe_router_topk=g.moe_router_topk,
                moe_ffn_hidden_size=g.moe_ffn_hidden_size,
                moe_layer_freq=moe_layer_freq(g.moe_layers),
                moe_router_pre_softmax=g.moe_router_pre_softmax,
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=g.moe_aux_loss_coeff, moe_grouped_gemm=False,
                moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep)


def hf_moe_prefix(family: str) -> str:
    """The MoE block's module name inside a transformers decoder layer."""
    return "block_sparse_moe." if family == "mixtral" else "mlp."


def hf_expert_names(family: str) -> tuple:
    """(gate, up, down) projection names of one transformers expert."""
    return ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def is_moe_layer(g, i: int) -> bool:
    return bool(g.num_experts) and bool(g.moe_layers[i])


def moe_family_hint(cfg: dict) -> Optional[str]:
    """For a refused ``model_type``: the sentence saying which MoE families convert, when the
    config has mixture-of-experts fields."""
    if any(cfg.get(k) not in (None, 0) for k in MOE_MARKERS):
        return (f"of the mixture-of-experts families only "
                f"{', '.join(repr(f) for f in MOE_FAMILIES)} convert (shared experts, grouped "
                f"or sigmoid routers and the rest are not implemented)")
    return None


def saved_moe_layers(saved: dict, num_layers: int) -> List[int]:
    """0/1 per layer from a run's saved ``moe_layer_freq`` (an integer ``N``: layers
    ``i % N == 0``; or the list)."""
    freq = saved.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)]
    return [int(v) for v in freq]


#: saved Megatron-LM MoE arguments neither qwen3_moe nor mixtral has: (attribute, flag, is-set)
_NO_FAMILY_MOE_ARGS = (
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", bool),
    ("moe_router_score_function", "--moe-router-score-function",
     lambda v: v not in (None, "softmax")),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor",
     lambda v: v not in (None, 1, 1.0)),
    ("moe_router_num_groups", "--moe-router-num-groups", bool),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", bool),
    ("moe_input_jitter_eps", "--moe-input-jitter-eps", bool),
)


def moe_family_problems(a: dict) -> List[str]:
    """Why a run's saved MoE arguments have no ``qwen3_moe`` / ``mixtral`` form (empty if they
    do, or if the run has no experts), each naming the flag."""
    if not a.get("num_experts"):
        return []
    out = [f"{flag} {a[name]!r}: neither Qwen3-MoE nor Mixtral has it"
           for name, flag, bad in _NO_FAMILY_MOE_ARGS if a.get(name) is not None and bad(a[name])]
    if a.get("add_qkv_bias"):
        out.append("--add-qkv-bias with --num-experts: no Hugging Face MoE family converts "
                   "(Qwen2-MoE's shared expert is not implemented)")
    if not a.get("qk_layernorm"):  # Mixtral: every layer MoE, top-k softmax
        layers = saved_moe_layers(a, a.get("num_layers") or 0)
        if not all(layers):
            out.append(f"--moe-layer-freq {a.get('moe_layer_freq')!r} without --qk-layernorm: "
                       f"Mixtral has experts in every layer (Qwen3-MoE, which may have dense "
                       f"layers, has --qk-layernorm)")
        if a.get("moe_router_pre_softmax"):
            out.append("--moe-router-pre-softmax without --qk-layernorm: Mixtral renormalises "
                       "its top-k (Qwen3-MoE with norm_topk_prob false, which has "
                       "--qk-layernorm, does not)")
    return out


def moe_config_from_args(a: dict, window) -> dict:
    """The MoE ``config.json`` fields (with ``model_type`` and ``architectures``) of a run's
    saved arguments that :func:`moe_family_problems` accepts: ``qwen3_moe`` with
    ``--qk-layernorm``, else ``mixtral``."""
    layers = saved_moe_layers(a, a["num_layers"])
    experts, topk = a["num_experts"], a.get("moe_router_topk") or 2
    ffn = a.get("moe_ffn_hidden_size") or a["ffn_hidden_size"]
    coeff = a.get("moe_aux_loss_coeff") or 0.0
    coeff = float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff)
    common = dict(num_experts_per_tok=topk, output_router_logits=coeff > 0,
                  router_aux_loss_coef=coeff)
    if a.get("qk_layernorm"):
        return dict(common, model_type="qwen3_moe", architectures=[MOE_FAMILIES["qwen3_moe"]],
                    num_experts=experts, moe_intermediate_size=ffn, decoder_sparse_step=1,
                    mlp_only_layers=[i for i, m in enumerate(layers) if not m],
                    norm_topk_prob=not a.get("moe_router_pre_softmax", False))
    return dict(common, model_type="mixtral", architectures=[MOE_FAMILIES["mixtral"]],
                num_local_experts=experts, intermediate_size=ffn, router_jitter_noise=0.0,
                sliding_window=None if window is None else int(window[0]) + 1)
