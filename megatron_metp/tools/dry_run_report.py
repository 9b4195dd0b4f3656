"""The dry run's report as text (:func:`format_report`: what ``scripts/pretrain_gpt.sh --dry-run``
prints; :mod:`.dry_run` builds the report)."""

from __future__ import annotations

from typing import Dict, Optional

__all__ = ["format_report"]

MiB = 2 ** 20
GiB = 2 ** 30


def _row(label: str, nbytes: float, extra: str = "") -> str:
    v = nbytes / MiB
    num = f"{v:>12,.0f}" if v >= 100 or v == 0 else f"{v:>12,.2f}"
    return f"  {label:<34} {num} MiB" + (f"   {extra}" if extra else "")


def format_report(r: Dict, gpu_memory_gib: Optional[float] = None,
                  host_memory_gib: Optional[float] = None) -> str:
    """The human-readable report of :func:`run`."""
    w, b, a, s = r["world"], r["bytes"], r["activation_detail"], r["static_detail"]
    kind = "METP" if r["metp"] else "CP"
    mode = "stock Megatron"
    if r["metp"]:
        mode = (f"METP {r['metp_size']}: "
                + ("weight ring + K/V ring" if r["weight_ring"] else "ring self-attention"))
    stage = []
    if r["pre_process"]:
        stage.append("embedding")
    if r["post_process"]:
        stage.append("output layer + loss")
    params = f"parameters on this rank: {r['params_total']:,}"
    if r["metp"]:
        params += f" (METP-sharded {r['params_metp_sharded']:,}"
    else:
        params += " ("
    params += ("; " if r["metp"] else "") + f"embedding/output {r['params_embedding_output']:,})"
    opt = f"{r['optimizer']}, {s['opt_bytes_per_param']:g} B/param, "
    if r["distributed_optimizer"]:
        opt += f"sharded {s['dense_shards']}-way"
        if r["metp"]:
            opt += f" (METP-sharded weights {s['expert_shards']}-way)"
    else:
        opt += "not distributed"
    if s.get("optimizer_on_host_fraction"):
        opt += f"; {s['optimizer_on_host_fraction']:g} of it on the host (--optimizer-cpu-offload)"
    inflight = a["inflight_microbatches"]
    lines = [
        f"METP dry run: Megatron-LM {r['megatron_lm_dir']} (patched), megatron.core from "
        f"{r['megatron_core']}",
        f"command: pretrain_gpt.py {' '.join(r['argv'])}",
        f"layout: world {w['world']} = TP {w['tp']} x "
        + (f"METP {r['metp_size']} x CP {w['cp'] // r['metp_size']}"
           f" (Megatron's CP group of {w['cp']}: the sequence over {w['cp']} ranks, the weights "
           f"over METP {r['metp_size']})" if r["metp"] and w["cp"] > r["metp_size"] else
           f"{kind} {w['cp']}")
        + f" x PP {w['pp']} x DP {w['dp']} ({mode})",
        f"batch: micro-batch {r['micro_batch_size']} x {r['seq_length']:,} tokens "
        f"({r['tokens_per_rank']:,} per rank"
        + (", sequence-parallel" if r["sequence_parallel"] else "")
        + f"); global batch {r['global_batch_size']} = {r['num_microbatches']} micro-batches "
          f"per step per DP rank",
        f"rank {r['rank']}: TP rank {r['where']['tp_rank']}, {kind} rank {r['where']['cp_rank']}, "
        f"PP stage {r['where']['pp_rank']} of {w['pp']}, DP rank {r['where']['dp_rank']}; "
        f"{r['layers_on_rank']} of {r['num_layers']} layers ({r['layer_type']})"
        + (", " + ", ".join(stage) if stage else "")
        + f"; transformer-impl {r['transformer_impl']}",
        params,
        f"memory of rank {r['rank']}:",
        _row(f"parameters ({s['params_dtype']})", b["params"]),
        _row(f"gradient buffer ({s['grad_dtype']})", b["grads"]),
        _row("optimizer state", b["optimizer"], opt),
        _row("activations (fwd+bwd peak)", b["activations"],
             f"{inflight} micro-batches in flight (1F1B)" if inflight > 1 else "one micro-batch"),
        _row("  kept from forward for backward", a["stored_for_backward_one_mb"],
             "per micro-batch"),
        _row("total", b["total"], f"= {b['total'] / GiB:,.1f} GiB"),
    ]
    if b.get("host"):
        lines.append(_row("host memory (offloaded activations)", b["host"],
                          f"per rank, --metp-offload-activations; = {b['host'] / GiB:,.1f} GiB, "
                          f"{b['host'] * r.get('gpus_per_node', 8) / GiB:,.0f} GiB per node "
                          f"of {r.get('gpus_per_node', 8)}"))
        from .plan.host import HOST_MEMORY_GIB

        host_cap = (host_memory_gib or HOST_MEMORY_GIB["H100-80GB"]) * GiB
        node = b["host"] * r.get("gpus_per_node", 8)
        lines.append(f"{'fits' if node <= host_cap else 'DOES NOT FIT'} in "
                     f"{host_cap / GiB:,.0f} GiB of host memory per node"
                     + ("" if host_memory_gib else " (a DGX node's 2 TB; --host-memory-gib)")
                     + f": {(host_cap - node) / GiB:+,.0f} GiB left")
    if gpu_memory_gib:
        cap = gpu_memory_gib * GiB
        verdict = "fits" if b["total"] <= cap else "DOES NOT FIT"
        lines.append(f"{verdict} in {gpu_memory_gib:g} GiB per GPU: {(cap - b['total']) / GiB:+,.1f} GiB "
                     f"left for the CUDA context, NCCL buffers and allocator fragmentation "
                     f"(not modelled; typically a few GiB)")
    lines.append(f"activations {a['method']}; fake process group + FakeTensorMode + MemTracker, "
                 f"build {r['seconds_build']:.1f} s, fwd+bwd {r['seconds_fwd_bwd']:.1f} s, "
                 f"total {r['seconds_total']:.1f} s")
    if r.get("model_tree"):  # what metp measure and a training log print for the same model
        lines.append(f"model: {r['model_tree']}")
    for n in r["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)
