"""Pure tensor re-layout between Hugging Face Llama and Megatron GPT weights (no I/O, no maths).

Names: ``h`` hidden size, ``n`` query heads, ``g`` query groups (K/V heads), ``d = h / n``,
``f`` FFN width, ``V`` the Hugging Face vocabulary, ``Vp`` Megatron's padded vocabulary, ``i`` a
layer index. Only ``cat``, ``split``, views and zero rows are used, so a round trip returns the
same bits.

=====================================================  ======================================================
Hugging Face (``LlamaForCausalLM.state_dict()``)       Megatron ``GPTModel.named_parameters()`` (TP = 1)
=====================================================  ======================================================
``model.embed_tokens.weight`` ``[V, h]``               ``embedding.word_embeddings.weight`` ``[Vp, h]``
``model.layers.i.input_layernorm.weight`` ``[h]``      ``decoder.layers.i.input_layernorm.weight``
``…self_attn.{q,k,v}_proj.weight`` ``[n·d | g·d, h]``  ``…self_attention.linear_qkv.weight`` ``[(n+2g)·d, h]``
``…self_attn.o_proj.weight`` ``[h, n·d]``              ``…self_attention.linear_proj.weight``
``…post_attention_layernorm.weight`` ``[h]``           ``decoder.layers.i.pre_mlp_layernorm.weight``
``…mlp.{gate,up}_proj.weight`` ``[f, h]``              ``…mlp.linear_fc1.weight`` ``[2f, h]`` (gate; up)
``…mlp.down_proj.weight`` ``[h, f]``                   ``…mlp.linear_fc2.weight``
``model.norm.weight`` ``[h]``                          ``decoder.final_layernorm.weight``
``lm_head.weight`` ``[V, h]`` (untied only)            ``output_layer.weight`` ``[Vp, h]`` (untied only)
=====================================================  ======================================================

Qwen2 (``qkv_bias``): ``…self_attn.{q,k,v}_proj.bias`` ↔ ``…self_attention.linear_qkv.bias``
``[(n+2g)·d]``, fused like the weight. Qwen3 (``qk_layernorm``): ``…self_attn.q_norm.weight`` /
``k_norm.weight`` ``[d]`` ↔ ``…self_attention.q_layernorm.weight`` / ``k_layernorm.weight``.

Megatron's fused QKV is grouped per query group, as ``SelfAttention.get_query_key_value_tensors``
splits it: rows ``[q heads of group 0 (n/g·d); k_0 (d); v_0 (d); q heads of group 1; …]``, where
query head ``j`` belongs to group ``j // (n/g)`` (the Hugging Face GQA convention, which repeats
each K/V head over ``n/g`` consecutive query heads). Megatron's SwiGLU takes
``silu(first half) · second half`` of ``linear_fc1``'s output: gate rows first, then up.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from .config import HFConfigError, LlamaGeometry
from .deepseek import (hf_mla_shapes, megatron_mla_shapes, mla_hf_to_megatron,
                       mla_megatron_to_hf)
from .gpt_oss import (gpt_oss_hf_to_megatron, gpt_oss_megatron_to_hf, hf_gpt_oss_shapes,
                      megatron_gpt_oss_shapes)
from .moe import is_moe_layer
from .moe_layout import (FP32_BUFFERS, hf_moe_shapes, megatron_moe_shapes, moe_hf_to_megatron,
                         moe_megatron_to_hf)

Tensor = torch.Tensor


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_groups: int) -> Tensor:
    """``q [n·d, h]``, ``k``/``v`` ``[g·d, h]`` → Megatron's ``linear_qkv`` ``[(n+2g)·d, h]``
    (biases: ``[n·d]``, ``[g·d]`` → ``[(n+2g)·d]``)."""
    if q.dim() == 1:
        return fuse_qkv(q[:, None], k[:, None], v[:, None], num_heads, num_groups)[:, 0]
    d = q.shape[0] // num_heads
    h = q.shape[1]
    per = num_heads // num_groups
    qg = q.reshape(num_groups, per * d, h)
    kg = k.reshape(num_groups, d, h)
    vg = v.reshape(num_groups, d, h)
    return torch.cat([qg, kg, vg], dim=1).reshape((num_heads + 2 * num_groups) * d, h)


def split_qkv(qkv: Tensor, num_heads: int, num_groups: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv`: ``[(n+2g)·d, h]`` → ``q [n·d, h]``, ``k [g·d, h]``, ``v``."""
    if qkv.dim() == 1:
        return tuple(t[:, 0].contiguous() for t in split_qkv(qkv[:, None], num_heads,
                                                             num_groups))
    d = qkv.shape[0] // (num_heads + 2 * num_groups)
    h = qkv.shape[1]
    per = num_heads // num_groups
    grouped = qkv.reshape(num_groups, (per + 2) * d, h)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(num_heads * d, h).contiguous(), k.reshape(num_groups * d, h).contiguous(),
            v.reshape(num_groups * d, h).contiguous())


