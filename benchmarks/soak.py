"""Soak: hundreds of CPU training steps of a tiny METP GPT, with a memory and handle trace.

Two (or ``--metp``) forked gloo ranks train the tiny GPT with METP through megatron-core's DDP,
optimizer and schedules (``megatron_metp.megatron.training.train``). After every step each rank
records, at a quiet point (after ``gc.collect()``):

* live tensor bytes: every tensor storage alive in the process, counted by a ``TorchDispatchMode``
  that holds each storage an op returns weakly (entered before the model is built, so parameters,
  gradient buffers and optimizer state are counted too);
* RSS (``/proc/self/status`` VmRSS), open file descriptors (``/proc/self/fd``), OS threads;
* Python objects tracked by the garbage collector;
* METP ring traffic of the step: exchanges posted (send/recv, broadcast, reduce), receive
  buffers allocated for them (storages not seen before), and how many of all the receive buffers
  ever used are still alive after the step (ring buffers are reused within an op and released
  after it: nothing retained across steps);
* which live storages were created in an earlier step after the warm-up (op, shape, dtype, step):
  the suspects, should anything be retained.

It prints rank 0's trace as a table (every ``--every`` steps), each rank's trend and a verdict
(:func:`growth_problems`, the same check ``tests/test_soak.py`` makes); exit status 1 when anything
grows after the warm-up.

    python benchmarks/soak.py                       # 300 steps, METP=2
    python benchmarks/soak.py --steps 600 --every 50 --json out/soak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp.megatron.training import GPTSize, Layout  # noqa: E402

SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
               vocab_size=64, seq_length=16, swiglu=True)
WARMUP = 5  # optimizer state, RoPE cache and Megatron's buffers are created in the first steps
SETTLE_TRIES, SETTLE_S = 5, 0.02
GC_SLACK = 16
RSS_SLACK = 8 * 2 ** 20  # RSS may grow this much after the warm-up (allocator pages, not tensors)


@dataclass
class Sample:
    step: int
    live_tensor_bytes: int
    live_storages: int
    rss_bytes: int
    fds: int
    threads: int
    gc_objects: int
    ring_exchanges: int        # posted during this step (send/recv, broadcast and reduce)
    ring_buffer_allocs: int    # receive buffers first used during this step (new storages)
    ring_buffers_alive: int    # receive buffers (of all steps so far) still alive after it
    lm_loss: float
    seconds: float             # wall time per step since the previous sample (incl. sampling)
    # live storages created after the warm-up and before this step: "op shape dtype @step"
    # (retained across steps; empty when flat)
    retained: list
    settle_retries: int        # re-measurements until the live bytes stopped changing


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def live_storage_mode():
    """A dispatch mode that keeps every storage returned by an op, weakly; ``live()`` sums them."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class LiveStorages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = WeakIdKeyDictionary()  # storage -> (op, shape, dtype, step)
            self.step = 0                          # the training step now running (1-based)

        def add(self, t, what):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self.storages:
                    self.storages[st] = (what, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                         self.step)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                self.add(t, func.__name__)
            return out

        def live(self):
            items = list(self.storages.items())
            return sum(s.nbytes() for s, _ in items), len(items)

        def retained(self, warmup, step):
            """Live storages created after ``warmup`` and before ``step``, described: what a
            finished step left behind (the suspects of a leak)."""
            return sorted(f"{op} {list(shape)} {dt} @step {k}"
                          for op, shape, dt, k in list(self.storages.values())
                          if warmup < k < step)

    return LiveStorages()


class RingBufferWatch:
    """Wraps ``RingExchanger.start/broadcast/reduce`` in this process to see their buffers."""

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        from megatron_metp.runtime import ring

        self.ring = ring
        self.alive = WeakIdKeyDictionary()   # every receive buffer ever used, weakly
        self.exchanges = 0
        self.allocs = 0                      # exchanges whose buffer was not seen before
        self._orig = {}
        for name, arg in (("start", "recv"), ("broadcast", "tensor"), ("reduce", "tensor")):
            orig = getattr(ring.RingExchanger, name)
            self._orig[name] = orig
            setattr(ring.RingExchanger, name, self._wrap(orig, name, arg))

    def _wrap(self, orig, name, arg):
        watch = self

        def wrapped(exchanger, *args, **kwargs):
            buf = kwargs.get(arg) if arg in kwargs else args[1 if name == "start" else 0]
            st = buf.untyped_storage()
            if st not in watch.alive:
                watch.alive[st] = True
                watch.allocs += 1
            watch.exchanges += 1
            return orig(exchanger, *args, **kwargs)

        return wrapped

    def take_step(self):
        """``(exchanges, new buffers)`` since the last call."""
        out = (self.exchanges, self.allocs)
        self.exchanges = self.allocs = 0
        return out

    def close(self):
        for name, orig in self._orig.items():
            setattr(self.ring.RingExchanger, name, orig)


