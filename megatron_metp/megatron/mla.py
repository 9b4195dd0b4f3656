"""Megatron's ``MLASelfAttention`` (DeepSeek-V2/V3 multi-latent attention) in a METP layer.

:class:`METPMLASelfAttention` is megatron-core's ``MLASelfAttention`` (same constructor,
submodule names, parameters and ``(output, bias)`` contract; ``sharded_state_dict`` from its
submodules) whose forward runs :func:`megatron_metp.ops.metp_mla_attention`, the latent ring
(``docs/mla.md``). Parameters on METP rank ``r`` of ``p`` (TP = 1; ``A`` heads, ``H = A/p``):

* head-sharded, :class:`~.linear.METPLinear` (shard ``r`` of stock TP ``p``'s layout; reduced over
  pure DP, the op sums them over the METP group): ``linear_q_up_proj.weight``
  ``[H·(dn+dr), q_lora_rank]`` (``linear_q_proj.weight`` ``[H·(dn+dr), h]`` without
  ``--q-lora-rank``), ``linear_kv_up_proj.weight`` ``[H·(dn+dv), kv_lora_rank]``,
  ``linear_proj.weight`` ``[h, H·dv]``;
* replicated, Megatron's own modules from the local spec (``ColumnParallelLinear`` at TP = 1,
  the ``q_layernorm``/``kv_layernorm`` RMSNorms, ``linear_proj.bias``): ordinary parameters whose
  gradients the op returns as this rank's token partials and Megatron's DDP sums over DP × CP —
  the METP group is Megatron's CP group (:mod:`.parallel`), as for the other replicated
  parameters of a METP layer.

So the state dict has stock's local-spec keys, and each METP shard is the one stock TP of size
``p`` holds (checkpoints interoperate as for :class:`~.modules.METPSelfAttention`).

RoPE: the module's own ``rotary_pos_emb`` (MLA builds one of ``qk_pos_emb_head_dim`` channels;
GPTModel has none) gives this rank's rows, exact angles by default (:func:`use_mla_angles`,
YaRN's scaled ``inv_freq`` included); YaRN's cos/sin factor and softmax scale are stock's
(``rope_mscale``, ``self.softmax_scale``). Packed documents (:class:`~.packing.METPDocuments`)
give the op ``cu_seqlens`` and the whole sequence's angle table (positions restart per
document inside the op). What is refused: :mod:`.mla_checks`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from ..ops import metp_mla_attention
from .cpu_mla import te_linear_is_stand_in
from .groups import METPGroups
from .head_norm import norm_kind
from .mla_checks import mla_problems
from .modules import document_kwargs, mask_is_causal, check_config
from .moe_checks import check_moe_config


class _UnusedCoreAttention(MegatronModule):
    """``core_attention`` of :class:`METPMLASelfAttention`: built (with Megatron's arguments,
    ``k_channels``/``v_channels`` too) and never called; the op runs the attention."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config=config)

    def forward(self, *args, **kwargs):
        raise RuntimeError("METP's multi-latent attention runs its core attention inside "
                           "metp_mla_attention; core_attention is not called")


@contextlib.contextmanager
def _stand_in_te_off():
    """megatron-core 0.16.1's ``MultiLatentAttention.__init__`` asks ``isinstance(linear_proj,
    TELinear)`` (an fp8 setting) whenever Transformer Engine imported; where TE is a stand-in
    whose ``TELinear`` is not a class (CPU installs) that raises. METP's ``linear_proj`` is never
    a ``TELinear``, so the answer is False: the flag is off while the base class is built."""
    from megatron.core.transformer import multi_latent_attention as stock

    stand_in = te_linear_is_stand_in(stock)
    if stand_in:
        stock.HAVE_TE = False
    try:
        yield
    finally:
        if stand_in:
            stock.HAVE_TE = True


def check_mla_config(config, groups: METPGroups) -> None:
    """Raise ``ValueError`` naming every flag :func:`.mla_checks.mla_problems` refuses for
    ``config``, and heads not divisible by TP × METP."""
    problems = mla_problems(config, tp=groups.tp_size)
    heads = config.num_attention_heads
    if heads % groups.shards:
        problems.append(f"--num-attention-heads ({heads}) is not divisible by TP×METP = "
                        f"{groups.shards}")
    if problems:
        raise ValueError("--metp-parallel-size does not support: " + "; ".join(problems))


