"""A Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Qwen2-MoE,
GLM-4.5, gpt-oss) as the
Megatron GPT it converts to (:class:`LlamaGeometry`).

:func:`geometry_from_hf` checks every field the conversion depends on and raises
:class:`HFConfigError` (a ``ValueError``) naming the field, its value and what to do, before any
tensor is read. From a geometry come Megatron-LM's ``pretrain_gpt.py`` flags
(:func:`megatron_args`), the ``TransformerConfig`` and ``GPTModel`` arguments
(:func:`transformer_config_kwargs`, :func:`gpt_model_kwargs`) and a ``pretrain_gpt.sh`` model
file (:func:`pretrain_gpt_sh_model`).

Supported: ``model_type`` ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (their ``*ForCausalLM``;
what differs between them: :mod:`.families`) with SiLU-gated MLP (SwiGLU), RMSNorm, RoPE (any
integer ``rope_theta``; ``rope_scaling`` none/default, ``llama3`` with Llama 3.1's
``low_freq_factor`` 1, ``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192,
which is what megatron-core 0.16.1's ``--use-rope-scaling`` implements, or ``yarn``:
:mod:`.yarn`), grouped-query attention,
any ``head_dim`` (``--kv-channels``), Qwen2's q/k/v bias (``--add-qkv-bias``), Qwen3's q/k norms
(``--qk-layernorm``), tied or untied embeddings; and the mixture-of-experts families
``qwen3_moe``, ``mixtral``, ``qwen2_moe`` and ``glm4_moe`` (:mod:`.moe`: experts, routing, shared
experts, which layers are MoE; GLM-4.5's partial RoPE as ``--rotary-percent``) and ``gpt_oss``
(:mod:`.gpt_oss`: biases, attention sinks, the clamped quick-GeGLU).

The config may be in transformers 4.x's or 5.x's layout (``rope_parameters``, ...): it is read
into one form first (:mod:`.versions`), and every key is mapped, checked or known to be
harmless, any other refused (:mod:`.keys`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import List, Optional

from .errors import HFConfigError
from .deepseek import mla_config_kwargs, mla_flags
from .gpt_oss import gpt_oss_config_kwargs, gpt_oss_fields, gpt_oss_flags
from .moe import moe_config_kwargs, moe_flags
from .yarn import yarn_flags, yarn_from_hf

#: what megatron-core 0.16.1's RotaryEmbedding._apply_scaling hard-codes for --use-rope-scaling
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}

DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class LlamaGeometry:
    """The Megatron GPT of a Llama checkpoint.

    ``vocab_size`` is the Hugging Face vocabulary ``V``; the Megatron tables have
    ``padded_vocab_size`` rows (Megatron's padding to a multiple of ``vocab_multiple``; rows
    ``[V, padded)`` are zeros after import and dropped on export). ``kv_channels`` is the head
    dimension ``d``: ``head_dim``, by default ``hidden_size / num_attention_heads``. ``family``
    is the ``model_type``; ``qk_layernorm`` (Qwen3's ``q_norm``/``k_norm``) and ``qkv_bias``
    (Qwen2's q/k/v biases) the two layer features beyond Llama's.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    padded_vocab_size: int
    vocab_multiple: int
    make_vocab_size_divisible_by: int
    norm_epsilon: float
    rotary_base: int
    rope_scaling_factor: Optional[float]
    max_position_embeddings: int
    tie_embeddings: bool
    dtype: str
    family: str = "llama"
    head_dim: Optional[int] = None
    qk_layernorm: bool = False
    qkv_bias: bool = False
    sliding_window: Optional[int] = None
    #: YaRN (``rope_scaling`` type ``yarn``): Megatron's ``yarn_*`` config attributes
    #: (:mod:`.yarn`), None without it
    yarn: Optional[dict] = None
    #: mixture of experts (``qwen3_moe``, ``mixtral``, ``qwen2_moe``, ``glm4_moe``: :mod:`.moe`),
    #: None / unused when dense:
    #: ``E`` experts, ``k`` per token, expert FFN width ``f'``, 0/1 per layer (1 = MoE; the
    #: dense layers have ``ffn_hidden_size``), softmax before top-k (no renormalisation),
    #: auxiliary load-balancing loss coefficient
    num_experts: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_layers: Optional[tuple] = None
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0
    #: the shared expert (``qwen2_moe``: gated; ``glm4_moe``): its width, None without one
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    #: the router (``glm4_moe``: sigmoid scores, expert bias, group-limited top-k, scaling)
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    #: the share of each head's channels RoPE rotates (``partial_rotary_factor``:
    #: ``--rotary-percent``)
    rotary_percent: float = 1.0
    #: gpt-oss (:mod:`.gpt_oss`): biases on every linear layer (``--add-bias-linear``), the
    #: experts' clamped quick-GeGLU (``--quick-geglu --glu-linear-offset 1.0
    #: --activation-func-clamp-value``), attention sinks (``--softmax-type learnable``)
    linear_bias: bool = False
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    softmax_type: str = "vanilla"
    #: DeepSeek's multi-latent attention (:mod:`.deepseek`): the query latent's rank (None: no
    #: query latent), the kv latent's, the no-RoPE / RoPE query-key widths, the value width,
    #: and MLATransformerConfig's YaRN fields (None: plain RoPE)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    mla_yarn: Optional[dict] = None

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of Megatron's fused ``linear_qkv``: ``(heads + 2·groups)·d``."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def to_json(self) -> dict:
        return asdict(self)


def read_hf_config(hf_dir: str) -> dict:
    """``hf_dir/config.json`` as a dict (:class:`HFConfigError` if absent or not JSON)."""
    if not os.path.isdir(hf_dir):
        raise HFConfigError(f"--hf-dir {hf_dir!r} is not a directory; pass the folder "
                            f"save_pretrained() wrote (config.json + *.safetensors)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFConfigError(f"{path!r} is missing: the Hugging Face checkpoint needs its "
                            f"config.json next to the safetensors (save_pretrained() writes it)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError as exc:
        raise HFConfigError(f"{path!r} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path!r} holds a {type(cfg).__name__}, not a JSON object")
    return cfg


def _int_field(cfg: dict, name: str, *, minimum: int = 1) -> int:
    if name not in cfg:
        raise HFConfigError(f"config.json has no {name!r}; a Llama config always sets it")
    v = cfg[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise HFConfigError(f"config.json: {name} = {v!r} must be an integer >= {minimum}")
    return v


def _rope_scaling_factor(cfg: dict, where: str = "rope_scaling") -> Optional[float]:
    rs = cfg.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise HFConfigError(f"config.json: {where} = {rs!r} must be null or an object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "yarn":
        return None  # geometry_from_hf reads it (yarn.yarn_from_hf)
    if kind != "llama3":
        raise HFConfigError(
            f"config.json: {where} type {kind!r} is not supported: megatron-core (and METP, "
            f"which uses its rotary embeddings) implements only the 'llama3' scaling "
            f"(--use-rope-scaling) and 'yarn' (--position-embedding-type yarn); remove "
            f"{where} or convert a model without it")
    factor = rs.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise HFConfigError(f"config.json: {where}.factor = {factor!r} must be a number > 0")
    for key, want in MEGATRON_LLAMA3_ROPE.items():
        got = rs.get(key)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or float(got) != want:
            raise HFConfigError(
                f"config.json: {where}.{key} = {got!r}: megatron-core 0.16.1's "
                f"--use-rope-scaling fixes it at {want:g} (Llama 3.1's value; only "
                f"--rope-scaling-factor is a flag), so this model's RoPE cannot be reproduced")
    return float(factor)


def geometry_from_hf(cfg: dict, *, make_vocab_size_divisible_by: int = 128,
                     tensor_model_parallel_size: int = 1,
                     metp_parallel_size: int = 1,
                     seq_length: Optional[int] = None) -> LlamaGeometry:
    """Check a ``config.json`` of a supported family and return its Megatron geometry.

    ``seq_length``: the longest sequence the run will train on (only needed for a model with a
    sliding window shorter than ``max_position_embeddings``, :mod:`.families`).

    The vocabulary is padded as Megatron-LM (patched for METP) pads it for the run that will load
    the checkpoint: to a multiple of ``make_vocab_size_divisible_by × TP × METP`` (a METP run pads
    as stock TP of size ``TP × METP``; ``megatron_metp.megatron_lm``). Heads, query groups and the
    FFN width must divide by ``TP × METP``.
    """
    for name, v in (("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
                    ("tensor_model_parallel_size", tensor_model_parallel_size),
                    ("metp_parallel_size", metp_parallel_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise HFConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    if seq_length is not None and (isinstance(seq_length, bool) or
                                   not isinstance(seq_length, int) or seq_length < 1):
        raise HFConfigError(f"--seq-length must be an integer >= 1, got {seq_length!r}")
    from .families import check_family, family_fields
    from .keys import check_keys
    from .versions import canonical, rope_source

    cfg = canonical(cfg)  # transformers 5.x's layout read as 4.x's (versions)
    where = rope_source(cfg)
    family = check_family(cfg)
    check_keys(cfg, family, rope_source=where)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"config.json: hidden_act {act!r} is not supported: Megatron's "
                            f"--swiglu is SiLU(gate)·up; only 'silu' converts")
    if float(cfg.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise HFConfigError(f"config.json: attention_dropout = {cfg['attention_dropout']!r}: METP "
                            f"has no attention dropout; set it to 0.0")
    prf = cfg.get("partial_rotary_factor", 1.0)
    if prf is None:
        prf = 1.0
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        raise HFConfigError(f"config.json: partial_rotary_factor = {prf!r} must be a number in "
                            f"(0, 1]")
    if prf != 1 and family != "glm4_moe":
        raise HFConfigError(f"config.json: partial_rotary_factor = {prf!r} is not supported for "
                            f"{family!r} (RoPE over the whole head; partial RoPE converts for "
                            f"glm4_moe, as --rotary-percent)")
    layers = _int_field(cfg, "num_hidden_layers")
    hidden = _int_field(cfg, "hidden_size")
    ffn = _int_field(cfg, "intermediate_size")
    heads = _int_field(cfg, "num_attention_heads")
    groups = cfg.get("num_key_value_heads") or heads
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise HFConfigError(f"config.json: num_key_value_heads = {groups!r} must be an integer >= 1")
    vocab = _int_field(cfg, "vocab_size")
    if heads % groups:
        raise HFConfigError(f"config.json: num_attention_heads {heads} is not divisible by "
                            f"num_key_value_heads {groups} (grouped-query attention needs whole "
                            f"groups)")
    from .moe import MOE_FAMILIES, moe_fields

    moe = (moe_fields(cfg, family, num_layers=layers, hidden=hidden,
                      metp_parallel_size=metp_parallel_size) if family in MOE_FAMILIES else {})
    shards = tensor_model_parallel_size * metp_parallel_size
    if moe and tensor_model_parallel_size != 1:
        raise HFConfigError(f"--tensor-model-parallel-size {tensor_model_parallel_size} with "
                            f"the experts of a {family} model: METP runs MoE at TP = 1 (experts "
                            f"sharded over the METP ranks); use --tensor-model-parallel-size 1")
    dense_ffn = not moe or not all(moe["moe_layers"])  # a dense MLP somewhere
    for name, v in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                    ("intermediate_size", ffn if dense_ffn else shards)):
        if v % shards:
            raise HFConfigError(f"config.json: {name} {v} is not divisible by TP x METP = "
                                f"{tensor_model_parallel_size} x {metp_parallel_size}: choose "
                                f"--tensor-model-parallel-size / --metp-parallel-size whose "
                                f"product divides it")
    shared = moe.get("moe_shared_expert_intermediate_size")
    if shared and shared % shards:  # the shared expert runs as METP's MLP (weight ring)
        key = ("shared_expert_intermediate_size" if family == "qwen2_moe" else
               "n_shared_experts x moe_intermediate_size")
        raise HFConfigError(f"config.json: {key} = {shared} (the shared expert's width) is not "
                            f"divisible by TP x METP = {tensor_model_parallel_size} x "
                            f"{metp_parallel_size}: choose a --metp-parallel-size that divides it")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise HFConfigError(f"config.json: rms_norm_eps = {eps!r} must be a number > 0")
    theta = cfg.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0 or \
            float(theta) != int(theta):
        raise HFConfigError(f"config.json: rope_theta = {theta!r}: Megatron's --rotary-base is an "
                            f"integer; only integral bases convert exactly")
    from .deepseek import DEEPSEEK_FAMILIES, mla_fields

    mla = family in DEEPSEEK_FAMILIES
    scaling = None if mla else _rope_scaling_factor(cfg, where)  # MLA: deepseek.mla_fields
    max_pos = cfg.get("max_position_embeddings", 2048)
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1:
        raise HFConfigError(f"config.json: max_position_embeddings = {max_pos!r} must be an "
                            f"integer >= 1")
    rs = cfg.get("rope_scaling") or {}
    yarn = (yarn_from_hf(rs, max_pos, where=where) if rs.get("rope_type", rs.get("type")) == "yarn"
            and not mla else None)
    fam = family_fields(cfg, family, hidden=hidden, heads=heads, max_pos=max_pos,
                        seq_length=seq_length)
    max_pos = fam["max_position_embeddings"]
    variant = (gpt_oss_fields(cfg) if family == "gpt_oss" else
               mla_fields(cfg, family, heads=heads, where=where) if mla else {})
    if prf != 1:
        rot = fam["head_dim"] * prf
        if rot != int(rot) or int(rot) % 2:
            raise HFConfigError(f"config.json: partial_rotary_factor = {prf!r} of head_dim "
                                f"{fam['head_dim']} is {rot:g} channels: RoPE needs an even "
                                f"whole number of them")
        if yarn is not None or scaling is not None:
            raise HFConfigError(f"config.json: partial_rotary_factor = {prf!r} with {where} "
                                f"scaling: Megatron's --rotary-percent takes plain RoPE only")
    dtype = cfg.get("torch_dtype", cfg.get("dtype")) or "float32"
    if dtype not in DTYPES:
        raise HFConfigError(f"config.json: torch_dtype {dtype!r} is not one of "
                            f"{sorted(set(DTYPES.values()))}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size * metp_parallel_size
    padded = int(math.ceil(vocab / multiple) * multiple)
    return LlamaGeometry(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, vocab_size=vocab, padded_vocab_size=padded,
        vocab_multiple=multiple, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        norm_epsilon=float(eps), rotary_base=int(theta), rope_scaling_factor=scaling,
        max_position_embeddings=max_pos, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=DTYPES[dtype], family=family,
        head_dim=None if fam["head_dim"] * heads == hidden else fam["head_dim"],
        qk_layernorm=variant.pop("qk_layernorm", fam["qk_layernorm"]),
        qkv_bias=variant.pop("qkv_bias", fam["qkv_bias"]),
        sliding_window=fam["sliding_window"], yarn=yarn, rotary_percent=float(prf), **moe,
        **variant)


def megatron_args(g: LlamaGeometry) -> List[str]:
    """The Megatron-LM ``pretrain_gpt.py`` model flags that build this geometry."""
    out = ["--num-layers", str(g.num_layers), "--hidden-size", str(g.hidden_size),
           "--ffn-hidden-size", str(g.ffn_hidden_size),
           "--num-attention-heads", str(g.num_attention_heads)]
    if g.num_query_groups != g.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", str(g.num_query_groups)]
    if g.head_dim is not None:
        out += ["--kv-channels", str(g.head_dim)]
    if g.qk_layernorm:
        out.append("--qk-layernorm")
    if g.qkv_bias:
        out.append("--add-qkv-bias")
    out += ["--normalization", "RMSNorm", "--norm-epsilon", repr(g.norm_epsilon),
            *(gpt_oss_flags(g) if g.quick_geglu else ["--swiglu"]),
            "--add-bias-linear" if g.linear_bias else "--disable-bias-linear",
            "--position-embedding-type",
            "yarn" if g.yarn else "rope", "--rotary-base", str(g.rotary_base),
            "--max-position-embeddings", str(g.max_position_embeddings),
            "--make-vocab-size-divisible-by", str(g.make_vocab_size_divisible_by),
            "--attention-dropout", "0", "--hidden-dropout", "0"]
    if g.rope_scaling_factor is not None:
        out += ["--use-rope-scaling", "--rope-scaling-factor", repr(g.rope_scaling_factor)]
    if g.yarn:
        out += yarn_flags(g.yarn)
    if g.rotary_percent != 1.0:
        out += ["--rotary-percent", repr(g.rotary_percent)]
    if not g.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    return out + mla_flags(g) + moe_flags(g)


def transformer_config_kwargs(g: LlamaGeometry, *, tp: int = 1, metp: int = 1,
                              ep: int = 1, dispatcher: str = "allgather") -> dict:
    """``TransformerConfig`` fields of this geometry for a CPU build (no fusions, fp32 unless
    the checkpoint's dtype says otherwise); a MoE geometry's with ``ep`` expert-parallel ranks
    and Megatron's ``dispatcher`` (:func:`.moe.moe_config_kwargs`)."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, g.dtype)
    out = dict(
        num_layers=g.num_layers, hidden_size=g.hidden_size, ffn_hidden_size=g.ffn_hidden_size,
        num_attention_heads=g.num_attention_heads, num_query_groups=g.num_query_groups,
        kv_channels=g.kv_channels, normalization="RMSNorm", layernorm_epsilon=g.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=g.linear_bias,
        add_qkv_bias=g.qkv_bias, qk_layernorm=g.qk_layernorm,
        tensor_model_parallel_size=tp, context_parallel_size=metp,
        attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **moe_config_kwargs(g, ep=ep, dispatcher=dispatcher))
    out.update(gpt_oss_config_kwargs(g))  # gpt-oss: quick-GeGLU in place of SiLU, sinks
    out.update(mla_config_kwargs(g))  # DeepSeek: MLATransformerConfig's fields
    return out


def set_yarn_config(config, g: LlamaGeometry) -> None:
    """Put YaRN's ``yarn_*`` attributes on a ``TransformerConfig`` (they are not dataclass
    fields: megatron-core's ``GPTModel`` and attention read them with ``getattr``, and
    Megatron-LM core_v0.19.0 sets them the same way from its flags)."""
    for name, value in (g.yarn or {}).items():
        setattr(config, name, value)


def gpt_model_kwargs(g: LlamaGeometry) -> dict:
    """``GPTModel`` arguments besides config and spec (as Megatron-LM's gpt_builder passes them)."""
    return dict(vocab_size=g.padded_vocab_size, max_sequence_length=g.max_position_embeddings,
                share_embeddings_and_output_weights=g.tie_embeddings,
                position_embedding_type="yarn" if g.yarn else "rope", rotary_base=g.rotary_base,
                rope_scaling=g.rope_scaling_factor is not None,
                rope_scaling_factor=g.rope_scaling_factor or 8.0,
                rotary_percent=g.rotary_percent)


def pretrain_gpt_sh_model(g: LlamaGeometry, load_dir: str, *, tp: int = 1, metp: int = 1) -> str:
    """A model file for ``scripts/pretrain_gpt.sh`` (``configs/models/*.sh`` style): the geometry
    and the converted-for TP / METP sizes as its variables, the rest (norm epsilon, RoPE
    scaling, vocabulary padding and ``--pretrained-checkpoint load_dir``) in ``EXTRA_ARGS``.
    Megatron-LM loads ``--pretrained-checkpoint`` as ``--finetune`` when the run's own
    ``--load`` directory (``CHECKPOINT_PATH``) holds no checkpoint yet, and resumes from
    ``--load`` once it does. The caller's environment still wins for every variable."""
    extra = ["--norm-epsilon", repr(g.norm_epsilon), "--make-vocab-size-divisible-by",
             str(g.make_vocab_size_divisible_by), "--pretrained-checkpoint", load_dir]
    if g.rope_scaling_factor is not None:
        extra += ["--use-rope-scaling", "--rope-scaling-factor", repr(g.rope_scaling_factor)]
    if g.yarn:
        extra += yarn_flags(g.yarn)
    if g.rotary_percent != 1.0:
        extra += ["--rotary-percent", repr(g.rotary_percent)]
    if g.quick_geglu:
        extra += gpt_oss_flags(g)
    extra += mla_flags(g) + moe_flags(g)
    lines = [
        "# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh",
        f"# Written by `python -m megatron_metp.tools.hf import`: the converted {g.family} "
        f"checkpoint's",
        "# geometry. Set SEQ_LENGTH, GPUS_PER_NODE, ... in the environment (they win).",
        "# The first run starts from the converted weights (--pretrained-checkpoint: Megatron",
        "# fine-tunes from it while CHECKPOINT_PATH holds no checkpoint), later runs resume from",
        "# CHECKPOINT_PATH.",
        f"# Megatron pads the vocabulary to a multiple of {g.make_vocab_size_divisible_by} x TP x "
        f"METP; the checkpoint has {g.padded_vocab_size} rows",
        f"# ({g.vocab_size} tokens), as at TP {tp} x METP {metp}: another TP x METP whose "
        f"multiple pads {g.vocab_size} differently",
        "# does not load it. With mock data (NullTokenizer adds one end-of-document token)",
        "# VOCAB_SIZE is the Hugging Face vocabulary minus one.",
        f': "${{TP:={tp}}}" "${{METP:={metp}}}"',
        f': "${{NUM_LAYERS:={g.num_layers}}}" "${{HIDDEN_SIZE:={g.hidden_size}}}" '
        f'"${{FFN_HIDDEN_SIZE:={g.ffn_hidden_size}}}"',
        f': "${{NUM_ATTENTION_HEADS:={g.num_attention_heads}}}" '
        # MLA: no --group-query-attention (Megatron-LM refuses it with MLA)
        f'"${{NUM_QUERY_GROUPS:={"" if g.multi_latent_attention else g.num_query_groups}}}" '
        f'"${{ROTARY_BASE:={g.rotary_base}}}"',
        f': "${{SWIGLU:={int(not g.quick_geglu)}}}" "${{NORMALIZATION:=RMSNorm}}" '
        f'"${{POSITION_EMBEDDING_TYPE:={"yarn" if g.yarn else "rope"}}}" '
        f'"${{DISABLE_BIAS_LINEAR:={int(not g.linear_bias)}}}"',
        f': "${{KV_CHANNELS:={g.head_dim or ""}}}" "${{QK_LAYERNORM:={int(g.qk_layernorm)}}}" '
        f'"${{ADD_QKV_BIAS:={int(g.qkv_bias)}}}"',
        f': "${{UNTIE_EMBEDDINGS:={0 if g.tie_embeddings else 1}}}" '
        f'"${{VOCAB_SIZE:={g.vocab_size - 1}}}" '
        f'"${{MAX_POSITION_EMBEDDINGS:={g.max_position_embeddings}}}"',
        'if [[ -z "${EXTRA_ARGS+x}" ]]; then EXTRA_ARGS=(); fi',
        "EXTRA_ARGS+=(" + " ".join(_sh_quote(a) for a in extra) + ")",
    ]
    return "\n".join(lines) + "\n"


def _sh_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