def soak_rank(rank, world, steps, size=SIZE, layout=None, sample_every=1, warmup=None):
    """Train ``steps`` steps with ``layout`` (default METP = the world size) and return the
    samples taken after step 1, every ``sample_every``-th step and the last step."""
    import warnings

    warnings.simplefilter("ignore")
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import init_parallel, setup, train

    cpu.enable()
    layout = layout or Layout(metp=world)
    warmup = WARMUP if warmup is None else warmup
    watch = RingBufferWatch()
    mode = live_storage_mode()
    samples = []
    try:
        with mode:
            init_parallel(layout, size.seq_length)
            state = setup(size, layout)
            mode.step = 1
            last = [time.perf_counter(), 0]  # time and step of the previous sample

            def measure(step, _state):
                mode.step = step + 1
                if step % sample_every and step not in (1, steps):
                    watch.take_step()
                    return
                gc.collect()
                live, n_storages = mode.live()
                settle = 0
                # A finished collective's tensor can be released by gloo's worker thread a moment
                # after wait() returns: re-measure briefly before calling a change real.
                while samples and live != samples[-1].live_tensor_bytes and settle < SETTLE_TRIES:
                    time.sleep(SETTLE_S)
                    settle += 1
                    gc.collect()
                    live, n_storages = mode.live()
                exchanges, allocs = watch.take_step()
                now = time.perf_counter()
                samples.append(Sample(
                    step=step, live_tensor_bytes=live, live_storages=n_storages,
                    rss_bytes=_proc_status("VmRSS") * 1024,
                    fds=len(os.listdir("/proc/self/fd")), threads=_proc_status("Threads"),
                    gc_objects=len(gc.get_objects()), ring_exchanges=exchanges,
                    ring_buffer_allocs=allocs, ring_buffers_alive=len(list(watch.alive.keys())),
                    lm_loss=float("nan"), seconds=(now - last[0]) / (step - last[1]),
                    retained=mode.retained(warmup, step)[:20], settle_retries=settle))
                last[:] = [now, step]

            # One long train() call, as a real run: measure() is its after-every-step callback.
            records = train(size, layout, steps, state=state, checkpoint_fn=measure)
            del state
    finally:
        watch.close()
    loss = {r.iteration: r.lm_loss for r in records}
    out = []
    for s in samples:
        s.lm_loss = loss[s.step]
        out.append(asdict(s))
    return out


# --------------------------------------------------------------------------- analysis

def trend(samples, warmup=WARMUP):
    """``{metric: (first sample after the warm-up, last sample, max after the warm-up)}``."""
    after = [s for s in samples if s["step"] > warmup]
    if not after:
        raise ValueError(f"no samples after the warm-up of {warmup} steps")
    keys = ("live_tensor_bytes", "live_storages", "rss_bytes", "fds", "threads", "gc_objects",
            "ring_exchanges", "ring_buffer_allocs", "ring_buffers_alive")
    return {k: (after[0][k], after[-1][k], max(s[k] for s in after)) for k in keys}


