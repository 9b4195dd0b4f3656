"""One rank of any job on a CPU, without a cluster or real allocations: the fake-rank harness.

``metp measure`` (:mod:`.measure`), the Megatron-LM dry run (:mod:`.dry_run`), the demo's memory
column and every memory benchmark (``benchmarks/*_memory.py``) build one rank with these pieces:

* :func:`fake_world`: torch's ``fake`` process group (``init_process_group("fake", ...)``): every
  collective and send/recv is a no-op with the true payload shapes; one CPU thread; the
  megatron-core CPU shims (:func:`megatron_metp.megatron.cpu.enable`); the METP finite checks off (a
  data-dependent check cannot run on fake tensors).
* ``FakeTensorMode`` (the caller's): nothing is allocated, every shape and dtype is exact.
* :func:`megatron_metp.tools.cuda_accounting.cuda_kernels`: the ops whose CPU kernels keep other
  tensors than the CUDA ones keep what CUDA keeps (:func:`measuring` enters it).
* :func:`tracker`: ``torch.distributed._tools.mem_tracker.MemTracker`` following every storage,
  with the peak by category (PARAM, GRAD, ACT = allocated in forward, TEMP = in backward, OTH =
  the caller's tensors) and the largest ACT+TEMP total seen (``work_peak``).
* :class:`CommCounter`: bytes and messages per c10d op, with the op's own process-group size.
* :func:`main_grad_buffer`: Megatron DDP's fp32 gradient buffer (``main_grad``) emulated.
* :func:`run_isolated` / :func:`map_isolated`: each measurement in a forked child (a fresh fake
  world), bounded by a timeout, the result or the child's traceback sent back.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import time
import traceback
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

MiB = 2 ** 20
GiB = 2 ** 30


# ----------------------------------------------------------------------------- the world

def fake_world(world: int, rank: int = 0, *, dtype=None, megatron: bool = True) -> None:
    """Make this process rank ``rank`` of a fake ``world``-rank job (call once per process).

    ``dtype``: default dtype from now on (e.g. ``torch.bfloat16`` to build bf16 models);
    ``megatron``: apply the megatron-core CPU shims."""
    import warnings

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    if megatron:
        from ..megatron import cpu as metp_cpu

        metp_cpu.enable(force=True)  # a throwaway process: CPU fake tensors only
    from ..runtime import finite

    finite.enable_finite_checks(False)
    if dtype is not None:
        torch.set_default_dtype(dtype)


# ----------------------------------------------------------------------------- memory

def tracker_class():
    """MemTracker that also records ``work_peak`` (the largest ACT+TEMP total at any moment).

    Pipeline stages run the model once per micro-batch in flight; MemTracker's per-module stats
    allow one call, so they restart at each root forward (the global peak is kept)."""
    import copy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as TOTAL, MemTracker

    class Tracker(MemTracker):
        work_peak = 0

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                fqn = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {fqn} == {"Global"}:
                    self.reset_mod_stats()
            return super()._pre_fw_hook(module, inputs)

        progress = None  # a tools.progress.Progress, ticked at every op

        _by_fqn: Dict[str, list] = {}  # module fqn -> its stats, rebuilt when modules change
        _by_fqn_size = -1

        def reset_mod_stats(self):
            super().reset_mod_stats()
            self._by_fqn_size = -1

        def _update_peak_stats(self, peak_state):
            """MemTracker's per-op peak update, visiting only the modules now open
            (``_mod_tracker.parents``) instead of every tracked module: the same updates (each
            module's local peak and snapshot, the global peak) in ``O(depth)`` per op, not
            ``O(modules)`` (a Qwen3-30B-A3B layer has over a hundred modules, 32 experts of
            two linears each; the full scan was half of ``metp measure``'s time)."""
            if self.progress is not None:
                self.progress.tick()
            if len(self.memory_tracking) != self._by_fqn_size:  # a module tracked
                by_fqn: Dict[str, list] = {}
                for st in self.memory_tracking.values():
                    by_fqn.setdefault(st.mod_fqn, []).append(st)
                self._by_fqn, self._by_fqn_size = by_fqn, len(self.memory_tracking)
            curr = self._curr_mem_snap
            for fqn in self._mod_tracker.parents:
                for st in self._by_fqn.get(fqn, ()):
                    if peak_state not in st.snapshots:
                        continue
                    for dev, dev_snap in curr.items():
                        if st.local_peak.get(dev, 0) < dev_snap[TOTAL]:
                            st.local_peak[dev] = dev_snap[TOTAL]
                            st.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
            for dev, dev_snap in curr.items():
                if self._peak_mem.get(dev, 0) < dev_snap[TOTAL]:
                    self._peak_mem[dev] = dev_snap[TOTAL]
                    self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)
            for dev in curr.values():
                work = sum(v for k, v in dev.items() if getattr(k, "name", None) in ("ACT", "TEMP"))
                self.work_peak = max(self.work_peak, work)

    return Tracker


def tracker():
    """A fresh :func:`tracker_class` instance (enter it with ``with``)."""
    return tracker_class()()


def snap(trk, kind: str = "peak", label: str = "name") -> Dict:
    """``{"total": bytes, "cat": {category: bytes}}`` of a tracker snapshot (``"peak"`` or
    ``"current"``), summed over devices; categories by their ``name`` (``ACT``) or, with
    ``label="value"``, their long name (``Activation``)."""
    total, cats = 0, {}
    for dev in trk.get_tracker_snapshot(kind).values():
        for k, v in dev.items():
            if k == "Total":
                total += v
            else:
                name = getattr(k, label, str(k))
                cats[name] = cats.get(name, 0) + v
    return {"total": total, "cat": cats}


@contextlib.contextmanager
def measuring(trk, *modes, cuda: bool = True, cuda_matmul: bool = True,
              moe_imbalance: float = 1.0):
    """Enter the tracker, the extra dispatch modes (e.g. a :class:`CommCounter`) and, with
    ``cuda``, the CUDA-faithful kernels (``cuda_matmul=False`` keeps METP's CPU matmul branch);
    with megatron-core's MoE imported, its token dispatch sized by balanced routing
    (:func:`.fake_moe.balanced_routing`, ``moe_imbalance`` the busiest rank's factor)."""
    import sys

    from .cuda_accounting import cuda_kernels

    with contextlib.ExitStack() as stack:
        if "megatron.core.transformer.moe.token_dispatcher" in sys.modules:
            from .fake_moe import balanced_routing

            stack.enter_context(balanced_routing(moe_imbalance))
        if cuda:
            stack.enter_context(cuda_kernels(matmul=cuda_matmul))
        stack.enter_context(trk)
        for m in modes:
            stack.enter_context(m)
        yield trk


def flat_tensors(a) -> list:
    """The tensors in ``a``: a tensor, or (nested) lists and tuples of them, in order."""
    import torch

    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in flat_tensors(x)]
    return []


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def main_grad_buffer(params):
    """Megatron DDP's contiguous fp32 gradient buffer, emulated: one flat fp32 tensor for
    ``params``; each parameter's gradient is added into its view as soon as autograd has
    accumulated it, then freed (what ``main_grad`` with gradient-accumulation fusion does)."""
    import torch

    params = list(params)
    buf = torch.empty(sum(prm.numel() for prm in params), dtype=torch.float32)
    off = 0
    for prm in params:
        view = buf[off:off + prm.numel()].view_as(prm)
        off += prm.numel()

        def _hook(prm, view=view):
            view.add_(prm.grad)
            prm.grad = None

        prm.register_post_accumulate_grad_hook(_hook)
    return buf


