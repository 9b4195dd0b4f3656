"""Parameters and the static memory of a rank: bf16 weights, the fp32 ``main_grad`` buffer and
Adam's states, without and with the distributed optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from .model import BF16, FP32, Job, Model, canonical, layout, padded_vocab
from .mla import attention_elements as mla_elements
from .moe import params_split as moe_params


def layer_weights(model: Model) -> Tuple[int, int, int]:
    """``(attention matrices, MLP matrices, norms)`` elements of one layer (no linear biases but
    ``--add-qkv-bias``'s, sharded with ``linear_qkv``; ``--qk-layernorm``'s two ``[d]`` norms are
    replicated like the layer norms)."""
    h, d = model.hidden, model.head_dim
    hq, hk = model.heads * d, model.groups * d
    k = 2 if model.swiglu else 1
    attn = h * (hq + 2 * hk) + hq * h + ((hq + 2 * hk) if model.add_qkv_bias else 0)
    mlp = k * model.ffn * h + model.ffn * h
    norms = 2 * 2 * h  # two LayerNorms, weight and bias
    if model.mla:  # head-sharded up/out projections; replicated down-projections, RMSNorms
        attn, replicated = mla_elements(model)
        return attn, mlp, 2 * h + replicated
    if model.qk_layernorm:
        norms += 2 * 2 * d  # q and k LayerNorms of the head width
    return attn, mlp, norms


@dataclass
class Params:
    layer_sharded: int     # elements of METP/TP-sharded layer matrices on this rank
    layer_replicated: int  # norms (and, for ring/cp, matrices replicated over the ring)
    embedding: int         # word embedding (+ output layer when untied), on this rank
    final_norm: int
    dp_sharded: int        # data-parallel size over which the distributed optimizer shards
    dp_replicated: int
    embedding_sharded: bool = False  # METP vocabulary split: the tables reduce over dp_sharded
    expert: int = 0        # MoE experts on this rank (E/EP per MoE layer, :mod:`.moe`)
    dp_expert: int = 1     # expert-DP: the group their gradients reduce over

    @property
    def total(self) -> int:
        return self.layer_sharded + self.layer_replicated + self.embedding + self.final_norm + \
            self.expert

    @property
    def sharded(self) -> int:
        """Elements whose gradients are reduced over ``dp_sharded`` (METP-sharded ones)."""
        return self.layer_sharded + (self.embedding if self.embedding_sharded else 0)

    def reduce_groups(self) -> Tuple[Tuple[int, int], ...]:
        """``(elements, data-parallel group size)`` of each class of parameters by the group
        that reduces their gradients (and that the distributed optimizer shards them over):
        the sharded ones, the replicated ones, the experts. (Stock modes reduce both of the
        first two over the same group.)"""
        return ((self.sharded, self.dp_sharded),
                (self.total - self.sharded - self.expert, self.dp_replicated),
                (self.expert, self.dp_expert))


def params(model: Model, job: Job, mode: str, stage: str = "first") -> Params:
    """Parameter elements held by one rank of ``stage`` ("first" or "last" pipeline stage)."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    attn, mlp, norms = layer_weights(model)
    L = model.layers // job.pp
    moe = moe_params(model, job, lay, stage)
    # MoE layers (.moe): no dense MLP; the router replicated like the norms, experts apart
    mlp_layers = moe["dense_mlp_layers"] if model.moe else L  # (+ the shared experts, dense)
    V = padded_vocab(model.vocab, lay.vocab_pad)
    emb = 0
    first = stage == "first" or job.pp == 1
    last = stage == "last" or job.pp == 1
    if first:
        emb += V * model.hidden // lay.vocab_shards
    if last and (not model.tied or job.pp > 1):
        emb += V * model.hidden // lay.vocab_shards
    final = (1 if model.mla else 2) * model.hidden if last else 0  # MLA: RMSNorm (no bias)
    repl = L * norms + moe["router"]
    if mode == "metp":
        sharded = (L * attn + mlp_layers * mlp + moe["shared"]) // lay.weight_shards
        # METP-sharded weights reduce over CP × DP (expert-DP under the fold), replicated
        # ones over everything Megatron's DP × CP group holds (c = METP × CP ranks)
        dp_sh, dp_rep = job.dp * lay.cp, job.dp * lay.c
        if model.moe and moe["ep"] > lay.p:
            # EP wider than METP: the METP-sharded weights ride in Megatron's expert buffers,
            # so the distributed optimizer shards them over expert-DP (megatron/wide_ep.py)
            dp_sh = moe["expert_dp"]
    elif mode in ("tp", "tp-sp"):
        sharded = (L * attn + mlp_layers * mlp + moe["shared"]) // lay.t
        dp_sh = dp_rep = job.dp
    else:  # ring, cp: TP shards, replicated over the ring; DP×CP reduces them
        sharded = (L * attn + mlp_layers * mlp + moe["shared"]) // lay.t
        dp_sh = dp_rep = job.dp * lay.c
    return Params(sharded, repl, emb, final, dp_sh, dp_rep, embedding_sharded=lay.vocab,
                  expert=moe["expert"], dp_expert=moe["expert_dp"])


#: Megatron's ``--optimizer-cpu-offload`` (``HybridDeviceOptimizer``, offload fraction 1.0, with
#: the precision-aware distributed optimizer it requires): per parameter of the rank's optimizer
#: shard the host holds an fp32 master copy (4 B), a pinned fp32 copy of its gradient (4 B, the
#: device-to-host target) and Adam's two fp32 moments (8 B); the device keeps no optimizer state
#: (its bf16 parameters and fp32 ``main_grad`` buffer stay). Read from megatron-core 0.16.1's
#: ``optimizer/cpu_offloading/hybrid_optimizer.py``; not measured here.
OFFLOADED_OPTIMIZER_BYTES = 16
OFFLOADED_PINNED_BYTES = 4


def static_memory(model: Model, job: Job, mode: str, stage: str = "first") -> Dict[str, float]:
    """Parameters (bf16), gradient buffer (fp32 main_grad), Adam states (fp32 master + 2 moments)
    without and with the distributed optimizer (sharded over the DP group that reduces each
    parameter: pure DP for METP-sharded weights — with the vocabulary split also METP's word
    embedding and output layer — DP×ring for parameters replicated over a ring)."""
    mode, job = canonical(mode, job)
    p = params(model, job, mode, stage)
    opt_plain = 12 * p.total
    # MoE experts (.moe): sharded over expert-DP (METP: CP × DP; stock: TP·CP·DP / EP)
    opt_dist = sum(12 * n / g for n, g in p.reduce_groups())
    opt = opt_dist if job.distributed_optimizer else opt_plain
    host = 0.0
    if job.optimizer_offload:  # Megatron's --optimizer-cpu-offload (offload fraction 1.0)
        host = OFFLOADED_OPTIMIZER_BYTES * opt / 12
        opt = 0.0
    return {"n_params": p.total, "params": BF16 * p.total, "grads": FP32 * p.total,
            "optimizer": opt, "optimizer_plain": opt_plain, "optimizer_distributed": opt_dist,
            "optimizer_host": host, "optimizer_host_pinned": OFFLOADED_PINNED_BYTES * host /
            OFFLOADED_OPTIMIZER_BYTES}
