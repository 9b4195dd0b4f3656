"""What ``metp plan`` prints (:func:`report`) and writes with ``--json`` (:func:`plan`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from .hardware import HARDWARE
from .job_checks import validate
from .keep import kept_bytes, recomputed_layers
from .model import (GiB, KEEP_AUTO, MiB, MODES, PRESET_NOTES, VOCAB_MODES, Job, Model,
                    canonical, layout)
from .fit import fit_hint, fits
from .textwidth import fmt_bytes, fmt_tokens
from .overlap import overlap_thresholds
from .internode import internode_hop
from .rank_memory import capacity_bytes, head_memory, longest_seq, memory
from .traffic import crossover_seq, traffic_per_layer
from .cost import step_cost
from .moe import active_twin
from .moe_time import describe as describe_moe_time
from .alst import alst_head, alst_traffic

from .host import GPUS_PER_NODE, host_capacity_bytes, host_fits  # noqa: F401 (GPUS_PER_NODE)


def plan(model: Model, job: Job, modes: Sequence[str] = MODES) -> Dict:
    """Everything :func:`report` prints, as a dict (bytes, tokens)."""
    validate(model, job, modes)
    hw = HARDWARE[job.hardware]
    out = {"model": asdict(model), "job": asdict(job), "hardware": asdict(hw), "modes": {}}
    for mode in modes:
        mem = memory(model, job, mode)
        a = mem.act
        out["modes"][mode] = {
            "layout": mem.layout,
            "static": mem.static,
            "stored_layer": a.stored_layer, "stored_per_layer": a.stored_per_layer,
            "korthikanti_layer": a.korthikanti_layer,
            "layers": a.layers, "inflight": a.inflight, "head": a.head,
            "persistent": a.persistent, "phases": a.phase_totals(),
            "peak_phase": a.peak_phase, "transient": a.transient,
            "layer_transient": a.layer_transient,
            "activation_peak": a.peak, "measured_part": mem.measured_part, "total": mem.total,
            "last_stage_total": memory(model, job, mode, stage="last").total
            if job.pp > 1 else None,
            "traffic_per_layer": alst_traffic(model, job) if mode == "alst" else
            traffic_per_layer(active_twin(model), job, mode),
            "vocab": alst_head(model, job) if mode == "alst" else head_memory(model, job, mode),
            "longest_seq": longest_seq(model, job, mode),
            "host": a.host, "cost": step_cost(model, job, mode),
            "optimizer_host": mem.static["optimizer_host"],
            "internode": internode_hop(model, job, mode),
            "host_per_node": GPUS_PER_NODE * a.host,
            "host_capacity_per_node": host_capacity_bytes(job),
            "fits_host": (not job.offload) or host_fits(job, a.host),
            "offloaded_layers": a.offloaded_layers,
            "offload_auto": job.offload and job.offload_layers is None and
            mem.job.offload_layers is not None,
            "fit_hint": _fit_hint(model, job, mode),
            # kept attention (.keep): layers per stage keeping O + LSE, those of them on the host
            "kept_attention_layers": a.kept_attention_layers,
            "kept_attention_host_layers": a.kept_attention_host_layers,
            "kept_attention_bytes_per_layer": kept_bytes(model, job, mode, model.seq)
            if a.kept_attention_layers else 0.0,
            "keep_applies": job.keep_attention_output is not None and
            canonical(mode, job)[0] == "metp",
            "keep_auto": job.keep_attention_output == KEEP_AUTO and
            canonical(mode, job)[0] == "metp",
        }
    # a MoE model's traffic, thresholds and time: the dense model of its active FFN (.moe)
    out["overlap"] = overlap_thresholds(active_twin(model), job, hw)
    if hw.measured_tflops:
        out["overlap_measured"] = overlap_thresholds(active_twin(model), job, hw, measured=True)
    if "metp" in modes and "tp-sp" in modes and job.width > 1 and not model.moe:
        out["crossover_vs_tp_sp"] = crossover_seq(model, job, "tp-sp")
    if model.moe:
        out["moe"] = {m: moe_describe(model, *canonical(m, job)[::-1], m) for m in modes}
    if model.mla:
        from .mla import describe as mla_describe

        out["mla"] = mla_describe(model, job, modes)
    return out


def _fit_hint(model: Model, job: Job, mode: str) -> Optional[Dict]:
    """None when ``mode`` fits (device and host, as the reach search counts them); else the
    cheapest options under which this layout fits (:func:`.fit.fit_hint`: ``flags``, ``total``,
    ``host_per_node``, ``megatron_lm_args``, ``pretrain_gpt_sh``), ``flags`` None when none
    does."""
    if mode == "alst":
        return None
    plain_mode, plain_job = canonical(mode, job)
    if fits(model, plain_job, plain_mode)[0]:
        return None
    hint = fit_hint(model, job, mode)
    return hint.as_dict() if hint else {"flags": None}


def fit_lines(res: Dict, job: Job, seq: int) -> List[str]:
    """The hint lines of :func:`report` for the modes that do not fit."""
    hw = HARDWARE[job.hardware]
    lines = []
    for mode, r in res["modes"].items():
        h = r.get("fit_hint")
        if h is None:
            continue
        if h["flags"] is None:
            lines.append(f"# {mode}: does not fit, and no options fit this layout at s = "
                         f"{seq:,} (every option set of the reach search tried): more GPUs, or "
                         f"metp plan --reach --gpus N for other layouts")
            continue
        lines.append(f"# {mode}: does not fit; fits with {' '.join(h['flags'])}: "
                     f"{fmt_bytes(h['total'])} per rank of {fmt_bytes(capacity_bytes(job))} on "
                     f"{hw.name}" + (f", host {fmt_bytes(h['host_per_node'])} per node"
                                     if h["host_per_node"] else "")
                     + " (the cheapest options on this layout)")
        lines.append(f"#   {h['pretrain_gpt_sh']}")
    return lines


def report(model: Model, job: Job, modes: Sequence[str] = MODES,
           width: Optional[int] = None) -> str:
    """The text ``metp plan`` prints: fitted to ``width`` columns (``metp plan``'s default
    :data:`.textwidth.DEFAULT_WIDTH`: the table in blocks of columns, long lines wrapped), or
    with ``width=None`` (``--wide``) one table with every column and every line whole."""
    from .textwidth import LEGEND, table_lines, wrap_lines

    res = plan(model, job, modes)
    hw = HARDWARE[job.hardware]
    lines = []
    g = f", {model.groups} query groups" if model.groups != model.heads else ""
    if model.kv_channels is not None and model.kv_channels * model.heads != model.hidden:
        g += f" of width {model.kv_channels}"
    g += "".join(f", {flag}" for flag, on in (("qk-layernorm", model.qk_layernorm),
                                               ("qkv bias", model.add_qkv_bias)) if on)
    lines.append(f"# plan: {model.name} h={model.hidden} L={model.layers} a={model.heads}{g} "
                 f"ffn={model.ffn}{' (SwiGLU)' if model.swiglu else ''} vocab={model.vocab} "
                 f"s={model.seq:,} b={job.micro_batch}, bf16, {job.kernel} attention, "
                 f"{'keep' if job.keep_intermediate else 'recompute'} METP MLP intermediate"
                 + (", METP vocabulary split (--vocab-parallel)" if job.vocab_parallel else ""))
    lines.append(f"# GPUs per model replica: TP×METP = {job.tp}×{job.metp} = {job.width} per "
                 f"stage" + (f" × CP {job.cp} (the sequence over METP×CP = {job.metp * job.cp} "
                             f"ranks, the weights over METP)" if job.cp > 1 else "")
                 + f" × PP {job.pp} × DP {job.dp}; distributed optimizer "
                 f"{'on' if job.distributed_optimizer else 'off'}"
                 + (" with Megatron's --optimizer-cpu-offload" if job.optimizer_offload else "")
                 + f"; {hw.name}: "
                 f"{hw.memory_gib:g} GB − {job.reserve_gib:g} GiB reserve, "
                 f"{hw.bf16_tflops:g} TFLOP/s bf16 dense, {hw.link_gbps:g} GB/s per direction "
                 f"({hw.source})")
    for m, line in res.get("moe", {}).items():
        lines.append(f"# {m}: {line}; the per-layer ring traffic planned as the dense model of "
                     f"the active FFN (top-k × expert FFN), the time with the experts' GEMMs and "
                     f"the token dispatch (tools/plan/moe_time.py)")
    if model.name in PRESET_NOTES:
        lines.append(f"# {model.name}: {PRESET_NOTES[model.name]}")
    if res.get("mla"):
        lines.append(f"# {res['mla']}")
    lines.append("# all figures planned (formulas of megatron_metp/tools/plan); per rank, rank 0"
                 + (" (first pipeline stage)" if job.pp > 1 else ""))
    lines.append("")
    cols = list(modes)
    rows = []

    def row(label, f):
        rows.append([label] + [f(res["modes"][m]) for m in cols])

    row("layout", lambda r: r["layout"])
    row("parameters (bf16)", lambda r: fmt_bytes(r["static"]["params"]))
    row("  embedding + output layer", lambda r: fmt_bytes(r["vocab"]["tables"]) +
        f" ({r['vocab']['rows']:,} rows)")
    row("gradients (fp32 main_grad)", lambda r: fmt_bytes(r["static"]["grads"]))
    row("Adam states (no dist. opt.)", lambda r: fmt_bytes(r["static"]["optimizer_plain"]))
    row("Adam states (dist. opt.)", lambda r: fmt_bytes(r["static"]["optimizer_distributed"]))
    row("stored / layer", lambda r: fmt_bytes(r["stored_per_layer"]))
    row("  Korthikanti / layer", lambda r: fmt_bytes(r["korthikanti_layer"])
        if r["korthikanti_layer"] else "")
    row("stored × layers × in flight", lambda r: f"{fmt_bytes(r['stored_per_layer'] * r['layers'] * r['inflight'])}"
        f" ({r['layers']}×{r['inflight']})")
    row("head stored (RoPE, norm, loss)",
        lambda r: fmt_bytes(r["inflight"] * sum(r["head"].values())))
    row("  loss: fp32 logits block", lambda r: fmt_bytes(r["vocab"]["logits_block"]))
    row("  loss: logits alive at once", lambda r: fmt_bytes(r["vocab"]["logits_at_once"]))
    row("persistent Megatron buffer", lambda r: fmt_bytes(r["persistent"]))
    row("transient (one layer / loss)", lambda r: fmt_bytes(r["transient"]))
    row("  at", lambda r: r["peak_phase"].split(" (")[0])
    row("largest single-layer transient", lambda r: f"{fmt_bytes(r['layer_transient'])} "
        f"({100 * r['layer_transient'] / r['total']:.1f} % of the total)")
    row("activation peak", lambda r: fmt_bytes(r["activation_peak"]))
    row("TOTAL per rank" + (" (first stage)" if job.pp > 1 else ""),
        lambda r: fmt_bytes(r["total"]))
    if job.pp > 1:
        row("TOTAL per rank (last stage)", lambda r: fmt_bytes(r["last_stage_total"]))
    row("fits " + hw.name, lambda r: "yes" if max(r["total"], r["last_stage_total"] or 0)
        <= capacity_bytes(job) else "NO")
    row("bytes sent / layer (fwd+bwd)", lambda r: fmt_bytes(sum(r["traffic_per_layer"].values())))
    if any(r["cost"]["sent_by_vocab_rings"] for r in res["modes"].values()):
        row("vocabulary rings sent / micro-batch",
            lambda r: fmt_bytes(r["cost"]["sent_by_vocab_rings"]))
        row("  loss backward: token tiles",
            lambda r: f"{r['vocab']['loss_tiles']} × {r['vocab']['loss_tile_rows']:,} rows"
            if r["cost"]["sent_by_vocab_rings"] else "")
    if job.offload:
        row("offloaded layers / stage", lambda r: f"{r['offloaded_layers']} of {r['layers']}"
            + (" (auto)" if r["offload_auto"] else ""))
        row("  kept on the device", lambda r: f"{r['layers'] - r['offloaded_layers']}")
        row("host memory (offloaded) / rank", lambda r: fmt_bytes(r["host"]))
        row(f"  per node of {GPUS_PER_NODE}", lambda r: fmt_bytes(GPUS_PER_NODE * r["host"]))
        cap = host_capacity_bytes(job)
        if cap is not None:
            row("  host memory per node", lambda r: fmt_bytes(cap))
            row("fits host memory", lambda r: "yes" if host_fits(job, r["host"]) else "NO")
    if job.keep_attention_output is not None:
        row("kept attention layers / stage", lambda r: (
            f"{r['kept_attention_layers']} of {r['layers']}" + (" (auto)" if r["keep_auto"]
                                                                 else ""))
            if r["keep_applies"] else "")
        row("  O + LSE on host / device", lambda r: f"{r['kept_attention_host_layers']} / "
            f"{r['kept_attention_layers'] - r['kept_attention_host_layers']} layers, "
            f"{fmt_bytes(r['kept_attention_bytes_per_layer'])} each"
            if r["kept_attention_layers"] else "")
    if job.optimizer_offload:
        row("optimizer on host (CPU Adam) / rank", lambda r: fmt_bytes(r["optimizer_host"]))
        row(f"  host in all, per node of {GPUS_PER_NODE}",
            lambda r: fmt_bytes(GPUS_PER_NODE * (r["host"] + r["optimizer_host"])))
    if any(r["internode"] and r["internode"]["crosses"] for r in res["modes"].values()):
        row("K/V bytes over the inter-node hop / layer",
            lambda r: fmt_bytes(r["internode"]["bytes_per_layer"]) if r["internode"] else "")
    if job.recompute == "full" or job.offload:
        row("recompute: extra FLOPs", lambda r: f"+{100 * r['cost']['recompute_flops_share']:.1f} %")
        row("  extra bytes sent / micro-batch", lambda r: fmt_bytes(r["cost"]["sent_by_recompute"]))
        row("host↔device / micro-batch", lambda r: fmt_bytes(r["cost"]["host_device_bytes"]))
        row("  copies hidden by compute", lambda r: "yes" if r["cost"]["offload_hidden"] else
            (f"NO ({r['cost']['host_copy_exposed_s']:.1f} s exposed"
             + (": no prefetch)" if not job.offload_prefetch else ": copy-bound passes)")
             if r["cost"].get("host_copy_exposed_s") else "NO"))
    row("est. time / micro-batch", lambda r: f"{r['cost']['step_s']:.2f} s")
    row("est. time / iteration", lambda r: f"{r['cost']['iteration_s']:.2f} s "
        f"({r['cost']['microbatches']} micro-batch{'es' if r['cost']['microbatches'] > 1 else ''})")
    row("longest sequence that fits", lambda r: fmt_tokens(r["longest_seq"]))
    lines = wrap_lines(lines, width) + table_lines(rows, cols, width)
    tail = [LEGEND, ""]
    tail += fit_lines(res, job, model.seq)
    for mode, r in res["modes"].items():
        if r["offload_auto"]:
            n, L = r["offloaded_layers"], r["layers"]
            tail.append(f"# {mode}: the node's host memory "
                         f"({fmt_bytes(r['host_capacity_per_node'])}) does not hold every layer "
                         f"of the offload: planned with {n} of {L} layers per stage offloaded "
                         f"and {L - n} kept on the device (Megatron-LM: --metp-offload-activations"
                         f" {n}; pretrain_gpt.sh: METP_OFFLOAD_LAYERS={n})"
                         if n else
                         f"# {mode}: the node's host memory "
                         f"({fmt_bytes(r['host_capacity_per_node'])}) does not hold one layer "
                         f"(or recompute chunk) of the offload: planned without it (drop "
                         f"--metp-offload-activations)")
        if r["keep_auto"]:
            k, R = r["kept_attention_layers"], recomputed_layers(job, r["layers"])
            tail.append(f"# {mode}: kept attention: the node's host memory and the device hold "
                         f"O + LSE of {k} of the {R} recomputed layers per stage (Megatron-LM: "
                         f"--metp-keep-attention-output {k}{'' if k < R else ' or no N'})"
                         if k else
                         f"# {mode}: kept attention: neither the host nor the device holds one "
                         f"more layer's O + LSE: planned without it (drop "
                         f"--metp-keep-attention-output)")
    ov = res["overlap"]
    tail.append(f"# full-overlap thresholds on {hw.name} (F/B = {ov['F/B (FLOP per byte)']:,.0f} "
                 f"FLOP/byte, datasheet rates): tokens per rank s·b/p")
    for key, v in ov.items():
        if key.startswith("F/B"):
            continue
        extra = ""
        if "overlap_measured" in res:
            extra = f"   (measured {hw.measured_tflops:g} TFLOP/s: {res['overlap_measured'][key]:,.0f})"
        tail.append(f"  {key:<40s} {v:>10,.0f}{extra}")
    if job.width > GPUS_PER_NODE:
        tail.append(f"  (a group of {job.width} GPUs crosses nodes: the inter-node link, not "
                     f"NVLink, sets B for the ring steps that cross it)")
    for mode, r in res["modes"].items():
        x = r["internode"]
        if not x or not x["crosses"]:
            continue
        tail.append(f"# {mode}: the K/V ring over {x['ring']} ranks spans {x['span']} GPUs = "
                     f"{x['nodes']} nodes of {GPUS_PER_NODE}: {x['crossing_hops']} of its hops "
                     f"cross nodes ({x['internode_gbps']:g} GB/s per GPU and direction, "
                     f"InfiniBand NDR/HDR per the preset's source); per forward step "
                     f"{fmt_bytes(x['block_bytes'])} per hop, "
                     f"{fmt_bytes(x['bytes_per_layer'])} per layer (fwd+bwd); hidden from "
                     f"s/(ring) ≥ {x['threshold_forward']:,.0f} tokens per rank (forward; "
                     f"backward {x['threshold_backward']:,.0f}); this job: "
                     f"{x['tokens_per_rank']:,} ({'hidden' if x['hidden'] else 'NOT hidden'}: "
                     f"{1e3 * x['step_transfer_s']:.2f} ms transfer vs "
                     f"{1e3 * x['step_compute_s']:.2f} ms attention per step)")
        if x["metp_group_crosses"]:
            tail.append(f"# {mode}: WARNING the METP group (TP×METP = {job.width} GPUs) spans "
                         f"nodes: its weight ring would run on the inter-node link; use "
                         f"TP×METP ≤ {GPUS_PER_NODE} and CP for the rest")
    if any(m in VOCAB_MODES for m in modes):
        n = model.seq * job.micro_batch // (job.metp * job.cp)
        tail.append(f"  this job: s·b/p = {n:,} tokens per METP rank "
                     f"({'above' if n >= ov['MLP weight ring, forward: tokens/rank'] else 'below'} "
                     f"the MLP threshold)")
    for mode, r in res["modes"].items():
        c = r["cost"]
        rt = c["rates"]
        comp = ", ".join(f"{k} {v:,.1f}" for k, v in c["components"].items() if v)
        tail.append(f"# {mode} time: kernel {rt['kernel']} (attention {rt['attention_fwd_tflops']:,.0f} "
                     f"forward / {rt['attention_bwd_tflops']:,.0f} backward TFLOP/s, backward "
                     f"2.5× the forward's FLOPs), GEMM {rt['gemm_tflops']:,.0f} TFLOP/s, host link "
                     f"{rt['host_gbs']:,.1f} GB/s per GPU"
                     + (f" (measured {rt['measured_at']}: --rates)" if rt["measured_at"] else
                        " (published figures: ops/kernel_rates.py, tools/plan/rates.py)")
                     + f"; ring imbalance {c['ring_imbalance']:.3f}; seconds: {comp}")
        if c.get("moe"):
            tail.append(f"# {mode}: {describe_moe_time(c['moe'])}")
        if c["host_passes"]:
            tail.append(f"# {mode}: host copies per offloaded layer, pass by pass, at "
                         f"{rt['host_gbs']:,.1f} GB/s per GPU (8 GPUs sharing the node's host "
                         f"memory: tools/plan/host_link.py): copy vs compute, ms each")
            for x in c["host_passes"]:
                bound = "COPY-BOUND" if x["exposed_s"] else "hidden"
                tail.append(f"  {x['pass']:<52s} ×{x['count']:<2d} {fmt_bytes(x['bytes']):>12} "
                             f"{1e3 * x['copy_s']:9,.1f} vs {1e3 * x['compute_s']:10,.1f}  {bound}")
    tail.append("# time estimates: attention causal (half the square), at the kernel's published "
                 "rates × the ring's busiest-rank imbalance; copies, ring hops and TP "
                 "collectives counted where nothing hides them; per iteration: (micro-batches + "
                 "PP − 1) × micro-batch + optimizer step + gradient sync (Megatron's default: "
                 "not overlapped)")
    if res.get("crossover_vs_tp_sp") is not None:
        tail.append(f"# METP sends fewer bytes per layer than TP+SP from s ≈ "
                     f"{res['crossover_vs_tp_sp']:,} tokens on")
    from .positions import REASON, refused_modes

    refused = refused_modes(res["modes"], job, model.seq)
    if refused:
        tail.append(f"# {', '.join(refused)}: REFUSED at s = {model.seq:,} (positions reach "
                     f"2^24): {REASON}")
    return "\n".join(lines + wrap_lines(tail, width))


def moe_describe(model: Model, job: Job, mode: str, asked: str) -> str:
    """The MoE line of ``asked`` (:func:`.moe.describe` at the rank's MoE tokens)."""
    from .moe import describe

    lay = layout(mode, job)
    n = model.seq * job.micro_batch // lay.c
    return describe(model, job, lay, n // lay.t if lay.sp else n)
