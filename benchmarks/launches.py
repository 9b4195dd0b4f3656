#!/usr/bin/env python
"""Kernel launches, GEMMs, messages and HBM traffic of one transformer layer: METP vs TP+SP.

For rank 0 of ``p`` ranks this counts one forward and one backward of one Megatron
``TransformerLayer`` (RMSNorm, causal self-attention with RoPE, SwiGLU MLP, no biases, bf16):

* ``metp``   the METP layer spec (``megatron_metp.megatron.build.layer_spec``: METP attention
             and MLP, ``torch_flash`` block kernel), this rank's ``s/p`` tokens;
* ``tp-sp``  Megatron's local spec with TP=``p`` and sequence parallelism (input ``[s/p, b, h]``)
             and a flash ``core_attention`` (PyTorch's fused causal kernel, grouped K/V read
             without repeating them, as TE's and flash-attn's kernels do).

How. One forked child per case becomes rank 0 of a fake ``p``-rank world
(:mod:`megatron_metp.tools.fakerank`); the layer runs under ``FakeTensorMode`` (nothing is
allocated, every shape is exact) with the CUDA-faithful accounting of
:mod:`megatron_metp.tools.cuda_accounting` and the METP ops' CUDA branches selected
(``mm_acc``'s in-place fp32 GEMM, the CUDA flash kernels' calling convention). A
``TorchDispatchMode`` (:class:`OpCounter`) sees every ATen op as eager mode issues it:

* ``launches``: ops that run a kernel on a GPU: everything except views/metadata ops (``view``,
  ``permute``, ``slice``, ``expand``, ...), allocations without a fill (``empty``) and c10d ops.
  A fused CUDA kernel that the CPU evaluates in pieces counts once: the norm (CUDA's fused
  RMSNorm, forward and backward) and Megatron's compiled SwiGLU (forward and backward).
* ``gemms``: ``mm``/``addmm``/``bmm``/``baddbmm`` (any overload, ``out_dtype`` included).
* ``attention``: flash-attention kernel calls (forward and backward).
* ``elementwise GB``: bytes read + written by every other launch (all but GEMMs and attention):
  each tensor argument read (a broadcast, stride-0 dimension counted once), each result written;
  ``out=`` arguments and the destination of ``copy_``/``fill_``/``zero_`` are written, not read.
* ``messages``: c10d collectives, plus P2P exchanges counted once per ``batch_isend_irecv``
  (one posted batch = one message, however many sends and receives it holds); ``p2p batches``
  alone; ``sent GB``: bytes this rank sends (ring-algorithm convention of
  :class:`megatron_metp.tools.fakerank.CommCounter`).
* ``TFLOP``: GEMM FLOPs (``2·m·n·k``) plus attention FLOPs (forward ``4·n·m·d`` per head and
  batch row, ``n(n+1)/2`` instead of ``n·m`` pairs for a causal block; backward 2.5× its forward)
  — "causal FLOPs": only unmasked pairs count. ``ratio`` = METP / TP+SP.

Usage::

    python benchmarks/launches.py                     # s = 32K and 128K, p = 8, 7B geometry
    python benchmarks/launches.py --seq 32768 --p 8 --json out/launches.json
    python benchmarks/launches.py --tiny              # small shapes (what the tests run)
    python benchmarks/launches.py --by-site           # each launch charged to its source line

Counts only; nothing here is timed. A GPU's own profile is ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp.tools import fakerank as FR  # noqa: E402

GB = 1e9

# ops that only make a view or read metadata (no kernel on a GPU)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "_unsafe_view", "lift_fresh", "detach", "alias", "sym_size", "sym_stride",
              "sym_numel", "is_same_size", "_has_compatible_shallow_copy_type", "resize_",
              "set_", "_reshape_alias", "sym_storage_offset", "_local_scalar_dense",
              "is_nonzero", "equal"}
_WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
               "index_put_", "masked_fill_"}
_FILL = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "scalar_tensor",
         "arange", "new_zeros", "new_ones", "new_full"}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "addmv", "mv", "dot"}


def _is_attention(name: str) -> bool:
    return "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name


def _tbytes(t) -> int:
    """Bytes a kernel touches reading/writing ``t``: stride-0 (broadcast) dims counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _attention_flops(name, args, kwargs) -> float:
    """Causal-aware FLOPs of one flash kernel call (forward or backward)."""
    bwd = "backward" in name
    if bwd:
        q, k = args[1], args[2]
    else:
        q, k = args[0], args[1]
    b, h, n, d = q.shape
    m = k.shape[2]
    causal = False
    for a in args[3:]:
        if isinstance(a, bool):
            causal = a
            break
    causal = kwargs.get("is_causal", causal)
    pairs = n * (n + 1) / 2 if causal and n == m else n * m
    flops = 4.0 * b * h * d * pairs
    return 2.5 * flops if bwd else flops


