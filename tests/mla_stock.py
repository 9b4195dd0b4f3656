"""Stock megatron-core ``MLASelfAttention`` (local spec, TP = 1, one forked gloo rank) with the
full weights of a ``tests.mla_cases.MLACase``: the output, ``dx`` and every weight's gradient,
keyed as :func:`tests.mla_cases.reference_mla` keys them, and the RoPE angles stock used.

megatron-core 0.16.1's local ``DotProductAttention`` takes no ``k_channels``/``v_channels``
(stock MLA there needs Transformer Engine's core attention, a GPU module), so the core attention
alone is :class:`_CoreAttention`, causal softmax attention in plain PyTorch with stock's
``softmax_scale``; the projections, both RMSNorms, the RoPE (and YaRN) and the layout are
stock's."""

from __future__ import annotations

import torch

from megatron_metp.megatron.yarn import yarn_inv_freq
from megatron_metp.ops.rope import rope_angles
from tests.harness import run_ranks
from tests.mla_cases import MLACase

#: our weight names → stock MLASelfAttention's parameters
_PARAMS = {"q_down_weight": "linear_q_down_proj.weight", "q_norm_weight": "q_layernorm.weight",
           "kv_down_weight": "linear_kv_down_proj.weight",
           "kv_norm_weight": "kv_layernorm.weight", "kv_up_weight": "linear_kv_up_proj.weight",
           "proj_weight": "linear_proj.weight", "proj_bias": "linear_proj.bias"}


class _CoreAttention(torch.nn.Module):
    """``softmax(q·kᵀ·scale + causal mask)·v`` per head: ``q, k [s, b, A, dq]``,
    ``v [s, b, A, dv]`` → ``[s, b, A·dv]`` (what stock's core attention returns)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale  # Attention's base class builds one too, then MLA its own

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                packed_seq_params=None, **_):
        s = query.shape[0]
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.scale
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)
        return out.reshape(s, out.shape[1], -1)


def _config(case: MLACase, yarn: dict, eps: float):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=case.h, num_attention_heads=case.heads,
        ffn_hidden_size=4 * case.h, q_lora_rank=case.ql, kv_lora_rank=case.kvr,
        qk_head_dim=case.dn, qk_pos_emb_head_dim=case.dr, v_head_dim=case.dv,
        rope_type="yarn" if yarn else "rope", rotary_base=10000, **yarn,
        layernorm_epsilon=eps, normalization="RMSNorm", qk_layernorm=True,
        add_bias_linear=case.bias, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        attention_softmax_in_fp32=True, tensor_model_parallel_size=1)


def _stock_rank(rank, world, runs, eps):
    import megatron_metp.megatron.cpu as mcpu

    mcpu.enable()
    return [_stock_one(case, full, yarn, eps) for case, full, yarn in runs]


def _stock_one(case, full, yarn, eps):
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
        _yarn_get_concentration_factor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer import multi_latent_attention as stock
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    # this venv's Transformer Engine is a stand-in (its classes are mocks, no TE layer is used
    # by the local spec), which stock MLA's TE-only fp8 branch cannot isinstance() against
    stock.HAVE_TE = False

    cfg = _config(case, yarn, eps)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                     create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    pgc = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(),
                                 cp=ps.get_context_parallel_group())
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                    normalization="RMSNorm")
    submodules = spec.submodules.self_attention.submodules
    submodules.core_attention = _CoreAttention
    if case.ql is None:  # no query latent, no query norm (megatron-core 0.19 refuses one unused)
        submodules.q_layernorm = IdentityOp
    attn = MLASelfAttention(cfg, submodules, layer_number=1,
                            attn_mask_type=AttnMaskType.causal, pg_collection=pgc)
    params = dict(attn.named_parameters())
    names = dict(_PARAMS, q_up_weight="linear_q_up_proj.weight" if case.ql is not None
                 else "linear_q_proj.weight")
    assert set(params) == {names[k] for k in names if full.get(k) is not None}, sorted(params)
    with torch.no_grad():
        for ours, theirs in names.items():
            if full.get(ours) is not None:
                params[theirs].copy_(full[ours])
    x = full["x"].clone().requires_grad_()
    out, bias = attn(x, attention_mask=None)
    y = out if bias is None else out + bias
    y.backward(full["gy"])
    rotary = attn.rotary_pos_emb
    inv_freq = yarn_inv_freq(rotary) if yarn else rotary.inv_freq
    return {"y": y.detach(), "dx": x.grad, "softmax_scale": attn.softmax_scale,
            # the same RoPE as stock's from the project's exact angles, and YaRN's factor A
            "exact_angles": rope_angles(torch.arange(case.s), inv_freq.float().cpu()),
            "rope_mscale": _yarn_get_concentration_factor(rotary.scaling_factor, rotary.mscale,
                                                          rotary.mscale_all_dim)
            if yarn else 1.0,
            **{"d" + k: params[v].grad for k, v in names.items() if full.get(k) is not None}}


def stock_mla(runs, eps: float = 1e-5) -> list:
    """Stock MLA for each ``(case, full, yarn)`` of ``runs``, in one forked rank; ``yarn``:
    MLATransformerConfig's YaRN fields (``rotary_scaling_factor``, ``mscale``,
    ``mscale_all_dim``, ...), or ``{}`` for plain RoPE. Each result also holds the softmax
    scale stock used, the project's exact angles of stock's ``inv_freq`` and YaRN's factor on
    cos/sin (``rope_mscale``)."""
    return run_ranks(_stock_rank, 1, list(runs), eps)[0]
