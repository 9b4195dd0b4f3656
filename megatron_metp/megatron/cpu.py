"""Opt-in switch that lets megatron-core (0.16.x and 0.19.x) run forward/backward on CPU with gloo.

megatron-core assumes a CUDA device in a handful of places that a CPU forward/backward reaches.
``enable()`` patches exactly those places, each with a small function written here; ``disable()``
puts the originals back. Nothing happens on import: a process that never calls ``enable()`` runs
stock Megatron. ``enable()`` refuses to run when CUDA is available (pass ``force=True`` to
override), so the shims can never switch on by accident on a GPU machine.

What ``enable()`` patches (ids as in ``reference/megatron-core-on-cpu.md``):

(c) ``torch.cuda.current_device`` returns ``torch.device("cpu")``. Megatron allocates buffers with
    ``device=torch.cuda.current_device()`` (global memory buffer, SP all-gather/reduce-scatter
    buffers, p2p shape buffers, RoPE ``inv_freq``); they now land on the CPU.
(b) RNG tracker: ``megatron.core.tensor_parallel.random.initialize_rng_tracker`` builds a
    :class:`CpuRNGStatesTracker`, whose ``add(name, seed)`` stores a CPU generator state and whose
    ``fork(name)`` swaps it in and out with ``torch.get_rng_state``/``torch.set_rng_state``. Hence
    ``get_cuda_rng_tracker()`` and ``model_parallel_cuda_manual_seed(...)`` work unchanged. The
    module's ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read/write the CPU generator too, so
    activation recomputation (``tensor_parallel.checkpoint``) restores the right stream.
    ``model_parallel_cuda_manual_seed`` still calls ``torch.cuda.manual_seed``, which CPU-only torch
    queues lazily and never runs; the default (data-parallel) stream on CPU is torch's default CPU
    generator, so seed it yourself with ``torch.manual_seed`` as Megatron's training loop does.
(d) ``megatron.core.pipeline_parallel.schedules`` sees a torch proxy whose ``zeros(...,
    device="cuda")`` allocates on the CPU (``total_num_tokens`` in all three schedules).
(e) ``get_pos_emb_on_this_cp_rank`` (RoPE with context parallelism; it pins memory and calls
    ``.cuda()``) is replaced in ``rope_utils``, ``rotary_pos_embedding`` and
    ``yarn_rotary_pos_embedding`` by a CPU slice of the same two dual-chunk pieces.
(g) ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` (``transformer.utils``,
    imported by name into ``fusions.fused_softmax``) build their masks with ``device="cuda"``;
    they are replaced by CPU versions. Unfused ``DotProductAttention`` with
    ``AttnMaskType.causal`` and no explicit mask reaches them.

(h) ``dist_checkpointing`` saves: ``torch.cuda.synchronize`` becomes a no-op; the async file
    writer's result queue (a ``spawn`` Manager process, left orphaned on CPU) becomes an
    in-process ``queue.Queue``; its ``_process_memory`` (psutil, optional) reports 0 when psutil is
    absent instead of raising inside a writer process, which would hang the save.

(i) ``torch.cuda.current_stream`` returns a CPU stand-in whose ``wait_event``/``wait_stream`` do
    nothing (megatron-core 0.19's ``start_grad_sync`` asks for the current stream on every call to
    wait for CUDA-graph events; work on the CPU is already ordered).

(j) Megatron's MoE layer (:mod:`.moe_cpu`): the names its CUDA-only paths assume.

(k) Without Transformer Engine, ``tensor_parallel.random.CheckpointWithoutOutput`` objects get
    ``fp8 = False`` after their own ``__init__``: megatron-core's (selective recompute of
    ``layernorm``, ``moe_act``) sets ``self.fp8 = fp8 is not None`` (True for the default
    ``False``) and then calls Transformer Engine's fp8 state and autocast, names never imported
    without TE (a ``NameError``); no fp8 runs on the CPU.

(l) Megatron's ``jit_fuser`` functions (``torch.compile``) run eagerly, without generating and
    compiling C++ on first use (:mod:`.cpu_eager`); applied before megatron-core is imported.

(m) The local ``DotProductAttention`` accepts stock MLA's ``k_channels``/``v_channels`` when both
    equal ``kv_channels`` (:mod:`.cpu_mla`), so stock multi-latent attention builds on CPU ranks.

(f) is not global: wrap optimizer construction and ``step()`` in :func:`cuda_to_cpu`, a
``TorchFunctionMode`` that maps CUDA devices to the CPU, drops ``pin_memory``, makes
``Tensor.cuda()`` a no-op and makes a zero-argument ``Tensor.type()`` report ``torch.cuda.*``.

Config-only workarounds that need no patch: ``batch_p2p_sync=False`` for pipeline parallelism.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

from . import compat
from .cpu_stream import CpuStream

__all__ = ["enable", "disable", "is_enabled", "cuda_to_cpu", "CpuRNGStatesTracker",
           "CudaToCpuMode"]

_LOCK = threading.Lock()
_SAVED: list = []  # (owner, attribute, original value), in patch order
_ENABLED = False
_DEFAULT_STREAM = "default-rng"  # Megatron's name for "no named stream forked"


def _refuse_on_cuda(force: bool, what: str) -> None:
    if torch.cuda.is_available() and not force:
        raise RuntimeError(
            f"megatron_metp.megatron.cpu.{what} refused: torch.cuda.is_available() is True. The CPU shims "
            "are meant for machines without a GPU; pass force=True to apply them anyway.")


# ------------------------------------------------------------------ (c) current device

def _cpu_current_device():
    return torch.device("cpu")


# ------------------------------------------------------------------ (b) RNG tracker

def _make_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker with named CPU generator states instead of CUDA ones.

        ``add(name, seed)`` records the state of a CPU generator seeded with ``seed``;
        ``fork(name)`` makes that state the current CPU RNG state for the duration of the block,
        then stores the advanced state under ``name`` and restores the previous one. With
        ``inference=True`` (Megatron's inference tracker) ``add``/``set_states`` do nothing and
        ``fork`` is a null context.
        """

        def __init__(self, inference: bool = False):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=inference)

        def add(self, name, seed):
            if self.is_inference_rng_tracker:
                return
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        def set_states(self, states):
            if not self.is_inference_rng_tracker:
                super().set_states(states)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if self.is_inference_rng_tracker:
                yield
                return
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_name = self._current_state_name
            outer_state = torch.get_rng_state()
            if outer_name != _DEFAULT_STREAM:
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current rng state {self._current_state_name} is not the "
                                    f"forked state {name}")
                self.states_[name] = torch.get_rng_state()
                if outer_name != _DEFAULT_STREAM:
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