def growth_problems(samples, warmup=WARMUP, rss_slack=RSS_SLACK):
    """Everything that is not flat after the warm-up; ``[]`` when the run is flat.

    * live tensor bytes and live storages: equal at every sample (exact);
    * open file descriptors and threads: never above the first sample;
    * ring receive buffers: none alive after any step; exchanges and new buffers the same
      number in every step;
    * GC-tracked Python objects: at most +1 per step (``train()``'s list of step records), +2
      per sample (this trace: a record and its list) and ``GC_SLACK`` (lazily created objects:
      a leak of one object per step over 30 steps exceeds it);
    * RSS: at most ``rss_slack`` bytes above the first sample (the allocator may keep pages);
    * the loss stays finite.
    """
    after = [s for s in samples if s["step"] > warmup]
    if not after:
        return [f"no samples after the warm-up of {warmup} steps"]
    first, last = after[0], after[-1]
    problems = []
    for k in ("live_tensor_bytes", "live_storages", "ring_exchanges", "ring_buffer_allocs"):
        seen = [s[k] for s in after]
        if len(set(seen)) > 1:
            problems.append(f"{k} not constant after step {warmup}: {seen}")
    if any(s["retained"] for s in after):
        worst = max(after, key=lambda s: len(s["retained"]))
        problems.append(f"step {worst['step']} holds storages of earlier steps: "
                        f"{worst['retained']}")
    for k in ("fds", "threads"):
        if max(s[k] for s in after) > first[k]:
            problems.append(f"{k} grew from {first[k]} to {max(s[k] for s in after)}")
    alive = [s["ring_buffers_alive"] for s in samples]
    if any(alive):
        problems.append(f"ring receive buffers still alive after steps: {alive}")
    allowed = (last["step"] - first["step"]) + 2 * (len(after) - 1) + GC_SLACK
    if last["gc_objects"] - first["gc_objects"] > allowed:
        problems.append(f"gc objects grew by {last['gc_objects'] - first['gc_objects']} "
                        f"(allowed {allowed})")
    if last["rss_bytes"] - first["rss_bytes"] > rss_slack:
        problems.append(f"RSS grew by {(last['rss_bytes'] - first['rss_bytes']) / 2 ** 20:.1f} MiB "
                        f"(slack {rss_slack / 2 ** 20:.0f} MiB)")
    if not all(math.isfinite(s["lm_loss"]) for s in samples):
        problems.append("the loss is not finite")
    return problems


def _mib(n):
    return f"{n / 2 ** 20:.2f}"


def format_table(samples, every=25):
    rows = [s for s in samples if s["step"] % every == 0 or s["step"] in (1, samples[-1]["step"])]
    head = ("| step | live tensor bytes | live storages | RSS MiB | open fds | threads "
            "| gc objects | ring exchanges | ring buffer allocs | ring buffers alive | lm loss "
            "| s/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        lines.append(f"| {s['step']} | {s['live_tensor_bytes']} | {s['live_storages']} | "
                     f"{_mib(s['rss_bytes'])} | {s['fds']} | {s['threads']} | {s['gc_objects']} | "
                     f"{s['ring_exchanges']} | {s['ring_buffer_allocs']} | "
                     f"{s['ring_buffers_alive']} | "
                     f"{s['lm_loss']:.4f} | {s['seconds']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--metp", type=int, default=2, help="METP size = number of forked ranks")
    ap.add_argument("--every", type=int, default=25, help="print every N-th step")
    ap.add_argument("--sample-every", type=int, default=5,
                    help="measure every N-th step (a sample costs a gc.collect)")
    ap.add_argument("--vocab-parallel", action="store_true",
                    help="shard the word embedding and output layer + loss over the ring too")
    ap.add_argument("--json", default=None, help="write every rank's full trace here")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the warm-up ({WARMUP})")

    from tests.harness import preload_megatron, run_ranks

    preload_megatron()
    t0 = time.time()
    from megatron_metp.megatron.training import Layout

    layout = Layout(metp=args.metp, vocab_parallel=args.vocab_parallel)
    traces = run_ranks(soak_rank, args.metp, args.steps, SIZE, layout, args.sample_every,
                       timeout=max(600, 3 * args.steps))
    wall = time.time() - t0
    print(f"Soak: tiny {layout.describe()} GPT ({SIZE.num_layers} layers, hidden {SIZE.hidden_size}, "
          f"SwiGLU), {args.steps} steps, {wall:.1f} s. Rank 0:\n")
    print(format_table(traces[0], args.every))
    print()
    bad = []
    for rank, tr in enumerate(traces):
        t = trend(tr)
        print(f"rank {rank} after step {WARMUP}: " + ", ".join(
            f"{k} {a}->{b} (max {c})" for k, (a, b, c) in t.items()))
        bad += [f"rank {rank}: {p}" for p in growth_problems(tr)]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "metp": args.metp, "size": asdict(SIZE),
                       "warmup": WARMUP, "traces": traces}, f, indent=1)
    verdict = "FLAT (no growth after warm-up)" if not bad else "GROWTH: " + "; ".join(bad)
    print("\nverdict: " + verdict)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
