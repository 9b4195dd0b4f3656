"""Host offload of what the transformer layers keep for backward (``--metp-offload-activations``).

:class:`ActivationOffloader` hooks a Megatron ``TransformerBlock``: while the block runs its
forward, every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``) that is at
least ``min_bytes`` large, not a parameter and not seen before in this forward is copied to host
memory (pinned on CUDA, on a side stream ordered after the producing stream; the device tensor is
handed to the allocator with ``record_stream`` so its memory is reused only after the copy) and
autograd keeps only a handle. Layer boundaries (a forward pre-hook on each layer) cut the saved
tensors into groups; when the backward first unpacks a tensor of group ``g``, that tensor is
copied back at once, the rest of group ``g`` and the whole group ``g − 1`` on the side stream, so
the previous layer is on the device when its backward starts: the GPU holds the saved tensors of
at most two groups (the running one and the prefetched one) instead of every layer's. With full recompute (``--recompute-granularity full``) what a layer keeps is its
input, so the device holds two layer inputs and the host ``L`` of them.

Tensors a second layer saves again (the RoPE table, masks shared by all layers) stay on the device
from their second use on. On the CPU the copies are real copies (host and device are the same
memory), so results are exact and the code path is the one a GPU runs; under ``FakeTensorMode``
(the fake-rank instruments) nothing is copied: the host side is counted (``host_bytes``,
``host_peak``) and the device side is re-allocated at prefetch time, so a memory tracker sees
exactly what stays on and returns to the device.

**Partial offload** (``ActivationOffloader(layers=N)``, Megatron-LM ``--metp-offload-activations
N``): only the first ``N`` layers of the block (a pipeline stage's) send their saved tensors to
the host; the last ``L − N`` keep theirs on the device, as without the offload. The last layers
stay because the backward runs them first: their tensors are needed the moment the backward
starts, when no compute is running yet that a copy from the host could hide behind, whereas layer
``N − 1``'s tensors come back on the side stream while the lowest kept layer ``N`` runs its
backward (it is prefetched there), so every copy of an offloaded layer stays hidden, as with the
full offload. Keeping the first layers instead would start the backward with ``L − N`` layers'
worth of host copies to wait for or to prefetch in the forward's tail. The kept layers also keep
the final norm's tensors (it runs in the last layer's group), and the host holds exactly ``N``
layers' worth (with full recompute ``N`` layer inputs, plus the RoPE table that the first chunk
saves): what the plan counts (``tools/plan/recompute.py``).

**Layer groups.** A group is one layer of one forward: :attr:`ActivationOffloader.current_group`
counts the block's layers from 0 in each forward (``-1`` before the first layer starts; those
tensors go with layer 0). With pipeline parallelism every stage has its own block and offloader,
so layer groups are counted per stage, and the micro-batches a stage runs forward before their
backward (1F1B) each count from 0 again; internally each group of each forward has its own key,
so they never mix. With Megatron's full recompute (``--recompute-granularity full``) a chunk's
forward runs without saving anything, and ``CheckpointFunction`` saves the chunk's input *after*
the chunk has run: in the group of the chunk's **last** layer. With ``--recompute-method uniform``
and chunks of ``k`` layers an offloaded count ``N`` must therefore be a multiple of ``k`` (a chunk
is either offloaded or kept; :meth:`attach` refuses the rest); with ``block`` every checkpointed
layer is its own chunk.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import overrides

#: tensors smaller than this stay on the device (norm statistics, RNG states, ids)
DEFAULT_MIN_BYTES = 1 << 20

#: the offloader whose :meth:`ActivationOffloader.saving` context is active (one at a time)
_CURRENT: Optional["ActivationOffloader"] = None


def current_offloader() -> Optional["ActivationOffloader"]:
    """The :class:`ActivationOffloader` whose forward (``saving()`` context) is running now, or
    ``None``. Ops that keep host copies themselves (the streaming METP layer) ask it whether the
    layer running now is offloaded (:meth:`ActivationOffloader.offloads_current_group`) and
    count their host bytes in its statistics (:meth:`ActivationOffloader.count_host`)."""
    return _CURRENT


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


#: ``0``: no prefetch; a group comes back when its backward first asks for it
PREFETCH_ENV = "METP_OFFLOAD_PREFETCH"


def offload_prefetch() -> bool:
    """``METP_OFFLOAD_PREFETCH``: ``1`` (default) prefetches group ``g − 1`` when the backward
    reaches group ``g`` (the device holds two groups: with full recompute two layer inputs),
    ``0`` brings each group back only when its backward first unpacks it (one group on the
    device; the copy of one layer input is then not hidden: at 64 GB/s 0.1 s for Llama-3-8B's
    6 GiB input at 768K tokens per rank, next to minutes of that layer's compute)."""
    return overrides.flag(PREFETCH_ENV)


@dataclass(eq=False)
class _Entry:
    group: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    host: Optional[torch.Tensor] = None      # real runs: the host copy
    on_device: Optional[torch.Tensor] = None  # after prefetch
    ready: Optional[object] = None           # CUDA event of the prefetch copy
    fake: bool = False
    original: Optional[weakref.ref] = None   # the device tensor saved (alive if shared)
    stamp: tuple = ()                        # its storage and version when saved


@dataclass(eq=False)
class _Kept:
    """A saved tensor of the first kept group of a forward (partial offload), with its group."""

    group: int
    tensor: torch.Tensor


@dataclass
class _Stats:
    host_bytes: int = 0        # host bytes held now
    host_peak: int = 0
    offloaded: int = 0         # tensors moved to the host (all forwards)
    offloaded_bytes: int = 0
    fetched_bytes: int = 0     # bytes brought back
    prefetched_groups: int = 0
    reused: int = 0            # brought back as the device tensor still alive (no copy)
    by_group: Dict[int, int] = field(default_factory=dict)


class ActivationOffloader:
    """Offloads the saved tensors of a transformer block's forward to the host, per layer group,
    and prefetches group ``g − 1`` when the backward reaches group ``g``.

    ``attach(block)`` wraps ``block.forward`` (inside: the saving hooks) and registers a forward
    pre-hook on each ``block.layers[i]`` that starts a new group. ``min_bytes``: smaller tensors
    stay on the device (default :data:`DEFAULT_MIN_BYTES`). ``layers``: offload only the first
    ``layers`` layer groups of each forward and keep the others' saved tensors on the device
    (``None``: every layer; see the module docstring for why the last layers stay). ``stats``:
    host bytes now and at peak, tensors and bytes moved.
    """

    def __init__(self, min_bytes: Optional[int] = None, prefetch: Optional[bool] = None,
                 layers: Optional[int] = None):
        if min_bytes is None:
            min_bytes = DEFAULT_MIN_BYTES
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)
                                   or layers < 1):
            raise ValueError(f"layers (the layer groups offloaded per forward) must be an int "
                             f">= 1 or None (every layer), got {layers!r}")
        self.min_bytes = min_bytes
        self.layers = layers
        self.prefetch = offload_prefetch() if prefetch is None else bool(prefetch)
        self.stats = _Stats()
        self._groups: Dict[int, List[_Entry]] = {}
        self._group = -1      # internal key of the running group: unique over all forwards
        self._layer = -1      # the running layer of this forward (current_group)
        self._trigger = -1    # key of this forward's first kept group that saved something
        self._seen: Dict[int, weakref.ref] = {}
        self._active = False
        self._stream = None

    # ------------------------------------------------------------------ wiring

    def attach(self, block: torch.nn.Module) -> "ActivationOffloader":
        """Hook ``block`` (a Megatron ``TransformerBlock``: ``forward`` and ``layers``).
        ``ValueError`` when ``layers`` exceeds the block's layers or splits a uniform recompute
        chunk (see the module docstring: a chunk's input is saved in its last layer's group)."""
        if self.attached_to(block) is not None:
            raise ValueError("this block already has an ActivationOffloader attached")
        n_layers = len(getattr(block, "layers", []))
        if self.layers is not None:
            check_offload_layers(self.layers, n_layers, getattr(block, "config", None),
                                 what="ActivationOffloader(layers=...)")
        forward = block.forward

        def offloaded_forward(*args, **kwargs):
            with self.saving():
                return forward(*args, **kwargs)

        block.forward = offloaded_forward
        for layer in getattr(block, "layers", []):
            layer.register_forward_pre_hook(lambda *_: self.next_group())
        block._metp_offloader = self
        return self

    @staticmethod
    def attached_to(block: torch.nn.Module) -> Optional["ActivationOffloader"]:
        """The offloader :meth:`attach` hooked onto ``block`` (``None``: none)."""
        return getattr(block, "_metp_offloader", None)

    @contextlib.contextmanager
    def saving(self):
        """Inside: saved tensors go to the host (a new forward: a new first group)."""
        global _CURRENT
        if self._active:  # nested (e.g. a checkpointed chunk inside the block): one context
            yield
            return
        self._active = True
        self._seen = {}
        self._layer = -2  # next_group() makes it -1: before the first layer
        self._trigger = -1
        self.next_group()
        outer, _CURRENT = _CURRENT, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _CURRENT = outer
            self._active = False
            self._seen = {}

    def next_group(self) -> None:
        if self._active:
            self._group += 1
            self._layer += 1

    @property
    def current_group(self) -> int:
        """The layer group the forward is in now: the index of the block's layer running now,
        counted from 0 in each forward (``-1`` before the first layer: those tensors go with
        layer 0)."""
        return self._layer

    def offloads_group(self, group: int) -> bool:
        """Whether the saved tensors of layer group ``group`` (a layer index of the block,
        :attr:`current_group`) go to the host: every group, or with ``layers=N`` the first
        ``N`` (``-1``, before the first layer, counts as layer 0)."""
        return self.layers is None or max(group, 0) < self.layers

    def offloads_current_group(self) -> bool:
        """:meth:`offloads_group` of the group the forward is in now (``False`` outside a
        forward)."""
        return self._active and self.offloads_group(self._layer)

    def count_host(self, nbytes: int) -> None:
        """Account ``nbytes`` of host memory taken by an op's own host copies (``host_bytes``,
        ``host_peak``; give them back with :meth:`release_host`)."""
        st = self.stats
        st.host_bytes += int(nbytes)
        st.host_peak = max(st.host_peak, st.host_bytes)

    def release_host(self, nbytes: int) -> None:
        """The op's host copies of ``nbytes`` are gone."""
        self.stats.host_bytes -= int(nbytes)

    # ------------------------------------------------------------------ hooks

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _pack(self, t: torch.Tensor):
        if not self.offloads_group(self._layer):
            if self._trigger < 0 or self._trigger == self._group:
                # the first kept group of this forward that saves anything: the backward
                # reaches the offloaded groups right after it, so its tensors carry the key
                # that starts their prefetch (_unpack)
                self._trigger = self._group
                return _Kept(self._group, t)
            return t
        if (t.numel() * t.element_size() < self.min_bytes or isinstance(t, torch.nn.Parameter)
                or (t.is_leaf and t.requires_grad)):
            return t
        ref = self._seen.get(id(t))
        if ref is not None and ref() is t:
            return t  # shared by several layers: stays on the device from now on
        self._seen[id(t)] = weakref.ref(t)
        nbytes = t.numel() * t.element_size()
        e = _Entry(self._group, t.shape, t.dtype, t.device, nbytes, fake=_is_fake(t),
                   original=weakref.ref(t), stamp=_stamp(t))
        if not e.fake:
            if t.is_cuda:
                e.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                side = self._side_stream()
                side.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(side):
                    e.host.copy_(t, non_blocking=True)
                t.record_stream(side)
            else:
                e.host = t.detach().to("cpu", copy=True)
        self._groups.setdefault(e.group, []).append(e)
        st = self.stats
        st.host_bytes += nbytes
        st.host_peak = max(st.host_peak, st.host_bytes)
        st.offloaded += 1
        st.offloaded_bytes += nbytes
        st.by_group[e.group] = st.by_group.get(e.group, 0) + nbytes
        return e

    def _bring_back(self, e: _Entry, async_: bool) -> None:
        if e.on_device is not None:
            return
        alive = e.original() if e.original is not None else None
        if alive is not None and _stamp(alive) == e.stamp:
            # still on the device, unchanged (a tensor later layers saved again, the RoPE
            # table): use it rather than a second copy
            e.on_device = alive
            self.stats.reused += 1
        elif e.fake:
            e.on_device = torch.empty(e.shape, dtype=e.dtype, device=e.device)
        elif e.device.type == "cuda":
            dev = torch.empty(e.shape, dtype=e.dtype, device=e.device)
            if async_:
                side = self._side_stream()
                side.wait_stream(torch.cuda.current_stream(e.device))
                with torch.cuda.stream(side):
                    dev.copy_(e.host, non_blocking=True)
                    e.ready = torch.cuda.Event()
                    e.ready.record(side)
                dev.record_stream(torch.cuda.current_stream(e.device))
            else:
                dev.copy_(e.host)
            e.on_device = dev
        else:
            e.on_device = e.host.to(e.device, copy=True)
        self.stats.fetched_bytes += e.nbytes
        self.stats.host_bytes -= e.nbytes
        e.host = None

    def _prefetch_before(self, group: int) -> None:
        earlier = [g for g in self._groups if g < group]
        if not earlier:
            return
        g = max(earlier)
        entries = self._groups.get(g, [])
        if entries and any(e.on_device is None for e in entries):
            for e in entries:
                self._bring_back(e, async_=True)
            self.stats.prefetched_groups += 1

    def _unpack(self, e):
        if isinstance(e, _Kept):
            if self.prefetch:  # the last kept group's backward: bring the last offloaded back
                self._prefetch_before(e.group)
            return e.tensor
        if not isinstance(e, _Entry):
            return e
        self._bring_back(e, async_=False)
        for other in self._groups.get(e.group, []):  # the rest of the running group
            self._bring_back(other, async_=True)
        if self.prefetch:
            self._prefetch_before(e.group)
        if e.ready is not None:
            torch.cuda.current_stream(e.device).wait_event(e.ready)
            e.ready = None
        group = self._groups.get(e.group)
        if group is not None and e in group:
            group.remove(e)
            if not group:
                del self._groups[e.group]
        # the handle (and so this device copy) lives as long as autograd keeps the saved
        # tensor, exactly as the original would have without the hooks
        return e.on_device

    # ------------------------------------------------------------------ reporting

    def pending(self) -> int:
        """Saved tensors still held for a backward that has not run."""
        return sum(len(v) for v in self._groups.values())


