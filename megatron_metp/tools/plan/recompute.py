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
* ``--offload-activations N`` (partial): only the first ``N`` layers of a stage go to the host,
  the others keep theirs on the device as without the offload (the last layer among them, so
  the last layer's phases are those without offload); the backward of the lowest kept layer
  prefetches the last offloaded one, which costs one layer's worth more only when it is the
  only kept unit (:func:`_partial_extra`).
* The METP model frees a re-formed chunk's output before the chunk's backward
  (``megatron/recompute_output.py``); its MLP backward then holds the chunk's activations
  without the chunk input (``frees_output``: ``kk·S − x``; the first norm's input *is* the
  checkpoint). Its attention backward holds ``kk·S`` all the same: the gradient arriving at the
  chunk stays referenced by Megatron's ``CheckpointFunction.backward`` through the chunk's
  backward (measured: TP 2 × METP 2 × CP 2, ``tests/test_plan_cp.py``). Stock and ring layers
  keep the output (``kk·S`` in both).

Phase shifts (added to the last layer's phases, which are written relative to every layer keeping
all its activations ``S``; ``S_mlp`` is the MLP's part with its norm, ``kk`` the last chunk's
layers, ``x`` one layer input; METP's MLP backward ``− x`` with recompute, see above):

======================  ============  ============  =============  ===========
                        forward       re-forward    MLP backward   attn. bwd
======================  ============  ============  =============  ===========
recompute uniform       0             kk·S − x      kk·S           kk·S
+ offload               0             kk·S + x      kk·S + 2x      kk·S + 2x
+ offload N < L, one    0             kk·S          kk·S + x       kk·S + x
  chunk kept
offload, no recompute   S_mlp         —             S(prev) + S    S(prev) + S
======================  ============  ============  =============  ===========

"re-forward": the last chunk's forward run again in backward (phases named ``… recompute``).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

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


def _per_layer(S: Dict[str, float], job: Job, layers: int, x: float
               ) -> Tuple[List[float], List[float], List[float]]:
    """Per layer ``i`` of a stage: what it keeps on the device without offload, the part of that
    which stays on the device when it is offloaded (per-row statistics), and what its backward
    re-forms on top (full recompute: its chunk's activations but the input). With uniform chunks
    of ``k`` the chunk's input counts at the chunk's *last* layer, where Megatron's
    ``CheckpointFunction`` saves it (and the offloader files it: ``runtime/offload.py``)."""
    full = sum(S.values())
    small = sum(v for k, v in S.items() if any(w in k for w in _SMALL))
    if job.recompute != "full":
        return [full] * layers, [small] * layers, [0.0] * layers
    k = job.recompute_num_layers
    if job.recompute_method == "uniform":
        ends = [(i + 1) % k == 0 for i in range(layers)]
        return ([x if e else 0.0 for e in ends], [0.0] * layers,
                [k * full - x if e else 0.0 for e in ends])
    r = min(k, layers)
    return ([x if i < r else full for i in range(layers)],
            [0.0 if i < r else small for i in range(layers)],
            [full - x if i < r else 0.0 for i in range(layers)])


def _partial_extra(S: Dict[str, float], job: Job, layers: int, x: float, offloaded: int
                   ) -> float:
    """Bytes the backward of the lowest kept layer or of an offloaded one holds above the last
    layer's (partial offload: the last layer is kept, so the planned phases are its own).

    At the backward of layer ``u`` the device holds the per-row statistics of the offloaded
    layers below ``u``, ``u``'s own saved tensors (kept, or brought back), what its backward
    re-forms, and with prefetch the previous offloaded layer's tensors; at the last layer's it
    holds everything kept. Uniform chunks: ``x`` (two chunk inputs against one) when a single
    chunk is kept, else nothing."""
    dev, small, reform = _per_layer(S, job, layers, x)
    units = [i for i in range(layers) if dev[i] > 0]
    kept = [i for i in units if i >= offloaded]
    last = sum(dev[i] for i in kept) + sum(small[:offloaded]) + reform[kept[-1]]
    worst = 0.0
    for u in units:
        if u > kept[0]:
            break
        prev = [i for i in units if i < u]
        pf = dev[prev[-1]] - small[prev[-1]] if (prev and job.offload_prefetch) else 0.0
        worst = max(worst, sum(small[:u]) + dev[u] + reform[u] + pf)
    return max(0.0, worst - last)


def recompute_and_offload(S: Dict[str, float], job: Job, layers: int, input_bytes: float, *,
                          offloaded: Optional[int] = None, frees_output: bool = False
                          ) -> Tuple[Dict[str, float], float, Dict[str, float]]:
    """``(device bytes per layer, host bytes per layer, shifts)`` for one micro-batch.

    ``S``: what one layer keeps without recompute; ``input_bytes``: one layer input. ``shifts``:
    bytes added to the last layer's ``forward``, ``MLP backward`` and other ``backward``
    phases (see the table in the module docstring). ``offloaded``: with ``job.offload``, the
    layers of the stage whose saved tensors go to the host (the first ones; ``None``: all).
    ``frees_output``: the METP model frees a re-formed chunk's output before its backward
    (``megatron/recompute_output.py``), so the MLP backward of the re-formed chunk holds its
    activations without the chunk input, which is the checkpoint itself (counted as stored or
    brought back); the attention backward holds them with it, because it holds the gradient
    arriving at the chunk instead (Megatron's ``CheckpointFunction.backward`` keeps it in its
    arguments through the whole chunk), one layer input's worth either way."""
    full = sum(S.values())
    small = sum(v for k, v in S.items() if any(w in k for w in _SMALL))
    mlp = _mlp_share(S)
    x = input_bytes
    n_off = 0 if not job.offload else (layers if offloaded is None else int(offloaded))
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
        # re-forms the chunk's activations ("recompute" phases) and its output (freed by the
        # METP model before the chunk's backward: frees_output)
        shifts = {"forward": 0.0, "recompute": chunk * full - x,
                  "mlp": chunk * full - (x if frees_output else 0.0), "backward": chunk * full}
    host = 0.0
    if job.offload and 0 < n_off < layers:
        # partial: the first n_off layers on the host, the rest (the last layer too) as without
        # the offload; what the lowest kept layer and the offloaded ones bring back on top
        d, sm, _ = _per_layer(S, job, layers, x)
        host = sum(d[i] - sm[i] for i in range(n_off)) / layers
        kept = sum(d[n_off:]) / layers
        dev = {f"layers {n_off + 1}-{layers} of the stage, kept on the device": kept,
               f"per-row statistics of the {n_off} offloaded layers": sum(sm[:n_off]) / layers}
        extra = _partial_extra(S, job, layers, x, n_off)
        if extra:
            shifts = {key: v + (extra if key != "forward" else 0.0) for key, v in shifts.items()}
    elif job.offload and n_off:
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
