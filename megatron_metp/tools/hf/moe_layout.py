"""Pure tensor re-layout of a MoE layer between transformers (``qwen3_moe``, ``mixtral``,
``qwen2_moe``, ``glm4_moe``) and
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

The shared expert (``qwen2_moe``: ``P shared_expert.``, ``glm4_moe``: ``P shared_experts.``; width
``F_s``) maps like a dense MLP: its ``{gate,up}_proj.weight [F_s, h]`` ↔
``…mlp.shared_experts.linear_fc1.weight [2F_s, h]``, ``down_proj.weight [h, F_s]`` ↔
``…linear_fc2.weight``; Qwen2-MoE's ``P shared_expert_gate.weight [1, h]`` ↔
``…mlp.shared_experts.gate_weight [1, h]``. GLM-4.5's router bias ``P gate.e_score_correction_bias
[E]`` ↔ the router's ``expert_bias`` buffer ``[E]`` (megatron-core keeps it in fp32, as
transformers does).

With EP = p (the experts sharded over the METP ranks) rank ``r`` holds global experts
``r·E/p … (r+1)·E/p - 1`` as its local experts ``0 … E/p - 1``; the ``torch_dist`` checkpoint
stores them by global index (megatron-core's ``SequentialMLP.sharded_state_dict``), so the
EP = 1 checkpoint the import writes loads at any EP dividing ``E``.
"""

from __future__ import annotations

from typing import Dict

import torch

from .moe import hf_expert_names, hf_moe_prefix, hf_shared_prefix

Tensor = torch.Tensor


def _mg_expert(j: int) -> str:
    return f"mlp.experts.local_experts.{j}."


#: transformers tensors of any float dtype that both sides keep in fp32 (GLM-4.5's router bias)
FP32_BUFFERS = (".e_score_correction_bias",)
#: Megatron names of the shared expert and the router bias
_MG_SHARED = "mlp.shared_experts."
_MG_GATE = _MG_SHARED + "gate_weight"
_MG_BIAS = "mlp.router.expert_bias"


def _renamed(g, i: int) -> Dict[str, tuple]:
    """MoE layer ``i``'s tensors that only change name: transformers' → (Megatron's, shape)."""
    p, t = f"model.layers.{i}.{hf_moe_prefix(g.family)}", f"decoder.layers.{i}."
    out = {p + "gate.weight": (t + "mlp.router.weight", (g.num_experts, g.hidden_size))}
    if g.moe_shared_expert_gate:
        out[p + "shared_expert_gate.weight"] = (t + _MG_GATE, (1, g.hidden_size))
    if g.moe_router_enable_expert_bias:
        out[p + "gate.e_score_correction_bias"] = (t + _MG_BIAS, (g.num_experts,))
    return out


def _mlps(g, i: int):
    """``(transformers prefix, Megatron prefix, width)`` of each SwiGLU MLP of MoE layer ``i``
    (the routed experts, then the shared expert)."""
    p, t = f"model.layers.{i}.{hf_moe_prefix(g.family)}", f"decoder.layers.{i}."
    out = [(f"{p}experts.{j}.", t + _mg_expert(j), g.moe_ffn_hidden_size)
           for j in range(g.num_experts)]
    if g.moe_shared_expert_intermediate_size:
        out.append((p + hf_shared_prefix(g.family), t + _MG_SHARED,
                    g.moe_shared_expert_intermediate_size))
    return out


def hf_moe_shapes(g, i: int) -> Dict[str, tuple]:
    """transformers' names and shapes of MoE layer ``i``'s block."""
    h = g.hidden_size
    gate, up, down = hf_expert_names(g.family)
    out = {k: shape for k, (_, shape) in _renamed(g, i).items()}
    for e, _, f in _mlps(g, i):
        out.update({e + gate + ".weight": (f, h), e + up + ".weight": (f, h),
                    e + down + ".weight": (h, f)})
    return out


def megatron_moe_shapes(g, i: int) -> Dict[str, tuple]:
    """Megatron's names (EP = 1) and shapes of MoE layer ``i``'s ``mlp``."""
    h = g.hidden_size
    out = dict(_renamed(g, i).values())
    for _, m, f in _mlps(g, i):
        out[m + "linear_fc1.weight"] = (2 * f, h)
        out[m + "linear_fc2.weight"] = (h, f)
    return out


def moe_hf_to_megatron(hf: Dict[str, Tensor], g, i: int, fuse_gate_up) -> Dict[str, Tensor]:
    """MoE layer ``i``: transformers → Megatron (``fuse_gate_up``: the dense MLP's fusion)."""
    gate, up, down = hf_expert_names(g.family)
    out = {m: hf[k].clone() for k, (m, _) in _renamed(g, i).items()}
    for e, m, _ in _mlps(g, i):
        out[m + "linear_fc1.weight"] = fuse_gate_up(hf[e + gate + ".weight"],
                                                    hf[e + up + ".weight"])
        out[m + "linear_fc2.weight"] = hf[e + down + ".weight"].clone()
    return out


def moe_megatron_to_hf(mg: Dict[str, Tensor], g, i: int, split_gate_up) -> Dict[str, Tensor]:
    """Inverse of :func:`moe_hf_to_megatron`."""
    gate, up, down = hf_expert_names(g.family)
    out = {k: mg[m].clone() for k, (m, _) in _renamed(g, i).items()}
    for e, m, _ in _mlps(g, i):
        w_gate, w_up = split_gate_up(mg[m + "linear_fc1.weight"])
        out[e + gate + ".weight"] = w_gate
        out[e + up + ".weight"] = w_up
        out[e + down + ".weight"] = mg[m + "linear_fc2.weight"].clone()
    return out