def _stamp(t: torch.Tensor) -> tuple:
    """What must not have changed for a saved tensor to stand for its host copy: its storage
    (the same one, not resized: ``.data`` swaps and freed storages change it), shape, strides,
    offset and version (an in-place write bumps it)."""
    st = t.untyped_storage()
    return (st._cdata, st.nbytes(), tuple(t.shape), t.stride(), t.storage_offset(), t._version)


def check_offload_layers(n: int, layers: int, config=None, what: str = "layers") -> None:
    """``ValueError`` naming ``what`` unless ``n`` layer groups can be offloaded from a block
    of ``layers`` layers with Megatron config ``config``: ``1 <= n <= layers``, and with full
    recompute, ``uniform`` chunks of ``k`` layers, a multiple of ``k`` (a chunk's input is saved
    in its last layer's group, so a chunk is offloaded or kept as a whole)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= layers:
        raise ValueError(f"{what}: {n!r} layers offloaded, but a pipeline stage has {layers} "
                         f"layers; offload 1 to {layers} of them (or every layer)")
    if config is not None and getattr(config, "recompute_granularity", None) == "full" and \
            getattr(config, "recompute_method", None) == "uniform":
        k = int(getattr(config, "recompute_num_layers", None) or 1)
        if n % k:
            raise ValueError(f"{what}: {n} layers offloaded with full recompute in chunks of {k} "
                             f"layers (--recompute-method uniform --recompute-num-layers {k}): a "
                             f"chunk keeps one input, offloaded or not; offload a multiple of {k} "
                             f"({', '.join(str(m) for m in range(k, layers + 1, k))})")