def _gemm_flops(name, args, out) -> float:
    tensors = [a for a in args if hasattr(a, "shape")]
    if name in ("mm", "_scaled_mm"):
        a, b = tensors[0], tensors[1]
    elif name in ("addmm", "baddbmm", "addbmm"):
        a, b = tensors[1], tensors[2]
    elif name == "bmm":
        a, b = tensors[0], tensors[1]
    else:
        return 0.0
    batch = a.shape[0] if a.dim() == 3 else 1
    if name == "addbmm":
        batch = a.shape[0]
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def _site() -> str:
    """``file:line`` of the innermost frame in ``megatron_metp`` (its ``tools`` aside), else in
    megatron-core, else ``autograd``: where a launch comes from (``--by-site``)."""
    import traceback

    core = None
    for f in reversed(traceback.extract_stack()):
        path = f.filename.replace(os.sep, "/")
        if "/megatron_metp/" in path and "/megatron_metp/tools/" not in path:
            return f"{path.split('/megatron_metp/', 1)[1]}:{f.lineno}"
        if core is None and "/megatron/core/" in path:
            core = f"megatron/core/{path.split('/megatron/core/', 1)[1]}:{f.lineno}"
    return core or "autograd"


def op_counter_class():
    """:class:`OpCounter` (built lazily: torch's dispatch-mode base class)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        """Counts launches, GEMMs, attention calls, elementwise bytes, c10d messages and FLOPs
        of the ops dispatched while inside (see the module docstring for the rules)."""

        def __init__(self, p: int = 1, sites: bool = False):
            super().__init__()
            self.p = p
            self.sites = {} if sites else None  # "op @ file:line" -> [launches, bytes]
            self.launches = self.gemms = self.attention = 0
            self.elementwise_bytes = 0
            self.gemm_flops = self.attention_flops = 0.0
            self.collectives = self.p2p_batches = self.p2p_unbatched = 0
            self.sent = 0
            self.by_op = {}
            self.bytes_by_op = {}
            self.suspended = 0
            self.in_batch = 0

        # a fused CUDA kernel that the CPU runs in pieces: count once
        def fused(self, name, tensors):
            self.launches += 1
            nb = sum(_tbytes(t) for t in tensors)
            self.elementwise_bytes += nb
            self.by_op[name] = self.by_op.get(name, 0) + 1
            self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + nb
            self.site(name, nb)

        def site(self, name, nb):
            """With ``sites``: charge a launch and its bytes to the innermost package line."""
            if self.sites is None:
                return
            key = f"{name} @ {_site()}"
            got = self.sites.setdefault(key, [0, 0])
            got[0] += 1
            got[1] += nb

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.suspended:
                return out
            name = func._schema.name.split("::")[-1]
            if func.namespace == "c10d":
                sent = FR._sent_bytes(name, args, FR._group_size(args) or self.p) or 0
                self.sent += sent
                if name in ("send", "recv_", "recv_any_source_"):
                    if not self.in_batch:
                        self.p2p_unbatched += 1
                else:
                    self.collectives += 1
                self.by_op["c10d." + name] = self.by_op.get("c10d." + name, 0) + 1
                return out
            if func.namespace != "aten" or name in _NO_KERNEL:
                return out
            rets = func._schema.returns
            if rets and all(r.alias_info is not None and not r.alias_info.is_write
                            for r in rets):
                return out  # a view
            self.launches += 1
            self.by_op[name] = self.by_op.get(name, 0) + 1
            if name in _GEMM or _is_attention(name):
                self.site(name, 0)
            if name in _GEMM:
                self.gemms += 1
                self.gemm_flops += _gemm_flops(name, args, out)
                return out
            if _is_attention(name):
                self.attention += 1
                self.attention_flops += _attention_flops(name, args, kwargs)
                return out
            read = 0
            schema_args = func._schema.arguments
            for i, a in enumerate(args):
                info = schema_args[i].alias_info if i < len(schema_args) else None
                writes = info is not None and info.is_write
                if writes and (name in _WRITE_ONLY or i > 0):
                    continue
                read += sum(_tbytes(t) for t in FR.flat_tensors(a))
            for k, a in kwargs.items():
                if k == "out":
                    continue
                read += sum(_tbytes(t) for t in FR.flat_tensors(a))
            written = sum(_tbytes(t) for t in FR.flat_tensors(out)
                          if isinstance(t, torch.Tensor))
            self.elementwise_bytes += read + written
            self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + read + written
            self.site(name, read + written)
            return out

        def summary(self):
            return {"launches": self.launches, "gemms": self.gemms,
                    "attention_calls": self.attention,
                    "messages": self.collectives + self.p2p_batches + self.p2p_unbatched,
                    "collectives": self.collectives, "p2p_batches": self.p2p_batches,
                    "p2p_unbatched": self.p2p_unbatched,
                    "elementwise_bytes": self.elementwise_bytes, "sent": self.sent,
                    "flops": self.gemm_flops + self.attention_flops,
                    "gemm_flops": self.gemm_flops, "attention_flops": self.attention_flops,
                    "by_op": dict(sorted(self.by_op.items(), key=lambda kv: -kv[1])),
                    **({} if self.sites is None else {
                        "by_site": {k: v[0] for k, v in self.sites.items()},
                        "bytes_by_site": {k: v[1] for k, v in self.sites.items()}}),
                    "bytes_by_op": dict(sorted(self.bytes_by_op.items(),
                                               key=lambda kv: -kv[1]))}

    return OpCounter


class _Patched:
    """Inside: fused CUDA kernels counted once, P2P batches counted, METP CUDA branches on."""

    def __init__(self, counter):
        self.counter = counter
        self.undo = []

    def _wrap_fused(self, owner, attr, name, is_static):
        orig = getattr(owner, attr)
        counter = self.counter
        fn = orig

        def wrapped(*args, **kwargs):
            counter.suspended += 1
            try:
                res = fn(*args, **kwargs)
            finally:
                counter.suspended -= 1
            tensors = [t for a in list(args) + [res] for t in FR.flat_tensors(a)]
            counter.fused(name, tensors)
            return res

        setattr(owner, attr, staticmethod(wrapped) if is_static else wrapped)
        self.undo.append(lambda: setattr(owner, attr, staticmethod(orig) if is_static else orig))

    def __enter__(self):
        import importlib

        import torch.distributed as dist

        from megatron_metp.ops.cuda_emulation import emulate_cuda
        from megatron_metp.tools import cuda_accounting as CA

        self.undo.append(emulate_cuda())
        self._wrap_fused(CA.CudaRMSNorm, "forward", "fused_rms_norm", True)
        self._wrap_fused(CA.CudaRMSNorm, "backward", "fused_rms_norm_backward", True)
        mod = importlib.import_module("megatron.core.fusions.fused_bias_swiglu")
        for fn in ("swiglu", "swiglu_back", "bias_swiglu", "bias_swiglu_back"):
            self._wrap_fused(mod, fn, "fused_" + fn, False)
        orig_batch = dist.batch_isend_irecv
        counter = self.counter

        def batch(ops):
            counter.p2p_batches += 1
            counter.in_batch += 1
            try:
                return orig_batch(ops)
            finally:
                counter.in_batch -= 1

        dist.batch_isend_irecv = batch
        self.undo.append(lambda: setattr(dist, "batch_isend_irecv", orig_batch))
        return self

    def __exit__(self, *exc):
        for u in reversed(self.undo):
            u()
        self.undo = []


def build_stack(mode: str, seq: int, p: int, *, hidden=4096, heads=32, groups=None, ffn=11008,
                batch=1, layers=1, device="cpu", gpu=False, cp=1):
    """Rank 0's ``layers``-layer Megatron ``TransformerBlock`` of ``mode`` (``metp``, ``tp-sp``
    or ``tp``: stock TP without SP) and its inputs ``(block, x, freqs, grad, groups)``; call once
    per process, after :func:`megatron_metp.tools.fakerank.fake_world` (and inside a
    ``FakeTensorMode`` to allocate nothing). ``device="cuda"`` builds real CUDA tensors; ``gpu``:
    the process has a GPU and no megatron-core CPU shims. ``cp`` (``metp`` only): METP × CP, the
    outer context-parallel factor (fake world ``p·cp``; rank 0 holds ``seq/(p·cp)`` tokens, its
    K/V ring runs over the ``p·cp`` ranks of the CP group)."""
    import torch
    import torch.nn.functional as Fn
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules)
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.megatron.groups import METPGroups
    from megatron_metp.megatron.parallel import initialize_model_parallel
    from megatron_metp.megatron.build import layer_spec
    from megatron_metp.megatron.settings import METPSettings
    from megatron_metp.tools.standins import flash_core_attention_class, sp_norm_class

    if mode not in ("metp", "tp-sp", "tp"):
        raise ValueError(f"mode must be metp, tp-sp or tp, got {mode!r}")
    groups = groups or heads
    metp = mode == "metp"
    if metp:
        mgroups = initialize_model_parallel(1, 1, p, seq_length=seq, context_parallel_size=cp,
                                            create_gloo_process_groups=False)
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=p,
                                     create_gloo_process_groups=False)
        mgroups = METPGroups.from_parallel_state()
    model_parallel_cuda_manual_seed(1234)
    torch.set_default_dtype(torch.bfloat16)
    d = hidden // heads
    sp = mode == "tp-sp"
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=d, ffn_hidden_size=ffn,
        tensor_model_parallel_size=1 if metp else p, context_parallel_size=p * cp if metp else 1,
        sequence_parallel=sp, use_cpu_initialization=not gpu, perform_initialization=gpu,
        attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
        gated_linear_unit=True, activation_func=Fn.silu, bias_activation_fusion=True,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, normalization="RMSNorm", params_dtype=torch.bfloat16,
        bf16=True, pipeline_dtype=torch.bfloat16, attention_softmax_in_fp32=False)
    norm = sp_norm_class()
    if metp:
        spec = layer_spec(cfg, mgroups, METPSettings(metp=p, context=cp,
                                                     kernel=None if gpu else "torch_flash"))
        block = TransformerBlockSubmodules(layer_specs=[spec] * layers)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = flash_core_attention_class()
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        block = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=norm)
    if cp > 1 and not metp:
        raise ValueError(f"cp={cp} (METP × CP) needs mode='metp', got {mode!r}")
    n = seq // (p * cp) if mode != "tp" else seq  # stock TP: every rank holds the whole sequence
    model = TransformerBlock(cfg, block, post_layer_norm=False)
    if str(device) != "cpu":
        model = model.to(device)
    x = torch.randn(n, batch, hidden, device=device, requires_grad=True)
    # Megatron's RoPE angles (fp32): this rank's tokens under CP, the whole sequence under TP
    freqs = torch.randn(n if metp else seq, 1, 1, d, dtype=torch.float32, device=device)
    grad = torch.randn(n, batch, hidden, device=device)
    return model, x, freqs, grad, mgroups


def count_layer(mode: str, seq: int, p: int, *, hidden=4096, heads=32, groups=None,
                ffn=11008, batch=1, layers=1, cp=1, sites=False) -> dict:
    """Counts of ``layers`` layers' forward + backward on rank 0 (call in a fresh process);
    ``cp``: METP × CP (:func:`build_stack`); ``sites``: also per source line (``by_site``)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.tools.cuda_accounting import cuda_kernels

    warnings.filterwarnings("ignore")
    FR.fake_world(p * cp)
    counter = op_counter_class()(p, sites)
    with FakeTensorMode():
        model, x, freqs, grad, mgroups = build_stack(mode, seq, p, hidden=hidden, heads=heads,
                                                     groups=groups, ffn=ffn, batch=batch,
                                                     layers=layers, cp=cp)
        with cuda_kernels(), _Patched(counter), counter:
            out = model(x, attention_mask=None, rotary_pos_emb=freqs)
            out.backward(grad)
    res = counter.summary()
    res.update(mode=mode, seq=seq, p=p, layers=layers, hidden=hidden, heads=heads,
               query_groups=groups or heads, ffn=ffn, batch=batch)
    if mode == "metp":
        res["ring_steps"] = mgroups.metp.stats.steps
    return res


