"""DeepSeek-V2 and DeepSeek-V3 (``model_type`` ``deepseek_v2``, ``deepseek_v3``): their
multi-latent attention (MLA) as megatron-core's ``MLASelfAttention`` (METP runs it as
:class:`megatron_metp.megatron.mla.METPMLASelfAttention`, the latent on the ring), and the
Megatron-LM flags and weights it converts to. The MoE half (routers, shared experts, leading dense
layers) is :mod:`.moe`'s.

Names: ``A`` heads, ``dn`` = ``qk_nope_head_dim``, ``dr`` = ``qk_rope_head_dim``, ``dv`` =
``v_head_dim``, ``kvr`` = ``kv_lora_rank``, ``ql`` = ``q_lora_rank``, ``h`` hidden.

=======================================  ===============================================
transformers ``config.json``             Megatron-LM flag
=======================================  ===============================================
(always)                                 ``--multi-latent-attention --qk-layernorm``
                                         (the latent RMSNorms ``q_a_layernorm``,
                                         ``kv_a_layernorm``)
``q_lora_rank`` (null: V2-Lite, no       ``--q-lora-rank`` (left out when null)
query latent)
``kv_lora_rank``                         ``--kv-lora-rank``
``qk_nope_head_dim``                     ``--qk-head-dim``
``qk_rope_head_dim``                     ``--qk-pos-emb-head-dim``
``v_head_dim``                           ``--v-head-dim``
no ``rope_scaling``                      ``--rope-type rope --no-rope-fusion``
``rope_scaling`` yarn                    ``--rope-type yarn --rotary-scaling-factor f
                                         --mscale m --mscale-all-dim M``
=======================================  ===============================================

RoPE pairs. transformers' DeepSeek rotates interleaved channel pairs ``(2j, 2j+1)`` of the
``dr`` rotary channels (V2: as complex numbers; V3 with ``rope_interleave`` true, its default:
gathered into halves first). megatron-core's MLA does the same (``apply_rotary_pos_emb`` with
``multi_latent_attention``: ``x[0::2] | x[1::2]``, then rotate-half with ``[θ | θ]``), and so does
METP's (:mod:`megatron_metp.ops.mla_rope`): the weights are copied as they are, no row is permuted.
``rope_interleave`` false (rotate-half over the stored order) is refused.

Norms. transformers normalises the latents with epsilon 1e-6 whatever ``rms_norm_eps`` says;
Megatron's MLA with ``--norm-epsilon``: only ``rms_norm_eps`` 1e-6 (DeepSeek's) converts.

YaRN. Megatron's MLA multiplies cos/sin by ``g(f, m)/g(f, M)`` and the softmax scale by
``g(f, M)²`` (``g(f, x) = 0.1·x·ln f + 1``); transformers 5.x (both families) and 4.x's
DeepSeek-V3 do the same when both ``mscale`` and ``mscale_all_dim`` are set, and with
``mscale_all_dim`` unset use ``g(f, 1)`` on cos/sin and no softmax factor (``--mscale 1
--mscale-all-dim 0``). transformers 4.x's DeepSeek-V2 leaves the softmax factor out (DeepSeek's
own code and 5.x apply it): the converter follows DeepSeek and 5.x, so a V2 with
``mscale_all_dim`` gives 4.x's logits only when ``g(f, M) = 1``. Megatron-LM has no flag for
MLA's original context (4096), ``beta_fast`` (32) or ``beta_slow`` (1) (``MLATransformerConfig``'s
defaults, DeepSeek's values); other values, ``truncate`` false and ``attention_factor`` are refused.

Weights (``P = model.layers.i.self_attn.``, ``T = decoder.layers.i.self_attention.``):

==================================================  ===============================================
transformers                                        Megatron (``named_parameters()``, TP = 1)
==================================================  ===============================================
``P q_a_proj.weight [ql, h]``                       ``T linear_q_down_proj.weight``
``P q_a_layernorm.weight [ql]``                     ``T q_layernorm.weight``
``P q_b_proj.weight [A·(dn+dr), ql]``               ``T linear_q_up_proj.weight``
``P q_proj.weight [A·(dn+dr), h]`` (no ``ql``)      ``T linear_q_proj.weight``
``P kv_a_proj_with_mqa.weight [kvr+dr, h]``         ``T linear_kv_down_proj.weight``
``P kv_a_layernorm.weight [kvr]``                   ``T kv_layernorm.weight``
``P kv_b_proj.weight [A·(dn+dv), kvr]``             ``T linear_kv_up_proj.weight``
``P o_proj.weight [h, A·dv]``                       ``T linear_proj.weight``
==================================================  ===============================================

Both sides order a head's rows ``[nope (dn); rope (dr)]`` (queries) and ``[k_nope (dn); v (dv)]``
(the kv up-projection), and the latent ``[kvr; dr]``: every tensor only changes its name, so a
round trip returns the same bits.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .errors import HFConfigError

#: DeepSeek model_type -> the causal-LM architecture that converts
DEEPSEEK_FAMILIES = {"deepseek_v2": "DeepseekV2ForCausalLM",
                     "deepseek_v3": "DeepseekV3ForCausalLM"}
#: what megatron-core's MLATransformerConfig fixes (Megatron-LM has no flags for them)
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": True}

#: the epsilon of transformers' latent RMSNorms (their constructor's default, not rms_norm_eps)
LATENT_NORM_EPS = 1e-6
#: the geometry fields of an MLA model (None / False without one)
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
              "qk_pos_emb_head_dim", "v_head_dim", "mla_yarn")


def _err(msg: str):
    return HFConfigError(msg)


def _dim(cfg: dict, name: str, *, optional: bool = False, even: bool = False) -> Optional[int]:
    v = cfg.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (even and v % 2):
        raise _err(f"config.json: {name} = {v!r} must be an {'even ' if even else ''}integer "
                   f">= {2 if even else 1}")
    return v


def _mla_yarn(rs: dict, where: str) -> dict:
    """MLATransformerConfig's YaRN fields of a ``rope_scaling`` of type yarn (module
    docstring), refusing what Megatron-LM's MLA flags cannot express, naming the key."""
    from .yarn import YARN_KEYS, rope_number

    unknown = sorted(set(rs) - YARN_KEYS)
    if unknown:
        raise _err(f"config.json: {where} has {unknown} besides YaRN's keys: remove them")
    factor = rope_number(rs, "factor", positive=True, where=where)
    if factor is None:
        raise _err(f"config.json: {where} type 'yarn' needs a 'factor'")
    if rs.get("attention_factor") is not None:
        raise _err(f"config.json: {where}.attention_factor = {rs['attention_factor']!r} with "
                   f"multi-latent attention: Megatron's MLA derives the factor from --mscale / "
                   f"--mscale-all-dim only; remove it")
    for key, want in MLA_YARN_FIXED.items():
        got = rs.get(key)
        if got is not None and got != want:
            raise _err(f"config.json: {where}.{key} = {got!r}: Megatron-LM's multi-latent "
                       f"attention fixes it at {want!r} (MLATransformerConfig's default, "
                       f"DeepSeek's value; no flag sets it), so this RoPE cannot be reproduced")
    ms = rope_number(rs, "mscale", where=where)
    msad = rope_number(rs, "mscale_all_dim", where=where)
    if msad and not ms:
        raise _err(f"config.json: {where}.mscale_all_dim = {msad!r} without mscale: "
                   f"transformers then scales cos/sin by g(factor, 1) and the softmax by "
                   f"g(factor, mscale_all_dim)^2, which Megatron's MLA (cos/sin by "
                   f"g(f, --mscale)/g(f, --mscale-all-dim)) cannot give; set mscale too")
    if ms and msad:
        return {"rotary_scaling_factor": factor, "mscale": ms, "mscale_all_dim": msad}
    return {"rotary_scaling_factor": factor, "mscale": 1.0, "mscale_all_dim": 0.0}


