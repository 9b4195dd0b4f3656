"""Full recompute: free the re-formed output of a checkpointed chunk while its backward runs.

Megatron's ``CheckpointFunction.backward`` re-runs a chunk's forward, keeps the chunk's output
tensor in a local variable and calls ``torch.autograd.backward(outputs, grads)``: the output's
data (``[s/p, b, h]``, 16-bit: 4 GiB per rank for Llama-3-8B at 4M tokens on METP 8) stays on the
device through the chunk's whole backward although nothing reads it: the output comes from the
residual add, whose backward needs no saved values, and autograd checks only the output's shape
against the gradient. :func:`free_recomputed_outputs` hooks the last layer of every checkpointed
chunk of a ``TransformerBlock``: in the re-run forward (inside the backward, Megatron's
``is_checkpointing()``, grad enabled) the layer's output keeps its shape and autograd graph but
its data is replaced by a one-element stand-in (the way Megatron's pipeline schedules free an
output they sent: ``deallocate_output_tensor``), so the storage is released before the chunk's
backward starts. The first forward (no grad) and every layer that is not the end of a chunk
(its output is the next layer's input) are untouched; results are bit-identical.

Chunks: ``--recompute-method uniform`` with ``N`` layers: layers ``N-1, 2N-1, …`` and the stage's
last; ``block``: every checkpointed layer is a chunk of its own.
"""

from __future__ import annotations

from typing import List

import torch


def free_output(module, args, output):
    """A forward hook (``module``, ``args`` unused): under Megatron's recompute, with grad
    enabled, the layer's output hidden states ``[s, b, h]`` (or the first of a tuple) keep their
    shape and autograd node but free their storage (a one-element view expanded to the shape);
    nothing otherwise. Returns ``None`` (the output is not replaced)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    if not (is_checkpointing() and torch.is_grad_enabled()):
        return None
    hs = output[0] if isinstance(output, (tuple, list)) else output
    if (isinstance(hs, torch.Tensor) and hs.requires_grad and hs.grad_fn is not None
            and hs._base is None and hs.numel() > 1):
        hs.data = torch.empty((1,), dtype=hs.dtype, device=hs.device).expand(hs.shape)
    return None


#: the hook :func:`free_recomputed_outputs` registers (a test rebinds it to count the frees)
_free_output = free_output


def free_recomputed_outputs(block) -> List:
    """Hook ``block``'s (a Megatron ``TransformerBlock``) chunk-ending layers; returns the hook
    handles (none without ``recompute_granularity='full'``)."""
    cfg = block.config
    if getattr(cfg, "recompute_granularity", None) != "full":
        return []
    layers = list(block.layers)
    k = max(1, int(cfg.recompute_num_layers or 1))
    uniform = cfg.recompute_method == "uniform"
    handles = []
    for i, layer in enumerate(layers):
        if not uniform or (i + 1) % k == 0 or i == len(layers) - 1:
            handles.append(layer.register_forward_hook(_free_output))
    return handles