_TRACKER_CLASS = None


def _tracker_class():
    global _TRACKER_CLASS
    if _TRACKER_CLASS is None:
        _TRACKER_CLASS = _make_tracker_class()
    return _TRACKER_CLASS


def __getattr__(name):
    # ``CpuRNGStatesTracker`` subclasses Megatron's tracker, so it is built on first use instead
    # of importing megatron.core with this module.
    if name == "CpuRNGStatesTracker":
        return _tracker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _initialize_cpu_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                                use_cudagraphable_rng=False, force_reset=False):
    """Replacement for ``random.initialize_rng_tracker`` (same signature; TE and CUDA-graph
    options have no CPU meaning and are ignored)."""
    from megatron.core.tensor_parallel import random as mrandom

    if force_reset:
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return
    mrandom._CUDA_RNG_STATE_TRACKER = _tracker_class()(inference=inference_rng_tracker)
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _reset_tracker(mrandom) -> None:
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# ------------------------------------------------------------------ (d) schedules' torch.zeros

def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _SchedulesTorch:
    """Stands in for ``torch`` inside ``pipeline_parallel.schedules``: everything is torch's,
    except that ``zeros(..., device=<cuda>)`` allocates on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if _is_cuda_device(device):
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


# ------------------------------------------------------------------ (e) RoPE slice for CP

def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """The two dual-chunk pieces (r and 2p-1-r of 2p) of ``pos_emb`` along ``seq_dim``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    n, r = cp_group.size(), cp_group.rank()
    chunk = pos_emb.size(seq_dim) // (2 * n)
    first = pos_emb.narrow(seq_dim, r * chunk, chunk)
    second = pos_emb.narrow(seq_dim, (2 * n - 1 - r) * chunk, chunk)
    return torch.cat([first, second], dim=seq_dim)


# ------------------------------------------------------------------ (g) causal masks

def _default_causal_mask(sq):
    """True above the diagonal: key j > query i is masked."""
    return torch.ones(sq, sq, dtype=torch.bool).triu(1)


def _sliding_window_causal_mask(sq, skv, window_size):
    """True where masked: keep keys whose offset from the query's aligned position lies in
    [-window_size[0], window_size[1]] (queries aligned to the last sq keys)."""
    q = torch.arange(sq).unsqueeze(1)
    k = torch.arange(skv).unsqueeze(0)
    offset = k - q - (skv - sq)
    return ~((offset >= -window_size[0]) & (offset <= window_size[1]))


# ------------------------------------------------------------------ switch

def _no_sync(device=None) -> None:
    """``torch.cuda.synchronize`` on CPU: nothing to wait for."""


def _cpu_current_stream(device=None) -> CpuStream:
    return CpuStream()


_WRITE_QUEUE = None


def _in_process_queue(*_args, **_kwargs):
    global _WRITE_QUEUE
    if _WRITE_QUEUE is None:
        import queue

        _WRITE_QUEUE = queue.Queue()
    return _WRITE_QUEUE


