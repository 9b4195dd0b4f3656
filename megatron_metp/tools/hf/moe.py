"""Mixture-of-experts fields of a Hugging Face ``config.json`` (``qwen3_moe``, ``mixtral``,
``qwen2_moe``, ``glm4_moe``, ``gpt_oss``: its attention and expert variants in :mod:`.gpt_oss`)
and the Megatron MoE they convert to.

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
``qwen2_moe``  as ``qwen3_moe`` (``norm_topk_prob`` default    as ``qwen3_moe``
               false)
``glm4_moe``   ``s = sigmoid(z)``; top-k of ``s + b`` within   ``--moe-router-score-function
               the ``topk_group`` best of ``n_group`` groups   sigmoid --moe-router-enable-expert-
               (a group's score: its best 2 of ``s + b``);     bias`` (``b``: ``expert_bias``),
               weights ``s`` of those / their sum ×            ``--moe-router-num-groups``/
               ``routed_scaling_factor``                       ``-group-topk`` (a group's score:
                                                               its best ``k / group_topk``),
                                                               ``--moe-router-topk-scaling-factor``
=============  ==============================================  ===================================

Shared experts: Qwen2-MoE's ``shared_expert`` (``shared_expert_intermediate_size`` wide) times
``sigmoid(x·gᵀ)`` (``shared_expert_gate``): ``--moe-shared-expert-intermediate-size
--moe-shared-expert-gate``; GLM-4.5's ``shared_experts`` (``n_shared_experts ×
moe_intermediate_size`` wide, no gate). GLM-4.5's dense layers are the first
``first_k_dense_replace``.

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
METP ranks: EP = METP); for GLM-4.5 group scores that differ (``num_experts_per_tok`` ≠ 2 ×
``topk_group`` with real groups), ``norm_topk_prob`` other than ``k > 1`` (megatron-core's sigmoid
router renormalises exactly then) and ``output_router_logits``. DeepSeek-V2 routes as
``--moe-router-pre-softmax`` times ``routed_scaling_factor`` (group-limited top-k only where both
libraries score a group alike: :func:`_softmax_group_router`), DeepSeek-V3 as GLM-4.5. Any other
MoE family is refused by :mod:`.families`.
"""

from __future__ import annotations

from typing import List, Optional

from .deepseek import DEEPSEEK_FAMILIES
from .errors import HFConfigError
from .gpt_oss import gpt_oss_config_from_args, gpt_oss_saved_problems, is_gpt_oss_args

#: MoE model_type → the causal-LM architecture that converts
MOE_FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                "gpt_oss": "GptOssForCausalLM", **DEEPSEEK_FAMILIES}
#: families with GLM-4.5's / DeepSeek's MoE block: leading dense layers
#: (``first_k_dense_replace``), an ungated shared expert ``n_shared_experts`` experts wide
_LEADING_DENSE = ("glm4_moe", *DEEPSEEK_FAMILIES)
#: config.json key of the routed-expert count, and of their FFN width (default
#: moe_intermediate_size), per MoE family
_EXPERTS_KEY = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts",
                "mixtral": "num_local_experts", "glm4_moe": "n_routed_experts",
                "gpt_oss": "num_local_experts",
                **{f: "n_routed_experts" for f in DEEPSEEK_FAMILIES}}
_FFN_KEY = {"mixtral": "intermediate_size", "gpt_oss": "intermediate_size"}

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
    if family in ("mixtral", "gpt_oss"):
        return [1] * num_layers
    if family in _LEADING_DENSE:  # the first first_k_dense_replace layers are dense
        k = cfg.get("first_k_dense_replace", 1 if family == "glm4_moe" else 0)
        freq = cfg.get("moe_layer_freq", 1)  # DeepSeek's own config.json; transformers: 1
        if freq != 1:
            raise _err(f"config.json: moe_layer_freq = {freq!r}: transformers' {family} makes "
                       f"every layer from first_k_dense_replace on a MoE layer (moe_layer_freq "
                       f"1); another value means a model transformers does not build")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise _err(f"config.json: first_k_dense_replace = {k!r} must be an integer >= 0")
        return [int(i >= k) for i in range(num_layers)]
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


