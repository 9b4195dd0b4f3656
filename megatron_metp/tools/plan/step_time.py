"""Time of one micro-batch on rank 0, by component, from published kernel rates (:mod:`.rates`),
the ring's per-step imbalance from the op's own tile plan (:mod:`.imbalance`), the host link
(:mod:`.host_link`) and the streaming layer's passes (:mod:`.streaming`).

Per layer and rank (``n`` tokens through the rank, ``s`` the sequence, ``t`` TP, ``q = a·d``):

* attention forward ``F_a = 2·n·s·q/t`` FLOPs (causal: half of ``4·n·s·q/t``) at the kernel's
  forward rate × the ring's forward imbalance; its backward ``2.5·F_a`` at the backward rate ×
  the backward imbalance; the recompute (full recompute, or the streaming layer's attention
  re-run, or ``--recompute selective``'s core attention) ``F_a`` again, but not in a layer
  that keeps its attention output (:mod:`.keep`);
* GEMMs (projections, MLP; METP's per-shard re-forming; recompute's share) at the GEMM rate
  (:func:`.flops.layer_flops`);
* output layer and loss ``2·n·h·V/t`` forward, twice that backward, once more where the loss
  re-forms its logits in the backward (the METP vocabulary ring's loss);
* host copies: the streaming layer, pass by pass (:func:`streaming_passes`): a pass that reads
  the host-resident layer input with little compute is copy-bound, its excess over its compute
  exposed; the activation offload of a layer outside the streaming path: its saved tensors go
  to the host during the forward and come back during the backward, one direction at a time, so
  the write's excess over one layer's forward compute and the read's over one layer's backward
  (with its recompute) are exposed (a layer that saves more than its forward computes is
  copy-bound there: stock TP+SP at 128K writes 4.7 GiB per layer and rank, 93 ms at 54.4 GB/s,
  against 77 ms of forward); all of it exposed without prefetch;
* ring: the backward's last hop (the travelling fp32 ``dK/dV`` sums going home with no block left
  to compute: pure transfer) per head group, query tile; the steps of the op's plan where no
  rank has work (pure transfer); a ring that crosses nodes: the excess of
  each step's inter-node transfer over its compute (:func:`.internode.internode_hop`);
* MoE (:mod:`.moe_time`): a MoE layer's GEMMs are its attention's, its router's and its shared
  expert's; the routed experts' GEMMs at a rate for their shape and the token dispatch (exposed)
  on the busiest expert-parallel rank are components of their own (``moe_experts``,
  ``moe_dispatch_exposed``);
* TP collectives (``tp_exposed``) and, once per iteration, the data-parallel gradient
  reduce-scatter and parameter all-gather (``grad_sync_exposed``), as Megatron's default
  schedule exposes them (:mod:`.collectives`);
* the optimizer step (:func:`.optimizer_time.optimizer_s`), once per iteration.

``step_s`` = the sum of the components but the per-iteration ones (:data:`PER_ITERATION`);
``iteration_s = (m + pp − 1)·step_s + optimizer + grad sync`` for ``m`` micro-batches per
iteration under 1F1B.
"""

from __future__ import annotations

from typing import Dict, List

from . import mla
from .collectives import collective_components
from .hardware import HARDWARE
from .host_link import host_link
from .imbalance import ring_imbalance
from .internode import GPUS_PER_NODE
from .model import BF16, FP32, Job, Model, canonical, layout, padded_vocab
from .optimizer_time import optimizer_s
from .rates import ATTENTION_BWD_FLOP_RATIO, Rates, resolve_rates

#: components that run once per iteration, not once per micro-batch
PER_ITERATION = ("optimizer", "grad_sync_exposed")


def job_rates(job: Job) -> Rates:
    """The rates of ``job``: ``--rates FILE``, else ``--kernel NAME``'s published figures, else
    the default kernel's (the memory kernel ``unfused`` plans the unfused rates)."""
    kernel = job.attention_kernel or ("unfused" if job.kernel == "unfused" and not job.rates_file
                                      else None)
    return resolve_rates(job.hardware, kernel, job.rates_file)


