"""Kept attention (``--keep-attention-output [N]``; Megatron-LM ``--metp-keep-attention-output
[N]``): under full recompute the first ``N`` METP layers of each pipeline stage keep the attention
core's output ``O`` and its log-sum-exp for the backward, which re-forms Q, K, V from the layer
input (norm, projections, q/k norm, RoPE) and runs the attention backward from them: the
attention forward is never run a second time.

What a kept layer keeps, per rank and micro-batch (``n = s·b/c`` tokens through the rank, ``t``
the TP size; the METP op keeps every head group's ``O`` for its own tokens, as
``ops/layer.py``'s ``O`` stashes and ``ops/attention.py``'s saved outputs hold them)::

    O    [n, a·d/t]   bf16      (the layer's attention output, all heads of the rank)
    LSE  [a/t, n]     fp32      (one per head and token)

On the host where that layer's input goes to the host (``--offload-activations [N']``: the
first ``N'`` layers of a stage), else on the device: ``min(N, N')`` kept layers on the host,
``N − min(N, N')`` on the device.

Time (:mod:`.step_time`): a kept layer loses its attention re-forward (``attention_recompute``
× kept / recomputed layers) and the K/V ring's steps of that re-forward; the streaming layer
loses its recompute pass over the query tiles (q is formed in the backward's query-tile pass,
which reads the layer input anyway).

Only METP modes keep attention (the stock layers' counterpart is Megatron's selective
recompute), and only the layers full recompute recomputes (method ``block``: the first
``--recompute-num-layers``).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

from .model import BF16, FP32, KEEP_AUTO, Job, Model, canonical, layout


def recomputed_layers(job: Job, layers: int) -> int:
    """Layers of a stage that full recompute runs again (``uniform``: all; ``block``: the first
    ``--recompute-num-layers``); 0 without full recompute."""
    if job.recompute != "full":
        return 0
    return layers if job.recompute_method == "uniform" else min(job.recompute_num_layers, layers)


def kept_layers(job: Job, mode: str, layers: int) -> int:
    """Layers of a stage that keep their attention output: ``min(N, recomputed layers)`` of a
    METP mode with ``keep_attention_output = N`` (resolved: :data:`.model.KEEP_AUTO` is
    resolved by :func:`.partial.resolve_keep` before this counts it, and counts 0 until then);
    0 otherwise."""
    mode, job = canonical(mode, job)
    n = job.keep_attention_output
    if mode != "metp" or n is None or n == KEEP_AUTO:
        return 0
    return max(0, min(int(n), recomputed_layers(job, layers)))


def kept_split(job: Job, mode: str, layers: int, offloaded: int) -> Tuple[int, int]:
    """``(on the host, on the device)``: kept layers of a stage whose ``O`` and LSE go to the host
    (kept and offloaded: the first ``min(N, N')``) and those that stay on the device."""
    kept = kept_layers(job, mode, layers)
    host = min(kept, offloaded)
    return host, kept - host


def kept_bytes(model: Model, job: Job, mode: str, seq: int) -> float:
    """Bytes one kept layer keeps on a rank per micro-batch: ``O`` (bf16 ``[n, a·d/t]``) + LSE
    (fp32 ``[a/t, n]``)."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    n = seq * job.micro_batch // lay.c
    return BF16 * n * (model.heads * model.head_dim // lay.t) + FP32 * n * (model.heads // lay.t)


def kept_not_re_formed(shifts: Dict[str, float], job: Job, layers: int, host: int, kept: int,
                       per_layer: float) -> Dict[str, float]:
    """The recompute shifts (:func:`.recompute.recompute_and_offload`) of the separate ops when
    layers of the last recomputed chunk keep their ``O`` + LSE on the device: the re-run forward
    hands those kept tensors (counted with what the stage stores) to the backward instead of
    forming them again, so each such layer's ``per_layer`` bytes leave the ``recompute``,
    ``mlp`` and ``backward`` shifts. ``host``/``kept``: the first ``host`` of the ``kept`` kept
    layers keep theirs on the host (brought back, so re-formed on the device as before)."""
    if job.recompute != "full":
        return shifts
    k = job.recompute_num_layers
    if job.recompute_method == "uniform":
        chunk = layers - (math.ceil(layers / k) - 1) * k
    else:
        chunk = 1 if min(k, layers) == layers else 0
    again = max(0, kept - max(host, layers - chunk)) if chunk else 0
    if not again:
        return shifts
    return {key: v - (again * per_layer if key != "forward" else 0.0)
            for key, v in shifts.items()}


__all__ = ["kept_bytes", "kept_layers", "kept_not_re_formed", "kept_split", "recomputed_layers"]