# ----------------------------------------------------------------------------- messages

def _sent_bytes(name: str, args, p: int) -> Optional[int]:
    """Bytes this rank sends for one c10d op, ring-algorithm convention: ``N`` for a send;
    ``2(p−1)/p·N`` for an all-reduce of ``N``; ``(p−1)/p·N`` for an all-gather or reduce-scatter
    whose full tensor is ``N``, and for a broadcast or reduce of ``N`` (pipelined chain, the rank
    average whoever the root is), and for an all-to-all of an input of ``N`` (the MoE dispatch
    and combine: all but the rank's own chunk, the rank average; exact for the balanced splits
    of :mod:`.fake_moe`); 0 for receives and barriers; ``None``: no rule."""
    if name == "send":
        return sum(nbytes(t) for t in flat_tensors(args[0]))
    if name in ("recv_", "recv_any_source_", "barrier", "monitored_barrier_"):
        return 0
    if name == "allreduce_":
        return 2 * (p - 1) * sum(nbytes(t) for t in flat_tensors(args[0])) // p
    if name == "_allgather_base_":  # (output [N], input [N/p])
        return (p - 1) * nbytes(args[1])
    if name == "_reduce_scatter_base_":  # (output [N/p], input [N])
        return (p - 1) * nbytes(args[0])
    if name == "allgather_":  # (outputs [[N/p] × p], inputs [N/p])
        return (p - 1) * sum(nbytes(t) for t in flat_tensors(args[1]))
    if name == "reduce_scatter_":  # (outputs [N/p], inputs [[N/p] × p])
        return (p - 1) * sum(nbytes(t) for t in flat_tensors(args[0]))
    if name == "alltoall_base_":  # (output, input [N], group, output splits, input splits)
        return (p - 1) * nbytes(args[1]) // p
    if name in ("broadcast_", "reduce_"):
        return (p - 1) * sum(nbytes(t) for t in flat_tensors(args[0])) // p
    return None