def _norm_eps(module, config, what: str) -> float:
    if norm_kind(module, config) != "RMSNorm":
        raise ValueError(f"{what} must be an RMSNorm (--normalization RMSNorm), got "
                         f"{type(module).__name__}")
    eps = getattr(module, "eps", None)
    if isinstance(eps, (tuple, list)):
        eps = eps[0]
    return float(config.layernorm_epsilon if eps is None else eps)


class METPMLASelfAttention(MLASelfAttention):
    """megatron-core ``MLASelfAttention`` whose forward is the METP latent ring (module
    docstring). ``hidden_states`` ``[s/p, b, h]`` (this rank's tokens, Megatron's CP order) →
    ``(output [s/p, b, h], linear_proj.bias)``."""

    #: its forward reads its submodules' weights without calling them (.param_gather)
    reads_submodule_weights = True

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal,
                 cp_comm_type=None, pg_collection=None, *, groups: METPGroups, kernel=None,
                 **megatron_kwargs):
        # what any METP layer refuses (dropout, SP, windows…), then MLA's own
        check_config(config)
        check_moe_config(config, groups.metp.size)  # experts sharded over the METP group
        check_mla_config(config, groups)
        with _stand_in_te_off():
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                             pg_collection=pg_collection, **megatron_kwargs)
        self.groups, self.kernel = groups, kernel
        self.causal = mask_is_causal(attn_mask_type)
        if config.q_lora_rank is not None:
            self.norm_eps = _norm_eps(self.q_layernorm, config, "q_layernorm")
        self.norm_eps = _norm_eps(self.kv_layernorm, config, "kv_layernorm")

    def _rope(self, n: int, packed: dict):
        """``(angles, rope_mscale)``: this rank's ``[n, 1, 1, dr]`` rows, or the whole
        sequence's ``[n·P, 1, 1, dr]`` with packed documents (``P``: Megatron's CP size, the
        sequence ring)."""
        cp = self.pg_collection.cp
        s = n * (cp.size() if cp is not None else 1)
        emb = self.rotary_pos_emb(s, packed_seq="cu_seqlens" in packed)
        if isinstance(emb, tuple):  # YaRN: (angles, cos/sin factor), as stock's MLA takes it
            return emb[0], float(emb[1])
        return emb, 1.0

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None):
        if key_value_states is not None or inference_context is not None or \
                inference_params is not None:
            raise ValueError("METP multi-latent attention supports training self-attention "
                             "only (no cross-attention or inference KV cache)")
        if attention_bias is not None or rotary_pos_emb is not None or \
                rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin:
            raise ValueError("METP multi-latent attention takes no attention_bias and no RoPE "
                             "from the model (MLA builds its own rotary_pos_emb)")
        packed = document_kwargs(packed_seq_params, "METP multi-latent attention")
        freqs, mscale = self._rope(hidden_states.shape[0], packed)
        cfg = self.config
        q_lora = cfg.q_lora_rank is not None
        q_up = self.linear_q_up_proj if q_lora else self.linear_q_proj
        y = metp_mla_attention(
            hidden_states, q_up_weight=q_up.weight,
            q_down_weight=self.linear_q_down_proj.weight if q_lora else None,
            q_norm_weight=self.q_layernorm.weight if q_lora else None,
            kv_down_weight=self.linear_kv_down_proj.weight,
            kv_norm_weight=self.kv_layernorm.weight,
            kv_up_weight=self.linear_kv_up_proj.weight, proj_weight=self.linear_proj.weight,
            proj_bias=None, group=self.groups.metp, num_heads=cfg.num_attention_heads,
            kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim,
            qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
            q_lora_rank=cfg.q_lora_rank, rotary_pos_emb=freqs, norm_eps=self.norm_eps,
            causal=self.causal, softmax_scale=self.softmax_scale, rope_mscale=mscale,
            kernel=self.kernel, label=f"layer {self.layer_number} self_attention", **packed)
        return y, self.linear_proj.bias


def fuses_query_norm() -> bool:
    """Whether the installed megatron-core (0.19 on) builds MLA without a query latent
    (``q_lora_rank`` None) with a query RMSNorm fused into ``linear_q_proj`` under
    ``qk_layernorm`` (Transformer Engine only); 0.16.1 applies no query norm there."""
    from megatron.core.transformer import multi_latent_attention as stock

    return hasattr(stock, "QKNormConfigResolver")


