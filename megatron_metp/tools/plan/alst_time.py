"""Time of one ALST iteration's micro-batch (mode ``alst``, :mod:`.alst`) on rank 0, by the
components of :func:`.step_time.step_time`, with ALST's own schedule:

* attention over the whole sequence for ``a/W`` heads (Ulysses): forward ``2·s²·q/W`` FLOPs
  (causal half), run twice (forward, checkpoint recompute), backward 2.5×; no ring, so no
  imbalance; FlashAttention-2's published rates unless ``--kernel``/``--rates`` say otherwise;
* GEMMs ``2·n·W_layer`` per pass: forward, recompute, backward (2×), and the tiled MLP's second
  forward in its backward; output layer and tiled loss: forward, its logits again in the
  backward, backward (2×);
* the Ulysses all-to-alls (synchronous: exposed) at the NVLink rate per GPU, at the inter-node
  rate for the share of peers on other nodes;
* ZeRO-3's gathers and reduce-scatter, prefetched: exposed only past each layer's compute;
* the checkpointed layer inputs to the host and back, overlapped with the layer's compute;
* CPU Adam over ``N/W`` parameters (:func:`.optimizer_time.optimizer_s`).
"""

from __future__ import annotations

from typing import Dict

from .alst import alst_layout, alst_params, alst_traffic
from .hardware import HARDWARE
from .host_link import host_link
from .internode import GPUS_PER_NODE
from .model import BF16, Job, Model, padded_vocab
from .optimizer_time import optimizer_s
from .parameters import layer_weights
from .rates import ATTENTION_BWD_FLOP_RATIO, resolve_rates

#: the kernel ALST ran (its paper: FlashAttention-2)
ALST_KERNEL = "fa2"


def alst_time(model: Model, job: Job) -> Dict:
    # a --rates file: its kernel unless --kernel names another it measured
    kernel = job.attention_kernel or (None if job.rates_file else ALST_KERNEL)
    rates = resolve_rates(job.hardware, kernel, job.rates_file)
    hw = HARDWARE[job.hardware]
    lay = alst_layout(job)
    W, s, h, L = lay.c, model.seq, model.hidden, model.layers
    n = s // W
    attn, mlp, _ = layer_weights(model)
    V = padded_vocab(model.vocab, 1)
    fa = 2 * s * s * model.heads * model.head_dim / W
    rf, rb, rg = (rates.attention_fwd_tflops * 1e12, rates.attention_bwd_tflops * 1e12,
                  rates.gemm_tflops * 1e12)
    gemm = L * (2 * n * (attn + mlp) * 4 + 2 * n * mlp)
    comp = {"attention_fwd": L * fa / rf, "attention_recompute": L * fa / rf,
            "attention_bwd": L * ATTENTION_BWD_FLOP_RATIO * fa / rb,
            "gemm": gemm / rg, "loss": 2 * n * h * V * 4 / rg}
    per_layer = sum(comp.values()) / L
    tr = alst_traffic(model, job)
    a2a = sum(v for k, v in tr.items() if k.startswith("Ulysses"))
    zero = sum(v for k, v in tr.items() if k.startswith("ZeRO"))
    off_node = max(0, W - GPUS_PER_NODE) / W  # peers on other nodes
    a2a_s = a2a * ((1 - off_node) / (hw.link_gbps * 1e9) + off_node / (hw.internode_gbps * 1e9))
    zero_link = hw.internode_gbps if W > GPUS_PER_NODE else hw.link_gbps
    comp["alltoall_exposed"] = L * a2a_s
    comp["zero3_exposed"] = L * max(0.0, zero / (zero_link * 1e9) - per_layer)
    gb = host_link(job.hardware)["gbs"] * 1e9
    comp["host_copies_exposed"] = L * max(0.0, 2 * BF16 * n * h / gb - per_layer)
    comp["ring_exposed"] = comp["internode_exposed"] = 0.0
    step = sum(comp.values())
    opt = optimizer_s(alst_params(model) / W, job, min(GPUS_PER_NODE, W), True, job.hardware)
    comp["optimizer"] = opt
    # (ZeRO-3's gradient reduce-scatter is among the components: nothing apart per iteration)
    return {"components": comp, "step_s": step, "optimizer_s": opt, "grad_sync_s": 0.0,
            "iteration_s": step + opt,
            "microbatches": 1,
            "rates": {"attention_fwd_tflops": rates.attention_fwd_tflops,
                      "attention_bwd_tflops": rates.attention_bwd_tflops,
                      "gemm_tflops": rates.gemm_tflops, "kernel": rates.kernel,
                      "host_gbs": host_link(job.hardware)["gbs"], "source": rates.source,
                      "measured_at": rates.measured_at},
            "ring_imbalance": 1.0, "ring_imbalance_forward": 1.0,
            "ring_imbalance_backward": 1.0, "query_tiles": 1, "kv_blocks": 1,
            "empty_ring_steps": 0,
            "host_passes": [], "host_passes_kept": [], "kept_attention_layers": 0}