def _group_size(args) -> Optional[int]:
    import torch
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except Exception:  # noqa: BLE001 - not a process group
                continue
    return None


def comm_counter_class():
    """The :class:`CommCounter` class (built lazily: torch's dispatch-mode base class)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..runtime.loop_sample import weight as loop_weight

    class CommCounter(TorchDispatchMode):
        """Counts, per c10d op, messages (``ops``) and bytes this rank sends (``bytes_by_op``,
        ``sent`` in all; see :func:`_sent_bytes`), with the process-group size of each op
        (``p`` when the op names none); inside a loop :mod:`megatron_metp.runtime.loop_sample`
        samples, a message counts as the passes it stands for. Optionally: ``watched``
        dispatch counts of ATen ops whose name contains one of ``watch``; with ``track_alloc``
        the largest tensor any non-aliasing op returned (``max_alloc``, ``max_alloc_op``) and the largest 4-D one
        (``max_alloc_4d``, ``max_alloc_4d_shape``: attention scores are 4-D)."""

        def __init__(self, p: int = 1, watch: Sequence[str] = (), track_alloc: bool = False):
            super().__init__()
            self.p = p
            self.sent = 0
            self.ops: Dict[str, int] = {}
            self.bytes_by_op: Dict[str, int] = {}
            self.watch = tuple(watch)
            self.watched: Dict[str, int] = {}
            self.track_alloc = track_alloc
            self.max_alloc, self.max_alloc_op = 0, None
            self.max_alloc_4d, self.max_alloc_4d_shape = 0, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if func.namespace == "c10d":
                sent = _sent_bytes(name, args, _group_size(args) or self.p)
                key = name if sent is not None else name + " (not counted)"
                w = loop_weight()  # passes a sampled loop skipped (runtime.loop_sample)
                self.ops[key] = self.ops.get(key, 0) + w
                self.bytes_by_op[key] = self.bytes_by_op.get(key, 0) + (sent or 0) * w
                self.sent += (sent or 0) * w
                return func(*args, **(kwargs or {}))
            if self.watch and any(w in name for w in self.watch):
                self.watched[name] = self.watched.get(name, 0) + 1
            out = func(*args, **(kwargs or {}))
            if self.track_alloc and not any(r.alias_info is not None
                                            for r in func._schema.returns):
                for t in flat_tensors(out):
                    if nbytes(t) > self.max_alloc:
                        self.max_alloc, self.max_alloc_op = nbytes(t), name
                    if t.dim() == 4 and nbytes(t) > self.max_alloc_4d:
                        self.max_alloc_4d = nbytes(t)
                        self.max_alloc_4d_shape = [list(t.shape),
                                                   str(t.dtype).replace("torch.", "")]
            return out

    return CommCounter


def live_storage_class():
    """A dispatch mode naming what is alive at the peak (diagnostics: a pass over the live
    storages per op). Every storage an op returns (and every tensor given to ``add``) is
    recorded weakly with the op's name, shape, dtype and ``phase`` (the caller sets "fwd" /
    "bwd"); ``top(k)`` groups the storages alive at the largest total by (op, shape, dtype,
    phase): ``[[bytes, count, op, shape, dtype, phase], ...]``, largest first."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    class LiveStorages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.info = WeakIdKeyDictionary()
            self.phase = "fwd"
            self.peak, self.peak_op, self.at_peak = 0, None, []

        def add(self, t, what):
            st = t.untyped_storage()
            if st not in self.info:
                self.info[st] = (what, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                 st.nbytes(), self.phase)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.add(t, func._schema.name.split("::")[-1])
            total = sum(v[3] for v in self.info.values())
            if total > self.peak:
                self.peak, self.peak_op = total, func._schema.name.split("::")[-1]
                self.at_peak = list(self.info.values())
            return out

        def top(self, k=12):
            agg = {}
            for what, shape, dt, nb, ph in self.at_peak:
                a = agg.setdefault((what, shape, dt, ph), [0, 0])
                a[0] += nb
                a[1] += 1
            rows = sorted(((nb, c) + key for key, (nb, c) in agg.items()), key=lambda r: -r[0])
            return [[nb, c, what, list(shape), dt, ph] for nb, c, what, shape, dt, ph in rows[:k]]

    return LiveStorages


