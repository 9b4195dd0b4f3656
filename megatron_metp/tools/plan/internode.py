"""The K/V hop that crosses nodes: a K/V ring longer than a node (METP × CP, or stock context
parallelism over several nodes) has, per ring step, some hops on the inter-node link instead of
NVLink; every rank sends at once, so the step lasts as long as its slowest hop.

Megatron's default rank order is tp-cp-ep-dp-pp (TP innermost): the ``c`` members of a
context-parallel group (``c = METP × CP`` for METP, the CP size for stock CP) are ``t`` ranks
apart and span ``t·c`` consecutive ranks, ``gpus_per_node`` of them per node. A ring over them
crosses a node boundary ``nodes`` times (the wrap-around included) when it spans more than one
node; the METP group (its first ``p`` members, ``t·p`` consecutive ranks) must stay in one node
(the weight ring and the head-group broadcasts run over NVLink).

Per ring step one head group's K/V block of this rank's ``n`` tokens travels each hop (forward:
``2·n·b·(g/(t·p))·d`` bf16; backward: the block again and its fp32 dK/dV sum, 3×). The step's
attention on that block is ``2·n²·b·d·a_g`` FLOPs (a causal off-diagonal block is half full, see
:func:`.overlap.overlap_thresholds`), so the inter-node hop is hidden while
``n ≥ 2·(F/B_node)·g/a`` (forward; backward ×1.2), ``B_node`` the inter-node link per GPU and
direction (:attr:`.hardware.Hardware.internode_gbps`). Multi-latent attention (:mod:`.mla`): the
block carries ``V`` values per token (METP's latent ``C``, stock's ``A/t·(dq+dv)``) against
``n²·a_g·(dq+dv)`` FLOPs: hidden while ``n ≥ 2·(F/B_node)·V/(a_g·(dq+dv))``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

from .hardware import HARDWARE
from .model import BF16, Job, Model, canonical, layout
from .traffic import traffic_per_layer

#: GPUs per node (one HGX / DGX node)
GPUS_PER_NODE = 8


def internode_hop(model: Model, job: Job, mode: str, seq: Optional[int] = None,
                  gpus_per_node: int = GPUS_PER_NODE) -> Optional[Dict[str, float]]:
    """The inter-node hop of the mode's K/V ring, or None when the mode has no K/V ring.

    Keys: ``ring`` (members), ``span`` (consecutive ranks), ``nodes``, ``crosses`` (0/1),
    ``crossing_hops`` (hops of one ring on the inter-node link), ``metp_group_crosses`` (0/1),
    ``block_bytes`` (one forward step's K/V block), ``bytes_per_layer`` (what the crossing hop
    carries per layer, forward + backward), ``tokens_per_rank`` (``n``), ``threshold_forward`` /
    ``threshold_backward`` (tokens per rank above which the inter-node hop is hidden),
    ``step_transfer_s`` / ``step_compute_s`` (one forward step at the datasheet rates) and
    ``hidden`` (0/1, the forward step at this ``n``)."""
    mode, job = canonical(mode, job)
    if mode not in ("metp", "cp", "ring"):
        return None
    lay = layout(mode, job)
    R = lay.c
    if R <= 1:
        return None
    hw = HARDWARE[job.hardware]
    s = model.seq if seq is None else int(seq)
    b = job.micro_batch
    n = s * b // R
    d = model.head_dim
    span = lay.t * R
    nodes = math.ceil(span / gpus_per_node)
    crosses = nodes > 1
    sh = lay.t * (lay.p if mode == "metp" else 1)  # the K/V heads of one block: g/(t·p) or g/t
    g_blk, a_blk = model.groups // sh, model.heads // sh
    block = 2 * n * g_blk * d * BF16
    kv = {k: v for k, v in traffic_per_layer(model, job, mode, s).items() if "K/V" in k}
    per_layer = sum(kv.values())
    fb = hw.bf16_tflops * 1e12 / (hw.internode_gbps * 1e9)
    ratio = model.groups / model.heads
    thr_f = 2 * fb * ratio
    flops = 2 * n * n * d * a_blk / b if b else 0.0  # one block's QKᵀ and P·V, half causal
    if model.mla:  # (.mla) the block is the latent (METP) or every head's K/V (stock)
        from .mla import ring_values_per_token_step

        values, width = ring_values_per_token_step(model, mode, lay.t), \
            model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim
        block = n * values * BF16
        ratio = values / (a_blk * width)
        thr_f = 2 * fb * ratio
        flops = n * n * width * a_blk / b if b else 0.0
    transfer = block / (hw.internode_gbps * 1e9)
    compute = flops / (hw.bf16_tflops * 1e12)
    return {"ring": R, "span": span, "nodes": nodes, "crosses": int(crosses),
            "crossing_hops": nodes if crosses else 0,
            "metp_group_crosses": int(mode == "metp" and lay.t * lay.p > gpus_per_node),
            "block_bytes": block, "bytes_per_layer": per_layer if crosses else 0.0,
            "tokens_per_rank": n, "threshold_forward": thr_f,
            "threshold_backward": thr_f * 3 / 2.5, "internode_gbps": hw.internode_gbps,
            "step_transfer_s": transfer, "step_compute_s": compute,
            "hidden": int(n >= thr_f)}
