"""Pure tensor re-layout of a MoE layer between transformers (``qwen3_moe``, ``mixtral``) and
megatron-core's ``MoELayer`` with ``SequentialMLP`` experts (no I/O, no maths: a round trip
returns the same bits).

Names: ``h`` hidden size, ``E`` experts, ``f'`` expert FFN width, ``i`` a layer, ``j`` an expert.
``P`` is transformers' MoE block (``model.layers.i.mlp.`` for Qwen3-MoE,
``model.layers.i.block_sparse_moe.`` for Mixtral); gate / up / down are ``gate_proj`` /
``up_proj`` / ``down_proj`` (Qwen3-MoE) or ``w1`` / ``w3`` / ``w2`` (Mixtral).

==========================================  ====================================================
transformers                                Megatron ``named_parameters()`` (EP = 1)
==========================================  ====================================================
``P gate.weight [E, h]`` (router)           ``decoder.layers.i.mlp.router.weight [E, h]``
``P experts.j.{gate,up}.weight [f', h]``    ``…mlp.experts.local_experts.j.linear_fc1.weight``
                                            ``[2f', h]`` (gate rows first, as the dense SwiGLU)
``P experts.j.down.weight [h, f']``         ``…mlp.experts.local_experts.j.linear_fc2.weight``
==========================================  ====================================================

With EP = p (the experts sharded over the METP ranks) rank ``r`` holds global experts
``r·E/p … (r+1)·E/p - 1`` as its local experts ``0 … E/p - 1``; the ``torch_dist`` checkpoint
stores them by global index (megatron-core's ``SequentialMLP.sharded_state_dict``), so the
EP = 1 checkpoint the import writes loads at any EP dividing ``E``.
"""

from __future__ import annotations

from typing import Dict

import torch

from .moe import hf_expert_names, hf_moe_prefix

Tensor = torch.Tensor


def _mg_expert(j: int) -> str:
    return f"mlp.experts.local_experts.{j}."


def hf_moe_shapes(g, i: int) -> Dict[str, tuple]:
    """transformers' names and shapes of MoE layer ``i``'s block."""
    h, f, E = g.hidden_size, g.moe_ffn_hidden_size, g.num_experts
    p = f"model.layers.{i}.{hf_moe_prefix(g.family)}"
    gate, up, down = hf_expert_names(g.family)
    out = {p + "gate.weight": (E, h)}
    for j in range(E):
        e = f"{p}experts.{j}."
        out.update({e + gate + ".weight": (f, h), e + up + ".weight": (f, h),
                    e + down + ".weight": (h, f)})
    return out


def megatron_moe_shapes(g, i: int) -> Dict[str, tuple]:
    """Megatron's names (EP = 1) and shapes of MoE layer ``i``'s ``mlp``."""
    h, f, E = g.hidden_size, g.moe_ffn_hidden_size, g.num_experts
    t = f"decoder.layers.{i}."
    out = {t + "mlp.router.weight": (E, h)}
    for j in range(E):
        out[t + _mg_expert(j) + "linear_fc1.weight"] = (2 * f, h)
        out[t + _mg_expert(j) + "linear_fc2.weight"] = (h, f)
    return out


def moe_hf_to_megatron(hf: Dict[str, Tensor], g, i: int, fuse_gate_up) -> Dict[str, Tensor]:
    """MoE layer ``i``: transformers → Megatron (``fuse_gate_up``: the dense MLP's fusion)."""
    s, t = f"model.layers.{i}.{hf_moe_prefix(g.family)}", f"decoder.layers.{i}."
    gate, up, down = hf_expert_names(g.family)
    out = {t + "mlp.router.weight": hf[s + "gate.weight"].clone()}
    for j in range(g.num_experts):
        e = f"{s}experts.{j}."
        out[t + _mg_expert(j) + "linear_fc1.weight"] = fuse_gate_up(hf[e + gate + ".weight"],
                                                                    hf[e + up + ".weight"])
        out[t + _mg_expert(j) + "linear_fc2.weight"] = hf[e + down + ".weight"].clone()
    return out


def moe_megatron_to_hf(mg: Dict[str, Tensor], g, i: int, split_gate_up) -> Dict[str, Tensor]:
    """Inverse of :func:`moe_hf_to_megatron`."""
    s, t = f"decoder.layers.{i}.", f"model.layers.{i}.{hf_moe_prefix(g.family)}"
    gate, up, down = hf_expert_names(g.family)
    out = {t + "gate.weight": mg[s + "mlp.router.weight"].clone()}
    for j in range(g.num_experts):
        e = f"{t}experts.{j}."
        w_gate, w_up = split_gate_up(mg[s + _mg_expert(j) + "linear_fc1.weight"])
        out[e + gate + ".weight"] = w_gate
        out[e + up + ".weight"] = w_up
        out[e + down + ".weight"] = mg[s + _mg_expert(j) + "linear_fc2.weight"].clone()
    return out