# ----------------------------------------------------------------------------- tiles

#: ``--measure-tiles``: ``sampled`` runs the first two and the last pass of every repeating tile
#: loop of the streaming layer and one step of each run of like K/V ring steps
#: (:mod:`megatron_metp.runtime.loop_sample`), ``full`` every pass and step
MEASURE_TILES = ("sampled", "full")


def tile_sampling(measure_tiles: str = "sampled"):
    """The context a measurement runs in for ``--measure-tiles`` (``ValueError`` naming the
    option for anything but :data:`MEASURE_TILES`)."""
    from ..runtime import loop_sample

    if measure_tiles == "sampled":
        return loop_sample.sampling()
    if measure_tiles == "full":
        return contextlib.nullcontext(None)
    raise ValueError(f"--measure-tiles {measure_tiles!r}: use one of {', '.join(MEASURE_TILES)}")


def sampled_text(counts: Optional[Dict], how: str = "the first and last passes of each loop, "
                 "one step of each run of like ring steps") -> str:
    """What a :func:`tile_sampling` block ran (its counts, ``None`` for ``full``): ``"1,405 of
    10,145 tile passes run, 900 of 5,000 K/V ring steps run (how)"``, or ``"every tile pass
    run"`` when nothing was skipped."""
    parts = []
    if counts and counts.get("skipped"):
        parts.append(f"{counts['passes']:,} of {counts['passes'] + counts['skipped']:,} tile "
                     f"passes run")
    if counts and counts.get("ring_skipped"):
        parts.append(f"{counts['ring_steps']:,} of "
                     f"{counts['ring_steps'] + counts['ring_skipped']:,} K/V ring steps run")
    return f"{', '.join(parts)} ({how})" if parts else "every tile pass run"


# ----------------------------------------------------------------------------- depth

def layer_depths(per_stage: int, measure_layers="auto", *, step: int = 1,
                 offload: bool = False) -> Optional[tuple]:
    """The two depths ``(a, b)`` (layers per stage, multiples of ``step``) to measure and
    extrapolate from linearly, or ``None`` to measure every layer.

    ``measure_layers``: ``"full"``; ``N`` (then ``b = N``, ``a = N − step``); ``"auto"``: full
    up to ``max(4, b)`` layers, else ``b = 2·step`` (``3·step`` with the host offload, whose
    device footprint is the same from two resident groups on). ``step``: the layers of one
    uniform-recompute chunk (depths must be whole chunks). ``ValueError`` names the option."""
    if measure_layers == "full":
        return None
    if measure_layers == "auto":
        b = step * (3 if offload else 2)
        if per_stage <= max(4, b):
            return None
    else:
        if not str(measure_layers).isdigit():
            raise ValueError(f"--measure-layers {measure_layers!r}: use auto, full or a number N")
        b = int(measure_layers)
    a = b - step
    if a < 1 or b % step or b >= per_stage:
        raise ValueError(f"--measure-layers {b}: need {step} < N < {per_stage} (layers on the "
                         f"stage), a multiple of {step} (the recompute chunk)")
    return a, b


