"""``make demo``: a tiny GPT trained with stock Megatron TP and with METP, side by side.

Run without arguments, it starts itself under ``torchrun`` on 2 gloo CPU ranks. In one job the
ranks train the same tiny ``GPTModel`` twice with megatron-core's DDP, optimizer and schedules
(:mod:`megatron_metp.megatron.training`): first stock tensor parallelism (TP=2), then METP=2 with
the vocabulary sharded too (word embedding and output layer + loss on the ring;
``--no-vocab-parallel`` keeps them replicated over the METP group as plain METP does). Both
runs start from the same full weights and see the same global batches, so their loss curves agree
to fp32 rounding. Between the runs Megatron's parallel state is destroyed and rebuilt.

Printed: Megatron-style iteration lines of both runs, then a table of the loss per iteration, the
per-rank peak tensor memory of one training step and the bytes each rank sends per step. Rank 0
writes ``<out-dir>/demo.json`` (the table) and ``<out-dir>/demo.png`` (loss curves, memory and
traffic bars). The exit status is 1 if the two loss curves differ by more than 1e-4 (relative) at
any iteration.

Data: a learnable synthetic language, so the loss visibly falls within a few iterations. Every
sequence is a walk over a fixed random permutation of the vocabulary (token t is followed by
succ[t]) from a random start: seeded, nothing downloaded. ``--packed``: every sample packs
several such documents (a new walk each, ended by an EOD token; the same boundaries in every
sample of a step, lengths drawn per step) with Megatron-LM's ``--reset-position-ids
--reset-attention-mask --eod-mask-loss`` semantics: stock TP gets Megatron's dense document mask,
METP derives the boundaries from the EOD tokens and runs document-masked ring attention.

Memory: ``torch.distributed._tools.mem_tracker.MemTracker`` around one whole training step (the
last iteration: forward and backward of every micro-batch, gradient reduction, optimizer step),
counting real CPU tensor storages. It reports the peak by category: Parameter, Buffer, Gradient
(Megatron DDP's contiguous fp32 grad buffers, handed to the tracker, and any other tensor it files
as a gradient), Optstate (Adam moments), Activation (allocated in forward: saved activations and
forward temporaries), Temp (allocated in backward).

Traffic: a ``TorchDispatchMode`` that sees every c10d collective and send/recv issued during a
step, for both runs alike (so Megatron's TP all-reduces, DDP's gradient all-reduce, the loss and
grad-norm reductions and METP's ring transfers are all counted the same way). Bytes *sent* by this
rank, ring-algorithm convention for collectives over a group of p ranks and a tensor of N bytes:
send N; all-reduce 2(p-1)/p·N; all-gather / reduce-scatter (p-1)/p·N of the full tensor;
broadcast / reduce (p-1)/p·N (pipelined chain, averaged over ranks). METP's own counters
(``METPGroup.stats``: ring send/recv, head-group weight broadcasts, gradient reduces) are reported
next to it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .demo_report import check, format_table, write_outputs

WORLD = 2  # ranks in the demo: stock TP=2 and METP=2


@dataclass
class DemoConfig:
    iters: int = 20
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    seq: int = 128
    vocab: int = 128
    global_batch: int = 4
    micro_batch: int = 2
    lr: float = 3e-3
    vocab_parallel: bool = True
    packed: bool = False
    out_dir: str = os.path.join("out", "demo")

    def size(self):
        from ..megatron.training import GPTSize

        return GPTSize(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                       ffn_hidden_size=4 * self.hidden, vocab_size=self.vocab, seq_length=self.seq)


def _parse(argv=None) -> DemoConfig:
    d = DemoConfig()
    from .helptext import plain

    ap = argparse.ArgumentParser(description=plain(__doc__),
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters", type=int, default=d.iters, help="training iterations per run")
    ap.add_argument("--layers", type=int, default=d.layers, help="transformer layers")
    ap.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (FFN = 4x)")
    ap.add_argument("--seq", type=int, default=d.seq, help="sequence length (divisible by 4)")
    ap.add_argument("--no-vocab-parallel", action="store_true",
                    help="keep METP's word embedding and output layer replicated over the ring")
    ap.add_argument("--packed", action="store_true",
                    help="packed documents (EOD-separated, document-masked attention)")
    ap.add_argument("--out-dir", default=d.out_dir, help="where rank 0 writes demo.json, demo.png")
    a = ap.parse_args(argv)
    cfg = DemoConfig(iters=a.iters, layers=a.layers, hidden=a.hidden, seq=a.seq, out_dir=a.out_dir,
                     vocab_parallel=not a.no_vocab_parallel, packed=a.packed)
    problems = []
    if cfg.iters < 1:
        problems.append(f"--iters must be >= 1, got {cfg.iters}")
    if cfg.layers < 1:
        problems.append(f"--layers must be >= 1, got {cfg.layers}")
    if cfg.hidden < 1:
        problems.append(f"--hidden must be >= 1, got {cfg.hidden}")
    elif cfg.hidden % (cfg.heads * WORLD):
        problems.append(f"--hidden ({cfg.hidden}) must be divisible by {cfg.heads * WORLD} "
                        f"({cfg.heads} heads, {WORLD} ranks)")
    if cfg.seq < 2 * WORLD or cfg.seq % (2 * WORLD):
        problems.append(f"--seq ({cfg.seq}) must be a positive multiple of {2 * WORLD} "
                        f"(METP splits the sequence into 2x{WORLD} chunks)")
    if not _writable_dir(cfg.out_dir):
        problems.append(f"--out-dir {cfg.out_dir!r} cannot be created or written (the results "
                        f"are written there after both runs); pass a writable directory")
    if problems:
        ap.error("; ".join(problems))
    return cfg


def _writable_dir(path: str) -> bool:
    """Whether ``path`` is (or can be made) a directory this process can write into."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _launch(cfg: DemoConfig) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", "-m", "megatron_metp.demo",
           f"--iters={cfg.iters}", f"--layers={cfg.layers}", f"--hidden={cfg.hidden}",
           f"--seq={cfg.seq}", f"--out-dir={cfg.out_dir}"]
    if not cfg.vocab_parallel:
        cmd.append("--no-vocab-parallel")
    if cfg.packed:
        cmd.append("--packed")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("launching:", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    code = subprocess.call(cmd, env=env)
    print(f"demo: finished in {time.perf_counter() - t0:.1f} s, exit status {code}", flush=True)
    return code


# ---------------------------------------------------------------- data

def permutation_walk_batch(size, step: int, global_batch_size: int, seed: int = 7):
    """The ``step``-th global batch of the demo's synthetic language, ``[batch, seq]`` tokens and
    labels. A fixed random permutation ``succ`` of the vocabulary (from ``seed``) gives each
    token's successor; every sequence starts at a random token (from ``seed`` and ``step``) and
    follows ``succ``. Same signature as :func:`megatron_metp.megatron.training.global_batch`."""
    succ = torch.randperm(size.vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    tok = torch.randint(0, size.vocab_size, (global_batch_size,), generator=gen)
    cols = [tok]
    for _ in range(size.seq_length):
        tok = succ[tok]
        cols.append(tok)
    tokens = torch.stack(cols, dim=1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def packed_walk_batch(size, step: int, global_batch_size: int, seed: int = 7):
    """:func:`permutation_walk_batch` packed: each sample holds 2–6 documents (the same
    boundaries in every sample of the step, drawn from ``seed`` and ``step``), each a walk over
    the permutation of tokens ``0 … V−2`` from a random start, ended by the EOD token ``V−1``."""
    v = size.vocab_size - 1  # the EOD token is the last id
    succ = torch.randperm(v, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 100003 + step + 17)
    s = size.seq_length
    docs = int(torch.randint(2, 7, (), generator=gen))
    ends = sorted(set(torch.randint(2, s, (docs - 1,), generator=gen).tolist())) + [s + 1]
    stream = torch.empty(global_batch_size, s + 1, dtype=torch.long)
    start = 0
    for end in ends:  # a document is stream[start:end], its last token EOD
        tok = torch.randint(0, v, (global_batch_size,), generator=gen)
        for t in range(start, end - 1):
            stream[:, t] = tok
            tok = succ[tok]
        stream[:, end - 1] = v
        start = end
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


# ---------------------------------------------------------------- traffic counter

def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _comm_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CommCounter(TorchDispatchMode):
        """Bytes this rank sends through c10d ops (ring convention, see the module docstring),
        total and per op name; ops without a rule are listed under ``uncounted``."""

        def __init__(self):
            super().__init__()
            self.sent = 0
            self.by_op = {}
            self.calls = {}
            self.uncounted = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self._count(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))

        def _count(self, func, args, kwargs):
            name = func._schema.name.split("::")[-1]
            vals = {a.name: (args[i] if i < len(args) else kwargs.get(a.name))
                    for i, a in enumerate(func._schema.arguments)}
            pg = vals.get("process_group")
            p = dist.ProcessGroup.unbox(pg).size() if pg is not None else 1
            if name == "send":
                sent = _nbytes(vals["tensors"])
            elif name in ("recv_", "recv_any_source_", "barrier", "monitored_barrier_"):
                sent = 0
            elif name in ("allreduce_", "allreduce_coalesced_"):
                sent = 2 * (p - 1) * _nbytes(vals["tensors"]) / p
            elif name in ("allgather_", "_allgather_base_", "allgather_coalesced_",
                          "allgather_into_tensor_coalesced_"):
                sent = (p - 1) * _nbytes(vals.get("input_tensors", vals.get("input_tensor")))
            elif name in ("reduce_scatter_", "_reduce_scatter_base_",
                          "reduce_scatter_tensor_coalesced_"):
                sent = (p - 1) * _nbytes(vals.get("output_tensors", vals.get("output_tensor")))
            elif name in ("broadcast_", "reduce_"):
                sent = (p - 1) * _nbytes(vals["tensors"]) / p
            else:
                self.uncounted[name] = self.uncounted.get(name, 0) + 1
                return
            self.sent += sent
            self.by_op[name] = self.by_op.get(name, 0) + sent
            self.calls[name] = self.calls.get(name, 0) + 1

    return CommCounter()


# ---------------------------------------------------------------- memory of one step

_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


def _torch_optimizers(opt):
    parts = getattr(opt, "chained_optimizers", None) or [opt]
    return [o.optimizer for o in parts if getattr(o, "optimizer", None) is not None]


def _memory_tracker(state):
    """A MemTracker that knows the model, the optimizer states and DDP's grad buffers."""
    from .fakerank import tracker_class

    class Tracker(tracker_class()):  # restarts per-module stats for every micro-batch
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # Megatron's DDP wrapper keeps its grad buffers in the attribute ``buffers``, which
            # hides ``Module.buffers()``; its parameters are those of the module it wraps.
            if not callable(module.buffers):
                module = module.module
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    ddp = state["model"]
    mt = Tracker()
    grad_buffers = [b.grad_data for b in list(ddp.buffers) + list(ddp.expert_parallel_buffers)]
    mt.track_external(ddp, *_torch_optimizers(state["optimizer"]))
    # Tensors passed as such are filed as "Other"; the only ones are the grad buffers.
    mt.track_external(*grad_buffers)
    return mt


def _peak_split(mt) -> dict:
    from .fakerank import snap

    got = snap(mt, "peak", label="value")
    peak = {c: 0 for c in _CATEGORIES}
    peak.update(got["cat"])
    peak["Gradient"] += peak.pop("Other", 0)  # DDP grad buffers (see _memory_tracker)
    return {"total": got["total"], "by_category": peak}


# ---------------------------------------------------------------- one run

def _reset_parallel_state() -> None:
    """Tear Megatron's parallel state down so the next layout can be initialised, and check it."""
    import gc

    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    gc.collect()
    if ps.model_parallel_is_initialized() or ps._GLOBAL_MEMORY_BUFFER is not None:
        raise RuntimeError("destroy_model_parallel left Megatron's parallel state behind")


def _check_fresh_state(layout) -> None:
    """After ``init_parallel``: groups of the right sizes, a fresh global memory buffer and an
    RNG tracker holding exactly the freshly seeded streams."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    want = (layout.tp, layout.metp)
    got = (ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size())
    if got != want:
        raise RuntimeError(f"parallel state after re-init: (TP, CP) = {got}, expected {want}")
    if ps._GLOBAL_MEMORY_BUFFER is None or ps._GLOBAL_MEMORY_BUFFER.buffer:
        raise RuntimeError("global memory buffer was not rebuilt empty")
    names = set(get_cuda_rng_tracker().get_states())
    if names != {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}:
        raise RuntimeError(f"RNG tracker after re-init holds {sorted(names)}")


def train_one(name: str, layout, cfg: DemoConfig, log=None) -> dict:
    """Train ``cfg.iters`` iterations of ``layout`` on the initialised world; per-rank results."""
    from ..megatron.training import init_parallel, megatron_log_line, setup, train

    size = cfg.size()
    rank = dist.get_rank()
    init_parallel(layout, size.seq_length)
    _check_fresh_state(layout)
    state = setup(size, layout)
    metp = state["groups"].metp
    metp.stats.reset()
    losses, norms, seconds, sent, by_op, calls, uncounted = [], [], [], [], {}, {}, {}
    mem = None
    mem_step = cfg.iters - 1
    batch_fn = packed_walk_batch if cfg.packed else permutation_walk_batch
    from ..runtime import agree

    checks = []  # bytes of the agreement check's exchanges (first calls, then every 64th)
    for step in range(cfg.iters):
        counter = _comm_counter()
        check0 = agree.exchange_stats["bytes_sent"]
        if step == mem_step:
            mt = _memory_tracker(state)
            with mt, counter:
                rec = train(size, layout, 1, state=state, start_step=step,
                            batch_fn=batch_fn)[0]
            mem = _peak_split(mt)
        else:
            with counter:
                rec = train(size, layout, 1, state=state, start_step=step,
                            batch_fn=batch_fn)[0]
        losses.append(rec.lm_loss)
        norms.append(rec.grad_norm)
        seconds.append(rec.seconds)
        checks.append(agree.exchange_stats["bytes_sent"] - check0)
        sent.append(counter.sent - checks[-1])  # the model's traffic, without the check's
        for d, src in ((by_op, counter.by_op), (calls, counter.calls),
                       (uncounted, counter.uncounted)):
            for k, v in src.items():
                d[k] = d.get(k, 0) + v
        if checks[-1]:  # the check's all-gathers are not the model's traffic
            by_op["allgather_"] -= checks[-1]
        if log is not None and rank == 0:
            note = "  (MemTracker on: slower)" if step == mem_step else ""
            log(f"[{name}]" + megatron_log_line(rec, cfg.iters, layout, state["optimizer"]) + note)
    n = cfg.iters
    ring = metp.stats.snapshot()
    result = {
        "losses": losses, "grad_norms": norms, "seconds": seconds,
        "memory": mem,
        "traffic": {
            "bytes_sent_per_step": sum(sent) / n,
            "bytes_sent_each_step": sent,
            "agreement_check_bytes_each_step": checks,
            "by_op_per_step": {k: v / n for k, v in sorted(by_op.items())},
            "calls_per_step": {k: v / n for k, v in sorted(calls.items())},
            "uncounted_calls": uncounted,
            "metp_ring_stats_per_step": {k: v / n for k, v in ring.items()},
        },
    }
    del state
    _reset_parallel_state()
    return result


def runs(world: int, cfg: DemoConfig):
    """The two runs, in order: stock Megatron TP over the world, then METP over the world."""
    from ..megatron.training import Layout

    common = dict(micro_batch_size=cfg.micro_batch, global_batch_size=cfg.global_batch, lr=cfg.lr,
                  packed_eod=cfg.vocab - 1 if cfg.packed else None)
    metp = Layout(metp=world, vocab_parallel=cfg.vocab_parallel, **common)
    return [(f"stock TP={world}", Layout(tp=world, mode="tp", **common)),
            (f"METP={world}" + ("+vocab" if cfg.vocab_parallel else ""), metp)]


def run_demo(cfg: DemoConfig, log=None) -> dict:
    """Both runs on the initialised world; rank 0 gets the merged table (others: ``None``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_run = {}
    for name, layout in runs(world, cfg):
        t0 = time.perf_counter()
        res = train_one(name, layout, cfg, log)
        res["wall_seconds"] = time.perf_counter() - t0
        parts = [None] * world
        dist.all_gather_object(parts, res)
        per_run[name] = (layout, parts)
    if rank != 0:
        return None
    return _table(cfg, per_run, world)


def _table(cfg: DemoConfig, per_run: dict, world: int) -> dict:
    names = list(per_run)
    a, b = names
    la, lb = per_run[a][1][0]["losses"], per_run[b][1][0]["losses"]
    rows = []
    for i, (x, y) in enumerate(zip(la, lb)):
        rows.append({"iteration": i + 1, a: x, b: y, "abs_diff": abs(x - y),
                     "rel_diff": abs(x - y) / max(abs(x), 1e-30)})
    out = {
        "config": {**asdict(cfg), "world_size": world, "ffn_hidden": 4 * cfg.hidden,
                   "dtype": "float32", "backend": "gloo (CPU)",
                   "data": "permutation walks (token t followed by succ[t]), seeded"},
        "runs": {n: {"layout": per_run[n][0].describe(), "mode": per_run[n][0].mode,
                     "wall_seconds": per_run[n][1][0]["wall_seconds"],
                     "losses": per_run[n][1][0]["losses"],
                     "grad_norms": per_run[n][1][0]["grad_norms"],
                     "seconds_per_iteration": per_run[n][1][0]["seconds"]} for n in names},
        "loss_table": rows,
        "max_abs_diff": max(r["abs_diff"] for r in rows),
        "max_rel_diff": max(r["rel_diff"] for r in rows),
        "memory": {n: [{"rank": r, **per_run[n][1][r]["memory"]} for r in range(world)]
                   for n in names},
        "traffic": {n: [{"rank": r, **per_run[n][1][r]["traffic"]} for r in range(world)]
                    for n in names},
        "conventions": {
            "memory": "torch.distributed._tools.mem_tracker.MemTracker around one training step "
                      "(the last iteration), real CPU tensor storages, peak bytes per rank; "
                      "Gradient includes Megatron DDP's contiguous grad buffers; Activation = "
                      "allocated in forward, Temp = allocated in backward",
            "traffic": "bytes sent by each rank per step through c10d ops (TorchDispatchMode, "
                       "same for both runs); ring convention over a group of p and N bytes: "
                       "send N, all-reduce 2(p-1)/p N, all-gather/reduce-scatter (p-1)/p N of "
                       "the full tensor, broadcast/reduce (p-1)/p N; metp_ring_stats_per_step = "
                       "METPGroup.stats (ring send/recv, weight broadcasts counted as received "
                       "by non-owners, gradient reduces as sent by non-owners)",
        },
    }
    out["tolerance_rel"] = 1e-4
    out["ok"] = out["max_rel_diff"] <= out["tolerance_rel"]
    return out


# ---------------------------------------------------------------- entry points

def rank_main(rank: int, world: int, cfg: DemoConfig, log=None):
    """One rank of the demo on an initialised gloo world (torchrun or ``tests.harness``)."""
    from ..megatron import cpu

    cpu.enable()
    return run_demo(cfg, log)


def _worker(cfg: DemoConfig) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import datetime

    from ..runtime.watchdog import job_timeout_s

    # the one job timeout (METP_RING_TIMEOUT_S) from the start: the default group too
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job_timeout_s()))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        raise SystemExit(f"the demo runs on {WORLD} ranks, got {world}")
    code = 0
    if rank == 0:
        print(f"tiny GPT: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
              f"FFN {4 * cfg.hidden}, vocab {cfg.vocab}, seq {cfg.seq}, global batch "
              f"{cfg.global_batch} (micro-batch {cfg.micro_batch}), Adam lr {cfg.lr}, "
              f"{cfg.iters} iterations per run, fp32, {world} gloo CPU ranks"
              + ("; packed documents (EOD-separated, document-masked attention)"
                 if cfg.packed else ""), flush=True)
    res = rank_main(rank, world, cfg, log=lambda s: print(s, flush=True))
    if rank == 0:
        for name, r in res["runs"].items():
            print(f"[{name}] {r['layout']}: {r['wall_seconds']:.1f} s for {cfg.iters} iterations")
        print(format_table(res))
        jpath, ppath = write_outputs(res, cfg.out_dir)
        print(f"\nwrote {os.path.abspath(jpath)}\nwrote {os.path.abspath(ppath)}")
        ok, msg = check(res)
        print(msg, flush=True)
        code = 0 if ok else 1
    flag = torch.tensor([code])
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return int(flag.item())


def main(argv=None) -> int:
    cfg = _parse(argv)
    if "RANK" not in os.environ:
        return _launch(cfg)
    return _worker(cfg)


if __name__ == "__main__":
    sys.exit(main())
