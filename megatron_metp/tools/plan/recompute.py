"""Activation recompute and host offload: what a layer then keeps on the device, on the host, and
what the last layer's phases have on the device on top of that.

* ``--recompute full`` (Megatron's ``--recompute-granularity full``), method ``uniform`` with
  ``N`` layers: the layers run in chunks of ``N``; a chunk keeps only its input (the checkpoint)
  and its backward first re-runs its forward, re-forming the chunk's activations and its output
  before the last layer's backward transients. Method ``block``: the first ``N`` layers of the
  stage keep their inputs only, the others keep everything; the last layer (the first backward)
  re-forms its activations only if all layers are checkpointed.
* ``--offload-activations`` (``megatron_metp.runtime.offload``): every tensor saved in the block's
  forward that is ≥ 1 MiB goes to host memory (here: everything but the per-row statistics and
  log-sum-exps); when the backward reaches a layer group it brings that group back and
  prefetches the previous one, so the device holds two groups (two chunk inputs with full
  recompute, two layers' activations without).

Phase shifts (added to the last layer's phases, which are written relative to every layer keeping
all its activations ``S``; ``S_mlp`` is the MLP's part with its norm, ``kk`` the last chunk's
layers, ``x`` one layer input):

======================  ============  ============  =============  ===========
                        forward       re-forward    MLP backward   attn. bwd
======================  ============  ============  =============  ===========
recompute uniform       0             kk·S − x      kk·S           kk·S
+ offload               0             kk·S + x      kk·S + 2x      kk·S + 2x
offload, no recompute   S_mlp         —             S(prev) + S    S(prev) + S
======================  ============  ============  =============  ===========

"re-forward": the last chunk's forward run again in backward (phases named ``… recompute``).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

from .model import Job

#: saved tensors smaller than the offload threshold (one value per token row): stay on device
_SMALL = ("statistics", "log-sum-exp")


def _mlp_share(S: Dict[str, float]) -> float:
    """The MLP's part of a layer's saved tensors, with its norm (half of the norm terms)."""
    norms = sum(v for k, v in S.items() if k.startswith("norm "))
    return sum(v for k, v in S.items() if k.startswith("MLP")) + norms / 2


def dev_full_share(job: Job, layers: int) -> float:
    """The share of a stage's layers that keep all their activations (block recompute: the
    layers after the first ``N``; uniform: none; no recompute: all)."""
    if job.recompute != "full":
        return 1.0
    if job.recompute_method == "uniform":
        return 0.0
    return (layers - min(job.recompute_num_layers, layers)) / layers


def recompute_and_offload(S: Dict[str, float], job: Job, layers: int, input_bytes: float
                          ) -> Tuple[Dict[str, float], float, Dict[str, float]]:
    """``(device bytes per layer, host bytes per layer, shifts)`` for one micro-batch.

    ``S``: what one layer keeps without recompute; ``input_bytes``: one layer input. ``shifts``:
    bytes added to the last layer's ``forward``, ``MLP backward`` and other ``backward``
    phases (see the table in the module docstring)."""
    full = sum(S.values())
    small = sum(v for k, v in S.items() if any(w in k for w in _SMALL))
    mlp = _mlp_share(S)
    x = input_bytes
    dev: Dict[str, float] = dict(S)
    shifts = {"forward": 0.0, "mlp": 0.0, "backward": 0.0}
    chunk = 0  # layers of the last chunk re-run in backward (0: the last layer is not)
    if job.recompute == "full":
        k = job.recompute_num_layers
        if job.recompute_method == "uniform":
            chunks = math.ceil(layers / k)
            chunk = layers - (chunks - 1) * k
            dev = {f"layer inputs, one per chunk of {k} (checkpoint)": chunks * x / layers}
        else:
            k = min(k, layers)
            chunk = 1 if k == layers else 0
            dev = {f"layer inputs of the first {k} layers (checkpoint)": k * x / layers,
                   f"activations of the other {layers - k} layers": (layers - k) * full / layers}
    if chunk:
        # the first forward keeps nothing of the chunk (no_grad); in backward the re-run forward
        # re-forms the chunk's activations ("recompute" phases) and its output
        shifts = {"forward": 0.0, "recompute": chunk * full - x, "mlp": chunk * full,
                  "backward": chunk * full}
    host = 0.0
    if job.offload:
        kept_small = small * (1.0 if job.recompute != "full" else
                              dev_full_share(job, layers))
        host = sum(dev.values()) - kept_small
        dev = {"per-row statistics (not offloaded)": kept_small}
        back = 2 if job.offload_prefetch else 1  # without prefetch: this chunk's input only
        if chunk:  # this chunk's input brought back, the previous one's prefetched
            shifts = {key: v + (back * x if key != "forward" else 0.0)
                      for key, v in shifts.items()}
        else:  # the last layer keeps everything: its tensors come back as its backward asks
            prev = full - small if layers - (job.recompute_num_layers
                                             if job.recompute == "full" else 0) > 1 else x
            shifts = {"forward": mlp, "mlp": prev + full - small, "backward": prev + full - small}
    return dev, host, shifts