def partial_offload_points(per_stage: int, offloaded: int, depths: tuple, *, step: int = 1
                           ) -> Tuple[List[Tuple[int, int]], List[float]]:
    """What to measure for a stage of ``per_stage`` layers whose first ``offloaded`` go to the
    host and whose last ``K = per_stage − offloaded`` stay on the device (partial offload), when
    ``depths`` (:func:`layer_depths`) say to extrapolate: ``([(layers, offloaded), ...],
    coefficients)``; the stage's figure is ``Σ coefficient × measurement``.

    Each measured stage keeps ``K`` layers (as the full one does) when ``K`` is at most two
    chunks (or the depths hold ``K`` and an offloaded chunk): two depths, deeper than ``depths``
    if need be, extrapolated linearly in the offloaded layers. Otherwise three points, ``(a, K₀)``, ``(b, K₀)``, ``(b, K₀ + step)`` with ``K₀ = 2·step``
    kept (two kept chunks: from there on a kept chunk adds its input and the backward of the
    lowest kept one no longer sets the peak, ``plan/recompute.py``), extrapolated linearly in the
    layers and in the kept layers. ``ValueError`` when the depths are too shallow for that."""
    a, b = depths
    kept = per_stage - offloaded
    k0 = 2 * step
    if kept <= max(k0, a - step):
        if a - kept < step:  # deeper, so that each measured stage offloads a chunk too
            a, b = kept + step, kept + 2 * step
        t = (per_stage - b) / (b - a)
        return [(a, a - kept), (b, b - kept)], [-t, 1 + t]
    a, b = max(a, k0 + step), max(b, k0 + 2 * step)
    if b - a != step:
        a = b - step
    t, u = (per_stage - b) / step, (kept - k0) / step
    return [(a, a - k0), (b, b - k0), (b, b - k0 - step)], [-t, 1 + t - u, u]


def partial_keep_points(per_stage: int, kept: int, depths: tuple
                        ) -> Tuple[List[Tuple[int, int]], List[float]]:
    """What to measure for a stage of ``per_stage`` layers whose first ``kept`` keep their
    attention output (``--metp-keep-attention-output N``, ``0 < N < per_stage``; depths one
    layer apart): ``([(layers, kept), ...], coefficients)`` as :func:`partial_offload_points`.
    A shallower stage given the same ``N`` would keep all its layers, so three points, ``(a, 1)``,
    ``(b, 1)``, ``(b, 2)`` with ``a >= 2`` (the last layer of each keeping nothing, as the full
    stage's; one kept layer in each, as the step the first one adds on the device is not a slope),
    extrapolated linearly in the layers and in the kept layers (a kept layer adds its ``O`` +
    LSE where its input goes). ``ValueError`` when the stage is too shallow for that."""
    a, b = depths
    if a < 2:
        a, b = 2, 3
    if b >= per_stage:
        raise ValueError(f"partial kept attention: extrapolating needs more than {b} layers per "
                         f"stage, got {per_stage}; measure every layer")
    t = (per_stage - b) / (b - a)
    return [(a, 1), (b, 1), (b, 2)], [-t, 1 + t - (kept - 1), float(kept - 1)]


def combine(values: List, coefficients: List[float]):
    """``Σ coefficient × value`` for numbers, key by key for dicts of them (other values: the
    last one's), as :func:`extrapolate` for more than two points."""
    last = values[-1]
    if isinstance(last, bool) or not isinstance(last, (int, float, dict)):
        return last
    if isinstance(last, dict):
        return {k: combine([v.get(k, 0) if isinstance(v, dict) else 0 for v in values],
                           coefficients) for k in last}
    out = sum(c * (v or 0) for c, v in zip(coefficients, values))
    return int(round(out)) if isinstance(last, int) else out


def extrapolate(a, b, times: float):
    """``b + times·(b − a)`` for numbers, key by key for dicts of them (other values: b's)."""
    if isinstance(b, bool) or not isinstance(b, (int, float, dict)):
        return b
    if isinstance(b, dict):
        return {k: extrapolate(a.get(k, 0) if isinstance(a, dict) else 0, v, times)
                for k, v in b.items()}
    out = b + times * (b - a)
    return int(round(out)) if isinstance(b, int) else out


# ----------------------------------------------------------------------------- isolation

