"""What recompute and offload cost: FLOPs, ring traffic and host↔device bytes of one rank per
micro-batch, and an estimated step time, next to the memory they save.

FLOPs per layer and rank (``n`` tokens through the rank's attention/MLP, ``t`` the TP size, ``W``
the layer's linear weights ``h·(q+2kv) + q·h + k·h·F + F·h``, ``q = a·d``):
* forward GEMMs ``2·n·W/t``; causal attention counted as half the score matrix:
  ``2·n·s·q/t`` (QKᵀ and P·V, each ``2·n·s·q/t`` over two);
* backward twice the forward's GEMMs and 2.5× its attention (a flash backward, :mod:`.rates`);
  METP re-forms each shard's Q/K/V and MLP intermediate in its
  backward (``2·n·(h·(q+2kv) + k·h·F)/t`` more; ``--keep-intermediate`` drops ``k·h·F``);
* full recompute: one more forward of every recomputed layer (rings included: the forward share
  of the layer's traffic is sent again), without the attention core in a layer that keeps its
  attention output (:mod:`.keep`).

Time (estimates, labelled so): :mod:`.step_time`, by component, from published kernel rates
(:mod:`.rates`), the ring's imbalance from the op's tile plan and the host link's documented
rate (:mod:`.host_link`).
"""

from __future__ import annotations

from typing import Dict

from .flops import layer_flops
from .model import Job, Model, canonical, layout, padded_vocab
from .rank_memory import memory
from .moe import active_twin
from .streaming import streaming_applies, streaming_host_bytes
from .traffic import forward_traffic_per_layer, traffic_per_layer
from .vocab import vocab_ring_traffic


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


def step_cost(model: Model, job: Job, mode: str) -> Dict:
    """One micro-batch on rank 0: FLOPs (with and without recompute), bytes sent (the layers'
    rings, again by recompute, and the vocabulary rings), host↔device bytes, and the time
    (seconds) by component from :func:`.step_time.step_time` (``step_s`` one micro-batch,
    ``iteration_s`` the iteration; ``rates``, ``ring_imbalance``, ``components``,
    ``host_passes``)."""
    from .step_time import step_time

    if canonical(mode, job)[0] == "alst":
        return _alst_cost(model, job)
    # a MoE model: FLOPs and ring traffic of the dense model of its active FFN
    # (.moe.active_twin); its memory and time its own (.moe_time: experts, dispatch)
    real, model = model, active_twin(model)
    L = model.layers // job.pp
    f = layer_flops(model, job, mode)
    recomputed = 0
    if job.recompute == "full":
        recomputed = L if job.recompute_method == "uniform" else min(job.recompute_num_layers, L)
    base = L * (f["forward"] + f["backward"] + f["METP per-shard recompute"])
    extra = recomputed * f["forward"]
    m_, j_ = canonical(mode, job)
    lay = layout(m_, j_)
    streaming = (m_ == "metp" and not real.moe and not real.mla
                 and streaming_applies(j_, lay, m_))
    if streaming:
        # the streaming layer re-runs the attention (projections and core) but not the MLP's
        # forward (its backward pass re-forms each shard's intermediate, as always)
        extra = recomputed * f["attention forward"]
    act = memory(real, job, mode).act
    kept = act.kept_attention_layers  # no attention core in their re-forward (.keep)
    extra -= kept * 2 * (model.seq * job.micro_batch // lay.c) * model.seq * model.heads * \
        model.head_dim / lay.t
    sent = L * sum(traffic_per_layer(model, job, mode).values())
    sent_extra = (recomputed - kept) * forward_traffic_per_layer(model, job, mode) + \
        kept * forward_traffic_per_layer(model, job, mode, kept=True)
    sent_vocab = sum(vocab_traffic(model, job, mode).values())
    host = act.host
    moved = 2 * host
    t = step_time(real, job, mode)
    sent_moe = t["moe"]["sent"] if t.get("moe") else 0.0
    if streaming and act.offloaded_layers:  # they read their host copies tile by tile
        plain = act.offloaded_layers - act.kept_attention_host_layers
        moved = plain * streaming_host_bytes(
            model, j_, lay, model.seq * job.micro_batch // lay.c) + \
            act.kept_attention_host_layers * sum(
                x["count"] * x["bytes"] for x in t["host_passes_kept"]) + 2 * sum(
            v for k, v in act.head.items() if "final norm" in k and "output" in k)
    c = t["components"]
    compute_s = sum(v for k, v in c.items() if not k.endswith("_exposed") and k != "optimizer")
    return dict(t, **{
        "flops": base + extra, "flops_without_recompute": base,
        "recompute_flops_share": extra / base if base else 0.0,
        "sent": sent + sent_extra + sent_vocab + sent_moe, "sent_by_recompute": sent_extra,
        "sent_by_vocab_rings": sent_vocab, "sent_by_moe_dispatch": sent_moe,
        "host_device_bytes": moved, "compute_s": compute_s,
        "host_copy_s": moved / (t["rates"]["host_gbs"] * 1e9),
        "offload_hidden": c["host_copies_exposed"] == 0,
        "host_copy_exposed_s": c["host_copies_exposed"]})


def _alst_cost(model: Model, job: Job) -> Dict:
    """:func:`step_cost` of mode ``alst`` (:mod:`.alst`, :mod:`.alst_time`)."""
    from .alst import alst_traffic
    from .alst_time import alst_time

    t = alst_time(model, job)
    c = t["components"]
    act = memory(model, job, "alst").act
    sent = model.layers * sum(alst_traffic(model, job).values())
    rates = t["rates"]
    flops = sum(c[k] * rates["attention_fwd_tflops"] * 1e12
                for k in ("attention_fwd", "attention_recompute")) + \
        c["attention_bwd"] * rates["attention_bwd_tflops"] * 1e12 + \
        (c["gemm"] + c["loss"]) * rates["gemm_tflops"] * 1e12
    compute_s = sum(v for k, v in c.items() if not k.endswith("_exposed") and k != "optimizer")
    return dict(t, **{
        "flops": flops, "flops_without_recompute": flops - c["attention_recompute"] *
        rates["attention_fwd_tflops"] * 1e12, "recompute_flops_share": 0.0,
        "sent": sent, "sent_by_recompute": 0.0, "sent_by_vocab_rings": 0.0,
        "host_device_bytes": 2 * act.host, "compute_s": compute_s,
        "host_copy_s": 2 * act.host / (rates["host_gbs"] * 1e9),
        "offload_hidden": c["host_copies_exposed"] == 0,
        "host_copy_exposed_s": c["host_copies_exposed"]})
