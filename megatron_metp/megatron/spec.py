"""``get_gpt_layer_metp_spec``: Megatron's local GPT layer spec with METP modules swapped in."""

from __future__ import annotations

import copy
import logging
from functools import partial
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from ..runtime.overrides import parse_int
from . import compat
from .groups import METPGroups
from .linear import METPLinear
from .modules import METPMLP, METPRingCoreAttention, METPSelfAttention
from .streaming import METPTransformerLayer


class _DropUnknownMLPWarning(logging.Filter):
    """TransformerLayer warns 'Unknown MLP type' for any MLP class other than ``MLP`` itself;
    :class:`METPMLP` is an ``MLP`` subclass that receives its groups from the spec."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_DropUnknownMLPWarning())


def get_gpt_layer_metp_spec(groups: METPGroups, *, weight_ring: bool = True,
                            normalization: Optional[str] = None, kernel: Optional[str] = None,
                            keep_intermediate: bool = False,
                            norm: Optional[type] = None,
                            qk_layernorm: bool = False,
                            mlp_token_tile: Optional[int] = None,
                            moe_token_tiles: Optional[int] = None) -> ModuleSpec:
    """A ``TransformerLayer`` spec for megatron-core's ``GPTModel`` running METP.

    Starts from ``get_gpt_layer_local_spec(normalization=...)`` and keeps ``TransformerLayer``,
    the norms and bias-dropout-add. With ``weight_ring=True`` (METP) ``SelfAttention``/``MLP``
    become their METP subclasses and ``linear_qkv``/``linear_fc1`` (column) and
    ``linear_proj``/``linear_fc2`` (row) hold ``TP×METP`` shards; ``core_attention`` is the K/V
    ring. With ``weight_ring=False`` (ring self-attention baseline) the linears stay Megatron's
    TP layers, replicated over the METP group, and only ``core_attention`` becomes the K/V ring.

    Args:
        groups: the TP / METP / DP groups (explicit; nothing is read from globals later).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` as for the local spec.
        kernel: attention block kernel (``flash_attn`` / ``torch_flash`` / ``reference``).
        keep_intermediate: keep the MLP's ``x·W1_j`` instead of recomputing it (more memory).
        norm: the module for ``input_layernorm`` and ``pre_mlp_layernorm`` instead of the local
            spec's (e.g. Transformer Engine's ``TENorm``:
            :func:`megatron_metp.megatron.gpu_stack.select_norm`).
        qk_layernorm: Megatron's ``--qk-layernorm`` (``config.qk_layernorm``): the local spec's
            per-head ``q_layernorm``/``k_layernorm``, which the METP attention applies inside its
            head-group loop (:mod:`.head_norm`) and the ring baseline's stock attention itself.
        mlp_token_tile: token rows per pass of the METP MLP's weight ring (``0``: whole;
            Megatron-LM's ``--metp-mlp-token-tile``), given to :class:`~.modules.METPMLP` and by
            it to the MLP op and the streaming layer's row passes; ``None``: the override
            ``METP_MLP_TOKEN_TILE``, else auto from the tile budget
            (:mod:`megatron_metp.ops.tiles`).
            Refused with ``weight_ring=False`` (Megatron's own MLP has no tiles).
        moe_token_tiles: token tiles of every MoE layer (:mod:`.moe_tiles`); taken by
            :func:`~.moe.get_gpt_decoder_block_metp_spec`, refused here when not ``None`` (this
            spec has no MoE layer).
    """
    if mlp_token_tile is not None:
        parse_int(mlp_token_tile, "mlp_token_tile", minimum=0,
                  unit="token rows per tile, 0 = whole")
        if not weight_ring:
            raise ValueError("mlp_token_tile tiles the METP MLP; with weight_ring=False (the "
                             "ring self-attention baseline) the layer runs Megatron's own MLP, "
                             "which has no token tiles: drop mlp_token_tile")
    if moe_token_tiles is not None:
        raise ValueError("moe_token_tiles tiles MoE layers; this dense layer spec has none: "
                         "build a MoE model with get_gpt_decoder_block_metp_spec(..., "
                         "moe_token_tiles=N), or drop moe_token_tiles")
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization,
                                                  qk_layernorm=qk_layernorm))
    layer = spec.submodules
    if norm is not None:
        layer.input_layernorm = norm
        layer.pre_mlp_layernorm = norm
    attn = layer.self_attention
    core = partial(METPRingCoreAttention, groups=groups, kernel=kernel,
                   ring_baseline=not weight_ring)
    attn.submodules.core_attention = core
    if not weight_ring:
        return spec
    spec.module = METPTransformerLayer  # Megatron's layer; the streaming op under full recompute
    attn.module = METPSelfAttention
    attn.params = {**attn.params, "groups": groups, "kernel": kernel}
    # SelfAttention calls its linear_qkv builder directly, and build_module()s the others.
    attn.submodules.linear_qkv = partial(METPLinear, groups=groups, mode="column")
    attn.submodules.linear_proj = linear_spec(groups, "row")
    mlp = compat.mlp_submodules(layer.mlp)
    mlp.linear_fc1 = linear_spec(groups, "column")
    mlp.linear_fc2 = linear_spec(groups, "row")
    layer.mlp = compat.layer_mlp(layer.mlp, METPMLP,
                                 {"groups": groups, "keep_intermediate": keep_intermediate,
                                  "token_tile": mlp_token_tile})
    return spec


def linear_spec(groups: METPGroups, mode: str) -> ModuleSpec:
    """A ``ModuleSpec`` of :class:`~.linear.METPLinear` (``mode`` ``"column"`` or ``"row"``):
    a weight sharded over TP × METP (the METP MLP's, the shared expert's, the projection's)."""
    return ModuleSpec(module=METPLinear, params={"groups": groups, "mode": mode})
