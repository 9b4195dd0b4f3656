"""Mode ``alst``: Arctic Long Sequence Training (Bekman et al. 2025, arXiv 2506.13996; DeepSpeed
Ulysses + ZeRO-3 on Hugging Face models) planned on the same GPUs, memory and time, as the
strongest published peer at millions of tokens.

ALST's published recipe, as planned here over ``W = tp·metp·cp`` GPUs (``--pp``/``--dp`` 1):

* **Ulysses sequence parallelism over all W ranks**: each rank holds ``n = s/W`` tokens of every
  layer input; attention runs over the whole sequence for ``a/W`` heads (and ``g/W`` K/V heads,
  replicated when ``g < W``) after an all-to-all of ``q, k, v``, and ``o`` goes back by another
  (backward: ``dO`` and ``dq, dk, dv``). All-to-alls are synchronous: their time is exposed.
* **ZeRO-3**: bf16 parameters and gradients sharded over the W ranks, each layer's weights
  gathered for its forward, its recompute and its backward, its gradient reduce-scattered
  (prefetched: exposed only past the layer's compute).
* **Optimizer on the host**: DeepSpeed's CPU Adam over the rank's ``N/W`` parameters (fp32 master,
  two moments and an fp32 gradient copy on the host, 16 B per parameter).
* **Activation checkpointing** of every layer with the checkpointed layer inputs **offloaded to
  host** memory (``n·h`` bf16 per layer and rank), the **tiled MLP** (its backward recomputes the
  MLP forward tile by tile: one more MLP forward) and the **tiled loss** (logits formed tile by
  tile, again in the backward), **FlashAttention-2** (``--kernel`` may say otherwise).

Published measurements (Llama-8B, bf16, H100 80GB, one sequence per iteration; the paper's
table of iteration times): 500K tokens on 1 GPU in 16:50 (1,010 s), 3.7M tokens on 8 GPUs (one
node) in 1:47:35 (6,455 s), 15M tokens on 32 GPUs (four nodes) in 7:25:09 (26,709 s).
:data:`PUBLISHED` holds them; ``tests/test_alst_plan.py`` checks the plan reproduces the first two
within 15 %.

Memory (per rank): the bf16 parameter shard (gradient partitions go to the host with the
optimizer), the gathered weights of the layer running and the next (prefetch), the checkpointed
inputs on the host, and the largest transient: one layer's backward with its recompute (see
:func:`alst_activations`). Planned: 500K on one H100 and 3.7M on eight fit (ALST's published
lengths); the planned longest on eight is a little above 3.7M.
"""

from __future__ import annotations

from typing import Dict

from .model import BF16, FP32, Job, Model, alst_layout, padded_vocab
from .parameters import layer_weights

#: ALST's measured iteration times (seconds), one sequence per iteration: (model, GPUs, tokens)
PUBLISHED = {("llama3-8b", 1, 500_000): 1010.0, ("llama3-8b", 8, 3_700_000): 6455.0,
             ("llama3-8b", 32, 15_000_000): 26709.0}
#: fp32 master + two moments + fp32 gradient per parameter, on the host (CPU Adam)
HOST_OPTIMIZER_BYTES = 16


def alst_params(model: Model) -> int:
    """Parameter elements of the whole model (embedding and output layer, untied or tied)."""
    attn, mlp, norms = layer_weights(model)
    V = padded_vocab(model.vocab, 1)
    return model.layers * (attn + mlp + norms) + V * model.hidden * (1 if model.tied else 2) \
        + 2 * model.hidden


def alst_static(model: Model, job: Job) -> Dict[str, float]:
    """``static_memory``'s keys for ALST: bf16 parameter and gradient shards on the device
    (ZeRO-3), the gradients and the optimizer on the host."""
    W = alst_layout(job).c
    N = alst_params(model)
    host = HOST_OPTIMIZER_BYTES * N / W
    # the gradient partitions go to the host bucket by bucket (ZeRO-Offload's fp32 gradient,
    # counted in the host optimizer's 16 B): none kept whole on the device
    return {"n_params": N / W, "params": BF16 * N / W, "grads": 0.0, "optimizer": 0.0,
            "optimizer_plain": 12 * N / W, "optimizer_distributed": 12 * N / W,
            "optimizer_host": host, "optimizer_host_pinned": FP32 * N / W}


