"""Megatron's MoE token dispatch under ``FakeTensorMode`` (the fake-rank instruments).

A fake tensor has shapes but no values, and Megatron's dropless dispatch sizes its tensors by
values: ``masked_select`` over the routing map, ``tokens_per_expert.tolist()`` in
``SequentialMLP``, the all-to-all's split sizes. :func:`balanced_routing` makes those sizes the
plan's (:mod:`megatron_metp.tools.plan.moe`): every local expert receives the same number of
routed rows, ``r = N·k·imbalance`` on this rank (``N`` tokens entering the layer on each of the
``ep`` ranks, top-``k``), every rank sends ``N·k / ep`` rows to each EP rank. The tensors are
those Megatron allocates, of those sizes:

* ``permute``: the indices ``[rows]`` (int64), the permuted tokens ``tokens.index_select`` and
  the permuted probabilities (``[rows]``, from the ``[E, tokens]`` transposed copy), as the
  unfused path allocates them; the routing map itself is computed by the real router;
* allgather dispatcher: ``dispatch_postprocess`` as Megatron's, with the local counts the
  balanced ones (a real CPU tensor, which ``SequentialMLP`` reads with ``tolist``);
* alltoall dispatcher: ``preprocess`` sets the balanced splits (Python lists: the fake group's
  all-to-all then allocates the received ``[r, h]``), the device-to-host syncs are skipped
  (nothing to wait for), and the sort by local expert is a split + concatenation of the same
  sizes (Megatron's unfused ``sort_chunks_by_idxs``).

Used by :mod:`.measure` and the Megatron-LM dry run (:mod:`.dry_run`) for MoE models only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["balanced_routing", "routed_rows"]


def routed_rows(tokens: int, topk: int, num_experts: int, local_experts: int, ep: int,
                imbalance: float = 1.0) -> int:
    """Routed rows this rank's local experts run: ``tokens·k·imbalance`` spread over the EP
    ranks (``tokens``: the tokens of one rank, ``local_experts = E / ep``), rounded up to a
    multiple of the local experts (every local expert gets the same count)."""
    rows = tokens * topk * ep * local_experts / num_experts * imbalance
    per = -(-int(round(rows)) // local_experts)
    return per * local_experts


def _real_counts(count: int, n: int):
    """A real (not fake) CPU ``int64`` tensor of ``n`` counts: ``tolist`` works on it."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.full((n,), int(count), dtype=torch.long)


class _Counts:
    """The ``[ep, local experts]`` split sizes, which the dispatcher reads as a tensor
    (``.ravel()``, ``.T``, ``.tolist()``) without a fake-tensor op: Python ints."""

    def __init__(self, rows):
        self.rows = [list(r) for r in rows]

    @property
    def T(self) -> "_Counts":
        return _Counts(zip(*self.rows))

    def ravel(self) -> "_Counts":
        return _Counts([[c for r in self.rows for c in r]])

    def tolist(self) -> list:
        flat = [c for r in self.rows for c in r]
        return flat if len(self.rows) == 1 else self.rows


