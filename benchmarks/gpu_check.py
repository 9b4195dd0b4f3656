#!/usr/bin/env python
"""One prepared GPU check of METP (≤ 8 min on one H100/H200): rates, block kernels, memory, time,
launches.

Writes ``<out>/gpu_check.json``, ``<out>/gpu_check.md`` and the rates file ``metp plan --rates``
reads (``--rates FILE``, default ``<out>/rates.json``). Parts:

0. **Rates first** (:mod:`gpu_rates`, within ~5 minutes of one H100/H200): GEMM TFLOP/s; each
   block kernel's forward and backward TFLOP/s at the streaming layer's shapes (a query
   tile × 4 query heads against 262K and 524K keys of one K/V head, head dim 128, full and
   causal pieces, with the log-sum-exp merges; the file's ``kernel`` the fastest, ``kernels``
   every one: what ``metp plan --rates`` and ``METP_KERNEL_RATES`` read); pinned host↔device
   GB/s while kernels run; one streaming layer (host stash) as rank 0 of 8 under the fake
   process group at the 4M geometry and the plan's tiles, forward and backward timed with CUDA
   events, next to the plan's one-layer figure, then its backward with kept attention
   (``metp_layer(..., keep_attention=True)``) against full recompute's (``keep_attention not
   available`` where the op lacks it). ``--only-rates`` stops there.
   The GPU path of this part has not run yet (written without a GPU; the ``--dry`` path is
   tested): its first GPU run is its test.
1. **Block kernels** against the plain reference (``ops.attention_kernels``): every kernel this
   machine has (``flash_attn``, ``torch_flash``; ``reference`` itself) on causal and full
   blocks, MHA and GQA, bf16: relative error of the output, of the log-sum-exp and of
   ``dq, dk, dv`` (the backward given the block's own output and lse), next to the error of the
   reference kernel run in bf16. Transformer Engine is listed as present or absent (its fused
   attention is cuDNN's, which METP calls through torch's cuDNN ops: kernel ``cudnn``).
2. **Stacks** as rank 0 of ``p`` under torch's fake process group (collectives are no-ops, the
   tensors are real, so memory and compute are one real rank's): a ``--layers``-layer stack of
   the 7B geometry (h=4096, 32 heads, SwiGLU ffn 11008, RMSNorm, bf16) for METP, stock TP and
   TP+SP (flash core attention) at ``--seq`` (16K..128K): fwd+bwd time (CUDA events, median of
   ``--iters`` after a warm-up), ``torch.cuda.max_memory_allocated`` during fwd+bwd next to the
   CPU instrument's peak for the same stack (``FakeTensorMode`` + ``MemTracker`` with the CUDA
   accounting, as ``metp measure`` does), and kernel launches per layer from the CUDA profiler
   (stacks of 1 and 2 layers, their difference). Mode ``metp-cp`` is METP × context parallelism:
   rank 0 of a fake world of ``p·cp`` ranks (``--cp``, the outer factor), holding ``s/(p·cp)``
   tokens, its weight ring and broadcasts over the ``p`` ranks of its METP group and each head
   group's K/V ring over the ``p·cp`` ranks of the CP group (on one GPU the K/V messages go
   nowhere; what it measures is one rank's memory, compute and launches at that split).
   Wall time is bounded by ``--budget`` seconds:
   cases that would start past it are reported as skipped (by name, never silently).

``--dry`` runs the same code on this CPU with tiny shapes (kernels on CPU tensors, stacks on CPU
tensors under the fake group, launches from the dispatch counter of ``benchmarks/launches.py``
instead of the CUDA profiler, no CUDA memory): what the tests run. Timings are printed, never
asserted anywhere.

    python benchmarks/gpu_check.py --out out/gpu_check            # on a GPU machine
    python benchmarks/gpu_check.py --dry --out /tmp/gpu_check      # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_metp.tools import fakerank as FR  # noqa: E402

GEO_7B = dict(hidden=4096, heads=32, groups=32, ffn=11008)
GEO_TINY = dict(hidden=64, heads=8, groups=8, ffn=128)


# ----------------------------------------------------------------------------- 0. rates

def rates(device: str, dry: bool, path: str, budget: float, t_start: float) -> dict:
    """Part 0 (:mod:`gpu_rates`): measure, write the rates file at ``path``, return the detail
    with the streaming layer's time next to the plan's one-layer figure, and the same layer's
    backward with kept attention against full recompute's (``keep_attention``)."""
    import gpu_rates

    got = FR.run_isolated(gpu_rates.measure, device, dry, 1 if dry else 5, timeout=600)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(got["rates"], fh, indent=1)
    geo = gpu_rates.GEO["dry" if dry else "gpu"]

    def layer_run(keep: bool) -> dict:
        # a 4M layer takes ~3 min on one H200 (attention ~40 s forward, ~115 s backward, the
        # recompute's forward again): each run gets at least 300 s, the stacks what is left
        left = max(300.0, budget - (time.monotonic() - t_start))
        try:
            return FR.run_isolated(gpu_rates.layer_time, device, geo, keep, timeout=left)
        except RuntimeError as exc:  # reported by name, never silently
            return {"error": str(exc)[-2000:]}

    layer = layer_run(False)
    layer.update(gpu_rates.plan_one_layer())
    if "fwd_bwd_s" in layer and not dry:  # --dry's tiny layer is not the plan's
        layer["measured_over_plan"] = layer["fwd_bwd_s"] / layer["plan_one_layer_s"]
    keep = gpu_rates.keep_check(layer, layer_run(True))
    return {"file": path, **got, "layer": layer, "keep_attention": keep}


