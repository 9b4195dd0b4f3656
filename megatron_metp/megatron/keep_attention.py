"""Keep attention, recompute the rest (``--metp-keep-attention-output [N]``) for Megatron's checkpoint.

Megatron's full recompute (``--recompute-granularity full``) wraps layers in
``tensor_parallel.checkpoint``: a chunk's forward runs once without autograd (Megatron's
``is_checkpointing()`` set, grad off) and again inside the backward (``is_checkpointing()``, grad
on) before it is differentiated. A METP layer's attention (:class:`~.modules.METPSelfAttention`)
would run every head group's K/V ring in both. With an :class:`AttentionKeeper` on the module:

* **first forward**: the op runs as usual and hands over each head-group block's output ``O_i``
  (the activation dtype) and its fp32 log-sum-exp ``LSE_i``
  (:class:`megatron_metp.ops.attention_keep.AttentionKeep`); the keeper queues them — in pinned
  host memory (:class:`megatron_metp.runtime.host_stash.Stash`, counted in the offloader's host
  bytes) when this layer's saved tensors go to the host (``--metp-offload-activations`` covers
  the layer: :meth:`ActivationOffloader.offloads_current_group`), else on the device;
* **re-run in the backward**: the op takes the oldest queued entry and runs no K/V ring and no
  Q/K/V projection (``y`` from the kept ``O`` and the output projection only); its backward is the
  usual one (Q/K/V re-formed from the layer's normed input, the ring backward from ``O``, ``dO``
  and the LSE). The entry leaves the queue there: the op's saved tensors hold it until its
  backward has run, then nothing does.

**One entry per micro-batch, first in first out.** Every backward of a layer re-runs the forward
of the oldest of its micro-batches still waiting (no pipeline schedule of Megatron changes the
order of a layer's micro-batches: 1F1B runs up to ``pp`` forwards ahead, a virtual pipeline has a
module, and so a queue, per model chunk), so a queue per module pairs each re-run with its own
forward. Forwards that have no backward keep nothing: a no-grad forward outside Megatron's
checkpoint (evaluation: the block is not checkpointed there) is never seen, and a training-mode
forward under ``torch.no_grad()`` is told apart by a forward pre-hook on the block that records
whether autograd was on when the block was entered. A re-run that finds its queue empty, or an
entry kept from another input (a fingerprint of the attention input ``x``, its fp32 sum, is kept
with the entry and compared on the device without a synchronisation), fails with a message
instead of differentiating another micro-batch's attention.

Memory per kept layer and micro-batch in flight: ``O`` — ``[s/(p·c), b, (A/(t·p))·d]`` of the
activation dtype, the size of the layer input when ``A·d = h`` — and the LSE, ``b·A/(t·p)·s/(p·c)``
fp32 values (``t`` TP, ``p`` METP, ``c`` CP).

Layers that keep (the first ``N`` of a pipeline stage, or all): :func:`attach_kept_attention`. The
streaming layer op (:mod:`.streaming`, Megatron's full recompute of one layer per checkpoint) has
no Megatron checkpoint to pair: it keeps ``O`` and the LSE inside its own autograd function.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from ..ops.attention_keep import AttentionKeep
from ..runtime.host_stash import Stash
from ..runtime.offload import current_offloader


@dataclass
class KeepStats:
    """What the keepers of one block did: entries kept (on the host), taken, the deepest queue."""

    kept: int = 0
    kept_on_host: int = 0
    taken: int = 0
    max_depth: int = 0


@dataclass
class _BlockState:
    """Shared by the keepers of one block: whether its running forward will have a backward."""

    recording: bool = True
    stats: KeepStats = field(default_factory=KeepStats)


class _Entry:
    """One micro-batch's kept ``O_i`` and ``LSE_i`` (device tensors or host stashes)."""

    def __init__(self, outs, lses, fingerprint, host: bool, offloader):
        self.fingerprint = fingerprint
        self.host = host
        if not host:
            self.outs, self.lses = list(outs), list(lses)
            return
        self.outs = [_to_host(t, offloader) for t in outs]
        self.lses = [_to_host(t, offloader) for t in lses]

    def take(self):
        """``(outs, lses)`` on the device (host stashes read back and released)."""
        if not self.host:
            return self.outs, self.lses
        return [_from_host(s) for s in self.outs], [_from_host(s) for s in self.lses]