def per_layer(mode, seq, p, **geo) -> dict:
    """Counts of one layer: two forked runs (1 and 2 layers) and their difference, so that
    once-per-model work (Megatron's RoPE table, a cached cos/sin) is not charged to a layer."""
    one, two = FR.map_isolated(lambda n: count_layer(mode, seq, p, layers=n, **geo), [(1,), (2,)],
                               timeout=1200, what=lambda a: f"{mode} s={seq} layers={a[0]}")
    for g in (one, two):
        if "error" in g:
            raise RuntimeError(g["error"])
    a, b = one["ok"], two["ok"]
    out = {}
    for k, v in b.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (
                "seq", "p", "layers", "hidden", "heads", "query_groups", "ffn", "batch"):
            out[k] = v - a[k]
        elif k in ("by_op", "bytes_by_op", "by_site", "bytes_by_site"):
            out[k] = {op: c - a[k].get(op, 0) for op, c in v.items() if c - a[k].get(op, 0)}
        else:
            out[k] = v
    out["layers"] = 1
    return out


def _s(seq: int) -> str:
    return f"{seq // 1024}K" if seq >= 1024 and seq % 1024 == 0 else str(seq)


def table(rows) -> str:
    """Markdown: one row per (seq, mode) and the METP / TP+SP ratios."""
    lines = ["| s | mode | launches | GEMMs | attention calls | messages (P2P batches) | "
             "elementwise GB | sent GB | TFLOP (causal) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["seq"], r["mode"]): r for r in rows}
    for seq in sorted({r["seq"] for r in rows}):
        for mode in ("tp-sp", "metp"):
            r = by.get((seq, mode))
            if r is None:
                continue
            lines.append(f"| {_s(seq)} | {'TP+SP' if mode == 'tp-sp' else 'METP'} | "
                         f"{r['launches']:,} | {r['gemms']:,} | {r['attention_calls']:,} | "
                         f"{r['messages']:,} ({r['p2p_batches']:,}) | "
                         f"{r['elementwise_bytes'] / GB:.2f} | {r['sent'] / GB:.3f} | "
                         f"{r['flops'] / 1e12:.2f} |")
        m, t = by.get((seq, "metp")), by.get((seq, "tp-sp"))
        if m and t:
            lines.append(f"| {_s(seq)} | METP / TP+SP | "
                         f"{m['launches'] / t['launches']:.2f}× | {m['gemms'] / t['gemms']:.2f}× | "
                         f"| {m['messages'] / t['messages']:.1f}× | "
                         f"{m['elementwise_bytes'] / t['elementwise_bytes']:.2f}× | "
                         f"{m['sent'] / t['sent']:.2f}× | {m['flops'] / t['flops']:.3f}× |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--query-groups", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--modes", nargs="+", default=["tp-sp", "metp"])
    ap.add_argument("--tiny", action="store_true",
                    help="h=64, 8 heads, ffn 128, s=256, p=4 (seconds; what the tests run)")
    ap.add_argument("--by-op", action="store_true", help="also print launches per ATen op")
    ap.add_argument("--by-site", action="store_true",
                    help="also print launches and elementwise GB per source line of "
                         "megatron_metp (else megatron-core) that issued them")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq, args.p, args.hidden, args.heads, args.ffn = [256], 4, 64, 8, 128
    FR.preload_megatron()
    geo = dict(hidden=args.hidden, heads=args.heads, groups=args.query_groups, ffn=args.ffn)
    if args.by_site:
        geo["sites"] = True
    rows = [per_layer(mode, seq, args.p, **geo) for seq in args.seq for mode in args.modes]
    print(f"Per layer, fwd+bwd, rank 0 of p={args.p}: h={args.hidden}, {args.heads} heads"
          f"{f', {args.query_groups} query groups' if args.query_groups else ''}, SwiGLU ffn "
          f"{args.ffn}, RMSNorm, bf16, batch 1; eager mode, CUDA branches selected\n")
    print(table(rows))
    if args.by_op:
        for r in rows:
            print(f"\n{r['mode']} s={r['seq']}: " + ", ".join(f"{k} {v}" for k, v in
                                                             r["by_op"].items()))
            print("  GB: " + ", ".join(f"{k} {v / GB:.2f}" for k, v in r["bytes_by_op"].items()
                                       if v >= GB / 100))
    if args.by_site:
        for r in rows:
            print(f"\n{r['mode']} s={r['seq']}, by source line (launches, elementwise GB):")
            for k in sorted(r["by_site"], key=lambda k: (-r["bytes_by_site"].get(k, 0),
                                                         -r["by_site"][k], k)):
                print(f"  {r['by_site'][k]:4d}  {r['bytes_by_site'].get(k, 0) / GB:7.3f}  {k}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
