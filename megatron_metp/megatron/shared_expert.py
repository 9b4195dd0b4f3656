"""The shared expert of a MoE layer with METP (``--moe-shared-expert-intermediate-size F_s``,
``--moe-shared-expert-gate``): a dense MLP beside the routed experts, run as METP's MLP.

Stock Megatron's ``SharedExpertMLP`` is an ``MLP`` of width ``F_s`` on every token of the layer,
TP-sharded like a dense MLP. With METP the layer's tokens are sequence-sharded (``[s/(p·c), b,
h]`` per rank), so the shared expert is :class:`~.modules.METPMLP` of width ``F_s``: ``W1``
``[k·F_s/p, h]`` and ``W2`` ``[h, F_s/p]`` per rank, the weight ring bringing every shard to every
rank's tokens (token tiles as the dense MLP's), nothing duplicated::

    y = act(x·W1ᵀ)·W2ᵀ                         x: [s/(p·c), b, h], y: [s/(p·c), b, h]
    y ← y · sigmoid(x·gᵀ)                      with the gate, g: [1, h] (replicated)

Backward: the METP MLP's (:func:`~megatron_metp.ops.metp_mlp`); the gate's ``dg = Σ_tokens
(dy·y_ungated · σ'(x·gᵀ))ᵀ·x`` over this rank's tokens, summed over the sequence ranks by
Megatron's DDP like a norm weight's (a replicated parameter). The MoE layer adds ``y`` to the
routed experts' output (``MoELayer.shared_experts_compute``). ``--moe-shared-expert-overlap``
(the shared expert inside the token dispatcher's communication) is refused
(:mod:`.moe_checks`).
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import torch

from .groups import METPGroups
from .modules import METPMLP

__all__ = ["METPSharedExpertMLP", "shared_expert_spec"]


class METPSharedExpertMLP(METPMLP):
    """``SharedExpertMLP`` for METP layers: :class:`~.modules.METPMLP` of width
    ``config.moe_shared_expert_intermediate_size`` with stock's optional sigmoid gate.

    ``hidden_states`` ``[s/p, b, h]``; returns the output tensor (not a tuple), as
    ``SharedExpertMLP`` does."""

    def __init__(self, config, submodules, gate: bool = False, pg_collection=None, *,
                 groups: METPGroups, keep_intermediate: bool = False,
                 token_tile: Optional[int] = None, **megatron_kwargs):
        del pg_collection  # the METP groups come from the spec
        if config.add_bias_linear:
            raise ValueError("--moe-shared-expert-intermediate-size with linear biases: the "
                             "shared expert has none (as in stock Megatron); add "
                             "--disable-bias-linear")
        # as stock's SharedExpertMLP: a config copy whose FFN width is the shared expert's
        # (MLP sizes linear_fc2 from config.ffn_hidden_size)
        config = copy.copy(config)
        config.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        super().__init__(config, submodules, groups=groups, keep_intermediate=keep_intermediate,
                         token_tile=token_tile, **megatron_kwargs)
        self.use_shared_expert_gate = bool(gate)
        self.gate_weight = None
        if self.use_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty((1, config.hidden_size)))
            if config.perform_initialization:
                config.init_method(self.gate_weight)
            self.gate_weight.data = self.gate_weight.data.to(dtype=config.params_dtype)
            # replicated over the METP group (each rank gates its own tokens): its gradient is
            # summed over the sequence ranks with the other replicated weights, not over TP
            setattr(self.gate_weight, "sequence_parallel", False)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        output, _ = super().forward(hidden_states, per_token_scale, **kwargs)
        if self.use_shared_expert_gate:
            score = torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
            output = output * score
        return output

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.use_shared_expert_gate:
            from megatron.core.utils import make_sharded_tensor_for_checkpoint

            name = f"{prefix}gate_weight"
            out[name] = make_sharded_tensor_for_checkpoint(self.gate_weight, name,
                                                           prepend_offsets=sharded_offsets)
        return out


def shared_expert_spec(shared, groups: METPGroups, *, keep_intermediate: bool = False,
                       token_tile: Optional[int] = None):
    """``MoESubmodules.shared_experts`` of a METP MoE layer from stock's entry ``shared``: a
    ``ModuleSpec`` (0.16: ``build_module(spec, config=, pg_collection=, gate=)``) or a builder
    ``partial`` (0.19: called with ``config=, pg_collection=, gate=, name=``), either way
    building :class:`METPSharedExpertMLP` on METP's column / row linears."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .spec import linear_spec

    def submodules(stock_submodules):
        sub = copy.copy(stock_submodules)
        sub.linear_fc1 = linear_spec(groups, "column")
        sub.linear_fc2 = linear_spec(groups, "row")
        return sub

    params = {"groups": groups, "keep_intermediate": keep_intermediate, "token_tile": token_tile}
    if isinstance(shared, functools.partial):
        return functools.partial(_build, submodules=submodules(shared.keywords["submodules"]),
                                 params=params)
    return ModuleSpec(module=METPSharedExpertMLP, params={**(shared.params or {}), **params},
                      submodules=submodules(shared.submodules))


def _build(*, config, gate: bool, submodules, params, pg_collection=None, name=None, **_unused):
    extra = {} if name is None else {"name": name}
    return METPSharedExpertMLP(config, submodules, gate=gate, pg_collection=pg_collection,
                               **params, **extra)
