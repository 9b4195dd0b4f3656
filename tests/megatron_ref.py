"""Attention references for parity tests: stock Megatron ``SelfAttention`` over TP, and plain PyTorch.

Both take the same FULL (TP=1) weights in Megatron's layout, packed in a dict ``full``:

- ``x`` ``[s, b, h]`` input, ``gy`` ``[s, b, h]`` output gradient;
- ``qkv_weight`` ``[(np + 2*ng)*d, h]``, query-group interleaved: for each query group g, the rows of
  its np/ng query heads, then k_g's d rows, then v_g's d rows (see :func:`qkv_layout`);
- ``qkv_bias`` ``[(np + 2*ng)*d]`` or None; ``proj_weight`` ``[h, np*d]``; ``proj_bias`` ``[h]`` or None;
- optionally ``rotary_pos_emb`` ``[s, 1, 1, d]``, frequencies as Megatron's ``RotaryEmbedding``
  returns them (non-interleaved: ``cat(freqs, freqs)``), see :func:`rope_freqs`.

Both return ``{"y", "dx", "dqkv_w", "dqkv_b", "dproj_w", "dproj_b"}`` (bias gradients None when
the bias is None); ``y`` includes the projection bias.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from tests.harness import run_ranks
from tests.numerics import rel_err

RESULT_KEYS = ("y", "dx", "dqkv_w", "dqkv_b", "dproj_w", "dproj_b")


# ---------------------------------------------------------------- inputs and layout

def rope_freqs(s, d, base=10000.0, dtype=torch.float32):
    """RoPE frequencies ``[s, 1, 1, d]`` laid out as Megatron's ``RotaryEmbedding(d, 1.0)(s)``."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :].to(dtype)