# ----------------------------------------------------------------------------- 1. kernels

def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernels_check(device: str, shapes) -> list:
    """Each available block kernel vs the fp32 reference on ``shapes``
    ``[(b, hq, hkv, n, d, causal), ...]``; one row per (kernel, shape)."""
    import torch

    from megatron_metp.ops.attention_kernels import _BY_NAME, available_kernels

    rows = []
    dev = torch.device(device)
    names = list(available_kernels(dev, torch.bfloat16))
    import importlib.util

    te = ("present (its fused attention is cuDNN's: METP's kernel 'cudnn' calls it through torch)"
          if importlib.util.find_spec("transformer_engine") is not None else "absent")
    ref = _BY_NAME["reference"]
    for b, hq, hkv, n, d, causal in shapes:
        g = torch.Generator(device="cpu").manual_seed(n + hq)
        q, k, v = (torch.randn(b, h_, n, d, generator=g).to(dev)
                   for h_ in (hq, hkv, hkv))
        dout = torch.randn(b, hq, n, d, generator=g).to(dev)
        scale = d ** -0.5
        o32, l32 = ref.forward(q, k, v, causal, scale)
        g32 = ref.backward(dout, q, k, v, o32, l32, causal, scale)
        q16, k16, v16, do16 = (t.to(torch.bfloat16) for t in (q, k, v, dout))
        for name in names:
            kern = _BY_NAME[name]
            t0 = time.perf_counter()
            o, lse = kern.forward(q16, k16, v16, causal, scale)
            grads = kern.backward(do16, q16, k16, v16, o, lse, causal, scale)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"kernel": name, "b": b, "hq": hq, "hkv": hkv, "n": n, "d": d,
                         "causal": causal, "err_out": _rel(o, o32), "err_lse": _rel(lse, l32),
                         **{f"err_{w}": _rel(x, y) for w, x, y in zip(("dq", "dk", "dv"),
                                                                        grads, g32)},
                         "seconds": round(time.perf_counter() - t0, 4),
                         "transformer_engine": te})
    return rows


# ----------------------------------------------------------------------------- 2. stacks

def _stack_mode(mode, cp):
    """``(build_stack mode, cp, fake world factor)`` of a gpu_check mode."""
    if mode == "metp-cp":
        return "metp", cp, cp
    return mode, 1, 1


def _cpu_instrument_peak(mode, seq, p, layers, geo, cp=1) -> int:
    """The CPU instrument's peak for the stack: FakeTensorMode + MemTracker + CUDA accounting
    (run in a fresh forked process)."""
    import launches
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.ops.cuda_emulation import emulate_cuda

    mode, cp, world = _stack_mode(mode, cp)
    FR.fake_world(p * world)
    undo = emulate_cuda(matmul=False)  # the GPU code paths (head-group blocks)
    try:
        with FakeTensorMode():
            model, x, freqs, grad, _ = launches.build_stack(mode, seq, p, layers=layers, cp=cp,
                                                            **geo)
            trk = FR.tracker()
            trk.track_external(model, x, freqs, grad)
            with FR.measuring(trk):
                out = model(x, attention_mask=None, rotary_pos_emb=freqs)
                out.backward(grad)
            return FR.snap(trk, "peak")["total"]
    finally:
        undo()


def _launches_dispatch(mode, seq, p, geo, cp=1) -> int:
    import launches

    mode, cp, _ = _stack_mode(mode, cp)
    return launches.per_layer(mode, seq, p, cp=cp, **geo)["launches"]