def fuse_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """``gate``, ``up`` ``[f, h]`` → ``linear_fc1`` ``[2f, h]`` (gate rows first)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: Tensor) -> Tuple[Tensor, Tensor]:
    """Inverse of :func:`fuse_gate_up`."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(table: Tensor, padded: int) -> Tensor:
    """``[V, h]`` → ``[Vp, h]`` with zero rows appended (Megatron's padded vocabulary)."""
    extra = padded - table.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad a {table.shape[0]}-row table to {padded} rows")
    if extra == 0:
        return table.clone()
    return torch.cat([table, table.new_zeros(extra, table.shape[1])], dim=0)


def strip_vocab(table: Tensor, vocab: int) -> Tensor:
    """``[Vp, h]`` → its first ``V`` rows."""
    return table[:vocab].clone()


def hf_names(g: LlamaGeometry) -> Dict[str, tuple]:
    h, f, d = g.hidden_size, g.ffn_hidden_size, g.kv_channels
    n, k = g.num_attention_heads, g.num_query_groups
    out = {"model.embed_tokens.weight": (g.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(g.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(hf_mla_shapes(g, i) if g.multi_latent_attention else {
            p + "self_attn.q_proj.weight": (n * d, h), p + "self_attn.k_proj.weight": (k * d, h),
            p + "self_attn.v_proj.weight": (k * d, h), p + "self_attn.o_proj.weight": (h, n * d)})
        if g.family == "gpt_oss":
            out.update(hf_gpt_oss_shapes(g, i))
        elif is_moe_layer(g, i):
            out.update(hf_moe_shapes(g, i))
        else:
            out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
        if g.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (n * d,), p + "self_attn.k_proj.bias": (k * d,),
                        p + "self_attn.v_proj.bias": (k * d,)})
        if g.qk_layernorm and not g.multi_latent_attention:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    if not g.tie_embeddings:
        out["lm_head.weight"] = (g.vocab_size, h)
    return out


def megatron_shapes(g: LlamaGeometry) -> Dict[str, tuple]:
    """Names and full (TP = 1) shapes of the Megatron parameters of this geometry."""
    h, f, d = g.hidden_size, g.ffn_hidden_size, g.kv_channels
    out = {"embedding.word_embeddings.weight": (g.padded_vocab_size, h),
           "decoder.final_layernorm.weight": (h,)}
    for i in range(g.num_layers):
        p = f"decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,)})
        out.update(megatron_mla_shapes(g, i) if g.multi_latent_attention else {
            p + "self_attention.linear_qkv.weight": (g.qkv_rows, h),
            p + "self_attention.linear_proj.weight": (h, g.num_attention_heads * d)})
        if g.family == "gpt_oss":
            out.update(megatron_gpt_oss_shapes(g, i))
        elif is_moe_layer(g, i):
            out.update(megatron_moe_shapes(g, i))
        else:
            out.update({p + "mlp.linear_fc1.weight": (2 * f, h),
                        p + "mlp.linear_fc2.weight": (h, f)})
        if g.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (g.qkv_rows,)
        if g.qk_layernorm and not g.multi_latent_attention:
            out[p + "self_attention.q_layernorm.weight"] = (d,)
            out[p + "self_attention.k_layernorm.weight"] = (d,)
    if not g.tie_embeddings:
        out["output_layer.weight"] = (g.padded_vocab_size, h)
    return out


#: buffers older Hugging Face Llama checkpoints carry that hold no weights (recomputed from config)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def unexpected_hint(unexpected, g: LlamaGeometry, default: str = "") -> str:
    """What to say about tensors a checkpoint holds beyond what its config implies: linear
    biases, or the multi-token-prediction layers (``model.layers.<num_hidden_layers>.*``) of
    DeepSeek-V3 and GLM-4.5 (``num_nextn_predict_layers``)."""
    if any(k.startswith(f"model.layers.{g.num_layers}.") for k in unexpected):
        return (f" (layer {g.num_layers} and beyond: multi-token-prediction layers "
                f"(num_nextn_predict_layers), which transformers neither builds nor loads and "
                f"METP does not convert (--mtp-num-layers is refused); delete their tensors "
                f"from the safetensors to convert the model without them)")
    if any(k.endswith(".bias") for k in unexpected):
        return (" (linear biases: the converted run has --disable-bias-linear, with "
                "--add-qkv-bias for Qwen2's q/k/v biases only; convert a model without other "
                "biases)")
    return default


def check_hf_tensors(hf: Dict[str, Tensor], g: LlamaGeometry) -> None:
    """Every tensor the geometry needs is there with its shape, and nothing else (clear
    :class:`HFConfigError` otherwise, naming the tensors)."""
    want = hf_names(g)
    names = {k for k in hf if not k.endswith(_IGNORED_SUFFIXES)}
    if g.tie_embeddings and "lm_head.weight" in names:
        # some tied checkpoints store the shared table twice: fine if it is the same table
        head, emb = hf["lm_head.weight"], hf.get("model.embed_tokens.weight")
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise HFConfigError("config.json has tie_word_embeddings = true but lm_head.weight "
                                "differs from model.embed_tokens.weight: set it to false if the "
                                "head is its own table")
        names.discard("lm_head.weight")
    missing = sorted(set(want) - names)
    unexpected = sorted(names - set(want))
    if missing:
        hint = (" (config.json says tie_word_embeddings = false but the checkpoint has no "
                "lm_head.weight: set it to true if the head shares the embedding)"
                if missing == ["lm_head.weight"] else "")
        raise HFConfigError(f"the safetensors lack {len(missing)} tensor(s) config.json implies: "
                            f"{missing[:6]}{hint}")
    if unexpected:
        hint = unexpected_hint(unexpected, g)
        raise HFConfigError(f"the safetensors hold {len(unexpected)} tensor(s) a {g.family} of "
                            f"this config.json does not have: {unexpected[:6]}{hint}")
    bad = [(k, tuple(hf[k].shape), s) for k, s in want.items() if tuple(hf[k].shape) != s]
    if bad:
        k, got, exp = bad[0]
        raise HFConfigError(f"tensor {k} has shape {list(got)}, config.json implies {list(exp)} "
                            f"({len(bad)} tensor(s) disagree); is config.json the checkpoint's own?")
    dtypes = {hf[k].dtype for k in want if not k.endswith(FP32_BUFFERS)}
    if len(dtypes) != 1:
        raise HFConfigError(f"the safetensors mix dtypes {sorted(str(t) for t in dtypes)}; cast "
                            f"them to one dtype first")


#: a layer's tensors that only change name (Hugging Face suffix, Megatron suffix)
_LAYER_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
)
#: the dense MLP's down projection (layers that are not MoE)
_DENSE_RENAMES = (("mlp.down_proj.weight", "mlp.linear_fc2.weight"),)
#: Qwen3's per-head q/k norms (``qk_layernorm``)
_QK_NORM_RENAMES = (
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
)