def _permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
             drop_and_pad=False, tokens_per_expert=None, align_size=0):
    """Megatron's unfused ``permute`` with ``num_out_tokens`` rows (a Python int here):
    ``(permuted tokens, permuted probabilities, indices)``; :func:`balanced_routing` adds
    core_v0.19.0's two more (no padding offsets, the counts given) where that release has them."""
    if align_size:
        raise ValueError("the fake-rank MoE dispatch measures unpadded expert inputs")
    import torch

    if fused or drop_and_pad:
        raise ValueError("the fake-rank MoE dispatch measures the unfused dropless permutation "
                         "(--moe-permute-fusion and capacity padding are not measured)")
    num_tokens = tokens.shape[0]
    rows = int(num_out_tokens)
    sorted_indices = torch.arange(rows, device=tokens.device) % num_tokens
    permuted_probs = None
    if probs is not None:
        flat = probs.T.contiguous().view(-1)
        permuted_probs = flat.index_select(0, torch.arange(rows, device=probs.device) %
                                           flat.numel())
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def _sort_chunks(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """Megatron's unfused ``sort_chunks_by_idxs`` with real split sizes (a split and a
    concatenation: the same bytes; the order does not change a size)."""
    import torch

    sizes = split_sizes.tolist()
    out = torch.cat(torch.split(input, sizes, dim=0), dim=0)
    if probs is not None:
        probs = torch.cat(torch.split(probs, sizes, dim=0), dim=0)
    return out, probs


def _empty_aux_log(moe_utils) -> None:
    """Drop Megatron's layer-wise MoE aux-loss log, whose entries are sized by the first model
    that logs (a later, deeper model would index past them): core_v0.16.1's dict, core_v0.19.0's
    ``moe_logging`` tracker (its legacy dict view is a copy)."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # core_v0.16.1
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    else:
        moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())

@contextlib.contextmanager
def balanced_routing(imbalance: float = 1.0) -> Iterator[None]:
    """Patch megatron-core's dispatchers for one fake measurement (see the module docstring);
    undone on exit. Megatron's layer-wise MoE aux-loss log is emptied on entry and exit: it is
    sized by the layer count of the first model that logs, and the dry run measures two depths
    (2 and 3 layers) in one process (the 3-layer model's third layer would index past it)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as TD

    AG, A2A = TD.MoEAllGatherTokenDispatcher, TD.MoEAlltoAllTokenDispatcher
    saved = [(TD, "permute", TD.permute), (TD, "sort_chunks_by_idxs", TD.sort_chunks_by_idxs),
             (AG, "dispatch_postprocess", AG.dispatch_postprocess),
             (A2A, "preprocess", A2A.preprocess),
             (A2A, "_maybe_dtoh_and_synchronize", A2A._maybe_dtoh_and_synchronize)]

    def ag_dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, lo:hi].contiguous()
        local_probs = probs[:, lo:hi].contiguous()
        n_local = hi - lo
        ep = max(1, self.tp_size * self.ep_size)
        rows = routed_rows(hidden_states.shape[0] // ep, self.router_topk,
                           self.config.num_moe_experts, n_local, ep, imbalance)
        tokens_per_expert = _real_counts(rows // n_local, n_local)
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping = _permute(
            hidden_states, self.local_map, probs=local_probs, num_out_tokens=rows)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def a2a_preprocess(self, routing_map):
        if self.drop_and_pad:
            raise ValueError("the fake-rank MoE dispatch measures dropless routing "
                             "(--moe-pad-expert-input-to-capacity is not measured)")
        tokens = routing_map.size(0)
        k = self.config.moe_router_topk
        self.num_out_tokens = tokens * k
        ep, n_local = self.ep_size * self.tp_size, self.num_local_experts
        rows = routed_rows(tokens, k, self.num_experts, n_local, ep, imbalance)
        send = tokens * k
        self.input_splits = [send // ep + (1 if i < send % ep else 0) for i in range(ep)]
        if self.tp_size > 1:
            raise ValueError("the fake-rank MoE dispatch measures expert TP 1")
        self.output_splits_tp = None
        # rows // n_local per local expert, spread over the ep senders
        per = rows // n_local
        counts = [[per // ep + (1 if i < per % ep else 0)] * n_local for i in range(ep)]
        self.output_splits = [sum(c) for c in counts]
        self.num_global_tokens_per_local_expert = _Counts(counts)
        return _real_counts(rows // n_local, n_local)

    def a2a_sync(self, point, tokens_per_expert):
        return tokens_per_expert

    import inspect

    five = "align_size" in inspect.signature(TD.permute).parameters  # core_v0.19.0's permute

    def permute(*args, **kwargs):
        out = _permute(*args, **kwargs)
        return out + (None, kwargs.get("tokens_per_expert")) if five else out

    TD.permute = permute
    TD.sort_chunks_by_idxs = _sort_chunks
    AG.dispatch_postprocess = ag_dispatch_postprocess
    A2A.preprocess = a2a_preprocess
    A2A._maybe_dtoh_and_synchronize = a2a_sync
    _empty_aux_log(moe_utils)
    try:
        yield
    finally:
        _empty_aux_log(moe_utils)  # (fake tensors)
        for owner, name, value in saved:
            setattr(owner, name, value)
