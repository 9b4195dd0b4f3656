"""Megatron's full recompute of a METP layer as the streaming layer op.

With ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``
Megatron's ``TransformerBlock`` wraps each layer in ``tensor_parallel.checkpoint``: the forward
runs without keeping anything, the layer input is saved, and the backward re-runs the layer's
forward (re-forming every activation of the layer: both norms' inputs and outputs, every head
group's attention output, the MLP's input) before differentiating it. For a METP layer the same
computation is :func:`megatron_metp.ops.layer.metp_layer`, which saves only the layer input and
re-forms, in its backward, one head group and one tile of tokens at a time
(:mod:`megatron_metp.ops.layer`). :func:`prepare_recompute` switches a block to it:

* every layer is a :class:`METPTransformerLayer` (the METP spec's layer class: Megatron's
  ``TransformerLayer``, same submodules, parameters, state dict and checkpoints) whose forward
  calls the op (``stream = True``);
* the block gets a copy of its config with ``recompute_granularity=None``, so it runs its
  plain layer loop instead of wrapping the layers in Megatron's checkpoint (the op is the
  checkpoint; Megatron's model config, and with it ``args.recompute_granularity`` and
  Megatron-LM's FLOP count, are unchanged);
* with ``--metp-keep-attention-output`` (the layer's attention has a
  :class:`~.keep_attention.AttentionKeeper`) the op keeps every head group's attention output
  and LSE for its backward (``keep_attention=True``) instead of re-running the attention forward;
* with ``--metp-offload-activations`` (an :class:`~megatron_metp.runtime.offload.
  ActivationOffloader` whose forward is running and which offloads this layer) the op keeps the
  layer input, the attention outputs and ``d(qkv)`` on the host and writes each layer's output
  over its input;
* the block's final norm runs as :func:`~megatron_metp.ops.layer_rows.streaming_norm` (in row
  tiles, its input on the host with the last layer's group, its output over its input, its
  input gradient over its output gradient), so that its backward holds no ``[s/p, h]`` tensor
  beyond the gradient.

A MoE layer of the block (Megatron's ``MoELayer`` as :mod:`.moe_tiles`' ``TiledMoELayer``) runs
as Megatron's checkpoint of that one layer (its input kept, its forward re-run in its backward,
the re-formed output freed as :mod:`.recompute_output` does), its routed part in token tiles: only
``[s/p, h]`` tensors and the ``[s/p, E]`` routing outlive a tile, so no MoE transient grows with
``s/(p·c)`` beyond the dense layers' own, while the block's dense layers keep the layer op.

Where the layer op does not apply, the block keeps Megatron's checkpoint and the separate METP
ops (with :mod:`.recompute_output`'s freed chunk outputs); :func:`streaming_problems` says why:
TP > 1 (the op has no TP reductions inside), hidden dropout, ``keep_intermediate``, another
recompute method or chunk size, the ring-attention baseline (no weight ring), or
``METP_STREAMING_LAYER=0`` (the switch to compare both; default on).
"""

from __future__ import annotations

import copy
from typing import List

from megatron.core.transformer.transformer_layer import TransformerLayer

from ..ops.layer import metp_layer
from ..ops.layer_rows import streaming_norm
from ..ops.streaming_switch import STREAMING_ENV, streaming_enabled  # noqa: F401 (re-export)
from ..runtime.offload import current_offloader
from .modules import METPMLP, METPSelfAttention


class METPTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` whose forward, once :func:`prepare_recompute` set
    :attr:`stream`, is the streaming METP layer op (the same parameters and results)."""

    stream = False

    @property
    def reads_submodule_weights(self) -> bool:
        """Whether its forward reads its submodules' weights without calling them
        (:mod:`.param_gather`): as the streaming layer op."""
        return self.stream

    def forward(self, *args, **kwargs):
        if not self.stream:
            return super().forward(*args, **kwargs)
        if _is_moe(self.mlp):
            return self._checkpointed_forward(*args, **kwargs)
        hidden_states = kwargs.pop("hidden_states", None)
        if hidden_states is None:
            hidden_states, args = args[0], args[1:]
        if args:
            raise ValueError("the streaming METP layer takes its inputs as keywords (Megatron's "
                             "TransformerBlock layer loop)")
        for name in ("context", "context_mask", "attention_bias", "inference_context",
                     "inference_params", "sequence_len_offset", "rotary_pos_cos_sin"):
            if kwargs.get(name) is not None:
                raise ValueError(f"the streaming METP layer does not take {name} (training "
                                 f"self-attention only)")
        attn, mlp = self.self_attention, self.mlp
        op = attn.op_kwargs(kwargs.get("rotary_pos_emb"), kwargs.get("rotary_pos_cos"),
                            kwargs.get("rotary_pos_sin"), kwargs.get("packed_seq_params"))
        off = current_offloader()
        host = off is not None and off.offloads_current_group()
        x = hidden_states
        out = metp_layer(x, **op, qkv_weight=attn.linear_qkv.weight,
                         qkv_bias=attn.linear_qkv.bias, proj_weight=attn.linear_proj.weight,
                         proj_bias=attn.linear_proj.bias, fc1_weight=mlp.linear_fc1.weight,
                         fc1_bias=mlp.linear_fc1.bias, fc2_weight=mlp.linear_fc2.weight,
                         fc2_bias=mlp.linear_fc2.bias, activation=mlp.activation,
                         norm1=self.input_layernorm, norm2=self.pre_mlp_layernorm,
                         host=host, offloader=off if host else None,
                         in_place=True, mlp_token_tile=mlp.token_tile,
                         keep_attention=attn.keeper is not None,
                         label=f"layer {self.layer_number}")
        return out, kwargs.get("context")


    def _checkpointed_forward(self, *args, **kwargs):
        """Megatron's full recompute of this one layer (a MoE layer in a streaming block)."""
        from megatron.core import tensor_parallel

        from .recompute_output import free_output

        hidden_states = kwargs.pop("hidden_states", None)
        if hidden_states is None:
            hidden_states, args = args[0], args[1:]
        context = []

        def run(x):
            out, ctx = TransformerLayer.forward(self, x, *args, **kwargs)
            context[:] = [ctx]
            free_output(None, None, out)  # in the backward's re-run only
            return out
        out = tensor_parallel.checkpoint(run, False, hidden_states)
        return out, context[0] if context else kwargs.get("context")


def _is_moe(mlp) -> bool:
    from .moe_tiles import TiledMoELayer

    return isinstance(mlp, TiledMoELayer)


def streaming_problems(block) -> List[str]:
    """Why ``block`` (a Megatron ``TransformerBlock``) cannot run the streaming layer op (``[]``:
    it can)."""
    cfg = block.config
    out = []
    if not streaming_enabled():
        out.append(f"{STREAMING_ENV}=0")
    if getattr(cfg, "recompute_granularity", None) != "full" or \
            cfg.recompute_method != "uniform" or int(cfg.recompute_num_layers or 0) != 1:
        out.append("the layer op is Megatron's full recompute of one layer per checkpoint "
                   "(--recompute-granularity full --recompute-method uniform "
                   "--recompute-num-layers 1)")
    if getattr(cfg, "hidden_dropout", 0.0):
        out.append("--hidden-dropout > 0")
    if (getattr(cfg, "softmax_type", "vanilla") or "vanilla") != "vanilla":
        out.append(f"attention sinks (--softmax-type {cfg.softmax_type}; the layer op has none: "
                   f"Megatron's checkpoint of the METP layers runs them)")
    for layer in block.layers:
        if not isinstance(layer, METPTransformerLayer) or \
                not isinstance(layer.self_attention, METPSelfAttention) or \
                not (isinstance(layer.mlp, METPMLP) or _is_moe(layer.mlp)):
            out.append("a layer without the METP weight ring (ring self-attention baseline or "
                       "another spec)")
            break
        if _is_moe(layer.mlp):  # checkpointed as a whole layer, its MoE in token tiles
            continue
        if layer.mlp.groups.tp_size > 1:
            out.append("TP > 1 inside a METP layer")
            break
        if layer.mlp.keep_intermediate:
            out.append("keep_intermediate (--metp-keep-intermediate)")
            break
    return out


def prepare_recompute(block) -> bool:
    """Set up full recompute for a block of METP layers: the streaming layer op where it
    applies (returns ``True``), else Megatron's checkpoint with the freed chunk outputs of
    :mod:`.recompute_output` (``False``)."""
    if getattr(block.config, "recompute_granularity", None) != "full":
        return False
    if streaming_problems(block):
        from .recompute_output import free_recomputed_outputs

        free_recomputed_outputs(block)
        return False
    cfg = copy.copy(block.config)
    cfg.recompute_granularity = None
    cfg.recompute_method = None
    cfg.recompute_num_layers = None
    block.config = cfg
    for layer in block.layers:
        layer.stream = True
    final = getattr(block, "final_layernorm", None)
    if final is not None:  # the final norm in tiles too: its input on the host, in place
        # the op calls a shallow copy (the same parameters and hooks) of the module, whose
        # forward is left as it was
        inner = copy.copy(final)

        def final_norm(hidden_states, norm=inner):
            off = current_offloader()
            host = off is not None and off.offloads_current_group()
            return streaming_norm(hidden_states, norm, host=host,
                                  offloader=off if host else None, in_place=True)
        final.forward = final_norm
    return True
