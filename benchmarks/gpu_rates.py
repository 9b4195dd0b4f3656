"""The rates ``metp plan --rates FILE`` reads, measured on this machine (``gpu_check.py`` runs this
first; ``--dry``: CPU, tiny shapes, what the tests run).

Measured (on a GPU: CUDA events, median of ``iters`` after a warm-up; on CPU: wall clock):

1. **GEMM**: a bf16 ``N×N·N×N`` matmul (``N = 8192``), ``2·N³`` FLOPs.
2. **Block kernels** (every kernel :func:`megatron_metp.ops.attention_kernels.available_kernels`
   lists here but the plain reference, whose score matrix at these shapes is tens of GiB): the
   streaming layer's shapes at the 4M job of
   ``configs/llama3-8b-4m-metp8.sh`` (rank 0 of 8: ``n = 512K`` tokens, 4 query heads of one
   K/V head, head dim 128): one query tile (``q`` rows, as :class:`~megatron_metp.ops.tiles.
   LayerTiles` cuts it) against a full block of 262,144 keys (one dual-chunk half) and of
   524,288 keys (a whole block), and the tile's causal square; each forward folded into fp32
   accumulators by the ring's log-sum-exp merge (:func:`~megatron_metp.ops.lse.merge_`), each
   backward given the merged output and log-sum-exp, its ``dq`` and fp32 ``dK/dV`` added into
   running sums. FLOPs: forward ``4·hq·n·m·d`` (full), half of ``4·hq·n²·d`` (causal square);
   backward 2.5× forward. A kernel's ``attention_fwd_tflops``/``attention_bwd_tflops`` are all
   cases' FLOPs over all cases' time (the full blocks dominate, as they do in the ring); the
   file's ``kernel`` is the fastest of them (``ops/kernel_rates.best_of``), ``kernels`` has
   each.
3. **Pinned host↔device bandwidth under load**: a pinned host buffer (1 GiB) copied to and
   from the device on a side stream while the default stream runs bf16 matmuls; GB/s per
   direction; ``pcie_gbs`` is the lower of the two. One GPU cannot load the node's host memory
   as 8 can: the figure is one GPU's under its own compute load.
4. **One streaming layer** (:func:`megatron_metp.ops.layer.metp_layer`, ``host=True``: the input,
   attention outputs and ``d(qkv)`` stashed on the host) as rank 0 of 8 under torch's fake
   process group at the 4M geometry (Llama-3-8B, ``n = 512K`` tokens, bf16, no RoPE, the op's
   own tiles: the plan's), forward and backward timed apart with CUDA events (one run each),
   next to the plan's one-layer figure (``step_cost(...)["step_s"] / layers`` of the same
   config, at the plan's own rates); then the same layer with ``keep_attention=True`` (the
   attention output and log-sum-exp kept, the backward without an attention forward): its
   backward against full recompute's (:func:`keep_check`; ``keep_attention not available``
   where the op has no such argument).

The rates file (JSON object, the format ``metp plan --rates`` reads)::

    {"hardware": str, "kernel": str, "gemm_tflops": float, "attention_fwd_tflops": float,
     "attention_bwd_tflops": float, "pcie_gbs": float, "source": str, "measured_at": str,
     "kernels": {name: {"attention_fwd_tflops": float, "attention_bwd_tflops": float}},
     "head_dim": int, "dtype": str}

(``ops/kernel_rates.read_measured`` reads it, for the planner's ``--rates FILE`` and the run
time's ``METP_KERNEL_RATES=FILE``.)

``--dry`` writes the same keys from tiny CPU shapes; its ``source`` says so (not rates for a
plan). The GPU path has not been run in the session that wrote it: the first GPU run is its
test.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch

RATES_KEYS = ("hardware", "kernel", "gemm_tflops", "attention_fwd_tflops",
              "attention_bwd_tflops", "pcie_gbs", "source", "measured_at", "kernels",
              "head_dim", "dtype")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_4M = os.path.join(ROOT, "configs", "llama3-8b-4m-metp8.sh")

#: the 4M job's per-rank geometry (Llama-3-8B, METP 8) and the tiny one of --dry
GEO = {"gpu": dict(p=8, seq=4194304, hidden=4096, heads=32, groups=8, d=128, ffn=14336,
                   keys=(262144, 524288), gemm=8192, copy_mib=1024),
       "dry": dict(p=8, seq=1024, hidden=64, heads=32, groups=8, d=8, ffn=128,
                   keys=(32, 64), gemm=128, copy_mib=4)}


def _timer(device: torch.device, iters: int):
    """``time(fn) -> seconds``: median of ``iters`` runs after one warm-up."""
    def run(fn):
        fn()
        out = []
        for _ in range(iters):
            if device.type == "cuda":  # pragma: no cover - GPU only
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return statistics.median(out)
    return run


def gemm_rate(device: torch.device, n: int, dtype, iters: int) -> dict:
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    t = _timer(device, iters)(lambda: a @ b)
    return {"n": n, "seconds": t, "tflops": 2 * n ** 3 / t / 1e12}


def query_tile(geo: dict) -> int:
    """The streaming layer's query tile for rank 0 of ``p`` at ``geo`` (bf16, micro-batch 1)."""
    from megatron_metp.ops.tiles import LayerTiles, mlp_row_bytes

    p, d = geo["p"], geo["d"]
    n = geo["seq"] // p
    return LayerTiles(n, 1, geo["hidden"], geo["heads"] // p * d, geo["groups"] // p * d, 2,
                      mlp_row_bytes(geo["hidden"], geo["ffn"] // p, 2, 2, 4)).q


def kernel_rates(device: torch.device, geo: dict, dtype, iters: int, name: str) -> dict:
    """Block kernel ``name`` at the streaming layer's shapes, with the merges (see module)."""
    from megatron_metp.ops import lse as lse_ops
    from megatron_metp.ops.attention_kernels import select_kernel

    d, hq = geo["d"], geo["heads"] // geo["groups"]  # one K/V head's query heads
    kern = select_kernel(device, dtype, name, head_dim=d)
    nq = min(query_tile(geo), max(geo["keys"]))
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, dout = mk(1, hq, nq, d), mk(1, hq, nq, d)
    scale = d ** -0.5
    timer = _timer(device, iters)
    # the rows' merged output and log-sum-exp start from the tile's causal square (as the ring)
    out, lse = lse_ops.start(*kern.forward(q, mk(1, 1, nq, d), mk(1, 1, nq, d), True, scale))
    o_acc, l_acc = out.clone(), lse.clone()  # what the timed forwards merge into
    out = out.to(dtype)  # the backward takes the merged output in q's dtype, as the layer's
    cases = []
    for piece, m in [("full", m) for m in geo["keys"]] + [("causal", nq)]:
        k, v = mk(1, 1, m, d), mk(1, 1, m, d)
        causal = piece == "causal"

        def fwd():
            o_b, l_b = kern.forward(q, k, v, causal, scale)
            lse_ops.merge_(o_acc, l_acc, o_b, l_b)

        dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=device)
        dv = torch.zeros_like(dk)
        ws: dict = {}

        def bwd():
            a, b_, c = kern.backward(dout, q, k, v, out, lse, causal, scale, workspace=ws)
            dq.add_(a)
            dk.add_(b_)
            dv.add_(c)

        flops = 4 * hq * nq * m * d * (0.5 if causal else 1.0)
        tf, tb = timer(fwd), timer(bwd)
        cases.append({"piece": piece, "q_rows": nq, "keys": m, "q_heads": hq, "kv_heads": 1,
                      "head_dim": d, "fwd_s": tf, "bwd_s": tb, "fwd_flops": flops,
                      "bwd_flops": 2.5 * flops, "fwd_tflops": flops / tf / 1e12,
                      "bwd_tflops": 2.5 * flops / tb / 1e12})
    fwd_t = sum(c["fwd_s"] for c in cases)
    bwd_t = sum(c["bwd_s"] for c in cases)
    return {"kernel": kern.name, "cases": cases,
            "fwd_tflops": sum(c["fwd_flops"] for c in cases) / fwd_t / 1e12,
            "bwd_tflops": sum(c["bwd_flops"] for c in cases) / bwd_t / 1e12}


def attention_rates(device: torch.device, geo: dict, dtype, iters: int) -> dict:
    """Every block kernel this machine runs but the plain reference (whose score matrix at
    these shapes is tens of GiB) at the streaming layer's shapes (:func:`kernel_rates`); the
    fastest by ``1/fwd + 2.5/bwd`` (``ops/kernel_rates.best_of``) is the file's ``kernel``, its
    cases the detail's ``cases``, every kernel's rates under ``kernels``."""
    from megatron_metp.ops import kernel_rates as KR
    from megatron_metp.ops.attention_kernels import available_kernels

    names = [k for k in available_kernels(device, dtype, geo["d"]) if k != "reference"]
    per = {k: kernel_rates(device, geo, dtype, iters, k) for k in names}
    rows = [KR.KernelRate(k, "", geo["d"], str(dtype).replace("torch.", ""), r["fwd_tflops"],
                          r["bwd_tflops"], "measured") for k, r in per.items()]
    best = per[KR.best_of(rows).kernel]
    return {**best, "kernels": {k: {"fwd_tflops": r["fwd_tflops"], "bwd_tflops": r["bwd_tflops"]}
                                for k, r in per.items()}}


def copy_under_load(device: torch.device, mib: int, iters: int) -> dict:
    """Pinned host↔device GB/s on a side stream while the default stream runs matmuls (GPU);
    on CPU a plain host copy (no device: only the code path)."""
    nbytes = mib * 2 ** 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        t_in = _timer(device, iters)(lambda: dev.copy_(host))
        t_out = _timer(device, iters)(lambda: host.copy_(dev))
    else:  # pragma: no cover - GPU only
        side = torch.cuda.Stream()
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

        def timed(copy):
            times = []
            for _ in range(iters + 1):
                for _ in range(64):  # ~0.1 s of matmuls queued: busy past the copy's end
                    a @ a
                with torch.cuda.stream(side):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    s.record(side)
                    copy()
                    e.record(side)
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) / 1e3)
            return statistics.median(times[1:])
        t_in = timed(lambda: dev.copy_(host, non_blocking=True))
        t_out = timed(lambda: host.copy_(dev, non_blocking=True))
    return {"bytes": nbytes, "h2d_gbs": nbytes / t_in / 1e9, "d2h_gbs": nbytes / t_out / 1e9,
            "pinned": device.type == "cuda", "under_load": device.type == "cuda"}