def mla_attention_spec(local_attention, groups: METPGroups, config, kernel: Optional[str]):
    """The ``self_attention`` spec of a METP MLA layer from the local spec's MLA one
    (``get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, ...)``): the
    head-sharded linears become :class:`~.linear.METPLinear`, the down-projections and norms
    stay the local spec's (replicated), the core attention a stand-in."""
    from .spec import linear_spec

    if config.q_lora_rank is None and fuses_query_norm():
        raise ValueError("--metp-parallel-size does not support: --multi-latent-attention "
                         "without --q-lora-rank on this megatron-core (its query norm is fused "
                         "into linear_q_proj, Transformer Engine only, which the METP layer "
                         "does not use): pass --q-lora-rank")
    spec = copy.deepcopy(local_attention)
    spec.module = METPMLASelfAttention
    spec.params = {**spec.params, "groups": groups, "kernel": kernel}
    sub = spec.submodules
    for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"):
        setattr(sub, name, linear_spec(groups, "column"))
    sub.linear_proj = linear_spec(groups, "row")
    sub.core_attention = _UnusedCoreAttention
    if config.q_lora_rank is None:  # no query latent, no query norm (as stock's MLA)
        sub.q_layernorm = IdentityOp
    return spec


def use_mla_spec(spec, groups: METPGroups, config, kernel: Optional[str],
                 normalization: Optional[str]):
    """``spec`` (a layer ``ModuleSpec`` or a decoder block's submodules with ``layer_specs``)
    with every layer's ``self_attention`` replaced by :func:`mla_attention_spec`; the MLPs
    (dense METP or MoE) are kept."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_mla_config(config, groups)
    local = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                     normalization=normalization)
    attn = mla_attention_spec(local.submodules.self_attention, groups, config, kernel)
    keys_map = dict(getattr(local.submodules, "sharded_state_dict_keys_map", None) or {})
    layers = getattr(spec, "layer_specs", None)
    for layer in (layers if layers is not None else [spec]):
        layer.submodules.self_attention = attn  # specs are data: one for every layer
        # checkpoint keys as stock's MLA layer (the dense METP spec maps input_layernorm onto
        # linear_qkv's fused norm, which an MLA layer does not have)
        layer.submodules.sharded_state_dict_keys_map = dict(keys_map)
    return spec


class _StockMLASelfAttention(MLASelfAttention):
    """Stock ``MLASelfAttention`` built with the Transformer Engine stand-in's fp8 question
    answered (:func:`_stand_in_te_off`); otherwise the same class."""

    def __init__(self, *args, **kwargs):
        with _stand_in_te_off():
            super().__init__(*args, **kwargs)


def without_core_attention(spec):
    """``spec`` (a layer ``ModuleSpec`` or a decoder block's submodules with ``layer_specs``) of
    stock MLA layers with their ``core_attention`` replaced by a stand-in that is built and
    never called: the parameters, state dict and ``sharded_state_dict`` stay stock's (the core
    attention has none). For building a stock MLA model to save or load weights on a machine
    whose local ``DotProductAttention`` takes no separate k/v head dims (the Hugging Face
    import); its forward raises."""
    layers = getattr(spec, "layer_specs", None)
    for layer in (layers if layers is not None else [spec]):
        attn = copy.copy(layer.submodules.self_attention)
        attn.submodules = copy.copy(attn.submodules)
        attn.submodules.core_attention = _UnusedCoreAttention
        if attn.module is MLASelfAttention:
            attn.module = _StockMLASelfAttention
        layer.submodules.self_attention = attn
    return spec


def use_mla_angles(model: torch.nn.Module, recipe: str, seq_length: int, asked: str) -> str:
    """Each MLA layer's own RoPE (``self_attention.rotary_pos_emb``) switched to exact angles
    as :func:`.rope.use_exact_angles` does a model's, refused past 2^24 positions on Megatron's
    recipe (:func:`.rope.check_reach`); returns what the angles are (``"none"``: no MLA)."""
    from .rope import check_reach, use_exact_angles

    state = "none"
    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            state = use_exact_angles(module, recipe)
            check_reach(module, state, seq_length, asked)
    return state