def preload_megatron() -> None:
    """Import megatron-core and the METP modules once, so forked children skip ~3 s each."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.transformer.transformer_block  # noqa: F401
        import torch.distributed._tools.mem_tracker  # noqa: F401
        import torch.testing._internal.distributed.fake_pg  # noqa: F401

        from ..megatron import spec, vocab  # noqa: F401


def compile_in_this_process() -> None:
    """Make TorchInductor compile (Megatron's ``jit_fuser`` kernels) synchronously here.

    A forked child inherits the parent's inductor state but none of its threads: if the parent
    compiled anything with inductor's worker pool, the child's compile (or cache load) waits
    forever on a future of that pool. With one compile thread inductor never uses the pool."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


def _child(conn, fn, args):
    try:
        compile_in_this_process()
        res = fn(*args)
        conn.send(("ok", pickle.dumps(res)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def map_isolated(fn: Callable, arg_tuples: Iterable[tuple], *, jobs: int = 1,
                 timeout: float = 600.0, what: Callable[[tuple], str] = repr) -> List[Dict]:
    """``fn(*args)`` for each ``args`` in its own forked child, ``jobs`` at a time, each bounded
    by ``timeout`` seconds. Returns, in order, ``{"ok": result}`` or ``{"error": text}`` (the
    child's traceback, its death, or the timeout, naming ``what(args)``)."""
    ctx = mp.get_context("fork")
    todo = list(enumerate(arg_tuples))
    n = len(todo)
    results: Dict[int, Dict] = {}
    running = []
    while todo or running:
        while todo and len(running) < max(1, jobs):
            i, args = todo.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(send, fn, args))
            proc.start()
            send.close()
            running.append((i, args, proc, recv, time.monotonic()))
        still = []
        for i, args, proc, recv, t0 in running:
            if recv.poll(0.05):
                try:
                    status, value = recv.recv()
                except EOFError:
                    status, value = "error", f"measurement child for {what(args)} died"
                results[i] = {"ok": pickle.loads(value)} if status == "ok" else {"error": value}
                proc.join(timeout=10)
                recv.close()
            elif not proc.is_alive() and not recv.poll(0):
                results[i] = {"error": f"measurement child for {what(args)} exited "
                                       f"{proc.exitcode} without a result"}
                recv.close()
            elif time.monotonic() - t0 > timeout:
                proc.kill()
                proc.join()
                results[i] = {"error": f"measurement of {what(args)} timed out after "
                                       f"{timeout:g} s"}
                recv.close()
            else:
                still.append((i, args, proc, recv, t0))
        running = still
    return [results[i] for i in range(n)]


def run_isolated(fn: Callable, *args, timeout: float = 600.0):
    """``fn(*args)`` in a forked child; its result, or ``RuntimeError`` with the child's error."""
    got = map_isolated(fn, [args], timeout=timeout, what=lambda a: fn.__name__)[0]
    if "error" in got:
        raise RuntimeError(got["error"])
    return got["ok"]


def run_cases(measure: Callable[[Dict], Dict], groups: Dict, *, setup: Optional[Callable] = None,
              jobs: int = 1, timeout: float = 600.0) -> List[Dict]:
    """The benchmarks' driver. ``groups``: ``{key: (p, cases)}``; for each group a forked child
    becomes rank 0 of a fake ``p``-rank world (bf16 default dtype), runs ``setup(p, cases)`` once, then
    ``measure(case)`` for every case. Returns every case's ``dict(case, **result, seconds=...)``
    in group order; a case that raised carries ``error`` and ``traceback``, and every case of a
    group whose child died or timed out carries that ``error``."""

    def child(p, cases):
        import torch

        fake_world(p, dtype=torch.bfloat16)
        if setup is not None:
            setup(p, cases)
        out = []
        for case in cases:
            t0 = time.perf_counter()
            try:
                res = measure(case)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            res.update(case)
            res["seconds"] = round(time.perf_counter() - t0, 3)
            out.append(res)
        return out

    items = list(groups.values())
    got = map_isolated(child, items, jobs=jobs, timeout=timeout, what=lambda a: f"p={a[0]}")
    results: List[Dict] = []
    for (p, cases), g in zip(items, got):
        results += g["ok"] if "ok" in g else [dict(c, error=g["error"]) for c in cases]
    return results