def _renames(g: LlamaGeometry, i: int):
    if g.multi_latent_attention:  # the attention's own names: .deepseek
        return _LAYER_RENAMES[:2] + (() if is_moe_layer(g, i) else _DENSE_RENAMES)
    return (_LAYER_RENAMES + (_QK_NORM_RENAMES if g.qk_layernorm else ()) +
            (() if is_moe_layer(g, i) else _DENSE_RENAMES))


def hf_to_megatron(hf: Dict[str, Tensor], g: LlamaGeometry) -> Dict[str, Tensor]:
    """Hugging Face Llama tensors → Megatron ``GPTModel`` parameters (full, TP = 1, names as
    ``named_parameters()``; shapes in :func:`megatron_shapes`). Checks the input first."""
    check_hf_tensors(hf, g)
    n, k = g.num_attention_heads, g.num_query_groups
    out = {"embedding.word_embeddings.weight": pad_vocab(hf["model.embed_tokens.weight"],
                                                         g.padded_vocab_size),
           "decoder.final_layernorm.weight": hf["model.norm.weight"].clone()}
    for i in range(g.num_layers):
        s, t = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _renames(g, i):
            out[t + mg_name] = hf[s + hf_name].clone()
        if g.multi_latent_attention:
            out.update(mla_hf_to_megatron(hf, g, i))
        else:
            out[t + "self_attention.linear_qkv.weight"] = fuse_qkv(
                hf[s + "self_attn.q_proj.weight"], hf[s + "self_attn.k_proj.weight"],
                hf[s + "self_attn.v_proj.weight"], n, k)
        if g.qkv_bias:
            out[t + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[s + "self_attn.q_proj.bias"], hf[s + "self_attn.k_proj.bias"],
                hf[s + "self_attn.v_proj.bias"], n, k)
        if g.family == "gpt_oss":
            out.update(gpt_oss_hf_to_megatron(hf, g, i))
        elif is_moe_layer(g, i):
            # looked up at call time: a test may replace fuse_gate_up (negative control)
            out.update(moe_hf_to_megatron(hf, g, i, lambda a, b: fuse_gate_up(a, b)))
        else:
            out[t + "mlp.linear_fc1.weight"] = fuse_gate_up(hf[s + "mlp.gate_proj.weight"],
                                                            hf[s + "mlp.up_proj.weight"])
    if not g.tie_embeddings:
        out["output_layer.weight"] = pad_vocab(hf["lm_head.weight"], g.padded_vocab_size)
    return out