def _to_host(t: torch.Tensor, offloader):
    """A pinned host copy of ``t`` (on a GPU: a side-stream copy that overlaps the forward's next
    layer; nothing writes ``t`` again and its memory is handed back only after the copy)."""
    stash = Stash(t.numel() // t.shape[-1], t.shape[-1], t, host=True, offloader=offloader)
    stash.write(slice(0, stash.rows), t.reshape(-1, t.shape[-1]))
    return stash, tuple(t.shape)


def _from_host(item) -> torch.Tensor:
    stash, shape = item
    t = stash.read(slice(0, stash.rows)).reshape(shape)
    stash.release()
    return t


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    return x.detach().sum(dtype=torch.float32)


class AttentionKeeper:
    """The queue of one METP attention module's kept outputs (see the module docstring)."""

    def __init__(self, block_state: _BlockState, label: str):
        self._state = block_state
        self.label = label
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def op_keep(self, x: torch.Tensor) -> Optional[AttentionKeep]:
        """What the op does with its attention outputs now (``x``: the op's input): keep them
        (first forward of Megatron's checkpoint, with a backward to come), take the oldest kept
        (its re-run in the backward), or neither (``None``: not under Megatron's checkpoint)."""
        from megatron.core.tensor_parallel.random import is_checkpointing

        if not is_checkpointing():
            return None
        if torch.is_grad_enabled():
            return AttentionKeep(kept=self._take(x))
        if not self._state.recording:
            return None
        fp = _fingerprint(x)
        return AttentionKeep(sink=lambda outs, lses: self.put(outs, lses, fp))

    def put(self, outs: List[torch.Tensor], lses: List[torch.Tensor], fingerprint) -> None:
        """Queue one micro-batch's ``O_i`` and ``LSE_i``: on the host when this layer is
        offloaded, else on the device (the tensors themselves, no copy)."""
        off = current_offloader()
        host = off is not None and off.offloads_current_group()
        self._queue.append(_Entry(outs, lses, fingerprint, host, off))
        st = self._state.stats
        st.kept += 1
        st.kept_on_host += int(host)
        st.max_depth = max(st.max_depth, len(self._queue))

    def _take(self, x: torch.Tensor):
        if not self._queue:
            raise RuntimeError(
                f"{self.label}: the backward re-runs this layer's forward with "
                f"--metp-keep-attention-output, but no attention output was kept for it (a "
                f"checkpointed forward without autograd ran no keeping forward first?)")
        entry = self._queue.popleft()
        self._state.stats.taken += 1
        if not is_fake(x):  # the fake-rank instruments have no values to compare
            torch._assert_async(
                _fingerprint(x) == entry.fingerprint,
                f"{self.label}: the attention output kept by --metp-keep-attention-output "
                f"belongs to another input than this re-run's (a training forward ran without "
                f"its backward?)")
        return entry.take()


def attach_kept_attention(block, layers: Union[bool, int]) -> List[AttentionKeeper]:
    """Give the METP attention of ``block``'s (a Megatron ``TransformerBlock``) first ``layers``
    layers (``True``: every layer) an :class:`AttentionKeeper` (``module.keeper``) and the block
    a forward pre-hook recording whether its forward runs with autograd; returns the keepers.
    The block's :class:`KeepStats` is ``block._metp_keep_stats``."""
    from .modules import METPSelfAttention

    state = _BlockState()
    keepers = []
    for i, layer in enumerate(getattr(block, "layers", [])):
        attn = getattr(layer, "self_attention", None)
        if not isinstance(attn, METPSelfAttention) or (layers is not True and i >= layers):
            continue
        attn.keeper = AttentionKeeper(state, f"layer {attn.layer_number} self_attention")
        keepers.append(attn.keeper)

    def record(_module, _args):
        state.recording = torch.is_grad_enabled()

    block.register_forward_pre_hook(record)
    block._metp_keep_stats = state.stats
    return keepers


def keep_stats(block) -> Optional[KeepStats]:
    """The :class:`KeepStats` of ``block``'s keepers (``None``: it keeps nothing)."""
    return getattr(block, "_metp_keep_stats", None)


def pending(block) -> int:
    """Entries kept by ``block``'s keepers and not taken yet (0 after every backward)."""
    return sum(len(getattr(layer.self_attention, "keeper", None) or ())
               for layer in getattr(block, "layers", [])
               if getattr(layer, "self_attention", None) is not None)