def _layer_weights(geo: dict, device, dtype):
    p, d, A, G, h = geo["p"], geo["d"], geo["heads"], geo["groups"], geo["hidden"]
    f = geo["ffn"] // p
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(  # noqa: E731
        device=device, dtype=dtype).requires_grad_()
    return dict(qkv_weight=mk((G // p) * (A // G + 2) * d, h), proj_weight=mk(h, (A // p) * d),
                fc1_weight=mk(2 * f, h), fc2_weight=mk(h, f))


#: what the kept-attention check reports where the streaming op has no ``keep_attention``
NO_KEEP = "keep_attention not available"


def keeps_attention() -> bool:
    """Whether :func:`megatron_metp.ops.layer.metp_layer` takes ``keep_attention``."""
    import inspect

    from megatron_metp.ops.layer import metp_layer

    return "keep_attention" in inspect.signature(metp_layer).parameters


def layer_time(device_type: str, geo: dict, keep_attention: bool = False) -> dict:
    """One streaming layer, rank 0 of ``p`` under the fake group, host stash on, its own tiles
    (``LayerTiles``, what the plan cuts): forward and backward seconds apart, full recompute or
    (``keep_attention``) the attention output and log-sum-exp kept, the backward running no
    attention forward (run in a fresh process: it makes the fake world). ``{"error": NO_KEEP}``
    where the op has no ``keep_attention``."""
    import torch.distributed as dist

    from megatron_metp import METPGroup
    from megatron_metp.ops.layer import metp_layer
    from megatron_metp.tools import fakerank as FR

    if keep_attention and not keeps_attention():
        return {"error": NO_KEEP, "keep_attention": True}
    extra = {"keep_attention": True} if keep_attention else {}
    device = torch.device(device_type)
    FR.fake_world(geo["p"], megatron=False)
    dtype = torch.bfloat16
    n = geo["seq"] // geo["p"]
    grp = METPGroup.from_process_group(dist.group.WORLD, name="rates-layer")
    w = _layer_weights(geo, device, dtype)
    norms = [torch.nn.RMSNorm(geo["hidden"], eps=1e-5).to(device=device, dtype=dtype)
             for _ in range(2)]
    x = (torch.randn(n, 1, geo["hidden"], device=device, dtype=dtype) * 0.1).requires_grad_()
    dy = torch.randn(n, 1, geo["hidden"], device=device, dtype=dtype) * 0.1
    box = {}

    def fwd():
        box["y"] = metp_layer(x, group=grp, num_heads=geo["heads"],
                              num_query_groups=geo["groups"], activation="swiglu",
                              norm1=norms[0], norm2=norms[1], host=True, **w, **extra)

    def bwd():
        box.pop("y").backward(dy)

    gpu = device.type == "cuda"
    secs = []
    for fn in (fwd, bwd):
        if gpu:  # pragma: no cover - GPU only
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            secs.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if gpu else None
    return {"tokens_per_rank": n, "p": geo["p"], "fwd_s": secs[0], "bwd_s": secs[1],
            "fwd_bwd_s": sum(secs), "host_stash": True, "keep_attention": keep_attention,
            "query_tile": query_tile(geo), "max_memory_allocated": peak,
            "timed_with": "CUDA events" if gpu else "wall clock (CPU)"}


def keep_check(recompute: dict, keep: dict) -> dict:
    """The kept-attention backward against full recompute's (both :func:`layer_time`)."""
    if "error" in keep or "error" in recompute:
        return {"error": keep.get("error") or recompute.get("error"), "recompute": recompute,
                "keep": keep}
    return {"recompute": recompute, "keep": keep,
            "backward_keep_over_recompute": keep["bwd_s"] / recompute["bwd_s"],
            "backward_saved_s": recompute["bwd_s"] - keep["bwd_s"]}


def plan_one_layer(config: str = CONFIG_4M) -> dict:
    """The plan's time of one layer of ``config``: ``step_s / layers`` and its rates."""
    from megatron_metp.tools import plan as P
    from megatron_metp.tools.cli import build_from_argv

    model, job, _ = build_from_argv(["--config", config])
    cost = P.step_cost(model, job, "metp")
    return {"config": config, "plan_one_layer_s": cost["step_s"] / model.layers,
            "plan_step_s": cost["step_s"], "layers": model.layers,
            "plan_rates": {k: v for k, v in cost.items() if "rate" in k or k == "kernel"}}


def rates_file(hardware: str, kernel: str, gemm: float, att: dict, copy: dict,
               source: str, head_dim: int = 128, dtype: str = "bfloat16") -> dict:
    """The ``--rates`` JSON object (:data:`RATES_KEYS`, checked): ``kernel`` the fastest
    measured, ``kernels`` every kernel measured (``att["kernels"]``; else ``kernel``'s)."""
    per = att.get("kernels") or {kernel: att}
    out = {"hardware": hardware, "kernel": kernel, "gemm_tflops": float(gemm),
           "attention_fwd_tflops": float(att["fwd_tflops"]),
           "attention_bwd_tflops": float(att["bwd_tflops"]),
           "pcie_gbs": float(min(copy["h2d_gbs"], copy["d2h_gbs"])), "source": source,
           "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"),
           "kernels": {k: {"attention_fwd_tflops": float(r["fwd_tflops"]),
                           "attention_bwd_tflops": float(r["bwd_tflops"])}
                       for k, r in per.items()},
           "head_dim": int(head_dim), "dtype": dtype}
    assert tuple(out) == RATES_KEYS
    return out


def measure(device_type: str, dry: bool, iters: int) -> dict:
    """Parts 1–3 (in the calling process): ``{"rates": file object, "detail": ...}``."""
    device = torch.device(device_type)
    geo = GEO["dry" if dry else "gpu"]
    dtype = torch.bfloat16
    gemm = gemm_rate(device, geo["gemm"], dtype if device.type == "cuda" else torch.float32,
                     iters)
    att = attention_rates(device, geo, dtype, iters)
    copy = copy_under_load(device, geo["copy_mib"], iters)
    if device.type == "cuda":  # pragma: no cover - GPU only
        hw = torch.cuda.get_device_name()
        source = (f"benchmarks/gpu_check.py on one {hw} (torch {torch.__version__}); attention "
                  f"at the streaming layer's 4M shapes with merges; pcie: one GPU under its own "
                  f"load")
    else:
        hw = "cpu (--dry)"
        source = ("benchmarks/gpu_check.py --dry: tiny CPU shapes, the code path only (not "
                  "rates for a plan)")
    return {"rates": rates_file(hw, att["kernel"], gemm["tflops"], att, copy, source,
                                geo["d"], str(dtype).replace("torch.", "")),
            "detail": {"gemm": gemm, "attention": att, "copy": copy, "geometry": geo}}