def run_stack(mode, seq, p, layers, geo, device, iters, cp=1) -> dict:
    """fwd+bwd time, peak memory and (GPU) CUDA kernels of the stack (fresh process)."""
    import torch

    import launches

    gpu = device == "cuda"
    name = mode
    mode, cp, world = _stack_mode(mode, cp)
    FR.fake_world(p * world, megatron=not gpu)
    if gpu:  # pragma: no cover - GPU only
        torch.cuda.set_device(0)
    model, x, freqs, grad, groups = launches.build_stack(mode, seq, p, layers=layers,
                                                         device=device, gpu=gpu, cp=cp, **geo)

    def step():
        out = model(x, attention_mask=None, rotary_pos_emb=freqs)
        out.backward(grad)
        x.grad = None
        for prm in model.parameters():
            prm.grad = None

    step()  # warm-up (kernel selection, allocator)
    times = []
    if gpu:  # pragma: no cover - GPU only
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(iters):
        if gpu:  # pragma: no cover
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    res = {"mode": name, "seq": seq, "layers": layers, "fwd_bwd_s": statistics.median(times),
           "cp": cp, "tokens_per_rank": int(x.shape[0])}
    if mode == "metp":
        ring = groups.metp.sequence_ring
        res.update(metp_ranks=groups.metp.size, kv_ring_ranks=ring.size)
    if gpu:  # pragma: no cover - GPU only
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        res["allocated_before"] = base
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        res["cuda_kernels"] = sum(1 for e in prof.events()
                                  if e.device_type.name == "CUDA")
    return res


def stacks(seqs, modes, p, layers, geo, device, iters, budget, t_start, cp=1) -> list:
    rows = []
    for seq in seqs:
        for mode in modes:
            name = f"{mode} s={seq}"
            if time.monotonic() - t_start > budget:
                rows.append({"mode": mode, "seq": seq, "skipped": f"past the {budget:g} s budget"})
                continue
            got = FR.map_isolated(lambda L: run_stack(mode, seq, p, L, geo, device, iters, cp),
                                  [(1,), (layers,)], timeout=max(60.0, budget),
                                  what=lambda a: f"{name} layers={a[0]}")
            if any("error" in g for g in got):
                rows.append({"mode": mode, "seq": seq,
                             "error": next(g["error"] for g in got if "error" in g)[-2000:]})
                continue
            one, full = got[0]["ok"], got[1]["ok"]
            row = dict(full)
            if "cuda_kernels" in full:
                row["launches_per_layer"] = (full["cuda_kernels"] - one["cuda_kernels"]) \
                    // max(1, layers - 1)
                row["launches_from"] = "CUDA profiler (kernels, 2 layers - 1 layer)"
            else:
                row["launches_per_layer"] = FR.run_isolated(_launches_dispatch, mode, seq, p, geo,
                                                            cp, timeout=600)
                row["launches_from"] = "dispatch counter (benchmarks/launches.py)"
            row["cpu_instrument_peak"] = FR.run_isolated(_cpu_instrument_peak, mode, seq, p,
                                                         layers, geo, cp, timeout=600)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report

def rates_table(rt) -> list:
    r = rt["rates"]
    out = [f"rates ({r['hardware']}, kernel {r['kernel']}; {rt['file']}): GEMM "
           f"{r['gemm_tflops']:.4g} TFLOP/s, attention fwd {r['attention_fwd_tflops']:.4g} / bwd "
           f"{r['attention_bwd_tflops']:.4g} TFLOP/s, pinned copy {r['pcie_gbs']:.4g} GB/s", "",
           "| piece | q rows × heads | keys | fwd TFLOP/s | bwd TFLOP/s |",
           "|---|---|---:|---:|---:|"]
    for c in rt["detail"]["attention"]["cases"]:
        out.append(f"| {c['piece']} | {c['q_rows']} × {c['q_heads']} | {c['keys']:,} | "
                   f"{c['fwd_tflops']:.4g} | {c['bwd_tflops']:.4g} |")
    lay = rt["layer"]
    got = (f"{lay['fwd_bwd_s']:.4g} s measured ({lay['timed_with']})" if "fwd_bwd_s" in lay
           else "error (see gpu_check.json)")
    out += ["", f"one streaming layer, rank 0 of 8, host stash: {got}; plan "
                f"{lay['plan_one_layer_s']:.4g} s ({lay['config']}, step_s / {lay['layers']})"]
    keep = rt.get("keep_attention", {})
    if "error" in keep:
        out.append(f"kept attention: {keep['error'][:200]}")
    elif keep:
        out.append(f"kept attention: backward {keep['keep']['bwd_s']:.4g} s against full "
                   f"recompute's {keep['recompute']['bwd_s']:.4g} s "
                   f"({keep['backward_keep_over_recompute']:.3f}x, "
                   f"{keep['backward_saved_s']:.4g} s saved per layer)")
    kernels = r.get("kernels", {})
    if len(kernels) > 1:
        out.append("per kernel (fwd / bwd TFLOP/s): " + ", ".join(
            f"{k} {v['attention_fwd_tflops']:.4g} / {v['attention_bwd_tflops']:.4g}"
            for k, v in kernels.items()))
    return out + [""]