def megatron_to_hf(mg: Dict[str, Tensor], g: LlamaGeometry) -> Dict[str, Tensor]:
    """Inverse of :func:`hf_to_megatron`: the padded vocabulary rows are dropped. A tied model
    gets no ``lm_head.weight`` (``save_pretrained`` omits it too)."""
    want = megatron_shapes(g)
    missing = sorted(set(want) - set(mg))
    if missing:
        raise HFConfigError(f"the Megatron checkpoint lacks {missing[:6]} (is the config the "
                            f"model's own?)")
    bad = [(k, tuple(mg[k].shape), s) for k, s in want.items() if tuple(mg[k].shape) != s]
    if bad:
        k, got, exp = bad[0]
        raise HFConfigError(f"Megatron tensor {k} has shape {list(got)}, the config implies "
                            f"{list(exp)} (a different vocabulary padding? pass the "
                            f"--make-vocab-size-divisible-by/--tensor-model-parallel-size the "
                            f"run used)")
    n, k = g.num_attention_heads, g.num_query_groups
    out = {"model.embed_tokens.weight": strip_vocab(mg["embedding.word_embeddings.weight"],
                                                    g.vocab_size),
           "model.norm.weight": mg["decoder.final_layernorm.weight"].clone()}
    for i in range(g.num_layers):
        s, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        for hf_name, mg_name in _renames(g, i):
            out[t + hf_name] = mg[s + mg_name].clone()
        if g.multi_latent_attention:
            out.update(mla_megatron_to_hf(mg, g, i))
        else:
            q, kk, v = split_qkv(mg[s + "self_attention.linear_qkv.weight"], n, k)
            out[t + "self_attn.q_proj.weight"] = q
            out[t + "self_attn.k_proj.weight"] = kk
            out[t + "self_attn.v_proj.weight"] = v
        if g.qkv_bias:
            q, kk, v = split_qkv(mg[s + "self_attention.linear_qkv.bias"], n, k)
            out[t + "self_attn.q_proj.bias"] = q
            out[t + "self_attn.k_proj.bias"] = kk
            out[t + "self_attn.v_proj.bias"] = v
        if g.family == "gpt_oss":
            out.update(gpt_oss_megatron_to_hf(mg, g, i))
            continue
        if is_moe_layer(g, i):
            out.update(moe_megatron_to_hf(mg, g, i, split_gate_up))
            continue
        gate, up = split_gate_up(mg[s + "mlp.linear_fc1.weight"])
        out[t + "mlp.gate_proj.weight"] = gate
        out[t + "mlp.up_proj.weight"] = up
    if not g.tie_embeddings:
        out["lm_head.weight"] = strip_vocab(mg["output_layer.weight"], g.vocab_size)
    return out
