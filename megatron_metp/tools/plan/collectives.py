"""Time of the collectives Megatron runs outside the rings the other components price: the
tensor-parallel all-gathers / reduce-scatters (all-reduces without sequence parallelism) of
every layer, and the data-parallel gradient reduce-scatter and parameter all-gather of each
iteration (the distributed optimizer). :mod:`.step_time` adds them as ``tp_exposed`` (per
micro-batch) and ``grad_sync_exposed`` (per iteration, like the optimizer step).

Tensor parallelism, ``t > 1``, one layer and micro-batch on a rank whose CP shard has ``n``
tokens; one collective moves ``(t − 1)/t · n·h`` bf16 elements per rank (ring convention, as
:func:`.traffic.traffic_per_layer` counts them) over NVLink (a TP group stays inside a node):

* with sequence parallelism (stock TP+SP), Megatron's default schedule (no ``--tp-comm-overlap``):
  the forward's two all-gathers (before the QKV and FC1 GEMMs) and two reduce-scatters (after
  the output projection and FC2) wait for their GEMM: exposed; so do those of a recomputed
  layer's forward. In the backward the gradient arriving at the output projection and at FC2 is
  all-gathered before their input-gradient GEMM (exposed); the QKV and FC1 backwards gather
  their input again for the weight gradient while the input-gradient GEMM runs, and
  reduce-scatter the input gradient while the weight-gradient GEMM runs (Megatron's and
  Transformer Engine's asynchronous backward): exposed only past that GEMM;
* without it (TP inside METP: Megatron's ``copy_to`` / ``reduce_from`` regions around the METP
  ops): one all-reduce after the attention and one after the MLP in the forward, one each for
  the input gradient in the backward, again in a recomputed forward; all-reduces move twice an
  all-gather's bytes; all exposed;
* a MoE layer's experts take their tokens by the dispatch (:mod:`.moe_time`), not by TP
  collectives: only the attention half is counted there.

``--tp-comm-overlap`` (Transformer Engine's userbuffers, which hide most of the forward's
collectives behind chunked GEMMs and pin buffers of their own) is not planned: the plan runs
what its launch line sets.

Data parallelism, once per iteration: the distributed optimizer reduce-scatters the fp32
gradient buffer (bf16 training accumulates and reduces gradients in fp32, Megatron-LM's
default) and all-gathers the bf16 parameters after the step: ``(g − 1)/g · P · (4 + 2)`` bytes
per rank for the ``P`` parameters a rank holds that reduce over a group of ``g`` (without the
distributed optimizer one fp32 all-reduce, ``2(g − 1)/g · P · 4``). Megatron's default runs them
after the last backward (no ``--overlap-grad-reduce``): exposed. ``--overlap-grad-reduce
--overlap-param-gather`` (which work with METP: ``megatron/param_gather.py``) would hide most of
them behind the backward and the next forward; the plan does not set them. The group's ring
crosses the inter-node link when a pipeline stage spans more ranks than a node has.
"""

from __future__ import annotations

from typing import Dict

from .hardware import HARDWARE
from .internode import GPUS_PER_NODE
from .model import BF16, FP32, Job, Model
from .parameters import params


def tp_exposed_s(model: Model, job: Job, lay, n: int, recomputed: int, moe_layers: int,
                 rate_gemm: float) -> float:
    """Exposed seconds of one micro-batch's TP collectives on a rank (module docstring):
    ``n`` tokens of the rank's CP shard (the micro-batch's sequences), ``recomputed`` layers whose forward runs again,
    ``moe_layers`` of the stage's layers MoE, ``rate_gemm`` FLOP/s."""
    t = lay.t
    if t <= 1:
        return 0.0
    hw = HARDWARE[job.hardware]
    L = model.layers // job.pp
    h, d = model.hidden, model.head_dim
    hq, hk = model.heads * d // t, model.groups * d // t
    k = 2 if model.swiglu else 1
    F = model.ffn // t
    one = (t - 1) / t * n * h * BF16 / (hw.link_gbps * 1e9)
    if not lay.sp:  # all-reduces: 2 forward, 2 backward, 2 per recomputed forward
        halves = lambda layers, moe: 2 * layers - moe  # noqa: E731  (attention + dense MLP)
        return 2 * one * (2 * halves(L, moe_layers) +
                          halves(recomputed, min(moe_layers, recomputed)))
    # sequence parallelism: per half (attention, MLP) 2 exposed in each forward, 1 in the
    # backward, and the input gather / gradient scatter of the first GEMM behind its backward
    # GEMMs (input gradient, weight gradient: the same FLOPs)
    qkv = 2 * n * h * (hq + 2 * hk) / rate_gemm
    fc1 = 2 * n * h * k * F / rate_gemm
    attn = 3 * one + 2 * max(0.0, one - qkv)
    mlp = 3 * one + 2 * max(0.0, one - fc1)
    dense = L - moe_layers
    rec_moe = min(moe_layers, recomputed)
    return L * attn + dense * mlp + 2 * one * (recomputed + (recomputed - rec_moe))


def grad_sync_s(model: Model, job: Job, mode: str) -> float:
    """Exposed seconds of one iteration's data-parallel gradient reduction and parameter
    gather on a rank (module docstring), from :func:`.parameters.params`' groups."""
    per = FP32 + BF16 if job.distributed_optimizer else 2 * FP32
    nbytes = sum((g - 1) / g * P * per for P, g in params(model, job, mode).reduce_groups()
                 if g > 1)
    if not nbytes:
        return 0.0
    hw = HARDWARE[job.hardware]
    stage_ranks = job.tp * job.metp * job.cp * job.dp
    link = hw.internode_gbps if stage_ranks > GPUS_PER_NODE else hw.link_gbps
    return nbytes / (link * 1e9)


def collective_components(model: Model, job: Job, mode: str, lay, n: int, recomputed: int,
                          moe_layers: int, rate_gemm: float) -> Dict[str, float]:
    """``{"tp_exposed": per micro-batch, "grad_sync_exposed": per iteration}`` seconds."""
    return {"tp_exposed": tp_exposed_s(model, job, lay, n, recomputed, moe_layers, rate_gemm),
            "grad_sync_exposed": grad_sync_s(model, job, mode)}
