"""What recompute and offload cost: FLOPs, ring traffic and host↔device bytes of one rank per
micro-batch, and an estimated step time, next to the memory they save.

FLOPs per layer and rank (``n`` tokens through the rank's attention/MLP, ``t`` the TP size, ``W``
the layer's linear weights ``h·(q+2kv) + q·h + k·h·F + F·h``, ``q = a·d``):
* forward GEMMs ``2·n·W/t``; causal attention counted as half the score matrix:
  ``2·n·s·q/t`` (QKᵀ and P·V, each ``2·n·s·q/t`` over two);
* backward twice the forward; METP re-forms each shard's Q/K/V and MLP intermediate in its
  backward (``2·n·(h·(q+2kv) + k·h·F)/t`` more; not with ``--keep-intermediate``);
* full recompute: one more forward of every recomputed layer (rings included: the forward share
  of the layer's traffic is sent again).

Time (estimates, labelled so): compute at the device's measured bf16 matmul rate where the project
measured one (H200: 708 TFLOP/s), else 70 % of the datasheet's dense rate; the offload copies at
the host link's nominal rate, hidden behind a layer's compute when a layer's copy takes less.
"""

from __future__ import annotations

from typing import Dict

from .hardware import HARDWARE
from .model import Job, Model, canonical, layout, padded_vocab
from .rank_memory import memory
from .streaming import streaming_applies, streaming_host_bytes
from .traffic import forward_traffic_per_layer, traffic_per_layer
from .vocab import vocab_ring_traffic


def layer_flops(model: Model, job: Job, mode: str) -> Dict[str, float]:
    """Forward, backward and METP's own per-shard recompute FLOPs of one layer on one rank."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    t, c = lay.t, lay.c
    s, b = model.seq, job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    q, kv = A * d, G * d
    k = 2 if model.swiglu else 1
    n = s * b // c
    w_attn, w_mlp = h * (q + 2 * kv) + q * h, k * h * F + F * h
    fwd = 2 * n * (w_attn + w_mlp) / t + 2 * n * s * q / t
    out = {"forward": fwd, "backward": 2 * fwd, "METP per-shard recompute": 0.0,
           "attention forward": 2 * n * w_attn / t + 2 * n * s * q / t}
    if mode == "metp" and not job.keep_intermediate:
        out["METP per-shard recompute"] = 2 * n * (h * (q + 2 * kv) + k * h * F) / t
    return out


def vocab_traffic(model: Model, job: Job, mode: str) -> Dict[str, float]:
    """Bytes rank 0 sends per micro-batch in the vocabulary rings (mode ``metp+vocab`` or
    ``--vocab-parallel``; nothing otherwise): the embedding's, and with PP = 1 (rank 0 is then
    the last stage too) the loss's, whose backward ring runs once per token tile
    (:func:`.vocab.vocab_ring_traffic`)."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    if not lay.vocab:
        return {}
    n = model.seq * job.micro_batch // lay.c
    rows = padded_vocab(model.vocab, lay.vocab_pad) // lay.vocab_shards
    return vocab_ring_traffic(n, model.hidden, rows, lay.p, embedding=True, loss=job.pp == 1)


def step_cost(model: Model, job: Job, mode: str) -> Dict[str, float]:
    """One micro-batch on rank 0: FLOPs (with and without recompute), bytes sent (the layers'
    rings, again by recompute, and the vocabulary rings), host↔device bytes, and the estimated
    times (seconds)."""
    hw = HARDWARE[job.hardware]
    L = model.layers // job.pp
    f = layer_flops(model, job, mode)
    recomputed = 0
    if job.recompute == "full":
        recomputed = L if job.recompute_method == "uniform" else min(job.recompute_num_layers, L)
    base = L * (f["forward"] + f["backward"] + f["METP per-shard recompute"])
    extra = recomputed * f["forward"]
    m_, j_ = canonical(mode, job)
    if m_ == "metp" and streaming_applies(j_, layout(m_, j_), m_):
        # the streaming layer re-runs the attention (projections and core) but not the MLP's
        # forward (its backward pass re-forms each shard's intermediate, as always)
        extra = recomputed * f["attention forward"]
    sent = L * sum(traffic_per_layer(model, job, mode).values())
    sent_extra = recomputed * forward_traffic_per_layer(model, job, mode)
    sent_vocab = sum(vocab_traffic(model, job, mode).values())
    act = memory(model, job, mode).act
    host = act.host
    moved = 2 * host
    lay = layout(m_, j_)
    streaming = m_ == "metp" and streaming_applies(j_, lay, m_)
    if streaming and act.offloaded_layers:  # they read their host copies tile by tile
        moved = act.offloaded_layers * streaming_host_bytes(
            model, j_, lay, model.seq * job.micro_batch // lay.c) + 2 * sum(
            v for k, v in act.head.items() if "final norm" in k and "output" in k)
    rate = (hw.measured_tflops or 0.7 * hw.bf16_tflops) * 1e12
    compute_s = (base + extra) / rate
    copy_s = moved / (hw.host_gbps * 1e9)
    per_layer_compute = compute_s / max(1, L)
    per_layer_copy = copy_s / max(1, L)
    # without prefetch every layer's copy back to the device waits in its backward's path (the
    # streaming layer reads its host copies chunk by chunk, each started a chunk ahead)
    exposed_s = 0.0 if (not job.offload or job.offload_prefetch or streaming) else \
        (host / (hw.host_gbps * 1e9))
    return {"flops": base + extra, "flops_without_recompute": base,
            "recompute_flops_share": extra / base if base else 0.0,
            "sent": sent + sent_extra + sent_vocab, "sent_by_recompute": sent_extra,
            "sent_by_vocab_rings": sent_vocab,
            "host_device_bytes": moved, "compute_s": compute_s, "host_copy_s": copy_s,
            "offload_hidden": per_layer_copy <= per_layer_compute and not exposed_s,
            "host_copy_exposed_s": exposed_s,
            "step_s": compute_s + max(0.0, copy_s - compute_s) + exposed_s,
            "rate_tflops": rate / 1e12}