def streaming_passes(model: Model, job: Job, lay, n: int, rates: Rates,
                     attn_fwd: float, attn_bwd: float, kept: bool = False
                     ) -> List[Dict[str, float]]:
    """The streaming layer's passes of one offloaded layer (rank 0), each ``{"pass", "count",
    "bytes", "copy_s", "compute_s", "exposed_s", "x_reads"}`` per occurrence (``count``
    occurrences per layer; ``x_reads``: the reads of the layer input among its bytes): host
    bytes (:func:`.streaming.streaming_host_bytes`' accounting, pass by pass: the input ``x``
    read by the passes :func:`megatron_metp.ops.layer_reads.host_reads` counts, the kept q
    projections instead of ``x`` where the backward forms q) at the host link's rate
    against the pass's compute (GEMMs at the GEMM rate; the attention's seconds); ``attn_fwd`` /
    ``attn_bwd`` the layer's attention seconds (forward, backward), split evenly over the head
    groups. A pass is copy-bound when its copies take longer than its compute (the next chunk's
    copy starts while one computes).

    The passes are the op's (:mod:`megatron_metp.ops.layer_reads`): K/V of head group
    ``g + 1`` are formed in group ``g``'s query-tile pass (the recompute's and the backward's),
    ``d(kv)`` of group ``g`` is reduced (``dWk/dWv``, its rows to the host for ``dx``) in group
    ``g + 1``'s backward pass, the last group's in ``dx``'s; a per-group figure of the ``p − 1``
    groups that have a previous / next group is averaged over the ``p`` occurrences.

    ``kept``: a layer that keeps its attention output and log-sum-exp (``keep_attention``,
    ``--metp-keep-attention-output``): no recompute passes; the forward writes every group's
    fp32 log-sum-exp to the host too, the MLP backward forms group 0's K/V, each group's
    backward forms its q from ``x`` (a second read of ``x``) and reads its log-sum-exp back."""
    p = lay.p
    h, d = model.hidden, model.head_dim
    hq, hk = model.heads * d // lay.t, model.groups * d // lay.t
    k = 2 if model.swiglu else 1
    F = model.ffn // lay.t
    x, O = BF16 * n * h, BF16 * n * hq
    g = rates.gemm_tflops * 1e12
    gb = host_link(job.hardware)["gbs"] * 1e9
    mlp = 2 * n * (k * h * F + F * h)
    Pq, Pkv = 2 * n * h * hq, 2 * n * h * 2 * hk  # projections of every group (FLOPs)
    kq, kkv = BF16 * n * hq, BF16 * n * 2 * hk    # the q projections kept, d(kv) (bytes)
    lse = FP32 * n * model.heads // lay.t if kept else 0  # every group's log-sum-exp
    edge = (p - 1) / p  # the groups with a previous (d(kv) reduced) / next (K/V formed) group
    fwd = [
        ("forward: attention (per head group)", p, (O + lse) / p,
         attn_fwd / p + (Pq + Pkv) / p / g),
        ("forward: rows (Wo, MLP; x to the host)", 1, x + O, (2 * n * hq * h + mlp) / g),
    ]
    mlp_bwd = (3 * 2 * n * hq * h + 2 * mlp + 2 * n * k * h * F) / g
    if kept:
        rows = fwd + [
            ("backward: MLP rows (h1, MLP backward) + K/V[0]", 1, x + O,
             mlp_bwd + Pkv / p / g),
            ("backward: q (from x), dWq, d(kv)[g-1], K/V[g+1]", p,
             2 * x + (O + lse) / p + kq / p + edge * kkv / p,
             attn_bwd / p + (3 * Pq + 2 * edge * Pkv) / p / g),
        ]
    else:
        rows = fwd + [
            ("recompute: K/V of group 0 (before the first ring)", 1, x, Pkv / p / g),
            ("recompute: query tiles, q kept, K/V[g+1] (per group)", p,
             x + O / p + kq / p, attn_fwd / p + (Pq + Pkv) / p / g),
            ("backward: MLP rows (re-form h1, MLP backward)", 1, x + O, mlp_bwd),
            ("backward: dWq tiles, d(kv)[g-1], K/V[g+1] (per group)", p,
             x + 2 * kq / p + O / p + edge * kkv / p,
             attn_bwd / p + (2 * Pq + 2 * edge * Pkv) / p / g),
        ]
    rows.append(("backward: dx (d(qkv)·Wqkv, norm1) + last d(kv)", 1,
                 x + kq + edge * kkv, (2 * n * (hq + 2 * hk) * h + Pkv / p) / g))
    out = []
    for name, count, nbytes, comp in rows:
        copy = nbytes / gb
        reads = 0 if name.startswith("forward") else \
            (2 if name.startswith("backward: q (") else 1)
        out.append({"pass": name, "count": count, "bytes": nbytes, "copy_s": copy,
                    "compute_s": comp, "exposed_s": max(0.0, copy - comp), "x_reads": reads})
    return out


