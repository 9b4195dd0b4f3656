#!/usr/bin/env python
"""Per-rank peak memory and traffic of one MLP block forward+backward: METP vs Megatron TP, TP+SP.

For rank 0 of a group of ``p`` ranks this measures one forward and one backward of

* ``metp``            ``megatron_metp.ops.metp_mlp``, x ``[s/p, b, h]``, shards ``[k·F/p, h]`` and
                      ``[h, F/p]``, default recompute of ``f(x·W1ᵀ)`` in backward;
* ``metp-keep``       the same with ``keep_intermediate=True``;
* ``metp-gpumm``      ``metp`` with the op's CUDA matmul branch emulated (see "CPU vs GPU" below);
* ``metp-keep-gpumm`` ``metp-keep`` likewise (not in the default list);
* ``metp-outer-gpumm`` ``metp-gpumm`` in token tiles of ``--token-tile`` rows, the ring once per
                      tile (tile-outer, ``ops/tiles.py``; not in the default list);
* ``metp-inner-gpumm`` the same tiles, the ring once and each step over the tiles (tile-inner);
* ``tp``              Megatron's ColumnParallelLinear(h→k·F, gather_output=False) → GeLU/SwiGLU →
                      RowParallelLinear(input_is_parallel=True), input ``[s, b, h]`` replicated;
* ``tp-sp``           the same with ``sequence_parallel=True``, input ``[s/p, b, h]``.

``k = 2`` for SwiGLU (gate and up rows), else 1; ``F`` is the FFN size.

How (no cluster, no real allocation). One subprocess per ``p`` (a fresh world each):
``init_process_group("fake", rank=0, world_size=p, store=FakeStore())`` makes every collective and
send/recv a no-op; everything is built under ``FakeTensorMode`` with
``torch.set_default_dtype(torch.bfloat16)``; ``torch.distributed._tools.mem_tracker.MemTracker``
follows every storage and reports the peak by category. Only tensor-level allocations are seen
(what a caching allocator would hand out, rounded up to 512 B); kernel workspaces, allocator
fragmentation and the CUDA context are not. The only shim, applied in the worker processes alone,
is ``torch.cuda.current_device = lambda: torch.device("cpu")`` (Megatron allocates its SP buffers
on ``torch.cuda.current_device()``).

Memory columns (MiB, rank 0):

* ``peak``: the largest total of tracked bytes during fwd+bwd; ``in`` says whether it was reached
  in the forward or the backward.
* ``W+dW``, ``in/dy``, ``fwd-alloc``, ``bwd-alloc``: that peak split by MemTracker category:
  parameters + their gradients; the tensors the caller hands in (x and the output gradient dy,
  tracked as "Other"); tensors allocated during forward and still alive (saved activations, the
  output y, Megatron's persistent SP all-gather buffer); tensors allocated during backward (dx,
  weight-gradient accumulators, recomputed intermediates, ring buffers, temporaries).
* ``work``: the largest ``fwd-alloc + bwd-alloc`` seen at any moment (activation memory proper,
  without weights, gradients and the caller's tensors).
* ``stored`` / ``stored≈``: what the forward leaves for the backward, measured as (forward
  allocations alive after forward) - (output y) + (input x, which every variant saves), against the
  analytical value: METP ``n·h·2`` (x only; ``n = s·b/p`` tokens) and with keep ``+ n·k·F·2`` (every
  shard's ``x·W1_jᵀ``); TP ``s·b·h·2 + c·s·b·(F/p)·2`` with ``c = 2`` for GeLU (fc1 output, GeLU
  output) and ``c = 4`` for SwiGLU (fc1 output ``2F/p``, silu(gate), product); TP+SP the same with
  the input ``/p`` plus Megatron's persistent ``s·b·h·2`` all-gather buffer (one per model on a GPU).
* ``rings≈`` (METP rows): of that peak, the ring buffers alone: 2 bf16 weight shards
  and the 2 fp32 buffers of the travelling gradient sum, ``(2·2 + 2·4)·w`` bytes for a shard of ``w`` elements.
* ``peak≈`` (METP rows): an analytical model of ``metp_mlp``'s backward peak from the buffers its
  code allocates (see ``metp_peak_model``); the ratio ``peak/peak≈`` shows how well it explains the
  measurement (and drifts if the op changes).

Traffic columns (MiB sent per rank per fwd+bwd):

* ``sent``: counted from the c10d ops that were dispatched (send, all-reduce, all-gather,
  reduce-scatter; their payload shapes are real under the fake group) with the ring-algorithm
  convention: bytes *sent* by one rank = ``N`` for a send, ``2(p-1)/p·N`` for an all-reduce of
  ``N`` bytes, ``(p-1)/p·N`` for an all-gather or reduce-scatter whose full (gathered) tensor is
  ``N`` bytes.
* ``sent≈``: closed form. METP: ``(p-1)·(2·Ws + Gs)``: the weight shard (``Ws`` bytes, bf16) goes
  round once in forward and once in backward, its fp32 gradient accumulator (``Gs`` bytes) once in
  backward; for METP rows the number is ``METPGroup.stats.bytes_sent`` (counted when the op posts
  each exchange) and the closed form is checked against it. TP: all-reduce of ``y`` (forward) and
  of ``dx`` (backward) of ``N = s·b·h·2`` bytes each: ``4(p-1)/p·N``. TP+SP: forward all-gather of
  x and reduce-scatter of y; backward all-gather of x *again* (Megatron re-gathers the input for
  the weight gradient instead of saving it), reduce-scatter of dx and all-gather of dy:
  ``5(p-1)/p·N``.

CPU vs GPU. ``metp_mlp`` accumulates 16-bit products into fp32 buffers. On CUDA it forms each
product with ``torch.mm(..., out_dtype=float32)`` (one fp32 temporary the size of the result); on
any other device it casts *both operands* to fp32 first, which also allocates fp32 copies of the
operands (e.g. of x, dz and of the weight shard). Fake CUDA tensors cannot be used on a CPU-only
torch (autograd aborts: "PyTorch is not linked with support for cuda devices"), so the ``-gpumm``
variants replace the op's private ``_mm_acc`` in the worker process by its CUDA branch, which runs
on CPU fake tensors too. Use those rows as the estimate of GPU memory.

Not modelled: Megatron DDP's fp32 ``main_grad`` buffers (4 B/param for every variant alike), the
optimizer, dropout, biases unless ``--bias``.

Usage::

    python benchmarks/mlp_memory.py                       # default sweep, markdown to stdout
    python benchmarks/mlp_memory.py --seq 32768 --p 8 --activation swiglu --ffn 11008
    python benchmarks/mlp_memory.py --out results.csv     # also CSV (or .json)

Default sweep: GeLU, h=4096, F=4h, b=1, s in {4K, 16K, 64K}, p in {2, 4, 8}; plus SwiGLU (F=4h)
at s=16K for p in {2, 4, 8}. Giving any of --seq/--hidden/--p/--activation replaces the default
sweep by the cross product of the values given (the others keep their defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402  (benchmarks/_bench.py: table and output helpers)
from _bench import REPO, MiB  # noqa: E402,F401

from megatron_metp.tools import fakerank as FR  # noqa: E402  (the fake-rank harness)

_tracker_class = FR.tracker_class
_comm_counter_class = FR.comm_counter_class
_snap = FR.snap
_fmt = _bench.fmt
_write_out = _bench.write_out
BF16 = 2  # bytes per element of every tensor built here (default dtype bf16)
FP32 = 4

METHODS = {
    "metp": "metp_mlp, recompute f(x·W1ᵀ) in backward",
    "metp-keep": "metp_mlp, keep_intermediate=True",
    "metp-gpumm": "metp_mlp recompute, CUDA fp32-accumulation matmul branch emulated",
    "metp-keep-gpumm": "metp_mlp keep_intermediate=True, CUDA matmul branch emulated",
    "metp-outer-gpumm": "metp-gpumm in token tiles (--token-tile rows), ring once per tile",
    "metp-inner-gpumm": "metp-gpumm in token tiles (--token-tile rows), ring once, tiles per step",
    "tp": "Megatron ColumnParallelLinear -> f -> RowParallelLinear, input [s,b,h] replicated",
    "tp-sp": "the same with sequence_parallel=True, input [s/p,b,h]",
}
DEFAULT_METHODS = ["metp", "metp-keep", "metp-gpumm", "tp", "tp-sp"]
DEFAULT_SEQ = [4096, 16384, 65536]
DEFAULT_P = [2, 4, 8]
DEFAULT_HIDDEN = 4096
RESULT_TAG = "MLP_MEMORY_RESULT "


# --------------------------------------------------------------------------- closed forms

def _k(act):
    return 2 if act == "swiglu" else 1


def metp_shard_numel(h, ffn, p, act, bias):
    """Elements of one flat METP weight shard: W1_j [k·F/p, h], b1_j [k·F/p], W2_j [h, F/p]."""
    f = ffn // p
    return _k(act) * f * h + (_k(act) * f if bias else 0) + h * f


def bytes_closed_form(c):
    """Bytes sent by one rank in one fwd+bwd, ring-algorithm convention (see module docstring)."""
    s, b, h, ffn, p, act, bias, m = (c["s"], c["b"], c["h"], c["ffn"], c["p"], c["act"],
                                     c["bias"], c["method"])
    if m.startswith("metp"):
        w = metp_shard_numel(h, ffn, p, act, bias)
        passes = _tile_count(c) if "outer" in m else 1  # tile-outer: the ring once per tile
        # grad_reduce_dtype = fp32 (the op's default)
        return passes * (p - 1) * (2 * w * BF16 + w * FP32)
    n = s * b * h * BF16
    if m == "tp":
        return 4 * (p - 1) * n // p
    if m == "tp-sp":
        return 5 * (p - 1) * n // p
    raise ValueError(m)


def _tile_count(c):
    """Tiles of the ``-outer``/``-inner`` methods (``ops/tiles.py``'s balanced tiles)."""
    from megatron_metp.ops import tiles as tiling

    n = c["s"] * c["b"] // c["p"]
    return len(tiling.tile_slices(n, tiling.resolve_rows(c.get("tile", 0), n, 1)))


def stored_analytic(c):
    """Bytes the forward leaves for the backward (see module docstring), analytical."""
    s, b, h, ffn, p, act, m = c["s"], c["b"], c["h"], c["ffn"], c["p"], c["act"], c["method"]
    if m.startswith("metp"):
        n = s * b // p
        out = n * h * BF16
        if "keep" in m:
            out += n * _k(act) * ffn * BF16
        return out
    per_f = 2 if act == "gelu" else 4
    inter = per_f * s * b * (ffn // p) * BF16
    if m == "tp":
        return s * b * h * BF16 + inter
    return (s // p) * b * h * BF16 + inter + s * b * h * BF16  # + persistent all-gather buffer


def metp_ring_buffers(c):
    """Bytes of ring buffers alive at ``metp_mlp``'s backward peak (see ``metp_peak_model``)."""
    h, ffn, p, act, bias = c["h"], c["ffn"], c["p"], c["act"], c["bias"]
    if p == 1:
        return 0
    w = metp_shard_numel(h, ffn, p, act, bias)
    return 2 * w * BF16 + 2 * w * FP32


def metp_peak_model(c):
    """Analytical backward peak of ``metp_mlp`` on rank 0, from the buffers its code allocates.

    Notation: ``n = s·b/p`` tokens, ``f = F/p``, ``kf = k·f``; ``Ws`` / ``Gs``: one flat weight shard
    in bf16 / its fp32 gradient accumulator. Alive through the backward:

    * parameters ``Ws``; the caller's x and dy and the output y (``3·n·h·2``); dx accumulated in
      fp32 (``n·h·4``); with keep, every shard's ``x·W1_jᵀ`` (``n·k·F·2``);
    * the weight ring: this rank's shard packed for sending (reused as ``circulate``'s spare once
      sent) and the shard received: ``2·Ws``;
    * the gradient ring: the two buffers of the travelling sum (one being sent / filled, one
      receiving), ``2·Gs`` (one ``Gs`` when p = 1); contributions are added into them in place.

    On top, the largest of the per-step phases of ``shard_grads`` (``z = x·W1_jᵀ`` ``n·kf·2``
    unless kept, ``a = f(z)`` and ``da = g·W2_j`` ``n·f·2`` each, ``dz`` ``n·kf·2``; SwiGLU's backward
    also holds its two halves, ``2·n·f·2``, while concatenating them): forming ``dz``; then
    ``dx += dz·W1_j``, ``dW1_j += dzᵀ·x``, ``dW2_j += gᵀ·a`` (``z, a, dz`` alive, ``da`` freed). Each
    fp32 accumulation allocates, on CPU, fp32 copies of both operands, and with the CUDA branch
    (``-gpumm``) one fp32 product the size of the result. Biases are ignored. This is a model of
    the current code, not a bound: when the op changes, ``peak/peak≈`` moves away from 1.
    """
    s, b, h, ffn, p, act, bias, m = (c["s"], c["b"], c["h"], c["ffn"], c["p"], c["act"],
                                     c["bias"], c["method"])
    n, f = s * b // p, ffn // p
    kf = _k(act) * f
    w = metp_shard_numel(h, ffn, p, act, bias)
    ws, gs = w * BF16, w * FP32
    keep = "keep" in m
    gpumm = m.endswith("gpumm")
    alive = ws + 3 * n * h * BF16 + n * h * FP32
    if keep:
        alive += n * _k(act) * ffn * BF16
    # the gradient sum travelling the ring: two reused buffers (one when p = 1)
    alive += 2 * ws + 2 * gs if p > 1 else gs
    z = 0 if keep else n * kf * BF16
    a = da = n * f * BF16
    dz = n * kf * BF16
    halves = 2 * n * f * BF16 if act == "swiglu" else 0
    locals_ = z + a + dz
    new_acc = 0  # contributions are added into the travelling buffers in place
    if gpumm:
        ext_dx, ext_dw1, ext_dw2 = n * h * FP32, kf * h * FP32, h * f * FP32
    else:
        ext_dx = n * kf * FP32 + kf * h * FP32
        ext_dw1 = n * kf * FP32 + n * h * FP32
        ext_dw2 = n * h * FP32 + n * f * FP32
    phases = [z + a + da + halves + dz,
              locals_ + ext_dx,
              new_acc + locals_ + ext_dw1,
              new_acc + locals_ + ext_dw2]
    return alive + max(phases)


# --------------------------------------------------------------------------- worker (one p)

def _run_worker(p, cases, timeout):
    """One forked child: a fake world of size p, every case of that p."""
    return FR.run_cases(_measure, {p: (p, cases)}, timeout=timeout)


def _build_metp(case, group):
    import torch

    from megatron_metp.ops import metp_mlp

    h, ffn, p, act, bias, m = (case["h"], case["ffn"], case["p"], case["act"], case["bias"],
                               case["method"])
    k, f = _k(act), ffn // p

    class _METPMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.empty(k * f, h))
            self.w2 = torch.nn.Parameter(torch.empty(h, f))
            self.b1 = torch.nn.Parameter(torch.empty(k * f)) if bias else None
            self.b2 = torch.nn.Parameter(torch.empty(h)) if bias else None

        def forward(self, x):
            tiled = "outer" in m or "inner" in m
            os.environ["METP_MLP_TILE_ORDER"] = "inner" if "inner" in m else "outer"
            return metp_mlp(x, self.w1, self.w2, group=group, activation=act, fc1_bias=self.b1,
                            fc2_bias=self.b2, keep_intermediate="keep" in m, ffn_hidden_size=ffn,
                            token_tile=case.get("tile", 0) if tiled else 0)

    return _METPMLP()


def _build_tp(case, tp_group):
    import torch
    import torch.nn.functional as F
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    h, ffn, p, act, bias = case["h"], case["ffn"], case["p"], case["act"], case["bias"]
    cfg = ModelParallelConfig(tensor_model_parallel_size=p, sequence_parallel=case["method"] == "tp-sp",
                              use_cpu_initialization=True, perform_initialization=False,
                              params_dtype=torch.bfloat16)

    class _StockTPMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(h, _k(act) * ffn, config=cfg, init_method=lambda w: None,
                                            bias=bias, gather_output=False, tp_group=tp_group)
            self.fc2 = RowParallelLinear(ffn, h, config=cfg, init_method=lambda w: None, bias=bias,
                                         input_is_parallel=True, skip_bias_add=False,
                                         tp_group=tp_group)

        def forward(self, x):
            z, _ = self.fc1(x)
            if act == "swiglu":
                zg, zu = torch.chunk(z, 2, dim=-1)
                a = F.silu(zg) * zu
            else:
                a = F.gelu(z)
            y, _ = self.fc2(a)
            return y

    return _StockTPMLP()


def _measure(case):
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp import METPGroup

    s, b, h, p, m = case["s"], case["b"], case["h"], case["p"], case["method"]
    is_metp = m.startswith("metp")
    restore = []
    group = None
    if is_metp:
        group = METPGroup.from_process_group(dist.group.WORLD, name="bench")
        if m.endswith("gpumm"):
            from megatron_metp.ops.cuda_emulation import emulate_cuda

            restore.append(emulate_cuda(kernels=False))
    else:
        import megatron.core.parallel_state as ps
        ps.destroy_global_memory_buffer()  # a fresh (fake) all-gather buffer per case
        ps._set_global_memory_buffer()

    n_in = s if m == "tp" else s // p
    try:
        with FakeTensorMode():
            module = _build_metp(case, group) if is_metp else _build_tp(case, dist.group.WORLD)
            x = torch.empty(n_in, b, h, requires_grad=True)
            dy = torch.empty(n_in, b, h)
            tracker = _tracker_class()()
            tracker.track_external(x, dy)
            comm = _comm_counter_class()(p)
            with tracker, comm:
                y = module(x)
                after_fwd = _snap(tracker, "current")
                fwd_peak = _snap(tracker, "peak")
                sent_fwd = comm.sent
                metp_fwd = group.stats.bytes_sent if is_metp else None
                y.backward(dy)
            peak = _snap(tracker, "peak")
            y_bytes = y.numel() * y.element_size()
            x_bytes = x.numel() * x.element_size()
    finally:
        for undo in restore:
            undo()
    cat = {"PARAM": 0, "GRAD": 0, "ACT": 0, "TEMP": 0, "OTH": 0, "BUFFER": 0, "OPT": 0}
    at_peak = dict(cat, **peak["cat"])
    res = {
        "peak_mib": peak["total"] / MiB,
        "peak_phase": "bwd" if peak["total"] > fwd_peak["total"] else "fwd",
        "fwd_peak_mib": fwd_peak["total"] / MiB,
        "peak_weights_grads_mib": (at_peak["PARAM"] + at_peak["GRAD"]) / MiB,
        "peak_inputs_mib": at_peak["OTH"] / MiB,
        "peak_fwd_alloc_mib": at_peak["ACT"] / MiB,
        "peak_bwd_alloc_mib": at_peak["TEMP"] / MiB,
        "work_peak_mib": tracker.work_peak / MiB,
        "stored_mib": (after_fwd["cat"].get("ACT", 0) - y_bytes + x_bytes) / MiB,
        "stored_analytic_mib": stored_analytic(case) / MiB,
        "sent_counted_mib": comm.sent / MiB,
        "sent_fwd_counted_mib": sent_fwd / MiB,
        "sent_closed_form_mib": bytes_closed_form(case) / MiB,
        "comm_ops": comm.ops,
    }
    if is_metp:
        res["metp_stats_sent_mib"] = group.stats.bytes_sent / MiB
        res["metp_stats_sent_fwd_mib"] = metp_fwd / MiB
        res["metp_stats"] = group.stats.snapshot()
        res["peak_model_mib"] = metp_peak_model(case) / MiB
        res["ring_buffers_model_mib"] = metp_ring_buffers(case) / MiB
    return res


# --------------------------------------------------------------------------- driver

def _cases(args):
    custom = any(v is not None for v in (args.seq, args.hidden, args.p, args.activation))
    seqs = args.seq or DEFAULT_SEQ
    hs = args.hidden or [DEFAULT_HIDDEN]
    ps_ = args.p or DEFAULT_P
    acts = args.activation or ["gelu"]
    configs = [(a, s, h, p) for a in acts for h in hs for s in seqs for p in ps_]
    if not custom:
        configs += [("swiglu", 16384, DEFAULT_HIDDEN, p) for p in DEFAULT_P]
    cases = []
    for act, s, h, p in configs:
        ffn = args.ffn or 4 * h
        if s % p or ffn % p:
            raise SystemExit(f"s={s} and ffn={ffn} must be divisible by p={p}")
        for m in args.methods:
            if m == "tp-sp" and p == 1:
                continue  # Megatron refuses sequence parallelism without tensor parallelism
            case = {"act": act, "s": s, "b": args.batch, "h": h, "ffn": ffn, "p": p,
                    "method": m, "bias": args.bias}
            if "outer" in m or "inner" in m:
                case["tile"] = args.token_tile
            cases.append(case)
    return cases


def _label(r):
    return f"{r['act']} s={r['s'] // 1024}K p={r['p']}" if r["s"] % 1024 == 0 else \
        f"{r['act']} s={r['s']} p={r['p']}"


def _print_tables(rows, args):
    print(f"# MLP block, one forward+backward, rank 0 of p (fake process group + FakeTensorMode + "
          f"MemTracker)\n")
    hs = sorted({r["h"] for r in rows})
    print(f"b={args.batch}, h={','.join(map(str, hs))}, ffn={'4h' if not args.ffn else args.ffn}, "
          f"bf16, bias={'yes' if args.bias else 'no'}; memory in MiB; traffic in MiB sent per "
          f"rank per fwd+bwd (ring convention: all-reduce 2(p-1)/p·N, all-gather and "
          f"reduce-scatter (p-1)/p·N, send N). Columns are explained in the module docstring.\n")
    cols = ["config", "method", "peak", "in", "W+dW", "in/dy", "fwd-alloc", "bwd-alloc", "work",
            "stored", "stored≈", "rings≈", "peak≈", "peak/peak≈", "sent", "sent≈"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {_label(r)} | {r['method']} | error: {r['error'][:200]} |" + " |" * (len(cols) - 3))
            continue
        metp = r["method"].startswith("metp")
        sent = r["metp_stats_sent_mib"] if metp else r["sent_counted_mib"]
        vals = [_label(r), r["method"], r["peak_mib"], r["peak_phase"], r["peak_weights_grads_mib"],
                r["peak_inputs_mib"], r["peak_fwd_alloc_mib"], r["peak_bwd_alloc_mib"],
                r["work_peak_mib"], r["stored_mib"], r["stored_analytic_mib"],
                r.get("ring_buffers_model_mib"), r.get("peak_model_mib"),
                (f"{r['peak_mib'] / r['peak_model_mib']:.3f}" if metp else None),
                sent, r["sent_closed_form_mib"]]
        print("| " + " | ".join(_fmt(v) for v in vals) + " |")

    # compact view: peak per method per config
    methods = [m for m in args.methods]
    configs = []
    for r in rows:
        key = (r["act"], r["s"], r["h"], r["p"])
        if key not in configs:
            configs.append(key)
    by = {(r["act"], r["s"], r["h"], r["p"], r["method"]): r for r in rows}
    print("\n## Peak per rank (MiB), and METP's peak relative to TP+SP\n")
    head = ["config"] + methods + (["metp / tp-sp"] if {"metp", "tp-sp"} <= set(methods) else []) \
        + (["metp-gpumm / tp-sp"] if {"metp-gpumm", "tp-sp"} <= set(methods) else [])
    print("| " + " | ".join(head) + " |")
    print("|---|" + "|".join("---:" for _ in head[1:]) + "|")
    for key in configs:
        line = [_label({"act": key[0], "s": key[1], "p": key[3]}) + (f" h={key[2]}" if len(hs) > 1 else "")]
        for m in methods:
            r = by.get(key + (m,))
            line.append("n/a" if r is None else "err" if "error" in r else _fmt(r["peak_mib"], 0))
        for a in ("metp", "metp-gpumm"):
            if f"{a} / tp-sp" in head:
                ra, rb = by.get(key + (a,)), by.get(key + ("tp-sp",))
                ok = ra and rb and "error" not in ra and "error" not in rb
                line.append(f"{ra['peak_mib'] / rb['peak_mib']:.2f}" if ok else "")
        print("| " + " | ".join(line) + " |")
    if "tp-sp" in methods:
        print("\ntp-sp includes Megatron's persistent all-gather buffer (s·b·h·2 bytes; on a GPU one "
              "per model, shared by every layer).")

    # consistency checks the reader should not have to do by eye
    notes = []
    for r in rows:
        if "error" in r:
            continue
        if r["method"].startswith("metp"):
            if abs(r["metp_stats_sent_mib"] - r["sent_closed_form_mib"]) > 1e-6:
                notes.append(f"{_label(r)} {r['method']}: METPGroup.stats {r['metp_stats_sent_mib']:.1f} "
                             f"MiB != closed form {r['sent_closed_form_mib']:.1f} MiB")
            if abs(r["metp_stats_sent_mib"] - r["sent_counted_mib"]) > 1e-6:
                notes.append(f"{_label(r)} {r['method']}: METPGroup.stats {r['metp_stats_sent_mib']:.1f} "
                             f"MiB != dispatched sends {r['sent_counted_mib']:.1f} MiB")
        elif abs(r["sent_counted_mib"] - r["sent_closed_form_mib"]) > 1e-6:
            notes.append(f"{_label(r)} {r['method']}: dispatched collectives {r['sent_counted_mib']:.1f} "
                         f"MiB != closed form {r['sent_closed_form_mib']:.1f} MiB ({r['comm_ops']})")
        if abs(r["stored_mib"] - r["stored_analytic_mib"]) > 0.01 * max(1.0, r["stored_analytic_mib"]):
            notes.append(f"{_label(r)} {r['method']}: stored {r['stored_mib']:.1f} MiB vs analytic "
                         f"{r['stored_analytic_mib']:.1f} MiB")
    print("\nChecks: " + ("traffic counted = closed form = METPGroup.stats for every row; stored = "
                          "analytic within 1 % for every row." if not notes else ""))
    for n in notes:
        print(f"- {n}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", help="sequence lengths s (default 4096 16384 65536)")
    ap.add_argument("--hidden", type=int, nargs="+", help="hidden sizes h (default 4096)")
    ap.add_argument("--p", type=int, nargs="+", help="group sizes p (default 2 4 8)")
    ap.add_argument("--activation", nargs="+", choices=["gelu", "swiglu"],
                    help="activations (default gelu, plus one swiglu case)")
    ap.add_argument("--ffn", type=int, default=None, help="FFN size F (default 4h)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch b (default 1)")
    ap.add_argument("--bias", action="store_true", help="give fc1/fc2 biases (default none)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS,
                    help=f"variants to measure (default {' '.join(DEFAULT_METHODS)})")
    ap.add_argument("--token-tile", type=int, default=0,
                    help="token rows per tile of the -outer/-inner methods (0 = whole)")
    _bench.add_run_args(ap)
    args = ap.parse_args(argv)

    cases = _cases(args)
    by_p = {}
    for c in cases:
        by_p.setdefault(c["p"], []).append(c)
    t0 = time.perf_counter()
    results = []
    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(args.jobs) as ex:
            for got in ex.map(lambda kv: _run_worker(kv[0], kv[1], args.timeout), by_p.items()):
                results += got
    else:
        for p, cs in by_p.items():
            results += _run_worker(p, cs, args.timeout)
    order = {json.dumps(c, sort_keys=True): i for i, c in enumerate(cases)}
    results.sort(key=lambda r: order.get(json.dumps({k: r[k] for k in cases[0]}, sort_keys=True), 1 << 30))
    _print_tables(results, args)
    print(f"\n{len(results)} measurements in {time.perf_counter() - t0:.1f} s "
          f"({len(by_p)} worker processes).")
    if args.out:
        _write_out(results, args.out)
        print(f"wrote {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
