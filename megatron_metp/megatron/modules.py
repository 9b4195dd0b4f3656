"""Megatron modules of a METP layer: Megatron's own classes, applied through the METP ops.

* :class:`METPSelfAttention` is Megatron's ``SelfAttention`` (same constructor, submodule names,
  parameters and ``(output, bias)`` contract) whose forward runs
  :func:`megatron_metp.ops.metp_attention` over its ``linear_qkv``/``linear_proj`` shards;
* :class:`METPMLP` is Megatron's ``MLP`` whose forward runs :func:`megatron_metp.ops.metp_mlp`;
* :class:`METPRingCoreAttention` is a ``core_attention`` for Megatron's stock ``SelfAttention``
  that runs :func:`megatron_metp.ops.ring_attention` over the METP group: with replicated
  (TP-only) weights this is the ring self-attention baseline (``weight_ring=False``).

Gradients of the METP-sharded weights travel the ring in the dtype of Megatron's ``main_grad``
buffer (fp32 by default, bf16 with ``--grad-reduce-in-bf16``: what Megatron's own reduce would
send) and are added into ``main_grad`` by the ops directly, without a rounding to bf16 first
(:func:`megatron_metp.ops.wire_dtype`); without Megatron's DDP they travel in fp32.

Why whole-block forwards rather than five swapped linears: the METP schedule recomputes each weight
shard's intermediate as the shard passes (``f(x·W1_j)`` in the MLP, ``Q/K/V`` of head group ``j`` in
attention). Chaining separate ring linears would store the full-width intermediates — the memory
METP exists to save (DESIGN.md §1).

With TP size ``t > 1`` each TP rank runs the METP ops on its ``1/t`` of the heads / FFN units,
between Megatron's ``copy_to`` / ``reduce_from`` tensor-parallel regions (as ColumnParallel →
RowParallel do). Sequence parallelism is not combined with METP.

Activation recompute: Megatron's ``recompute_granularity='full'`` wraps layers in
``tensor_parallel.checkpoint`` and re-runs their forward in backward, rings included. That is
exact: the modules and ops keep no state between a forward and its recompute (each call builds
its own ring buffers and saves only its own inputs/outputs), and every rank recomputes the same
layers in the same order, so the recomputed rings pair the same messages as the first forward.
Selective recompute (``recompute_granularity='selective'``) runs ``core_attn`` (the METP
attention keeps neither its output nor its LSE and re-runs its K/V ring forward in backward) and
``layernorm`` (Megatron's own output-discarding checkpoint of the norms) and refuses the other
modules, each with its reason (:mod:`.selective`); ``distribute_saved_activations`` and
Megatron's ``cpu_offloading`` are refused (:func:`recompute_problems`). With
``--metp-keep-attention-output`` the attention's re-run under full recompute takes the attention
outputs its first forward kept (:mod:`.keep_attention`) instead of running the K/V rings again.

Packed documents: ``packed_seq_params`` may be a :class:`~.packing.METPDocuments` (derived from
the EOD tokens by :class:`~.packing.DocumentBoundaries`, Megatron-LM's
``--reset-attention-mask``); its ``cu_seqlens`` go to the ops. Any other ``packed_seq_params``
(Megatron's THD batches) is refused. ``attention_mask`` is never read: the attention is causal,
within documents when boundaries are given.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule

from ..ops import metp_attention, metp_mlp, ring_attention, wire_dtype
from .groups import METPGroups
from .head_norm import head_norm_kwargs
from .packing import METPDocuments
from .moe_checks import check_moe_config
from .yarn import metp_softmax_scale


def mask_is_causal(attn_mask_type) -> bool:
    if attn_mask_type == AttnMaskType.causal:
        return True
    if attn_mask_type == AttnMaskType.no_mask:
        return False
    raise ValueError(f"METP attention supports causal and no_mask attention, got {attn_mask_type}; "
                     f"padding/arbitrary masks are not supported with --metp-parallel-size")


def _single_rope(rotary_pos_emb):
    if isinstance(rotary_pos_emb, tuple):
        q_emb, k_emb = rotary_pos_emb
        if q_emb is not k_emb and not torch.equal(q_emb, k_emb):
            raise ValueError("METP attention needs the same RoPE table for queries and keys")
        return q_emb
    return rotary_pos_emb


def document_kwargs(packed_seq_params, what: str) -> dict:
    """``cu_seqlens`` and ``layout`` of METP's packed documents (:mod:`.packing`) for the ops;
    ``layout='dual_chunk'`` alone without them."""
    if packed_seq_params is None:
        return {"layout": "dual_chunk"}
    if not isinstance(packed_seq_params, METPDocuments):
        raise ValueError(f"{what} takes packed documents only as METPDocuments (derived from "
                         f"the EOD tokens with --reset-attention-mask), not Megatron's packed "
                         f"THD batches (qkv_format="
                         f"{getattr(packed_seq_params, 'qkv_format', None)!r}, e.g. --sft)")
    return {"cu_seqlens": packed_seq_params.cu_seqlens, "layout": packed_seq_params.layout}


def recompute_problems(config, weight_ring: bool = True) -> list:
    """Megatron recompute / offload settings a METP layer refuses, each naming the field and flag.

    ``recompute_granularity='full'`` works (Megatron re-runs whole layers, and with them the METP
    rings, in backward); ``'selective'`` with the modules :mod:`.selective` runs (``core_attn``,
    ``layernorm``; with ``weight_ring=False``, the ring baseline, none). Refused: the other
    selective modules, ``distribute_saved_activations`` (splits a checkpointed layer input over TP
    only; with METP it is already sharded over the ring) and Megatron's ``cpu_offloading``.
    """
    from .selective import selective_problems

    out = []

    def get(name, default=None):
        return getattr(config, name, default)

    if get("recompute_granularity") == "selective":
        out.extend(f"recompute_granularity='selective', recompute_modules="
                   f"{get('recompute_modules')} ({problem})"
                   for problem in selective_problems(get("recompute_modules"),
                                                     weight_ring=weight_ring))
    if get("distribute_saved_activations"):
        out.append("distribute_saved_activations=True (--distribute-saved-activations): it "
                   "splits a checkpointed layer input over TP only (and needs TP > 1); with METP "
                   "the layer inputs are already sharded over the METP ring, drop the flag")
    if get("cpu_offloading") or (get("cpu_offloading_num_layers", 0) or 0) > 0:
        out.append("cpu_offloading=True (--cpu-offloading, Megatron's activation offload): use "
                   "METP's own offload (--metp-offload-activations) instead")
    return out


def check_recompute_config(config, weight_ring: bool = True) -> None:
    """Raise ``ValueError`` for the settings :func:`recompute_problems` lists."""
    problems = recompute_problems(config, weight_ring)
    if problems:
        raise ValueError("--metp-parallel-size does not support: " + "; ".join(problems))


def check_config(config) -> None:
    """Refuse TransformerConfig settings the METP layer cannot honour, naming the flag."""
    problems = recompute_problems(config)
    if config.sequence_parallel:
        problems.append("--sequence-parallel (METP already shards the sequence)")
    if config.attention_dropout:
        problems.append("--attention-dropout > 0 (set --attention-dropout 0)")
    if getattr(config, "window_size", None) is not None:
        problems.append(f"--window-size {config.window_size} (sliding-window attention: the METP "
                        f"K/V ring attends causally over the whole sequence; drop it, which "
                        f"equals a window >= the sequence length)")
    if getattr(config, "rotary_interleaved", False):
        problems.append("--rotary-interleaved")
    if getattr(config, "attention_output_gate", False):
        problems.append("attention_output_gate")
    from .variant_checks import variant_problems  # sinks, window patterns, GLU offset / clamp

    problems.extend(variant_problems(lambda name, default: getattr(config, name, default)))
    if problems:
        raise ValueError("--metp-parallel-size does not support: " + "; ".join(problems))


def mlp_activation(config) -> str:
    """The METP op's activation name for Megatron's MLP settings."""
    act = config.activation_func
    if config.gated_linear_unit and act is F.silu:
        return "swiglu"
    if not config.gated_linear_unit and act is F.gelu:
        return "gelu"
    raise ValueError(f"METP MLP supports GeLU (--no-swiglu, activation F.gelu) and SwiGLU "
                     f"(--swiglu); got activation {getattr(act, '__name__', act)} with "
                     f"gated_linear_unit={config.gated_linear_unit}")


class METPSelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` whose forward is the METP attention schedule.

    ``hidden_states`` ``[s/p, b, h]`` (this METP rank's tokens, Megatron's CP order);
    returns ``(output [s/p, b, h], linear_proj.bias)`` exactly like ``SelfAttention``.
    ``keeper``: an :class:`~.keep_attention.AttentionKeeper` when this layer keeps its attention
    output under Megatron's full recompute (``--metp-keep-attention-output``), else ``None``.
    """

    keeper = None
    #: its forward reads its submodules' weights without calling them (.param_gather)
    reads_submodule_weights = True

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal,
                 cp_comm_type=None, pg_collection=None, *, groups: METPGroups, kernel=None,
                 **megatron_kwargs):
        # megatron_kwargs: what the installed SelfAttention takes beyond these (0.19: name)
        check_config(config)
        check_moe_config(config, groups.metp.size)  # experts sharded over the METP group
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection, **megatron_kwargs)
        self.groups, self.kernel = groups, kernel
        self.causal = mask_is_causal(attn_mask_type)
        t = groups.tp_size
        for count, flag in ((config.num_attention_heads, "--num-attention-heads"),
                            (config.num_query_groups, "--num-query-groups")):
            if count % groups.shards:
                raise ValueError(f"{flag} ({count}) is not divisible by TP×METP = {groups.shards}")
        self.heads_tp = config.num_attention_heads // t
        self.groups_tp = config.num_query_groups // t
        self._head_norm = head_norm_kwargs(self)  # checks the q/k norm modules now

    def op_kwargs(self, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                  packed_seq_params=None) -> dict:
        """The keyword arguments :func:`megatron_metp.ops.metp_attention` (and the streaming
        layer, :func:`megatron_metp.ops.layer.metp_layer`) take from this module and the
        layer's RoPE / packed-document inputs: group, heads, mask, RoPE (per document when
        packed), kernel, softmax scale (times YaRN's attention factor squared, :mod:`.yarn`),
        q/k norm, gradient wire dtype."""
        packed = document_kwargs(packed_seq_params, "METP attention")
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            raise ValueError("METP attention takes RoPE as rotary_pos_emb, not cos/sin tables")
        rope = getattr(packed_seq_params, "rope", None)
        if rope is not None and rotary_pos_emb is not None:
            # the micro-batch's per-document angles (packing.py), one tensor for every layer
            rotary_pos_emb, packed["rope_per_document"] = rope, True
        return dict(packed, group=self.groups.metp, num_heads=self.heads_tp,
                    num_query_groups=self.groups_tp, causal=self.causal,
                    rotary_pos_emb=_single_rope(rotary_pos_emb),
                    softmax_scale=metp_softmax_scale(self.config), kernel=self.kernel,
                    grad_reduce_dtype=wire_dtype(self.linear_qkv.weight, self.linear_proj.weight),
                    **head_norm_kwargs(self))

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        if key_value_states is not None or inference_context is not None or \
                inference_params is not None:
            raise ValueError("METP attention supports training self-attention only (no "
                             "cross-attention or inference KV cache)")
        if attention_bias is not None:
            raise ValueError("METP attention does not support attention_bias")
        tp = self.groups.tp if self.groups.tp_size > 1 else None
        x = copy_to_tensor_model_parallel_region(hidden_states, group=tp) if tp else hidden_states
        out = metp_attention(x, self.linear_qkv.weight, self.linear_proj.weight,
                             **self.op_kwargs(rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                                              packed_seq_params),
                             qkv_bias=self.linear_qkv.bias, proj_bias=None,
                             label=f"layer {self.layer_number} self_attention",
                             keep=None if self.keeper is None else self.keeper.op_keep(x),
                             # Megatron's selective recompute of core_attn (its own flag)
                             recompute_core=bool(self.checkpoint_core_attention and self.training),
                             softmax_offset=self.core_attention.softmax_offset)
        if tp:
            out = reduce_from_tensor_model_parallel_region(out, group=tp)
        return out, self.linear_proj.bias