def _attention_flops(model: Model, lay, n: int) -> float:
    """One layer's causal attention forward on a rank: ``2·n·s·q/t`` (half of ``4·n·s·q/t``);
    multi-latent attention: ``n·s·A·(dq + dv)/t`` (:mod:`.mla`)."""
    if model.mla:
        return mla.layer_flops(model, n, model.seq, lay.t)["core"]
    return 2 * n * model.seq * model.heads * model.head_dim / lay.t


def step_time(model: Model, job: Job, mode: str) -> Dict:
    """Components (seconds) of one micro-batch on rank 0 and of the iteration's optimizer step;
    the rates assumed, the ring's imbalance, the streaming layer's passes. See the module
    docstring. Mode ``alst``: :func:`.alst_time.alst_time`."""
    from .flops import layer_flops
    from .internode import internode_hop
    from .parameters import static_memory
    from .rank_memory import memory
    from .streaming import layer_tiles, streaming_applies

    mode, job = canonical(mode, job)
    if mode == "alst":
        from .alst_time import alst_time
        return alst_time(model, job)
    rates = job_rates(job)
    hw = HARDWARE[job.hardware]
    lay = layout(mode, job)
    L = model.layers // job.pp
    b = job.micro_batch
    n = model.seq * b // lay.c
    h, d = model.hidden, model.head_dim
    hk = model.groups * d // lay.t
    # (a MoE model's layers run Megatron's checkpoint, not the streaming layer op: .moe; nor do
    # MLA layers: megatron/mla.py)
    streaming = (mode == "metp" and not model.moe and not model.mla
                 and streaming_applies(job, lay, mode))
    # the ring and its imbalance: METP's query tiles (whole blocks without the streaming
    # layer); stock CP / ring: whole dual-chunk blocks (balanced)
    groups, tl = 1, None
    imb = {"forward": 1.0, "backward": 1.0, "q_tiles": 1, "kv_blocks": 1,
           "empty_steps_forward": 0, "empty_steps_backward": 0}
    if mode == "metp":
        groups = lay.p
        if streaming:
            tl = layer_tiles(model, job, lay, n)
            imb = ring_imbalance(n // b, lay.c, tl.q, tl.kv)
        else:
            imb = ring_imbalance(n // b, lay.c, n // b, n // b)
    elif mode in ("cp", "ring"):
        imb = ring_imbalance(n // b, lay.c, n // b, n // b)
    if model.mla:  # (.mla) a ring block's values per token (2·hk/groups): latent or K/V
        hk = mla.ring_values_per_token_step(model, mode, lay.t) * groups / 2
    fa = _attention_flops(model, lay, n)
    rf, rb, rg = (rates.attention_fwd_tflops * 1e12, rates.attention_bwd_tflops * 1e12,
                  rates.gemm_tflops * 1e12)
    recomputed = 0
    if job.recompute == "full":
        recomputed = L if job.recompute_method == "uniform" else min(job.recompute_num_layers, L)
    mem = memory(model, job, mode)  # (kept attention and offload as resolved for this mode)
    act = mem.act
    kept, kept_host = act.kept_attention_layers, act.kept_attention_host_layers
    # selective: stock's core attention, METP's core_attn (its K/V ring forward re-run in
    # backward, megatron/selective.py); the Q/K/V it needs are re-formed there anyway
    attn_recomputed = recomputed - kept if job.recompute == "full" else (
        L if job.recompute == "selective" and mode in ("tp", "tp-sp", "cp", "ring", "metp")
        else 0)
    fl = layer_flops(model, job, mode)
    moe = None
    if model.moe:  # MoE layers: attention, router, shared expert here; the experts apart
        from .moe import stage_layers
        from .moe_time import moe_layer_flops, moe_time

        n_moe, n_dense = stage_layers(model, job.pp, "first")
        fm = moe_layer_flops(model, job, mode)
        fl = {k: (n_dense * fl[k] + n_moe * fm[k]) / L for k in fl}
        moe = moe_time(model, job, mode, lay, rates.gemm_tflops, recomputed)
    gemm_layer = fl["forward"] - fa            # projections + MLP, forward (a layer's mean)
    gemm = L * (3 * gemm_layer + fl["METP per-shard recompute"])
    # recompute: the streaming layer re-runs the attention's projections; else the layer
    gemm += recomputed * ((fl["attention forward"] - fa) if streaming else gemm_layer)
    V = padded_vocab(model.vocab, lay.vocab_pad)
    last = job.pp == 1
    loss_f = 2 * n * h * V / lay.t if last else 0.0
    loss = loss_f * (3 + (1 if lay.vocab else 0))  # the ring loss re-forms its logits
    comp = {
        "attention_fwd": L * fa * imb["forward"] / rf,
        "attention_recompute": attn_recomputed * fa * imb["forward"] / rf,
        "attention_bwd": L * ATTENTION_BWD_FLOP_RATIO * fa * imb["backward"] / rb,
        "gemm": gemm / rg,
        "loss": loss / rg,
    }
    if moe is not None:  # (.moe_time) the busiest EP rank
        comp["moe_experts"] = moe["experts_s"]
        comp["moe_dispatch_exposed"] = moe["dispatch_s"]
    # host copies
    passes: List[Dict[str, float]] = []
    kept_passes: List[Dict[str, float]] = []
    host_exposed = 0.0
    gb = host_link(job.hardware)["gbs"] * 1e9
    if streaming and act.offloaded_layers:
        fa_s = fa * imb["forward"] / rf
        fb_s = ATTENTION_BWD_FLOP_RATIO * fa * imb["backward"] / rb
        plain = act.offloaded_layers - kept_host  # offloaded layers that re-run attention
        if plain:
            passes = streaming_passes(model, job, lay, n, rates, fa_s, fb_s)
        if kept_host:
            kept_passes = streaming_passes(model, job, lay, n, rates, fa_s, fb_s,
                                           kept=True)
        host_exposed = plain * sum(x["count"] * x["exposed_s"] for x in passes) + \
            kept_host * sum(x["count"] * x["exposed_s"] for x in kept_passes)
    elif job.offload and act.host:
        # one direction per phase: a layer's saved tensors go out while the next layer runs its
        # forward and come back while the one after it in backward order runs its backward, so
        # each copy hides behind the compute of its own phase only (the loss hides neither)
        fwd_layer = comp["attention_fwd"] / L + gemm_layer / rg + \
            (moe["forward_s"] * moe["moe_layers"] / L if moe else 0.0)
        bwd_layer = (sum(comp.values()) - comp["loss"]) / L - fwd_layer
        copy = act.host / max(1, act.offloaded_layers) / gb
        host_exposed = act.offloaded_layers * (max(0.0, copy - fwd_layer) +
                                               max(0.0, copy - bwd_layer))
        if not job.offload_prefetch:  # every layer's copy back waits in its backward's path
            host_exposed += act.host / gb
    comp["host_copies_exposed"] = host_exposed
    # the ring: the backward's last hop carries the fp32 dK/dV sums home with nothing to compute
    ring_s = inter_s = 0.0
    if lay.c > 1 and mode in ("metp", "cp", "ring"):
        hop = internode_hop(model, job, "metp" if mode == "metp" else mode)
        crosses = bool(hop and hop["crosses"])
        link = (hw.internode_gbps if crosses else hw.link_gbps) * 1e9
        ring_s = L * groups * imb["q_tiles"] * 2 * n * (hk // groups) * FP32 / link
        # steps of the op's plan where no rank has work: the block travels with nothing to hide
        # it (forward and recompute: the K/V block; backward: a sub-block and its fp32 sums)
        kv_blk = 2 * n * (hk // groups) * BF16 / link
        ring_s += groups * ((L + attn_recomputed) * imb["empty_steps_forward"] * kv_blk +
                            L * imb["empty_steps_backward"] * 3 * kv_blk / imb["kv_blocks"])
        if crosses:
            # per ring step: one head group's K/V block on the inter-node hop against the step's
            # attention (forward ×2 with the recompute; backward 3× the bytes, 2.5× the FLOPs)
            steps = groups * imb["q_tiles"] * (lay.c - 1)
            blk = 2 * n * (hk // groups) * BF16 / (hw.internode_gbps * 1e9)
            f_step = fa / (groups * imb["q_tiles"] * lay.c) / rf
            b_step = ATTENTION_BWD_FLOP_RATIO * fa / (groups * imb["q_tiles"] * lay.c) / rb
            inter_s = steps * ((L + attn_recomputed) * max(0.0, blk - f_step)
                               + L * max(0.0, 3 * blk - b_step))
    comp["ring_exposed"] = ring_s
    comp["internode_exposed"] = inter_s
    coll = collective_components(model, job, mode, lay, n, recomputed,
                                 moe["moe_layers"] if moe else 0, rg)
    comp["tp_exposed"] = coll["tp_exposed"]
    st = static_memory(model, job, mode)
    n_opt = (st["optimizer_host"] / 16) if job.optimizer_offload else (
        st["optimizer"] / 12)
    ranks_node = min(GPUS_PER_NODE, job.tp * job.metp * job.cp * job.pp * job.dp)
    opt = optimizer_s(n_opt, job, ranks_node, job.optimizer_offload, job.hardware)
    step = sum(comp.values())
    comp["optimizer"] = opt
    comp["grad_sync_exposed"] = sync = coll["grad_sync_exposed"]
    m = job.microbatches or job.pp
    return {"components": comp, "step_s": step, "optimizer_s": opt, "grad_sync_s": sync,
            "iteration_s": (m + job.pp - 1) * step + opt + sync, "microbatches": m,
            "rates": {"attention_fwd_tflops": rates.attention_fwd_tflops,
                      "attention_bwd_tflops": rates.attention_bwd_tflops,
                      "gemm_tflops": rates.gemm_tflops, "kernel": rates.kernel,
                      "host_gbs": host_link(job.hardware)["gbs"], "source": rates.source,
                      "measured_at": rates.measured_at},
            "ring_imbalance": max(imb["forward"], imb["backward"]),
            "ring_imbalance_forward": imb["forward"], "ring_imbalance_backward": imb["backward"],
            "query_tiles": imb["q_tiles"], "kv_blocks": imb["kv_blocks"],
            "empty_ring_steps": imb["empty_steps_forward"] + imb["empty_steps_backward"],
            "host_passes": passes, "host_passes_kept": kept_passes,
            "kept_attention_layers": kept, "moe": moe}