def table(res) -> str:
    out = rates_table(res["rates"])
    if "kernels" not in res:
        return "\n".join(out)
    out += ["| kernel | shape (b, hq, hkv, n, d) | causal | out | lse | dq | dk | dv |",
            "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in res["kernels"]:
        out.append(f"| {r['kernel']} | {r['b']}, {r['hq']}, {r['hkv']}, {r['n']}, {r['d']} | "
                   f"{r['causal']} | {r['err_out']:.1e} | {r['err_lse']:.1e} | "
                   f"{r['err_dq']:.1e} | {r['err_dk']:.1e} | {r['err_dv']:.1e} |")
    out += ["", "| mode | s | fwd+bwd s | max_memory_allocated MiB | CPU instrument MiB | "
                "launches / layer |", "|---|---:|---:|---:|---:|---:|"]
    for r in res["stacks"]:
        if "skipped" in r or "error" in r:
            out.append(f"| {r['mode']} | {r['seq']} | {r.get('skipped') or 'error'} | | | |")
            continue
        mem = r.get("max_memory_allocated")
        out.append(f"| {r['mode']} | {r['seq']} | {r['fwd_bwd_s']:.4f} | "
                   f"{'' if mem is None else f'{mem / 2 ** 20:,.1f}'} | "
                   f"{r['cpu_instrument_peak'] / 2 ** 20:,.1f} | {r['launches_per_layer']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gpu_check")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes (what the tests run)")
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--modes", nargs="+", default=["metp", "tp-sp", "tp", "metp-cp"],
                    help="metp, tp-sp, tp, metp-cp (METP × CP, --cp)")
    ap.add_argument("--cp", type=int, default=4,
                    help="outer context-parallel factor of mode metp-cp (default 4; --dry: 2)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds after which no further stack case starts (default 420)")
    ap.add_argument("--rates", default=None,
                    help="where to write the rates file for metp plan --rates (default "
                         "<out>/rates.json)")
    ap.add_argument("--only-rates", action="store_true",
                    help="measure the rates (part 0) only, then stop")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    if args.dry:
        device, geo = "cpu", GEO_TINY
        args.p, args.seq, args.iters = 4, [256], 1
        args.cp = min(args.cp, 2)
        shapes = [(1, 4, 4, 32, 16, True), (1, 4, 2, 32, 16, False)]
    else:  # pragma: no cover - GPU only
        device, geo = "cuda", GEO_7B
        shapes = [(1, 4, 4, 4096, 128, True), (1, 4, 4, 4096, 128, False),
                  (1, 8, 2, 2048, 128, True), (1, 8, 2, 2048, 128, False),
                  (1, 32, 32, 4096, 128, True)]
    bad = [m for m in args.modes if m not in ("metp", "tp-sp", "tp", "metp-cp")]
    if bad or args.cp < 1:
        ap.error(f"--modes takes metp, tp-sp, tp, metp-cp (got {bad}); --cp must be >= 1")
    FR.preload_megatron()
    os.makedirs(args.out, exist_ok=True)
    rates_path = args.rates or os.path.join(args.out, "rates.json")
    res = {"device": device, "dry": args.dry, "p": args.p, "layers": args.layers,
           "geometry": geo, "rates": rates(device, args.dry, rates_path, args.budget, t_start)}
    if args.only_rates:
        return _write(res, args.out, t_start)
    res["kernels"] = FR.run_isolated(kernels_check, device, shapes, timeout=600)
    res["cp"] = args.cp
    res["stacks"] = stacks(args.seq, args.modes, args.p, args.layers, geo, device, args.iters,
                           args.budget, t_start, args.cp)
    return _write(res, args.out, t_start)


def _write(res, out: str, t_start: float) -> int:
    res["seconds"] = round(time.monotonic() - t_start, 1)
    with open(os.path.join(out, "gpu_check.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    md = table(res)
    with open(os.path.join(out, "gpu_check.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    print(f"\n{res['seconds']} s; wrote {out}/gpu_check.json and gpu_check.md, rates "
          f"{res['rates']['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