def alst_activations(model: Model, job: Job):
    """ALST's :class:`~.activation_memory.Activations` of one rank: nothing stored per layer on
    the device (the checkpointed inputs are on the host), the head's final hidden states, and
    the phases: one layer's backward (its recompute's tensors, the all-to-alls' copies, the
    FlashAttention-2 fp32 ``dq`` accumulator) and the tiled loss."""
    from .activation_memory import Activations

    lay = alst_layout(job)
    W, s, h = lay.c, model.seq, model.hidden
    n = s // W
    d = model.head_dim
    hq, hk = model.heads * d, model.groups * d
    hk_w = max(hk // W, d) * W   # K/V heads replicated up to one per rank
    qkv, qkv_w = hq + 2 * hk, hq + 2 * hk_w
    k = 2 if model.swiglu else 1
    attn, mlp, _ = layer_weights(model)
    V = padded_vocab(model.vocab, 1)
    e = BF16
    tile = min(n, h)  # TiledMLP: ceil(n/h) tiles of about h rows (ALST's default)
    a2a = 1 if W > 1 else 0        # the all-to-alls' second copies (none on one GPU)
    gathered = 2 * e * (attn + mlp) if W > 1 else 0
    bwd = {
        "layer input (back from the host) and the incoming gradient (bf16)": 2 * e * n * h,
        "norm1(x), q/k/v local, RoPE'd q/k (bf16)": e * n * (h + qkv + hq + hk),
        "q/k/v after the all-to-all [s, heads/W] (bf16)": a2a * e * n * qkv_w,
        "attention output [s, heads/W] and local, log-sum-exp (bf16, fp32)":
            (1 + a2a) * e * n * hq + FP32 * s * model.heads // W,
        "dO local and after the all-to-all (bf16)": (1 + a2a) * e * n * hq,
        "dq/dk/dv [s, heads/W] and local (bf16)": e * n * (qkv_w + a2a * qkv),
        "FlashAttention-2's fp32 dq accumulator": FP32 * n * hq,
        "d norm1 (bf16)": e * n * h,
        "gathered layer weights: running + prefetched (bf16, ZeRO-3)": gathered,
    }
    mlp_ph = {"layer input, incoming gradient, h1, norm2(h1) (bf16)": 4 * e * n * h,
              "one MLP tile: z, f(z), dz (bf16)": e * tile * (k + 2) * model.ffn,
              "gathered layer weights: running + prefetched (bf16, ZeRO-3)": gathered}
    loss = {"final hidden states and their gradient (bf16)": 2 * e * n * h,
            "one loss tile's logits: bf16 and fp32": (e + FP32) * tile * V,
            "gathered output layer (bf16, ZeRO-3)": e * V * h}
    head = {"final hidden states (bf16)": e * n * h, "RoPE angle table (fp32)": 0.0}
    host = model.layers * e * n * h
    return Activations(stored_layer={"layer input: on the host": 0.0}, head=head,
                       phases={"attention backward (last layer)": bwd,
                               "MLP backward, tiled (last layer)": mlp_ph,
                               "loss, tiled (forward and backward)": loss},
                       persistent=0.0, layers=model.layers, inflight=1, host=host,
                       offloaded_layers=model.layers)


def alst_traffic(model: Model, job: Job) -> Dict[str, float]:
    """Bytes one rank sends per layer (forward, recompute, backward): the Ulysses all-to-alls
    (``(W−1)/W`` of each tensor leaves the rank) and ZeRO-3's weight all-gathers (3) and
    gradient reduce-scatter (1)."""
    W = alst_layout(job).c
    if W == 1:
        return {}
    n, h, d = model.seq // W, model.hidden, model.head_dim
    hq, hk = model.heads * d, model.groups * d
    attn, mlp, _ = layer_weights(model)
    f = (W - 1) / W
    a2a = BF16 * n * (hq + 2 * hk + hq) * f  # q/k/v out, o back (backward: dO out, dqkv back)
    return {"Ulysses all-to-all: q/k/v + o (forward, recompute), dO + dq/dk/dv (backward)":
            3 * a2a,
            "ZeRO-3: weight all-gathers (forward, recompute, backward) + gradient "
            "reduce-scatter": 4 * BF16 * (attn + mlp) * f}


def alst_head(model: Model, job: Job) -> Dict[str, float]:
    """:func:`.rank_memory.head_memory`'s keys for ALST: the tables ZeRO-3-sharded, the tiled
    loss's logits one tile at a time."""
    W = alst_layout(job).c
    V = padded_vocab(model.vocab, 1)
    emb = V * model.hidden * (1 if model.tied else 2) / W
    n = model.seq // W
    tile = min(n, model.hidden)
    return {"rows": V, "tables": BF16 * emb, "table_grads": BF16 * emb,
            "table_optimizer": 0.0, "logits_block": FP32 * tile * V, "logits_stored": 0,
            "logits_at_once": (BF16 + FP32) * tile * V, "loss_token_chunk": tile,
            "loss_tiles": -(-n // tile), "loss_tile_rows": tile}