_MISSING = object()  # an attribute the installed megatron-core never defined


def patch(owner, name, value) -> None:
    _SAVED.append((owner, name, getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _ENABLED


def enable(force: bool = False) -> None:
    """Apply shims (b), (c), (d), (e), (g), (h), (i), (j), (k), (l), (m); a second call does nothing.

    Raises ``RuntimeError`` when ``torch.cuda.is_available()`` unless ``force=True``.
    Any RNG tracker created before the call is dropped, so the next ``get_cuda_rng_tracker()`` or
    ``model_parallel_cuda_manual_seed()`` builds a CPU one.
    """
    global _ENABLED
    with _LOCK:
        if _ENABLED:
            return
        _refuse_on_cuda(force, "enable()")
        from .cpu_eager import patch_compile

        patch_compile(patch)  # (l), before megatron-core's jit_fuser is defined
        with warnings.catch_warnings():
            # Importing megatron.core without TE/Apex warns several times; on CPU that is expected.
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not")
            from megatron.core.fusions import fused_softmax
            from megatron.core.models.common.embeddings import (rope_utils, rotary_pos_embedding,
                                                                yarn_rotary_pos_embedding)
            from megatron.core.pipeline_parallel import schedules
            from megatron.core.tensor_parallel import random as mrandom
            from megatron.core.transformer import utils as tutils
            from megatron.core.dist_checkpointing.strategies import filesystem_async

        _tracker_class()
        try:
            patch(torch.cuda, "current_device", _cpu_current_device)  # (c)
            patch(mrandom, "initialize_rng_tracker", _initialize_cpu_rng_tracker)  # (b)
            patch(mrandom, "_get_cuda_rng_state", _get_cpu_rng_state)
            patch(mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)
            patch(schedules, "torch", _SchedulesTorch())  # (d)
            for mod in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # (e)
                patch(mod, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank)
            for mod in (tutils, fused_softmax):  # (g)
                patch(mod, "get_default_causal_mask", _default_causal_mask)
                patch(mod, "get_sliding_window_causal_mask", _sliding_window_causal_mask)
            patch(torch.cuda, "synchronize", _no_sync)  # (h)
            patch(torch.cuda, "current_stream", _cpu_current_stream)  # (i)
            patch(filesystem_async, compat.write_results_queue_name(filesystem_async),
                   _in_process_queue)
            if not getattr(filesystem_async, "HAVE_PSUTIL", True):
                patch(filesystem_async, "_process_memory", lambda: 0)
            from .moe_cpu import patch_moe  # (j) Megatron's MoE layer

            patch_moe(patch)
            from .cpu_mla import patch_mla_core_attention  # (m)

            patch_mla_core_attention(patch)
            if not getattr(mrandom, "HAVE_TE", True):  # (k)
                cls = mrandom.CheckpointWithoutOutput
                patch(cls, "__init__", _without_fp8(cls.__init__))
        except BaseException:
            _restore()
            raise
        _reset_tracker(mrandom)
        _ENABLED = True


def _without_fp8(init):
    """Shim (k): ``CheckpointWithoutOutput.__init__`` then ``fp8 = False`` (no TE, no fp8)."""
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    return __init__


def _restore() -> None:
    while _SAVED:
        owner, name, value = _SAVED.pop()
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


def disable() -> None:
    """Undo :func:`enable` (restore every patched attribute); a no-op when not enabled.

    A CPU RNG tracker in place is dropped, so the next one is Megatron's own.
    """
    global _ENABLED
    with _LOCK:
        if not _ENABLED:
            return
        _restore()
        from megatron.core.tensor_parallel import random as mrandom

        if isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _tracker_class()):
            _reset_tracker(mrandom)
        _ENABLED = False


# ------------------------------------------------------------------ (f) optimizer calls

class CudaToCpuMode(TorchFunctionMode):
    """Inside this mode, code written for CUDA tensors runs on CPU tensors:

    - a ``device=`` keyword naming CUDA (``"cuda"``, ``"cuda:0"``, an int, ``torch.device``)
      becomes ``"cpu"``; ``pin_memory=`` is dropped;
    - ``Tensor.cuda()`` returns the tensor itself; ``Tensor.to("cuda")`` keeps it on the CPU;
    - ``Tensor.type()`` without arguments reports ``torch.cuda.<X>Tensor`` for a CPU tensor
      (Megatron's optimizer selects parameters with such string checks).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) and not isinstance(a, int) else a
                         for i, a in enumerate(args))
        return func(*args, **kwargs)


def cuda_to_cpu(force: bool = False) -> CudaToCpuMode:
    """Shim (f), scoped: ``with cuda_to_cpu(): opt = get_megatron_optimizer(...)`` and around
    ``opt.step()``. Refuses when CUDA is available unless ``force=True``."""
    _refuse_on_cuda(force, "cuda_to_cpu()")
    return CudaToCpuMode()