def _norm_topk(cfg: dict, default: bool) -> bool:
    norm = cfg.get("norm_topk_prob", default)
    if not isinstance(norm, bool):
        raise _err(f"config.json: norm_topk_prob = {norm!r} must be true or false")
    return norm


def _shared_expert(cfg: dict, family: str, ffn: int) -> dict:
    """The shared expert: Qwen2-MoE's ``shared_expert`` (width
    ``shared_expert_intermediate_size``) behind a sigmoid gate ``shared_expert_gate [1, h]``;
    GLM-4.5's ``shared_experts`` (``n_shared_experts`` experts' width, no gate)."""
    if family == "qwen2_moe":
        return {"moe_shared_expert_intermediate_size":
                _pos_int(cfg, "shared_expert_intermediate_size"),
                "moe_shared_expert_gate": True}
    if family == "deepseek_v2" and cfg.get("n_shared_experts") is None:
        return {}  # transformers 4.x's DeepSeek-V2 builds no shared expert then
    if family in _LEADING_DENSE:
        return {"moe_shared_expert_intermediate_size": _pos_int(cfg, "n_shared_experts", 1) * ffn,
                "moe_shared_expert_gate": False}
    return {}


def _sigmoid_router(cfg: dict, experts: int, topk: int) -> dict:
    """GLM-4.5's router as Megatron's: ``s = sigmoid(z)``; experts chosen by ``s + b`` (``b``
    the ``e_score_correction_bias``: ``--moe-router-enable-expert-bias``), within the
    ``topk_group`` best of ``n_group`` groups; weights ``s`` of the chosen, divided by their
    sum, times ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``)."""
    groups = _pos_int(cfg, "n_group", 1)
    group_topk = _pos_int(cfg, "topk_group", 1)
    if experts % groups or group_topk > groups:
        raise _err(f"config.json: n_group = {groups}, topk_group = {group_topk} with {experts} "
                   f"experts: the groups must divide the experts and topk_group <= n_group")
    if groups > 1 and group_topk < groups and topk != 2 * group_topk:
        raise _err(f"config.json: n_group = {groups}, topk_group = {group_topk}, "
                   f"num_experts_per_tok = {topk}: transformers scores a group by the sum of its "
                   f"best 2 experts, megatron-core (--moe-router-num-groups) by its best "
                   f"num_experts_per_tok / topk_group = {topk / group_topk:g}; they pick the "
                   f"same groups only when num_experts_per_tok = 2 x topk_group (or n_group = "
                   f"topk_group, or n_group 1)")
    norm = _norm_topk(cfg, True)
    if norm != (topk > 1):
        raise _err(f"config.json: norm_topk_prob = {str(norm).lower()} with num_experts_per_tok "
                   f"{topk}: megatron-core's sigmoid router divides the top-k weights by their "
                   f"sum exactly when k > 1, so only norm_topk_prob = "
                   f"{str(topk > 1).lower()} converts")
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise _err(f"config.json: routed_scaling_factor = {scale!r} must be a number > 0")
    limited = 1 < groups and group_topk < groups
    return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if limited else None,
            "moe_router_group_topk": group_topk if limited else None,
            "moe_router_topk_scaling_factor": None if scale == 1 else float(scale)}


def _named(cfg: dict, family: str, want: dict) -> None:
    """DeepSeek's own router keys (``topk_method``, ``scoring_func``), which transformers'
    configs leave out: when present they must name the router transformers builds."""
    if family == "glm4_moe":
        return
    for key, value in want.items():
        if cfg.get(key, value) != value:
            raise _err(f"config.json: {key} = {cfg[key]!r}: transformers' {family} routes with "
                       f"{key} {value!r} whatever it says; a model trained with another router "
                       f"does not convert")