def full_attention_params(s, b, h, num_heads, num_query_groups, head_dim, *, qkv_bias=True,
                          proj_bias=True, rope=False, seed=0, dtype=torch.float32):
    """Random full weights in Megatron's layout, an input and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    n_rows = (num_heads + 2 * num_query_groups) * head_dim

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return {
        "x": rnd(s, b, h),
        "gy": rnd(s, b, h),
        "qkv_weight": rnd(n_rows, h, scale=h ** -0.5),
        "qkv_bias": rnd(n_rows, scale=0.1) if qkv_bias else None,
        "proj_weight": rnd(h, num_heads * head_dim, scale=(num_heads * head_dim) ** -0.5),
        "proj_bias": rnd(h, scale=0.1) if proj_bias else None,
        "rotary_pos_emb": rope_freqs(s, head_dim) if rope else None,
    }


def qkv_layout(num_heads, num_query_groups, head_dim):
    """Row indices of q (head-major, ``[np*d]``), k and v (group-major, ``[ng*d]``) in the full
    query-group-interleaved ``qkv_weight``."""
    per = num_heads // num_query_groups
    stride = (per + 2) * head_dim
    q, k, v = [], [], []
    for g in range(num_query_groups):
        base = g * stride
        q.append(torch.arange(base, base + per * head_dim))
        k.append(torch.arange(base + per * head_dim, base + (per + 1) * head_dim))
        v.append(torch.arange(base + (per + 1) * head_dim, base + stride))
    return torch.cat(q), torch.cat(k), torch.cat(v)


def _check_full(full, num_heads, num_query_groups):
    h = full["x"].shape[-1]
    if num_heads % num_query_groups:
        raise ValueError(f"num_heads={num_heads} is not a multiple of "
                         f"num_query_groups={num_query_groups}")
    rows, cols = full["qkv_weight"].shape
    if cols != h or rows % (num_heads + 2 * num_query_groups):
        raise ValueError(f"qkv_weight {tuple(full['qkv_weight'].shape)} does not fit h={h}, "
                         f"np={num_heads}, ng={num_query_groups}")
    d = rows // (num_heads + 2 * num_query_groups)
    if tuple(full["proj_weight"].shape) != (h, num_heads * d):
        raise ValueError(f"proj_weight {tuple(full['proj_weight'].shape)} != {(h, num_heads * d)}")
    return h, d


# ---------------------------------------------------------------- plain PyTorch reference

def _rope(t, freqs):
    """Megatron's non-interleaved RoPE: t·cos + rotate_half(t)·sin, cos/sin rounded to t's dtype."""
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat([-t2, t1], dim=-1) * sin


def reference_self_attention(full, *, num_heads, num_query_groups, causal=True,
                             rotary_pos_emb=None, dtype=torch.float32) -> dict:
    """Single-device self-attention forward/backward by autograd from the full weights.

    Computes in ``dtype`` with the softmax in fp32 (as Megatron with
    ``attention_softmax_in_fp32``). ``rotary_pos_emb`` defaults to ``full.get("rotary_pos_emb")``.
    """
    h, d = _check_full(full, num_heads, num_query_groups)
    if rotary_pos_emb is None:
        rotary_pos_emb = full.get("rotary_pos_emb")
    leaf = {}
    for k in ("x", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias"):
        v = full.get(k)
        leaf[k] = None if v is None else v.detach().to(dtype).requires_grad_()
    s, b, _ = leaf["x"].shape
    npg = num_heads // num_query_groups

    qkv = F.linear(leaf["x"], leaf["qkv_weight"], leaf["qkv_bias"])   # [s, b, (np+2ng)d]
    qkv = qkv.view(s, b, num_query_groups, (npg + 2) * d)
    q, k, v = torch.split(qkv, [npg * d, d, d], dim=-1)
    q = q.reshape(s, b, num_heads, d)                                 # head i is in group i // npg
    if rotary_pos_emb is not None:
        q = _rope(q, rotary_pos_emb)
        k = _rope(k, rotary_pos_emb)
    k = k.repeat_interleave(npg, dim=2)                               # [s, b, np, d]
    v = v.repeat_interleave(npg, dim=2)

    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * (1.0 / math.sqrt(d))
    scores = scores.float()
    if causal:
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(dtype)
    ctx = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, num_heads * d)
    y = F.linear(ctx, leaf["proj_weight"], leaf["proj_bias"])
    y.backward(full["gy"].to(dtype))
    grad = {k: (None if v is None else v.grad) for k, v in leaf.items()}
    return {"y": y.detach(), "dx": grad["x"], "dqkv_w": grad["qkv_weight"],
            "dqkv_b": grad["qkv_bias"], "dproj_w": grad["proj_weight"],
            "dproj_b": grad["proj_bias"]}


# ---------------------------------------------------------------- stock Megatron over TP

def _quiet_megatron_warnings():
    # Megatron warns on import and first use about TE/Apex being absent, deprecated scopes and
    # CUDA_DEVICE_MAX_CONNECTIONS; none of it matters for a CPU reference.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def _stock_rank(rank, p, full, num_heads, num_query_groups, causal, dtype, rotary_pos_emb):
    import megatron_metp.megatron.cpu as mcpu

    _quiet_megatron_warnings()  # a forked rank's own filters; the parent's are untouched

    mcpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    h, d = _check_full(full, num_heads, num_query_groups)
    qkv_bias, proj_bias = full.get("qkv_bias"), full.get("proj_bias")
    # Megatron gives linear_qkv a bias when add_bias_linear or add_qkv_bias; linear_proj only with
    # add_bias_linear. A proj bias without a qkv bias is loaded as a zero qkv bias (grad dropped).
    cfg = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=num_heads,
        num_query_groups=num_query_groups, kv_channels=d, ffn_hidden_size=4 * h,
        attention_dropout=0.0, hidden_dropout=0.0,
        add_bias_linear=proj_bias is not None, add_qkv_bias=qkv_bias is not None,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=p, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, attention_softmax_in_fp32=True)

    # Megatron still reads globals here: the global memory buffer (DotProductAttention's score
    # buffer), the global TP rank/group (SelfAttention when ng < p), the RNG tracker (dropout
    # fork). initialize_model_parallel sets the first two; the seed call the third.
    ps.initialize_model_parallel(tensor_model_parallel_size=p, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    pgc = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(),
                                 cp=ps.get_context_parallel_group())
    submodules = get_gpt_layer_local_spec().submodules.self_attention.submodules
    attn = SelfAttention(cfg, submodules, layer_number=1,
                         attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.no_mask,
                         pg_collection=pgc)

    n_rows = full["qkv_weight"].shape[0] // p
    n_cols = full["proj_weight"].shape[1] // p
    rows, cols = slice(rank * n_rows, (rank + 1) * n_rows), slice(rank * n_cols, (rank + 1) * n_cols)
    with torch.no_grad():
        attn.linear_qkv.weight.copy_(full["qkv_weight"][rows])
        if qkv_bias is not None:
            attn.linear_qkv.bias.copy_(qkv_bias[rows])
        elif attn.linear_qkv.bias is not None:
            attn.linear_qkv.bias.zero_()
        attn.linear_proj.weight.copy_(full["proj_weight"][:, cols])
        if proj_bias is not None:
            attn.linear_proj.bias.copy_(proj_bias)

    x = full["x"].detach().to(dtype).requires_grad_()
    out, bias = attn(x, attention_mask=None, rotary_pos_emb=rotary_pos_emb)
    y = out if bias is None else out + bias
    y.backward(full["gy"].to(dtype))
    return {"y": y.detach(), "dx": x.grad,
            "dqkv_w": attn.linear_qkv.weight.grad,
            "dqkv_b": attn.linear_qkv.bias.grad if qkv_bias is not None else None,
            "dproj_w": attn.linear_proj.weight.grad,
            "dproj_b": attn.linear_proj.bias.grad if proj_bias is not None else None}


def stock_tp_self_attention(p, full: dict, *, num_heads, num_query_groups, causal=True,
                            dtype=torch.float32, rotary_pos_emb=None) -> dict:
    """Stock Megatron ``SelfAttention`` (local spec: ColumnParallelLinear, unfused
    DotProductAttention, RowParallelLinear) on ``p`` forked gloo ranks, TP=p, no SP.

    Rank r loads rows r/p of ``qkv_weight``/``qkv_bias`` (Megatron's TP shard: query groups
    r·ng/p … (r+1)·ng/p when p divides ng) and columns r/p of ``proj_weight``. Returns y and dx
    (identical on every rank after TP's all-reduce; rank 0's) and the full-weight gradients
    reassembled from the shards. ``rotary_pos_emb`` defaults to ``full.get("rotary_pos_emb")``.
    """
    _check_full(full, num_heads, num_query_groups)
    if full["qkv_weight"].shape[0] % p or full["proj_weight"].shape[1] % p:
        raise ValueError(f"TP size {p} does not divide the qkv rows / proj columns")
    if rotary_pos_emb is None:
        rotary_pos_emb = full.get("rotary_pos_emb")
    out = run_ranks(_stock_rank, p, full, num_heads, num_query_groups, causal, dtype,
                    rotary_pos_emb)
    return {"y": out[0]["y"], "dx": out[0]["dx"],
            "dqkv_w": torch.cat([o["dqkv_w"] for o in out], dim=0),
            "dqkv_b": (None if out[0]["dqkv_b"] is None
                       else torch.cat([o["dqkv_b"] for o in out], dim=0)),
            "dproj_w": torch.cat([o["dproj_w"] for o in out], dim=1),
            "dproj_b": out[0]["dproj_b"]}
