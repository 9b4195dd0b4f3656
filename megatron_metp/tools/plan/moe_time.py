"""MoE in the step time (:mod:`.step_time`): the token dispatch, the expert GEMMs at a rate for
their shape, the router and the shared expert, on the busiest rank of the expert-parallel group
(issue 42, deliver 5). Stock Megatron's layouts and METP's are timed by the same formulas.

**Tokens.** ``N`` tokens enter a rank's MoE layer (METP: ``s/(p·c)``; stock: ``s/(t·c)``, the
sequence-parallel shard), each
routed to ``k`` experts. Routing imbalance ``ι`` (``--moe-imbalance``, default 1: balanced, as
the memory plan and ``metp measure``'s balanced routing assume; printed with the plan): the
busiest EP rank runs ``r = N·k·ι`` routed rows, spread evenly over its ``E/EP`` experts.

**Dispatch bytes per rank per layer** (:func:`dispatch_bytes`; ring convention of
:mod:`.traffic`, the balanced splits that ``metp measure`` counts: an all-to-all sends the
``(ep−1)/ep`` of its input meant for the other ranks; an all-gather or reduce-scatter whose
full tensor is ``X`` sends ``(ep−1)/ep·X``), probabilities in the router's dtype (bf16,
``moe_router_dtype`` unset):

* ``alltoall``: forward, the dispatch of the permuted rows ``[N·k, h]`` and their
  probabilities ``[N·k]`` and the combine of ``[N·k, h]``: ``(ep−1)/ep·N·k·(4h + 2)`` bytes;
  backward the same again (each all-to-all's gradient is an all-to-all back);
* ``allgather``: forward, the gathered routing map ``[N·ep, E]`` (bool), probabilities
  ``[N·ep, E]`` and tokens ``[N·ep, h]``, and the combine's reduce-scatter of ``[N·ep, h]``:
  ``(ep−1)·N·(3E + 4h)``; backward the tokens' and probabilities' reduce-scatter and the
  combine's all-gather: ``(ep−1)·N·(2E + 4h)``.

A forward pass runs once per MoE layer, again in a full recompute of the layer, and once more
in the backward of METP's MoE token tiles when there are several (each tile re-runs its
dispatch, experts and combine with autograd, :mod:`megatron_metp.megatron.moe_tiles`).

**The link** (:func:`ep_link`): an EP group is ``ep`` consecutive ranks (METP: ``e`` adjacent
METP groups of ``p``, TP 1; stock: Megatron's expert rank order with expert TP 1). Inside one
node it runs over NVLink (:attr:`.hardware.Hardware.link_gbps`); across nodes an all-to-all
sends ``(ep − g)/ep`` of its rows over the inter-node link (``g`` the group's ranks on a node)
and the rest over NVLink, at once, so it lasts the longer of the two; a ring all-gather or
reduce-scatter lasts as long as its inter-node hop (every step has one).

**Exposed.** Megatron's dispatchers run their collectives in the layer's path (the experts
wait for the dispatch, the next layer for the combine): the whole transfer is exposed, for
stock and METP alike. Stock Megatron hides it only with ``--overlap-moe-expert-parallel-comm``
(one micro-batch's all-to-all behind another's compute in combined 1F1B), which METP refuses
(:mod:`megatron_metp.megatron.moe_checks`) and the plan does not plan for either family.
Routing imbalance slows the busiest rank's receive: its dispatch time is scaled by ``ι``.

**Expert GEMMs** (:func:`expert_gemm_s`): per expert and pass, ``fc1 [m, h]·[h, k′f′]`` and
``fc2 [m, f′]·[f′, h]`` (``k′ = 2`` with SwiGLU, ``m`` the expert's rows); the backward their
input gradients (same shapes) and weight gradients (``[h, m]·[m, k′f′]``, ``[f′, m]·[m, h]``).
The rate for a shape comes from the same published table (:mod:`.rates`' dense bf16 GEMM rate
``R``, 708 TFLOP/s on H100 / H200) by NVIDIA's GEMM performance model (*Matrix Multiplication
Background User's Guide*, DU-09799-001, §2.3 and §3: tile and wave quantization): the output
is cut into ``128 × 128`` tiles (:data:`TILE`, a tile size cuBLAS uses), the GPU's SMs
(datasheet) work through them in waves, and each wave costs what a full wave costs at ``R``:
``waves·2·TILE²·K·SMs/R``; a GEMM is at least as long as reading and writing its operands at
the memory bandwidth (datasheet, :attr:`.hardware.Hardware.hbm_gbps`). Megatron's default
``SequentialMLP`` runs each expert's GEMM apart (each pays its own partial last wave);
``--moe-grouped-gemm`` runs every local expert's GEMM of a step as one kernel (one wave
schedule over all their tiles). For large shapes both reach ``2·M·N·K/R``; the launch cost of
``SequentialMLP``'s many small kernels and the permutation / activation passes (memory-bound,
``O(r·(h + f′))`` bytes) are not timed: the expert time is a lower bound, sequential more so.

**Router and shared expert**: the router's ``2·N·h·E`` FLOPs per forward, the shared expert a
dense MLP of ``F_s`` (METP's MLP under METP, TP-sharded under stock), both at ``R`` with the
layer's other GEMMs (:func:`moe_layer_flops`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Tuple

from .hardware import HARDWARE
from .internode import GPUS_PER_NODE
from .model import BF16, Job, Model
from .moe import expert_ffn, expert_parallel, stage_layers, tile_count

#: output tile of the GEMM model (rows × columns; NVIDIA's GEMM guide, §2.3)
TILE = 128
#: bytes of one routing probability (the router's dtype: bf16, ``moe_router_dtype`` unset)
PROB = BF16


def ep_link(job: Job, ep: int, gpus_per_node: int = GPUS_PER_NODE) -> Dict[str, float]:
    """The link an EP group of ``ep`` consecutive ranks spans: ``crosses`` (0/1: some group
    spans two nodes), ``on_node`` (the group's ranks on one node), ``nvlink_gbps``,
    ``internode_gbps``."""
    hw = HARDWARE[job.hardware]
    crosses = ep > gpus_per_node or (ep > 1 and gpus_per_node % ep != 0)
    return {"crosses": int(crosses), "on_node": min(ep, gpus_per_node) if not crosses else
            math.gcd(ep, gpus_per_node), "nvlink_gbps": hw.link_gbps,
            "internode_gbps": hw.internode_gbps}


def dispatch_bytes(model: Model, dispatcher: str, ep: int, N: int) -> Dict[str, float]:
    """Bytes one rank sends per MoE layer for ``N`` tokens over ``ep`` ranks (module
    docstring): ``{"forward": ..., "backward": ...}`` of one forward pass and the backward."""
    if ep <= 1:
        return {"forward": 0.0, "backward": 0.0}
    h, E, k = model.hidden, model.experts, model.topk
    if dispatcher == "alltoall":
        one = (ep - 1) / ep * N * k * (2 * BF16 * h + PROB)
        return {"forward": one, "backward": one}
    if dispatcher == "allgather":
        return {"forward": (ep - 1) * N * (E * (1 + PROB) + 2 * BF16 * h),
                "backward": (ep - 1) * N * (E * PROB + 2 * BF16 * h)}
    raise ValueError(f"--moe-token-dispatcher-type {dispatcher!r}: allgather or alltoall")


def dispatch_s(nbytes: float, dispatcher: str, ep: int, link: Dict[str, float]) -> float:
    """Seconds to send ``nbytes`` (one rank's, :func:`dispatch_bytes`) over the EP group's link
    (module docstring)."""
    if nbytes <= 0:
        return 0.0
    nv, ib = link["nvlink_gbps"] * 1e9, link["internode_gbps"] * 1e9
    if not link["crosses"]:
        return nbytes / nv
    if dispatcher == "alltoall":  # to the other nodes' ranks over the inter-node link
        g = link["on_node"]
        off = (ep - g) / (ep - 1)  # of the bytes sent to the other ep − 1 ranks
        return max(nbytes * off / ib, nbytes * (1 - off) / nv)
    return nbytes / ib  # a ring: every step has its inter-node hop


def gemm_s(M: int, N: int, K: int, count: int, grouped: bool, rate_tflops: float,
           hbm_gbps: float, sms: int) -> float:
    """Seconds for ``count`` GEMMs ``[M, K]·[K, N]`` (bf16) run one after another, or as one
    grouped kernel: ``max(waves·2·TILE²·K·sms/R, bytes/bandwidth)`` (module docstring)."""
    if count <= 0 or M <= 0:
        return 0.0
    tiles = math.ceil(M / TILE) * math.ceil(N / TILE)
    wave = 2 * TILE * TILE * K * sms / (rate_tflops * 1e12)
    nbytes = BF16 * (M * K + K * N + M * N)
    if grouped:
        return max(math.ceil(count * tiles / sms) * wave, count * nbytes / (hbm_gbps * 1e9))
    return count * max(math.ceil(tiles / sms) * wave, nbytes / (hbm_gbps * 1e9))


def expert_gemm_s(model: Model, job: Job, rows: float, local: int, rate_tflops: float
                  ) -> Dict[str, float]:
    """``{"forward": s, "backward": s}`` of one pass of ``rows`` routed rows through ``local``
    experts (each ``rows/local`` rows, rounded up) on one rank (module docstring)."""
    hw = HARDWARE[job.hardware]
    h, f = model.hidden, expert_ffn(model)
    kf = (2 if model.swiglu else 1) * f
    m = math.ceil(rows / local) if rows > 0 else 0

    def g(M, N, K):
        return gemm_s(M, N, K, local, job.moe_grouped_gemm, rate_tflops, hw.hbm_gbps, hw.sms)

    fwd = g(m, kf, h) + g(m, h, f)
    bwd = g(m, f, h) + g(m, h, kf) + g(h, f, m) + g(kf, h, m)
    return {"forward": fwd, "backward": bwd}


def moe_layer_flops(model: Model, job: Job, mode: str) -> Dict[str, float]:
    """:func:`.flops.layer_flops` of a MoE layer without its routed experts: attention, the
    shared expert (a dense MLP of ``F_s``; none: no MLP) and the router's ``2·N·h·E`` (forward;
    backward twice that)."""
    from .flops import layer_flops
    from .model import canonical, layout

    m_, j_ = canonical(mode, job)
    n = model.seq * job.micro_batch // layout(m_, j_).c
    f = dict(layer_flops(replace(model, ffn=model.moe_shared_ffn), job, mode))
    router = 2 * n * model.hidden * model.experts
    f["forward"] += router
    f["backward"] += 2 * router
    return f


def moe_time(model: Model, job: Job, mode: str, lay, rate_tflops: float,
             recomputed: int) -> Dict:
    """The MoE share of one micro-batch on the busiest EP rank of the first stage:
    ``experts_s`` (expert GEMMs, every pass), ``dispatch_s`` (exposed), ``forward_s`` (one
    MoE layer's forward: experts and dispatch, for the offload's overlap), and what they
    rest on (``ep``, ``link``, ``tiles``, ``rows``, ``dispatch_bytes`` per layer and pass,
    ``forward_passes``). ``recomputed``: the stage's layers under full recompute."""
    n_moe, n_dense = stage_layers(model, job.pp, "first")
    L = n_moe + n_dense
    ep = expert_parallel(job, lay)
    N = model.seq * job.micro_batch // lay.c
    N = N // lay.t if lay.sp else N  # stock TP+SP: the sequence-parallel shard
    T = tile_count(model, job, lay, N)
    link = ep_link(job, ep)
    local = max(1, model.experts // ep)
    imb = job.moe_imbalance
    # the tiles: T − 1 of ceil(N/T) tokens and the last one shorter
    full = -(-N // T)
    sizes = [(full, T - 1), (N - full * (T - 1), 1)] if T > 1 else [(N, 1)]
    fwd = bwd = d_fwd = d_bwd = 0.0
    b = {"forward": 0.0, "backward": 0.0}
    for tokens, count in sizes:
        if tokens <= 0:
            continue
        e = expert_gemm_s(model, job, tokens * model.topk * imb, local, rate_tflops)
        by = dispatch_bytes(model, job.moe_dispatcher, ep, tokens)
        fwd += count * e["forward"]
        bwd += count * e["backward"]
        d_fwd += count * imb * dispatch_s(by["forward"], job.moe_dispatcher, ep, link)
        d_bwd += count * imb * dispatch_s(by["backward"], job.moe_dispatcher, ep, link)
        b = {k: b[k] + count * by[k] for k in b}
    # forward passes of a MoE layer: the forward, a full recompute's, METP's tile re-run
    rec = recomputed * n_moe / L if L else 0.0
    passes = n_moe + rec + (n_moe if T > 1 else 0)
    return {"experts_s": passes * fwd + n_moe * bwd,
            "dispatch_s": passes * d_fwd + n_moe * d_bwd,
            "forward_s": fwd + d_fwd, "ep": ep, "link": link, "tiles": T,
            "rows": N * model.topk * imb, "rows_per_expert": N * model.topk * imb / local,
            "dispatch_bytes": b, "forward_passes": passes, "moe_layers": n_moe,
            "imbalance": imb, "grouped": job.moe_grouped_gemm,
            "dispatcher": job.moe_dispatcher,
            "sent": passes * b["forward"] + n_moe * b["backward"]}


def describe(t: Dict) -> str:
    """One line for the plan: the MoE time's figures and assumptions."""
    link = t["link"]
    where = ("no link (nothing dispatched)" if t["ep"] == 1 else
             "NVLink (inside a node)" if not link["crosses"] else
             f"the inter-node link ({link['internode_gbps']:g} GB/s per GPU; "
             f"{link['on_node']} of the group's ranks per node)")
    return (f"MoE time: EP {t['ep']} over {where}; {t['dispatcher']} dispatch "
            f"{t['dispatch_bytes']['forward'] / 2**20:,.1f} MiB per rank per layer forward, "
            f"{t['dispatch_bytes']['backward'] / 2**20:,.1f} MiB backward, "
            f"{t['forward_passes'] / max(1, t['moe_layers']):.2f} forward passes per layer, "
            f"exposed (Megatron's dispatchers run in the layer's path): "
            f"{t['dispatch_s']:,.3f} s; expert GEMMs "
            f"({'grouped' if t['grouped'] else 'sequential'}, {t['rows_per_expert']:,.0f} "
            f"rows per expert per micro-batch, {t['tiles']} tile(s)) {t['experts_s']:,.3f} s "
            f"on the busiest rank; routing imbalance {t['imbalance']:g}× "
            f"(--moe-imbalance; 1 = balanced)")


__all__ = ["PROB", "TILE", "describe", "dispatch_bytes", "dispatch_s", "ep_link",
           "expert_gemm_s", "gemm_s", "moe_layer_flops", "moe_time"]