def _softmax_group_router(cfg: dict, experts: int, topk: int) -> dict:
    """DeepSeek-V2's router as Megatron's: ``p = softmax(z)`` over all experts, the top-k of
    ``p`` (``--moe-router-pre-softmax``), not renormalised, times ``routed_scaling_factor``
    (``--moe-router-topk-scaling-factor``); ``topk_method`` ``group_limited_greedy`` first keeps
    the ``topk_group`` groups of ``n_group`` with the largest best expert (megatron-core:
    ``--moe-router-num-groups``/``-group-topk``, a group's score the sum of its best
    ``k / topk_group``: the same when ``k = topk_group``)."""
    _named(cfg, "deepseek_v2", {"scoring_func": "softmax"})
    method = cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise _err(f"config.json: topk_method = {method!r}: transformers' DeepSeek-V2 routes "
                   f"with 'greedy' or 'group_limited_greedy' only")
    if _norm_topk(cfg, False):
        raise _err("config.json: norm_topk_prob = true for deepseek_v2: transformers' "
                   "DeepSeek-V2 ignores it (its top-k weights are never renormalised) while "
                   "DeepSeek's own code renormalises, so the model it names is ambiguous; set "
                   "it to false (DeepSeek-V2 and V2-Lite have false)")
    groups = limited = None
    if method == "group_limited_greedy":
        groups, limited = _pos_int(cfg, "n_group"), _pos_int(cfg, "topk_group")
        if experts % groups or limited > groups or topk > limited * (experts // groups):
            raise _err(f"config.json: n_group = {groups}, topk_group = {limited} with "
                       f"{experts} experts and num_experts_per_tok {topk}: the groups must "
                       f"divide the experts and the kept groups hold at least k experts")
        if limited < groups and topk != limited:
            raise _err(f"config.json: topk_method 'group_limited_greedy' with "
                       f"num_experts_per_tok = {topk}, topk_group = {limited}: transformers "
                       f"scores a group by its best expert, megatron-core "
                       f"(--moe-router-num-groups) by the sum of its best num_experts_per_tok / "
                       f"topk_group = {topk / limited:g}; they pick the same groups only when "
                       f"num_experts_per_tok = topk_group")
        if limited == groups:
            groups = limited = None
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise _err(f"config.json: routed_scaling_factor = {scale!r} must be a number > 0")
    return {"moe_router_num_groups": groups, "moe_router_group_topk": limited,
            "moe_router_topk_scaling_factor": None if scale == 1 else float(scale)}


def moe_fields(cfg: dict, family: str, *, num_layers: int, hidden: int,
               metp_parallel_size: int) -> dict:
    """The :class:`~.config.LlamaGeometry` MoE fields of a MoE family's config:
    ``num_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``, ``moe_layers`` (0/1 per
    layer), ``moe_router_pre_softmax``, ``moe_aux_loss_coeff``, the shared expert's and the
    sigmoid router's (GLM-4.5); every field that cannot convert refused."""
    experts = _pos_int(cfg, _EXPERTS_KEY[family], 8 if family == "mixtral" else None)
    ffn = _pos_int(cfg, _FFN_KEY.get(family, "moe_intermediate_size"))
    topk = _pos_int(cfg, "num_experts_per_tok", 2)
    if topk > experts:
        raise _err(f"config.json: num_experts_per_tok {topk} is more than the {experts} experts")
    router = {}
    if family in ("mixtral", "gpt_oss"):  # gpt-oss: Mixtral's routing, router bias added
        jitter = cfg.get("router_jitter_noise", 0.0) or 0.0
        if jitter != 0:
            raise _err(f"config.json: router_jitter_noise = {jitter!r} is not supported: "
                       f"transformers multiplies the experts' input by the noise too, "
                       f"Megatron's --moe-input-jitter-eps only the router's; set it to 0.0")
        pre_softmax = False
    elif family in ("glm4_moe", "deepseek_v3"):
        _named(cfg, family, {"topk_method": "noaux_tc", "scoring_func": "sigmoid"})
        router = _sigmoid_router(cfg, experts, topk)
        pre_softmax = False
    elif family == "deepseek_v2":
        router, pre_softmax = _softmax_group_router(cfg, experts, topk), True
    else:
        pre_softmax = not _norm_topk(cfg, False)
    if topk == 1 and not pre_softmax and family not in ("glm4_moe", "deepseek_v3"):
        what = {"mixtral": "Mixtral", "gpt_oss": "gpt-oss"}.get(family, "norm_topk_prob true")
        raise _err(f"config.json: num_experts_per_tok = 1 with {what}: transformers weights "
                   f"each token's one expert by 1 (its top-1 probability divided by itself); "
                   f"megatron-core's top-1 softmax router takes only --moe-router-pre-softmax, "
                   f"which weights it by the softmax probability, so the logits would differ "
                   f"(Qwen3-MoE / Qwen2-MoE top-1 with norm_topk_prob false converts)")
    if experts % metp_parallel_size:
        raise _err(f"config.json: {experts} experts are not divisible by --metp-parallel-size "
                   f"{metp_parallel_size}: METP shards the experts over its ranks (expert "
                   f"parallel size = METP size); choose a METP size that divides {experts}")
    layers = moe_layers(cfg, family, num_layers)
    if not any(layers):
        raise _err("config.json: decoder_sparse_step / mlp_only_layers / first_k_dense_replace "
                   "leave no MoE layer: convert it as the dense model it is")
    if family in _LEADING_DENSE and cfg.get("output_router_logits"):
        raise _err(f"config.json: output_router_logits = true for {family} is not supported: "
                   f"megatron-core's auxiliary loss is not transformers' (GLM-4.5 and "
                   f"DeepSeek-V3 balance their experts with the expert bias, "
                   f"--moe-router-enable-expert-bias); set it to false")
    coeff = cfg.get("router_aux_loss_coef", 0.0) if cfg.get("output_router_logits") else 0.0
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
        raise _err(f"config.json: router_aux_loss_coef = {coeff!r} must be a number >= 0")
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_layers": tuple(layers), "moe_router_pre_softmax": pre_softmax,
            "moe_aux_loss_coeff": float(coeff), **_shared_expert(cfg, family, ffn), **router}