class METPMLP(MLP):
    """Megatron ``MLP`` whose forward is the METP MLP weight ring.

    ``hidden_states`` ``[s/p, b, h]``; returns ``(output, linear_fc2.bias)`` like ``MLP``.
    """

    #: its forward reads its submodules' weights without calling them (.param_gather)
    reads_submodule_weights = True

    def __init__(self, config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None,
                 tp_group=None, *, groups: METPGroups, keep_intermediate=False,
                 token_tile: Optional[int] = None, **megatron_kwargs):
        check_config(config)
        if is_expert:
            raise ValueError("METP MLP does not support MoE experts")
        self.activation = mlp_activation(config)
        ffn = ffn_hidden_size if ffn_hidden_size is not None else config.ffn_hidden_size
        if ffn % groups.shards:
            raise ValueError(f"--ffn-hidden-size ({ffn}) is not divisible by TP×METP = "
                             f"{groups.shards}")
        super().__init__(config=config, submodules=submodules, is_expert=False,
                         input_size=input_size, ffn_hidden_size=ffn, tp_group=groups.tp,
                         **megatron_kwargs)  # what the installed MLP takes beyond (0.19: name)
        self.groups, self.keep_intermediate = groups, keep_intermediate
        self.token_tile = token_tile  # rows per ring pass (None: the override, else auto)
        self.layer_number = None
        self.ffn_tp = ffn // groups.tp_size

    def set_layer_number(self, layer_number: int) -> None:
        """Called by ``TransformerLayer``; used in NaN/Inf reports."""
        self.layer_number = layer_number

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("METP MLP does not support per_token_scale (MoE)")
        tp = self.groups.tp if self.groups.tp_size > 1 else None
        x = copy_to_tensor_model_parallel_region(hidden_states, group=tp) if tp else hidden_states
        y = metp_mlp(x, self.linear_fc1.weight, self.linear_fc2.weight, group=self.groups.metp,
                     activation=self.activation, fc1_bias=self.linear_fc1.bias, fc2_bias=None,
                     keep_intermediate=self.keep_intermediate, ffn_hidden_size=self.ffn_tp,
                     token_tile=self.token_tile, label=f"layer {self.layer_number} mlp",
                     grad_reduce_dtype=wire_dtype(self.linear_fc1.weight,
                                                  self.linear_fc2.weight))
        if tp:
            y = reduce_from_tensor_model_parallel_region(y, group=tp)
        return y, self.linear_fc2.bias