def mla_fields(cfg: dict, family: str, *, heads: int, where: str) -> dict:
    """The :class:`~.config.LlamaGeometry` MLA fields of a DeepSeek config (its latent ranks,
    head dims, YaRN), every field that cannot convert refused naming it."""
    groups = cfg.get("num_key_value_heads")
    if groups not in (None, heads):
        raise _err(f"config.json: num_key_value_heads = {groups!r} with num_attention_heads "
                   f"{heads}: multi-latent attention up-projects K and V for every head "
                   f"(Megatron's MLA has no --group-query-attention); set it to {heads}")
    nope, rope = _dim(cfg, "qk_nope_head_dim"), _dim(cfg, "qk_rope_head_dim", even=True)
    for key, want in (("head_dim", rope), ("qk_head_dim", nope + rope)):
        if cfg.get(key) is not None and cfg[key] != want:
            raise _err(f"config.json: {key} = {cfg[key]!r}: a {family} config derives it "
                       f"({'qk_rope_head_dim' if key == 'head_dim' else 'qk_nope_head_dim + qk_rope_head_dim'}"
                       f" = {want}); a different value means another model")
    if family == "deepseek_v3" and cfg.get("rope_interleave", True) is not True:
        raise _err(f"config.json: rope_interleave = {cfg['rope_interleave']!r}: Megatron's "
                   f"multi-latent attention rotates interleaved channel pairs (DeepSeek's "
                   f"layout, rope_interleave true); a rotate-half checkpoint does not convert")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if eps != LATENT_NORM_EPS:
        raise _err(f"config.json: rms_norm_eps = {eps!r}: transformers' {family} normalises "
                   f"the latents (q_a_layernorm, kv_a_layernorm) with epsilon "
                   f"{LATENT_NORM_EPS:g} whatever rms_norm_eps says, Megatron's MLA with "
                   f"--norm-epsilon; they agree only at rms_norm_eps = {LATENT_NORM_EPS:g} "
                   f"(DeepSeek's value)")
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise _err(f"config.json: {where} type {kind!r} with multi-latent attention: Megatron's "
                   f"MLA takes plain RoPE (--rope-type rope) or YaRN (--rope-type yarn) only")
    return {"multi_latent_attention": True, "q_lora_rank": _dim(cfg, "q_lora_rank", optional=True),
            "kv_lora_rank": _dim(cfg, "kv_lora_rank"), "qk_head_dim": nope,
            "qk_pos_emb_head_dim": rope, "v_head_dim": _dim(cfg, "v_head_dim"),
            "mla_yarn": _mla_yarn(rs, where) if kind == "yarn" else None,
            "qk_layernorm": True}