#: the flags of :func:`moe_flags`
MOE_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq",
             "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
             "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size",
             "--moe-shared-expert-gate", "--moe-router-score-function",
             "--moe-router-enable-expert-bias", "--moe-router-num-groups",
             "--moe-router-group-topk", "--moe-router-topk-scaling-factor")
#: geometry field -> its flag, for the shared expert and the sigmoid router (set when not None /
#: false; a bool is a switch)
EXTRA_MOE_FLAGS = (("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
                ("moe_shared_expert_gate", "--moe-shared-expert-gate"),
                ("moe_router_score_function", "--moe-router-score-function"),
                ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
                ("moe_router_num_groups", "--moe-router-num-groups"),
                ("moe_router_group_topk", "--moe-router-group-topk"),
                ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"))


def _extra_moe(g) -> dict:
    """The geometry's shared-expert and router fields that differ from Megatron's defaults."""
    out = {}
    for name, _ in EXTRA_MOE_FLAGS:
        v = getattr(g, name, None)
        if v not in (None, False, "softmax"):
            out[name] = v
    return out


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
    extra = _extra_moe(g)
    for name, flag in EXTRA_MOE_FLAGS:
        if name in extra:
            out += [flag] if extra[name] is True else [flag, str(extra[name])]
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
                moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
                **_extra_moe(g))


def hf_shared_prefix(family: str) -> str:
    """The shared expert's module name inside transformers' MoE block."""
    return "shared_experts." if family in _LEADING_DENSE else "shared_expert."


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
                f"{', '.join(repr(f) for f in MOE_FAMILIES)} convert (other MoE types are not "
                f"implemented)")
    return None


def saved_moe_layers(saved: dict, num_layers: int) -> List[int]:
    """0/1 per layer from a run's saved ``moe_layer_freq`` (an integer ``N``: layers
    ``i % N == 0``; or the list)."""
    freq = saved.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)]
    return [int(v) for v in freq]


