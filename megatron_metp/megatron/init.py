"""Initialise a METP model's weights exactly as stock Megatron TP of size ``t·p`` does.

With TP size ``t`` and METP size ``p`` the rank at TP rank ``τ`` and METP rank ``r`` holds the
shard stock TP of size ``t·p`` gives its rank ``k = τ·p + r`` (see :mod:`.linear`). Stock TP
draws every TP-sharded weight from rank ``k``'s model-parallel RNG stream, seeded
``base + 2718 + k`` by ``model_parallel_cuda_manual_seed(base)``, in construction order: the
word embedding's rows, then each layer's ``linear_proj``, ``linear_qkv``, ``linear_fc1``,
``linear_fc2``, then an untied output layer's rows. :func:`initialize_like_tp` replays those
streams:

* a METP-sharded weight (:class:`~.linear.METPLinear`, the METP vocabulary shards) is drawn
  from stream ``k``;
* a weight sharded over TP only (Megatron's ``VocabParallelEmbedding`` / output
  ``ColumnParallelLinear`` of a model without ``--metp-vocab-parallel``; shard ``[V/t, h]``) is
  ``p`` blocks of ``V/(t·p)`` rows, block ``j`` drawn from stream ``τ·p + j``; for that the
  streams ``j ≠ r`` also draw (into a scratch tensor) every METP-sharded weight before it.

So METP and its TP twin start from the same global weight matrices and print the same losses
from the first iteration. With ``use_cpu_initialization`` Megatron draws each full matrix from
the default CPU generator on every rank; the METP modules then take their shard of it at
construction (:func:`.linear.init_cpu_shard`) and nothing else is needed. The stream of a
pipeline stage continues across its virtual-pipeline chunks, as in stock Megatron.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["initialize_like_tp", "tp_base_seed"]

#: stream registry: (id(tracker.states_), device) -> (tracker.states_, {k: generator state})
_STREAMS: Dict[Tuple[int, str], Tuple[dict, Dict[int, torch.Tensor]]] = {}


def tp_base_seed(tp_rank: int) -> Optional[int]:
    """The ``seed`` given to ``model_parallel_cuda_manual_seed``, read back from Megatron's RNG
    tracker (which records the data-parallel seed ``seed`` and the model-parallel seed
    ``seed + 2718 + tp_rank``); ``None`` if the tracker does not tell."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    seeds = getattr(get_cuda_rng_tracker(), "seeds_", None)
    if not seeds:
        return None
    found = [s for s in seeds if s + 2718 + tp_rank in seeds]
    return found[0] if len(found) == 1 else None


class _Streams:
    """Stock TP rank ``k``'s model-parallel stream for each ``k`` of this TP rank's METP group."""

    def __init__(self, base: int, tp_rank: int, p: int, device: torch.device):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.device = device
        self.first = tp_rank * p
        states_dict = get_cuda_rng_tracker().states_
        key = (id(states_dict), str(device))
        entry = _STREAMS.get(key)
        if entry is None or entry[0] is not states_dict:
            entry = (states_dict, {})
            _STREAMS.clear()  # the tracker was re-seeded: streams restart, as stock TP's do
            _STREAMS[key] = entry
        self.states = entry[1]
        for k in range(self.first, self.first + p):
            if k not in self.states:
                gen = torch.Generator(device=device)
                gen.manual_seed(base + 2718 + k)
                self.states[k] = gen.get_state()

    def _get(self):
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def draw(self, k: int, tensor: torch.Tensor, init_method: Callable) -> None:
        """Run ``init_method(tensor)`` on stream ``k``, leaving the current stream as it was."""
        outer = self._get()
        self._set(self.states[k])
        try:
            init_method(tensor)
            self.states[k] = self._get()
        finally:
            self._set(outer)


def _tp_only_modules(model) -> Dict[int, Tuple[str, Callable]]:
    """Stock TP-sharded vocabulary modules of ``model`` → (name, the init method Megatron used)."""
    out = {}
    config = model.config
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if emb is not None and getattr(emb, "weight", None) is not None:
        out[id(emb)] = ("embedding.word_embeddings", config.embedding_init_method)
    head = getattr(model, "output_layer", None)
    if head is not None and getattr(head, "weight", None) is not None:
        out[id(head)] = ("output_layer", config.init_method)
    return out


def initialize_like_tp(model, groups) -> bool:
    """Re-draw ``model``'s TP- and METP-sharded weights as stock TP of size ``t·p`` draws them.

    ``model``: one megatron-core ``GPTModel`` chunk with METP layers, just built (call it for
    each virtual-pipeline chunk in order; :func:`.build.build_metp_gpt` does). Returns whether
    the weights are now stock TP's (a model re-drawn before is left as it is and gives ``True``);
    it does nothing (returns
    ``False``) with ``perform_initialization`` off or ``use_cpu_initialization`` on (then the
    construction already matched), and warns and returns ``False`` if Megatron's RNG tracker
    does not record its seeds (e.g. Transformer Engine's tracker).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

    from .linear import METPLinear
    from .vocab import VocabShard

    config = model.config
    if not config.perform_initialization or config.use_cpu_initialization:
        return False
    if getattr(model, "metp_initialized_like_tp", False):
        return True  # re-drawn already (by the builder): a second draw would move the streams
    base = tp_base_seed(groups.tp_rank)
    if base is None:
        warnings.warn("METP: Megatron's RNG tracker does not record its seeds, so the METP "
                      "weights are initialised from their own streams, not as stock TP of size "
                      "TP x METP would initialise them", stacklevel=2)
        return False
    p, r = groups.metp.size, groups.metp.rank
    tp_only = _tp_only_modules(model)
    plan: List[Tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, (METPLinear, VocabShard)) and module.weight is not None:
            plan.append(("metp", module))
        elif id(module) in tp_only:
            if not isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
                raise TypeError(f"METP init: {name} is a {type(module).__name__}")
            plan.append(("tp", module))
    if not plan:
        return False
    last_tp = max((i for i, (kind, _) in enumerate(plan) if kind == "tp"), default=-1)
    device = plan[0][1].weight.device
    streams = _Streams(base, groups.tp_rank, p, device)
    own = streams.first + r
    with torch.no_grad():
        for i, (kind, module) in enumerate(plan):
            w = module.weight.data
            if kind == "metp":
                init = module.init_method
                streams.draw(own, w, init)
                if i < last_tp:  # keep the other ranks' streams where stock TP has them
                    scratch = torch.empty_like(w)
                    for j in range(p):
                        if j != r:
                            streams.draw(streams.first + j, scratch, init)
                    del scratch
            else:
                name, init = tp_only[id(module)]
                rows = w.shape[0]
                if rows % p:
                    raise ValueError(f"METP init: {name} has {rows} rows on this TP rank, not "
                                     f"divisible by --metp-parallel-size {p}; Megatron pads "
                                     f"the vocabulary to a multiple of "
                                     f"--make-vocab-size-divisible-by x TP x METP (apply all "
                                     f"of patches/)")
                block = rows // p
                for j in range(p):
                    piece = torch.empty_like(w[j * block:(j + 1) * block])
                    streams.draw(streams.first + j, piece, init)
                    w[j * block:(j + 1) * block].copy_(piece)
    model.metp_initialized_like_tp = True
    return True