def attention_sinks(config, groups: METPGroups, ring_baseline: bool):
    """The attention sinks of ``config.softmax_type`` (``None`` for ``vanilla``), as Megatron's
    ``DotProductAttention`` holds them: ``learnable`` a parameter ``softmax_offset [A]``
    (every head: TP is 1 with sinks, :mod:`.variant_checks`; replicated over the METP group,
    whose op runs every head group for this rank's rows), drawn with ``config.init_method``;
    ``off-by-one`` a zero tensor. The ring-attention baseline refuses them."""
    kind = getattr(config, "softmax_type", "vanilla") or "vanilla"
    if kind == "vanilla":
        return None
    if ring_baseline:
        raise ValueError(f"--softmax-type {kind} (attention sinks) with the ring self-attention "
                         f"baseline (--metp-disable-weight-ring): run METP's weight ring")
    heads = config.num_attention_heads // groups.tp_size
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    sinks = torch.zeros(heads, dtype=config.params_dtype, device=device)
    if kind == "off-by-one":
        return sinks
    sinks = torch.nn.Parameter(sinks)
    if config.perform_initialization:
        config.init_method(sinks)
    return sinks


class METPRingCoreAttention(MegatronModule):
    """``core_attention`` running the K/V ring over the METP group (ring self-attention).

    Called like Megatron's ``DotProductAttention``: ``q [s/p, b, heads, d]``, ``k, v`` with
    ``query groups`` heads; returns ``[s/p, b, heads·d]``.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None, *,
                 groups: METPGroups, kernel=None, ring_baseline: bool = True):
        # ring_baseline=False: built by METPSelfAttention's constructor and never called (its
        # forward runs the METP op), so the METP layer's recompute rules apply
        super().__init__(config=config)
        if config.attention_dropout:
            raise ValueError("ring attention has no attention dropout; set --attention-dropout 0")
        check_recompute_config(config, weight_ring=not ring_baseline)
        self.groups, self.kernel = groups, kernel
        self.layer_number = layer_number
        self.causal = mask_is_causal(attn_mask_type)
        self.softmax_scale = softmax_scale
        self.softmax_offset = attention_sinks(config, groups, ring_baseline)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("ring attention does not support attention_bias")
        packed = document_kwargs(packed_seq_params, "ring attention")
        causal = self.causal if attn_mask_type is None else mask_is_causal(attn_mask_type)
        out = ring_attention(query, key, value, **packed, group=self.groups.metp, causal=causal,
                             softmax_scale=self.softmax_scale,
                             kernel=self.kernel, label=f"layer {self.layer_number} core_attention")
        n, b = out.shape[:2]
        return out.reshape(n, b, -1)