def mla_flags(g) -> List[str]:
    """Megatron-LM flags of the geometry's multi-latent attention (empty without it)."""
    if not g.multi_latent_attention:
        return []
    out = ["--multi-latent-attention"]
    if g.q_lora_rank is not None:
        out += ["--q-lora-rank", str(g.q_lora_rank)]
    out += ["--kv-lora-rank", str(g.kv_lora_rank), "--qk-head-dim", str(g.qk_head_dim),
            "--qk-pos-emb-head-dim", str(g.qk_pos_emb_head_dim), "--v-head-dim",
            str(g.v_head_dim)]
    y = g.mla_yarn
    if y is None:  # megatron-core's MLA takes rope fusion with YaRN only
        return out + ["--rope-type", "rope", "--no-rope-fusion"]
    return out + ["--rope-type", "yarn", "--rotary-scaling-factor",
                  repr(y["rotary_scaling_factor"]), "--mscale", repr(y["mscale"]),
                  "--mscale-all-dim", repr(y["mscale_all_dim"])]


def mla_config_kwargs(g) -> dict:
    """``MLATransformerConfig`` fields of the geometry (empty without MLA)."""
    if not g.multi_latent_attention:
        return {}
    y = g.mla_yarn or {}
    return dict(multi_latent_attention=True, q_lora_rank=g.q_lora_rank,
                kv_lora_rank=g.kv_lora_rank, qk_head_dim=g.qk_head_dim,
                qk_pos_emb_head_dim=g.qk_pos_emb_head_dim, v_head_dim=g.v_head_dim,
                rope_type="yarn" if y else "rope", rotary_base=g.rotary_base,
                rotary_scaling_factor=y.get("rotary_scaling_factor", 1.0),
                mscale=y.get("mscale", 1.0), mscale_all_dim=y.get("mscale_all_dim", 0.0),
                **{k: v for k, v in MLA_YARN_FIXED.items() if k != "truncate"})


def config_class(g):
    """megatron-core's config class of the geometry: ``MLATransformerConfig`` with MLA."""
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    return MLATransformerConfig if g.multi_latent_attention else TransformerConfig


def _renames(g, i: int):
    """Layer ``i``'s MLA tensors: ``(transformers name, Megatron name, shape)``."""
    p, t = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    h, A = g.hidden_size, g.num_attention_heads
    dq, ql, kvr = g.qk_head_dim + g.qk_pos_emb_head_dim, g.q_lora_rank, g.kv_lora_rank
    if ql is None:
        out = [(p + "q_proj.weight", t + "linear_q_proj.weight", (A * dq, h))]
    else:
        out = [(p + "q_a_proj.weight", t + "linear_q_down_proj.weight", (ql, h)),
               (p + "q_a_layernorm.weight", t + "q_layernorm.weight", (ql,)),
               (p + "q_b_proj.weight", t + "linear_q_up_proj.weight", (A * dq, ql))]
    return out + [
        (p + "kv_a_proj_with_mqa.weight", t + "linear_kv_down_proj.weight",
         (kvr + g.qk_pos_emb_head_dim, h)),
        (p + "kv_a_layernorm.weight", t + "kv_layernorm.weight", (kvr,)),
        (p + "kv_b_proj.weight", t + "linear_kv_up_proj.weight",
         (A * (g.qk_head_dim + g.v_head_dim), kvr)),
        (p + "o_proj.weight", t + "linear_proj.weight", (h, A * g.v_head_dim))]


def hf_mla_shapes(g, i: int) -> Dict[str, tuple]:
    """transformers' names and shapes of layer ``i``'s attention."""
    return {a: s for a, _, s in _renames(g, i)}


def megatron_mla_shapes(g, i: int) -> Dict[str, tuple]:
    """Megatron's names and shapes of layer ``i``'s attention."""
    return {b: s for _, b, s in _renames(g, i)}


def mla_hf_to_megatron(hf: dict, g, i: int) -> dict:
    """Layer ``i``'s attention: transformers → Megatron (renames only)."""
    return {b: hf[a].clone() for a, b, _ in _renames(g, i)}


def mla_megatron_to_hf(mg: dict, g, i: int) -> dict:
    """Inverse of :func:`mla_hf_to_megatron`."""
    return {a: mg[b].clone() for a, b, _ in _renames(g, i)}