#: saved Megatron-LM MoE arguments of the shared expert and the router: (attribute, flag,
#: is-set); :data:`_ARGS_OF` says which families have them
_NO_FAMILY_MOE_ARGS = (
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", bool),
    ("moe_router_score_function", "--moe-router-score-function",
     lambda v: v not in (None, "softmax")),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor",
     lambda v: v not in (None, 1, 1.0)),
    ("moe_router_num_groups", "--moe-router-num-groups", bool),
    ("moe_router_group_topk", "--moe-router-group-topk", bool),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", bool),
    ("moe_input_jitter_eps", "--moe-input-jitter-eps", bool),
)
#: family -> the arguments of :data:`_NO_FAMILY_MOE_ARGS` it has
_ARGS_OF = {"qwen2_moe": {"moe_shared_expert_intermediate_size"},
            "glm4_moe": {"moe_shared_expert_intermediate_size", "moe_router_score_function",
                         "moe_router_topk_scaling_factor", "moe_router_num_groups",
                         "moe_router_group_topk", "moe_router_enable_expert_bias"}}


def moe_family_of_args(a: dict) -> str:
    """The MoE family a run's saved arguments are written as: ``gpt_oss`` with ``--quick-geglu``
    or ``--softmax-type learnable``, ``glm4_moe`` with the sigmoid router, ``qwen2_moe`` with a
    shared expert, ``qwen3_moe`` with ``--qk-layernorm``, else ``mixtral``."""
    if is_gpt_oss_args(a):
        return "gpt_oss"
    if a.get("moe_router_score_function") == "sigmoid":
        return "glm4_moe"
    if a.get("moe_shared_expert_intermediate_size"):
        return "qwen2_moe"
    return "qwen3_moe" if a.get("qk_layernorm") else "mixtral"


def _moe_ffn(a: dict) -> int:
    return a.get("moe_ffn_hidden_size") or a["ffn_hidden_size"]


def _aux_coeff(a: dict) -> float:
    coeff = a.get("moe_aux_loss_coeff") or 0.0
    return float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff)


def _leading_dense(layers) -> Optional[int]:
    """``k`` when ``layers`` is ``k`` dense layers then MoE ones (GLM-4.5's pattern), else
    None."""
    k = next((i for i, m in enumerate(layers) if m), len(layers))
    return k if all(layers[k:]) else None


def moe_family_problems(a: dict) -> List[str]:
    """Why a run's saved MoE arguments have no form in the family :func:`moe_family_of_args`
    picks (empty if they do, or if the run has no experts), each naming the flag."""
    if not a.get("num_experts"):
        return []
    fam = moe_family_of_args(a)
    have = _ARGS_OF.get(fam, set())
    out = [f"{flag} {a[name]!r}: no Hugging Face MoE family the converter writes has it with "
           f"the run's other MoE flags (written as {fam})"
           for name, flag, bad in _NO_FAMILY_MOE_ARGS
           if name not in have and a.get(name) is not None and bad(a[name])]
    layers = saved_moe_layers(a, a.get("num_layers") or 0)
    if fam == "gpt_oss":
        out += gpt_oss_saved_problems(a, layers)
    elif fam == "qwen2_moe":
        if not a.get("moe_shared_expert_gate"):
            out.append(f"--moe-shared-expert-intermediate-size "
                       f"{a['moe_shared_expert_intermediate_size']!r} without "
                       f"--moe-shared-expert-gate and with the softmax router: Qwen2-MoE's "
                       f"shared expert is gated (GLM-4.5's, ungated, comes with "
                       f"--moe-router-score-function sigmoid)")
        if a.get("qk_layernorm"):
            out.append("--qk-layernorm with a shared expert: Qwen2-MoE has no q/k norms")
    elif fam == "glm4_moe":
        shared, ffn = a.get("moe_shared_expert_intermediate_size"), _moe_ffn(a)
        if not a.get("moe_router_enable_expert_bias"):
            out.append("--moe-router-score-function sigmoid without "
                       "--moe-router-enable-expert-bias: GLM-4.5's router has the bias")
        if a.get("moe_shared_expert_gate"):
            out.append("--moe-shared-expert-gate with the sigmoid router: GLM-4.5's shared "
                       "expert has no gate")
        if not shared or shared % ffn:
            out.append(f"--moe-shared-expert-intermediate-size {shared!r}: GLM-4.5's shared "
                       f"expert is n_shared_experts x --moe-ffn-hidden-size {ffn} wide")
        if _leading_dense(layers) is None:
            out.append(f"--moe-layer-freq {a.get('moe_layer_freq')!r}: GLM-4.5's dense layers "
                       f"are the first ones (first_k_dense_replace)")
        if a.get("moe_router_pre_softmax"):
            out.append("--moe-router-pre-softmax with the sigmoid router: GLM-4.5 has none")
        if _aux_coeff(a) > 0:
            out.append(f"--moe-aux-loss-coeff {_aux_coeff(a)!r} with the sigmoid router: "
                       f"transformers' GLM-4.5 has no auxiliary loss to write it as")
    else:
        if a.get("add_qkv_bias"):
            out.append("--add-qkv-bias with --num-experts and no shared expert: Qwen2-MoE (q/k/v "
                       "biases) has a gated shared expert, GLM-4.5 a sigmoid router")
        if fam == "mixtral":  # every layer MoE, top-k softmax
            if not all(layers):
                out.append(f"--moe-layer-freq {a.get('moe_layer_freq')!r} without "
                           f"--qk-layernorm: Mixtral has experts in every layer (Qwen3-MoE, "
                           f"which may have dense layers, has --qk-layernorm)")
            if a.get("moe_router_pre_softmax"):
                out.append("--moe-router-pre-softmax without --qk-layernorm: Mixtral "
                           "renormalises its top-k (Qwen3-MoE with norm_topk_prob false, which "
                           "has --qk-layernorm, does not)")
    return out


def moe_config_from_args(a: dict, window) -> dict:
    """The MoE ``config.json`` fields (with ``model_type`` and ``architectures``) of a run's
    saved arguments that :func:`moe_family_problems` accepts, in the family
    :func:`moe_family_of_args` picks."""
    fam = moe_family_of_args(a)
    layers = saved_moe_layers(a, a["num_layers"])
    experts, topk, ffn = a["num_experts"], a.get("moe_router_topk") or 2, _moe_ffn(a)
    coeff = _aux_coeff(a)
    common = dict(model_type=fam, architectures=[MOE_FAMILIES[fam]], num_experts_per_tok=topk,
                  output_router_logits=coeff > 0, router_aux_loss_coef=coeff)
    dense = [i for i, m in enumerate(layers) if not m]
    if fam == "glm4_moe":
        groups = a.get("moe_router_num_groups") or 1
        return dict(common, n_routed_experts=experts, moe_intermediate_size=ffn,
                    n_shared_experts=a["moe_shared_expert_intermediate_size"] // ffn,
                    first_k_dense_replace=_leading_dense(layers), n_group=groups,
                    topk_group=a.get("moe_router_group_topk") or groups,
                    norm_topk_prob=topk > 1,
                    routed_scaling_factor=float(a.get("moe_router_topk_scaling_factor") or 1.0),
                    use_qk_norm=bool(a.get("qk_layernorm")),
                    attention_bias=bool(a.get("add_qkv_bias")),
                    partial_rotary_factor=float(a.get("rotary_percent") or 1.0))
    if fam in ("qwen3_moe", "qwen2_moe"):
        out = dict(common, num_experts=experts, moe_intermediate_size=ffn,
                   decoder_sparse_step=1, mlp_only_layers=dense,
                   norm_topk_prob=not a.get("moe_router_pre_softmax", False))
        if fam == "qwen2_moe":
            out.update(shared_expert_intermediate_size=a["moe_shared_expert_intermediate_size"],
                       qkv_bias=bool(a.get("add_qkv_bias")))
        return out
    if fam == "gpt_oss":
        return dict(common, num_local_experts=experts, intermediate_size=ffn,
                    **gpt_oss_config_from_args(a))
    return dict(common, num_local_experts=experts, intermediate_size=ffn,
                router_jitter_noise=0.0,
                sliding_window=None if window is None else int(window[0]) + 1)
