#!/usr/bin/env python
"""Per-rank peak memory, stored activations and traffic of attention and of a whole layer:
METP vs ring self-attention vs Megatron TP (± flash, ± SP). One forward+backward, rank 0 of p.

Parts (``--part``):

* ``attention``: QKV projection → causal core attention → output projection (no residual);
* ``layer``: LayerNorm → attention → residual → LayerNorm → MLP (GeLU, F = ffn) → residual.

Methods (``--methods``; ``n = s/p`` tokens per rank, dual-chunk causal layout where local):

* ``metp``         ``megatron_metp.ops.metp_attention`` (kernel ``torch_flash``: the fused ATen op
                   ``_scaled_dot_product_flash_attention_for_cpu``, never an s×s score) on
                   ``[n, b, h]``; the layer adds replicated bf16 ``torch.nn.LayerNorm``\\ s, the
                   residuals and ``megatron_metp.ops.metp_mlp`` (default: recompute f(x·W1ᵀ));
* ``metp-unfused`` the same with ``kernel="reference"`` (one fp32 ``(A/p)·n·n`` score block per
                   ring step per head group);
* ``metp-gpumm``   ``metp`` with the CUDA branch of ``megatron_metp.ops._accum.mm_acc`` emulated
                   (on CPU that helper casts both operands of every fp32-accumulated matmul to
                   fp32 first; on CUDA it forms one fp32 product): the estimate for a GPU;
* ``tp``           Megatron TP=p, local spec (``get_gpt_layer_local_spec``): ``SelfAttention``
                   (ColumnParallelLinear → unfused ``DotProductAttention`` → RowParallelLinear)
                   or ``TransformerLayer``; input ``[s, b, h]`` replicated, no SP;
* ``tp-flash``     the same with ``core_attention`` = :class:`SDPAFlashCoreAttention` below:
                   ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)``
                   on ``[b, heads/p, s, d]``; the ops it dispatched are recorded and checked
                   (on CPU it is ``_scaled_dot_product_flash_attention_for_cpu``, the same ATen op
                   as METP's ``torch_flash`` kernel);
* ``tp-sp``, ``tp-sp-flash``  the two above with ``sequence_parallel=True`` (input ``[n, b, h]``;
                   the layer's norms are :class:`CpuSPNorm`, a bf16 ``torch.nn.LayerNorm`` with
                   Megatron's norm signature, since WrappedTorchNorm refuses SP);
* ``ring``         ring self-attention (sequence parallelism with replicated weights): full
                   ``W_qkv``/``W_proj`` (and full MLP) on every rank, tokens ``[n, b, h]``,
                   ``megatron_metp.ops.ring_attention`` (kernel ``torch_flash``) as the core.

Common settings: bf16 everywhere (built under ``torch.set_default_dtype(torch.bfloat16)``), no
biases, no dropout (``attention_dropout = hidden_dropout = 0``: METP has none; Megatron's CPU
``F.dropout(p=0)`` returns its input, so no masks are kept), Megatron's softmax in bf16
(``attention_softmax_in_fp32=False``, Megatron-LM's command-line default), no RoPE, causal.

How: as ``benchmarks/mlp_memory.py`` (see ``megatron_metp/tools/fakerank.py``): one subprocess per
(p, part), torch's ``fake`` process group, ``FakeTensorMode``, ``MemTracker``. The workers call
``megatron_metp.megatron.cpu.enable()`` (CPU RNG tracker, CPU causal mask, current device = CPU) and
``initialize_model_parallel(tensor_model_parallel_size=p)`` on the fake world.

Memory columns (MiB, rank 0, tensor allocations only, each rounded up to 512 B):

* ``peak``: largest total of tracked bytes during fwd+bwd (``in``: reached in fwd or bwd);
  ``W+dW`` parameters and gradients at that moment; ``in/dy`` the caller's input and output grad;
  ``fwd``/``bwd`` tensors allocated in forward / backward and alive at the peak;
* ``stored``: what the forward leaves for the backward = (forward allocations alive after forward)
  − (output y) + (input x, which every variant saves) − ``persist``; ``stored≈`` its closed form
  (:func:`stored_analytic`, a model of what each implementation saves);
* ``persist``: Megatron's GlobalMemoryBuffer after the step: the persistent ``"mpu"`` bf16 buffer
  that backs both the unfused score matmul (``b·(A/p)·s²·2``) and the SP all-gather
  (``s·b·h·2``), one per process on a GPU, shared by all layers. It *is* in ``peak`` (it is
  allocated on a GPU too) and is *not* in ``stored``.

Traffic (MiB per rank per fwd+bwd): ``sent`` counts the c10d ops dispatched with the ring
convention of ``megatron_metp.tools.fakerank.CommCounter`` (send N; all-reduce 2(p−1)/p·N; all-gather,
reduce-scatter, broadcast, reduce (p−1)/p·N: the rank average); ``sent≈`` the closed form
(:func:`bytes_closed_form`). For METP also ``METPGroup.stats`` (``stats sent/recv``): it counts a
broadcast only at its receivers and a reduce only at its senders.

Usage::

    python benchmarks/attention_memory.py                     # default sweep (about 2-4 min)
    python benchmarks/attention_memory.py --part attention --seq 16384 --p 8
    python benchmarks/attention_memory.py --query-groups 8 --out results.csv   # GQA; CSV/JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402  (benchmarks/_bench.py: table and output helpers)
from _bench import MiB, fmt  # noqa: E402

from megatron_metp.tools import fakerank as FR  # noqa: E402  (the fake-rank harness)

BF16, FP32 = 2, 4
RESULT_TAG = "ATTN_MEMORY_RESULT "

METHODS = {
    "metp": "metp_attention (+ LN, metp_mlp), kernel torch_flash",
    "metp-unfused": "metp_attention (+ LN, metp_mlp), kernel reference (materialises blocks)",
    "metp-gpumm": "metp with mm_acc's CUDA branch (one fp32 product, no fp32 operand copies)",
    "tp": "Megatron TP, local spec, unfused DotProductAttention, no SP",
    "tp-flash": "Megatron TP, local spec, core_attention = SDPA flash, no SP",
    "tp-sp": "Megatron TP + sequence parallelism, unfused",
    "tp-sp-flash": "Megatron TP + sequence parallelism, SDPA flash",
    "ring": "ring self-attention: replicated weights, local tokens, ring_attention (torch_flash)",
}
DEFAULT_METHODS = ["metp", "metp-unfused", "metp-gpumm", "tp", "tp-flash", "tp-sp",
                   "tp-sp-flash", "ring"]
DEFAULT_SEQ = [4096, 16384, 65536, 131072, 262144]
DEFAULT_P = [2, 4, 8]
PAPER_CLAIM = 41.7  # % saved vs TP with FlashAttention, METP abstract


def _is_metp(m):
    return m.startswith("metp")


def _is_tp(m):
    return m.startswith("tp")


# --------------------------------------------------------------------------- closed forms

def _geo(c):
    A, G, h = c["heads"], c["groups"], c["h"]
    d = h // A
    return A, G, d, A * d, G * d


def stored_analytic(c):
    """Bytes the forward leaves for the backward, as each implementation saves them.

    ``T = s·b`` tokens, ``t = T/p``; ``hq = A·d``, ``hk = G·d``; ``F`` the FFN size. LayerNorm keeps
    its input and fp32 mean and rstd (``8`` bytes per token); ``x`` is the part's input.

    * METP attention: ``x`` + every head group's output ``O_g`` (bf16, ``2t·hq`` in all) + fp32
      log-sum-exp ``4t·A``. METP layer: ``x``, LN1 stats, LN1 output (attention's ``x``), O, lse,
      the residual sum (LN2 input) and its stats, LN2 output (the MLP's only saved tensor).
    * ring attention: ``x`` (Linear input), heads-first copies of q, k, v ``2t(hq+2hk)``, the
      output heads-first ``2t·hq`` and seq-first (proj input) ``2t·hq``, lse ``4t·A``; layer:
      + norms as METP + MLP input ``2t·h`` and fc1 / GeLU outputs ``4t·F``.
    * Megatron, ``T`` tokens without SP (``t`` with SP for the tensors that stay local):
      ``linear_qkv`` input (``2T·h``; SP: the local ``2t·h``, it re-gathers in backward); the
      QKV output ``2T(hq+2hk)/p`` (q, k, v are views of it; with GQA the repeated k, v
      ``4T·hq/p`` as well, and when a rank holds several query groups q is a copy ``2T·hq/p``
      and the QKV output is freed); unfused: softmax output ``2·b·(A/p)·s²`` and the causal mask ``s²``
      (bool); flash: lse ``4T·A/p`` (the kernel's output is laid out ``[b, s, heads, d]``, so
      the ``[s, b, heads·d]`` view handed to ``linear_proj`` is the saved output itself);
      ``linear_proj`` input ``2T·hq/p``.
      Layer: + LN1, LN2 as above (over T or t tokens), the MLP input, fc1 and GeLU outputs
      ``4T·F/p``.
    """
    s, b, h, p, F, m, part = c["s"], c["b"], c["h"], c["p"], c["ffn"], c["method"], c["part"]
    A, G, d, hq, hk = _geo(c)
    T = s * b
    t = T // p
    ln = 8  # fp32 mean + rstd per token
    if _is_metp(m):
        attn = 2 * t * h + 2 * t * hq + 4 * t * A
        if part == "attention":
            return attn
        return 2 * t * h + ln * t + attn + (2 * t * h + ln * t) + 2 * t * h
    if m == "ring":
        attn = 2 * t * h + 2 * t * (hq + 2 * hk) + 4 * t * hq + 4 * t * A
        if part == "attention":
            return attn
        return 2 * t * h + ln * t + attn + (2 * t * h + ln * t) + 2 * t * h + 4 * t * F
    sp = "-sp" in m
    flash = m.endswith("flash")
    tl = t if sp else T  # tokens of the tensors that stay local under SP
    if G == A or G == p:  # q is a view of the QKV output, which stays alive
        core = 2 * T * (hq + 2 * hk) // p
    else:  # q's heads of several groups cannot be merged into one stride: a copy
        core = 2 * T * hq // p
    if G < A:
        core += 4 * T * hq // p
    if flash:
        core += 4 * T * A // p  # lse; the output is the proj input itself (see docstring)
    else:
        core += 2 * b * (A // p) * s * s + s * s
    attn = 2 * tl * h + core + 2 * T * hq // p
    if part == "attention":
        return attn
    return 2 * tl * h + ln * tl + attn + (2 * tl * h + ln * tl) + 2 * tl * h + 4 * T * F // p


def persist_analytic(c):
    """Megatron's persistent ``"mpu"`` buffer (bf16, the largest request it served)."""
    m, s, b, h, p = c["method"], c["s"], c["b"], c["h"], c["p"]
    if not _is_tp(m):
        return 0
    A = c["heads"]
    need = 0
    if not m.endswith("flash"):
        need = b * (A // p) * s * s
    if "-sp" in m:
        need = max(need, s * b * h)
    return need * BF16


def metp_attention_shard_bytes(c):
    """One head group's bf16 weight shard: W_qkv,g ``[(G/p)(A/G+2)d, h]`` + W_proj,g ``[h, (A/p)d]``."""
    A, G, d, hq, hk = _geo(c)
    p, h = c["p"], c["h"]
    return ((hq + 2 * hk) // p * h + h * hq // p) * BF16


def bytes_closed_form(c):
    """Bytes sent per rank in one fwd+bwd (the convention of the module docstring).

    * METP attention: head-group weights broadcast in forward and again in backward
      (``2(p−1)·W``), their fp32 gradients reduced to the owners (``(p−1)·2W``); K/V blocks of one
      head group go round once per head group in forward, K/V plus fp32 dK/dV in backward:
      ``4p(p−1)·KV`` with ``KV = 2·t·(hk/p)·2``. METP layer: + the MLP's weight ring
      ``(p−1)·(2·Wm + 2·Wm)`` (bf16 shard ``Wm = 2·h·F/p·2`` twice, fp32 gradient once).
    * ring: K/V of all heads ``(p−1)·KVa`` forward, ``(p−1)·3KVa`` backward, ``KVa = 2·t·hk·2``;
      the layer adds nothing (replicated MLP). Not included: the all-reduce of its replicated
      weight gradients (once per optimizer step; see the traffic table).
    * TP: all-reduce of the block output in forward and of the input gradient in backward,
      ``4(p−1)/p·N`` per block, ``N = s·b·h·2``; TP+SP: all-gather x, reduce-scatter y, and in
      backward all-gather x again, reduce-scatter dx, all-gather dy: ``5(p−1)/p·N`` per block.
    """
    s, b, h, p, F, m, part = c["s"], c["b"], c["h"], c["p"], c["ffn"], c["method"], c["part"]
    A, G, d, hq, hk = _geo(c)
    t = s * b // p
    blocks = 2 if part == "layer" else 1
    if _is_metp(m):
        W = metp_attention_shard_bytes(c)
        KV = 2 * t * (hk // p) * BF16
        out = 4 * (p - 1) * W + 4 * p * (p - 1) * KV
        if part == "layer":
            wm = 2 * h * (F // p)
            out += (p - 1) * (2 * wm * BF16 + wm * FP32)
        return out
    if m == "ring":
        KVa = 2 * t * hk * BF16
        return 4 * (p - 1) * KVa
    N = s * b * h * BF16
    per_block = 5 if "-sp" in m else 4
    return blocks * per_block * (p - 1) * N // p


def replicated_weight_bytes(c):
    """bf16 bytes of the ring baseline's replicated weights (attention, + MLP for the layer)."""
    A, G, d, hq, hk = _geo(c)
    h, F = c["h"], c["ffn"]
    n = (hq + 2 * hk) * h + h * hq
    if c["part"] == "layer":
        n += 2 * h * F + 4 * h  # + the two LayerNorms
    return n * BF16


def unfused_block_analytic(c):
    """The brief's live intermediate of METP without a fused kernel: ``b·(A/p)·(s/p)²·4`` bytes
    (one fp32 diagonal score block of one head group)."""
    return c["b"] * (c["heads"] // c["p"]) * (c["s"] // c["p"]) ** 2 * FP32


# --------------------------------------------------------------------------- worker (one p, part)

def _setup_megatron(p):
    import warnings

    import megatron_metp.megatron.cpu as mcpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcpu.enable()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    ps.initialize_model_parallel(tensor_model_parallel_size=p, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def _setup(p, cases):
    if any(_is_tp(c["method"]) for c in cases):
        _setup_megatron(p)


def _megatron_classes():
    """The SP-capable norm and the flash ``core_attention`` of ``metp measure``
    (:mod:`megatron_metp.tools.standins`; built lazily, after the imports)."""
    from megatron_metp.tools.standins import flash_core_attention_class, sp_norm_class

    return sp_norm_class(), flash_core_attention_class()


def _build_megatron(case):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    m, h, p = case["method"], case["h"], case["p"]
    A, G, d, hq, hk = _geo(case)
    sp = "-sp" in m
    cfg = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=A, num_query_groups=G, kv_channels=d,
        ffn_hidden_size=case["ffn"], attention_dropout=0.0, hidden_dropout=0.0,
        add_bias_linear=False, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=p,
        sequence_parallel=sp, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, attention_softmax_in_fp32=False)
    CpuSPNorm, SDPAFlashCoreAttention = _megatron_classes()
    spec = get_gpt_layer_local_spec()
    if sp:
        spec.submodules.input_layernorm = CpuSPNorm
        spec.submodules.pre_mlp_layernorm = CpuSPNorm
    if m.endswith("flash"):
        spec.submodules.self_attention.submodules.core_attention = SDPAFlashCoreAttention
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    if case["part"] == "attention":
        attn = SelfAttention(cfg, spec.submodules.self_attention.submodules, layer_number=1,
                             attn_mask_type=AttnMaskType.causal, pg_collection=pgc)

        class _Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = attn

            def forward(self, x):
                out, bias = self.attn(x, attention_mask=None)
                assert bias is None
                return out

        return _Attn()
    layer = TransformerLayer(cfg, spec.submodules, layer_number=1, pg_collection=pgc)

    class _Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            out, _ = self.layer(x, attention_mask=None)
            return out

    return _Layer()


def _build_metp(case, group):
    import torch

    from megatron_metp.ops import metp_attention, metp_mlp

    m, h, p, F, part = case["method"], case["h"], case["p"], case["ffn"], case["part"]
    A, G, d, hq, hk = _geo(case)
    kernel = "reference" if m == "metp-unfused" else "torch_flash"

    class _METP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wqkv = torch.nn.Parameter(torch.empty((hq + 2 * hk) // p, h))
            self.wo = torch.nn.Parameter(torch.empty(h, hq // p))
            if part == "layer":
                self.ln1 = torch.nn.LayerNorm(h)
                self.ln2 = torch.nn.LayerNorm(h)
                self.w1 = torch.nn.Parameter(torch.empty(F // p, h))
                self.w2 = torch.nn.Parameter(torch.empty(h, F // p))

        def attn(self, x):
            return metp_attention(x, self.wqkv, self.wo, group=group, num_heads=A,
                                  num_query_groups=G, causal=True, layout="dual_chunk",
                                  kernel=kernel)

        def forward(self, x):
            if part == "attention":
                return self.attn(x)
            x = x + self.attn(self.ln1(x))
            return x + metp_mlp(self.ln2(x), self.w1, self.w2, group=group, activation="gelu",
                                ffn_hidden_size=F)

    return _METP()


def _build_ring(case, group):
    import torch
    import torch.nn.functional as Fn

    from megatron_metp.ops import ring_attention

    h, F, part = case["h"], case["ffn"], case["part"]
    A, G, d, hq, hk = _geo(case)

    class _Ring(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(h, hq + 2 * hk, bias=False)
            self.proj = torch.nn.Linear(hq, h, bias=False)
            if part == "layer":
                self.ln1 = torch.nn.LayerNorm(h)
                self.ln2 = torch.nn.LayerNorm(h)
                self.fc1 = torch.nn.Linear(h, F, bias=False)
                self.fc2 = torch.nn.Linear(F, h, bias=False)

        def attn(self, x):
            n, b = x.shape[:2]
            qkv = self.qkv(x).view(n, b, G, (A // G + 2) * d)  # Megatron's interleaved layout
            q, k, v = torch.split(qkv, [(A // G) * d, d, d], dim=-1)
            o = ring_attention(q.reshape(n, b, A, d), k, v, group=group, causal=True,
                               layout="dual_chunk", kernel="torch_flash")
            return self.proj(o.reshape(n, b, hq))

        def forward(self, x):
            if part == "attention":
                return self.attn(x)
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(Fn.gelu(self.fc1(self.ln2(x))))

    return _Ring()


def _gpumm_patch():
    """Make the METP ops' ``mm_acc`` take its CUDA branch (runs on CPU fakes); returns the undo
    callables."""
    from megatron_metp.ops.cuda_emulation import emulate_cuda

    return [emulate_cuda(kernels=False)]


def _measure(case):
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp import METPGroup

    s, b, h, p, m = case["s"], case["b"], case["h"], case["p"], case["method"]
    group = None
    undo = []
    if _is_tp(m):
        import megatron.core.parallel_state as ps
        ps.destroy_global_memory_buffer()  # a fresh (fake) "mpu" buffer per case
        ps._set_global_memory_buffer()
    else:
        group = METPGroup.from_process_group(dist.group.WORLD, name="bench")
        if m == "metp-gpumm":
            undo = _gpumm_patch()
    n_in = s if m in ("tp", "tp-flash") else s // p
    try:
        with FakeTensorMode():
            if _is_tp(m):
                module = _build_megatron(case)
            elif m == "ring":
                module = _build_ring(case, group)
            else:
                module = _build_metp(case, group)
            x = torch.empty(n_in, b, h, requires_grad=True)
            dy = torch.empty(n_in, b, h)
            tracker = FR.tracker()
            tracker.track_external(x, dy)
            comm = FR.comm_counter_class()(p, watch=("scaled_dot_product",),
                                                 track_alloc=True)
            live = contextlib.nullcontext()
            if case.get("explain"):
                live = FR.live_storage_class()()
                for prm in module.parameters():
                    live.add(prm, "(parameter)")
                live.add(x, "(input x)")
                live.add(dy, "(output grad dy)")
            with tracker, comm, live:
                y = module(x)
                after_fwd = FR.snap(tracker, "current")
                fwd_peak = FR.snap(tracker, "peak")
                sent_fwd = comm.sent
                if case.get("explain"):
                    live.phase = "bwd"
                y.backward(dy)
            peak = FR.snap(tracker, "peak")
            y_bytes = y.numel() * y.element_size()
            x_bytes = x.numel() * x.element_size()
            persist = 0
            if _is_tp(m):
                import megatron.core.parallel_state as ps
                persist = sum(t.numel() * t.element_size()
                              for t in ps.get_global_memory_buffer().buffer.values())
    finally:
        for u in undo:
            u()
    cat = {"PARAM": 0, "GRAD": 0, "ACT": 0, "TEMP": 0, "OTH": 0}
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
        "stored_mib": (after_fwd["cat"].get("ACT", 0) - y_bytes + x_bytes - persist) / MiB,
        "stored_analytic_mib": stored_analytic(case) / MiB,
        "persist_mib": persist / MiB,
        "persist_analytic_mib": persist_analytic(case) / MiB,
        "max_alloc_mib": comm.max_alloc / MiB,
        "max_alloc_op": comm.max_alloc_op,
        "max_4d_mib": comm.max_alloc_4d / MiB,
        "max_4d_shape": comm.max_alloc_4d_shape,
        "sent_counted_mib": comm.sent / MiB,
        "sent_fwd_counted_mib": sent_fwd / MiB,
        "sent_closed_form_mib": bytes_closed_form(case) / MiB,
        "comm_ops": comm.ops,
        "sdpa_ops": comm.watched,
    }
    if case.get("explain"):
        res["explain_peak"] = {"peak_mib": live.peak / MiB, "op": live.peak_op, "top": live.top(14)}
    if group is not None:
        res["metp_stats_sent_mib"] = group.stats.bytes_sent / MiB
        res["metp_stats_recv_mib"] = group.stats.bytes_received / MiB
        res["metp_stats"] = group.stats.snapshot()
        res["kernels"] = dict(group.stats.kernels)
    return res


def _flash_op_check():
    """Runs the CPU flash ATen op and its backward on fake CPU tensors under the fake group."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = {}
    try:
        with FakeTensorMode():
            q = torch.empty(1, 4, 256, 128)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, q, q, 0.0, True, attn_mask=None, scale=0.1)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                o, q, q, q, o, lse, 0.0, True, attn_mask=None, scale=0.1)
            out = {"ok": True, "out": [list(o.shape), str(o.dtype)],
                   "lse": [list(lse.shape), str(lse.dtype)], "dq": [list(dq.shape), str(dq.dtype)],
                   "fake": type(o).__name__}
    except Exception as exc:  # noqa: BLE001 - reported
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def _check_worker():
    import torch

    FR.fake_world(2, dtype=torch.bfloat16)
    return _flash_op_check()


# --------------------------------------------------------------------------- driver

def _cases(args):
    seqs = args.seq or DEFAULT_SEQ
    ps_ = args.p or DEFAULT_P
    parts = ["attention", "layer"] if args.part == "both" else [args.part]
    cases = []
    A = args.heads
    G = args.query_groups or A
    if args.hidden % A or A % G:
        raise SystemExit(f"hidden {args.hidden} must be a multiple of heads {A}, and heads of "
                         f"query groups {G}")
    ffn = args.ffn or 4 * args.hidden
    for part in parts:
        for s in seqs:
            for p in ps_:
                if s % (2 * p) or G % p or ffn % p:
                    raise SystemExit(f"s={s} must be divisible by 2p={2 * p}, query groups {G} and "
                                     f"ffn {ffn} by p={p}")
                for m in args.methods:
                    if "-sp" in m and p == 1:
                        continue  # Megatron refuses sequence parallelism without TP
                    case = {"part": part, "s": s, "b": args.batch, "h": args.hidden,
                            "heads": A, "groups": G, "ffn": ffn, "p": p, "method": m}
                    if args.explain:
                        case["explain"] = True
                    cases.append(case)
    return cases


def _label(r):
    s = r["s"]
    return (f"s={s // 1024}K" if s % 1024 == 0 else f"s={s}") + f" p={r['p']}"


def _key(r):
    return (r["part"], r["s"], r["p"])


def _print_tables(rows, args, check, wall):
    methods = list(args.methods)
    parts = [pt for pt in ("attention", "layer") if any(r["part"] == pt for r in rows)]
    by = {(r["part"], r["s"], r["p"], r["method"]): r for r in rows}
    configs = []
    for r in rows:
        if _key(r) not in configs:
            configs.append(_key(r))
    G = rows[0]["groups"]
    A = rows[0]["heads"]
    print("# Attention and transformer-layer memory, one forward+backward, rank 0 of p "
          "(fake process group + FakeTensorMode + MemTracker)\n")
    print(f"h={rows[0]['h']}, {A} heads (query groups {G}{', MHA' if G == A else ', GQA'}), head "
          f"dim {rows[0]['h'] // A}, ffn={rows[0]['ffn']}, b={rows[0]['b']}, bf16, causal, "
          f"dual-chunk layout, no biases, no dropout, no RoPE, Megatron softmax in bf16. "
          f"MiB per rank; tensor allocations only (not modelled: kernel workspaces, allocator "
          f"fragmentation, DDP main_grad buffers, optimizer state). Methods: "
          + "; ".join(f"`{m}` {METHODS[m]}" for m in methods) + ".\n")

    def cell(r, key, nd=0):
        if r is None:
            return "n/a"
        if "error" in r:
            return "err"
        return fmt(r[key], nd)

    for part in parts:
        pcfg = [k for k in configs if k[0] == part]
        title = "attention block (QKV → core → proj)" if part == "attention" else \
            "transformer layer (LN → attn → +res → LN → MLP(GeLU) → +res)"
        for what, key, note in (
                ("Peak per rank", "peak_mib",
                 "weights + grads of the part, its input and output gradient, and Megatron's "
                 "persistent buffer included"),
                ("Stored for backward", "stored_mib",
                 "what forward leaves for backward, input x included, weights and persistent "
                 "buffer excluded")):
            print(f"\n## {part}: {what} (MiB) — {title}\n\n({note})\n")
            head = ["config"] + methods
            ratios = [(a, bb) for a in ("metp", "metp-gpumm") for bb in ("tp-flash", "tp-sp-flash")
                      if a in methods and bb in methods]
            head += [f"{a} / {bb}" for a, bb in ratios]
            print("| " + " | ".join(head) + " |")
            print("|---|" + "|".join("---:" for _ in head[1:]) + "|")
            for k in pcfg:
                line = [_label({"s": k[1], "p": k[2]})]
                for m in methods:
                    line.append(cell(by.get(k + (m,)), key))
                for a, bb in ratios:
                    ra, rb = by.get(k + (a,)), by.get(k + (bb,))
                    ok = ra and rb and "error" not in ra and "error" not in rb and rb[key] > 0
                    line.append(f"{ra[key] / rb[key]:.3f}" if ok else "")
                print("| " + " | ".join(line) + " |")

    # METP breakdown: what dominates its peak
    for m in [x for x in ("metp", "metp-gpumm") if x in methods]:
        print(f"\n## `{m}`: composition of the peak (MiB)\n")
        print("W+dW: parameters and gradients; in/dy: the caller's x and dy; fwd: forward "
              "allocations alive at the peak (= stored + output y); bwd: backward allocations "
              "alive at the peak (fp32 dx, weight-gradient accumulators, recomputed q/k/v, "
              "ring buffers, kernel outputs, temporaries).\n")
        cols = ["part", "config", "peak", "in", "W+dW", "in/dy", "fwd", "bwd", "stored",
                "stored≈", "max tensor", "(op)"]
        print("| " + " | ".join(cols) + " |")
        print("|---|---|" + "|".join("---:" for _ in cols[2:-1]) + "|---|")
        for k in configs:
            r = by.get(k + (m,))
            if r is None:
                continue
            if "error" in r:
                print(f"| {k[0]} | {_label(r)} | error: {r['error'][:200]} |" + " |" * 9)
                continue
            vals = [k[0], _label(r), r["peak_mib"], r["peak_phase"], r["peak_weights_grads_mib"],
                    r["peak_inputs_mib"], r["peak_fwd_alloc_mib"], r["peak_bwd_alloc_mib"],
                    r["stored_mib"], r["stored_analytic_mib"], r["max_alloc_mib"],
                    r["max_alloc_op"]]
            print("| " + " | ".join(fmt(v) for v in vals) + " |")

    # (1) unfused intermediate
    if "metp-unfused" in methods:
        print("\n## `metp-unfused`: largest live attention intermediate vs (a/p)·(s/p)²·4 B\n")
        print("`score block`: the largest 4-D tensor any op returned during fwd+bwd (with the "
              "reference kernel: the fp32 scores of the diagonal ring step, [b, A/p, s/p, s/p]; "
              "`shape` shows it). `×p³/(a·s²·4)` normalises it by the 1/p³ law: 1.000 at every "
              "p means exactly (a/p)(s/p)²·4 bytes. `max tensor`: the largest tensor of any "
              "rank (at short s an fp32 weight-gradient accumulator is larger than the scores). "
              "For contrast `tp scores`: Megatron's unfused scores [b, A/p, s, s] bf16 (1/p). "
              "`peak − metp peak`: what the unfused kernel costs on top of the fused one, also "
              "in units of the score block.\n")
        cols = ["part", "config", "score block", "shape", "(a/p)(s/p)²·4", "ratio",
                "×p³/(a·s²·4)", "max tensor", "tp scores", "peak", "peak − metp peak",
                "/ block"]
        print("| " + " | ".join(cols) + " |")
        print("|---|---|---:|---|" + "|".join("---:" for _ in cols[4:]) + "|")
        for k in configs:
            r = by.get(k + ("metp-unfused",))
            if r is None or "error" in r:
                continue
            ana = unfused_block_analytic(r)
            full = r["b"] * r["heads"] * r["s"] ** 2 * FP32
            rt = by.get(k + ("tp",))
            rm = by.get(k + ("metp",))
            extra = r["peak_mib"] - rm["peak_mib"] if rm and "error" not in rm else None
            shape = r["max_4d_shape"]
            vals = [k[0], _label(r), r["max_4d_mib"],
                    f"{'×'.join(map(str, shape[0]))} {shape[1]}" if shape else None, ana / MiB,
                    f"{r['max_4d_mib'] * MiB / ana:.3f}",
                    f"{r['max_4d_mib'] * MiB * r['p'] ** 3 / full:.3f}", r["max_alloc_mib"],
                    rt["max_4d_mib"] if rt and "error" not in rt else None, r["peak_mib"], extra,
                    f"{extra * MiB / ana:.2f}" if extra is not None else None]
            print("| " + " | ".join(fmt(v) for v in vals) + " |")

    # (2) savings vs tp-flash
    if "tp-flash" in methods and any(m in methods for m in ("metp", "metp-gpumm")):
        print(f"\n## METP (flash kernel) vs Megatron TP with a flash core attention: saving in % "
              f"(paper: \"at least {PAPER_CLAIM}%\")\n")
        print("saving = 1 − METP / tp-flash, rank 0 of p, one layer (or one attention block), "
              "same p for both. `stored`: activations kept for backward (input x included; no "
              "weights, no gradients, no output). `peak`: the whole per-rank peak of the "
              "fwd+bwd, weights + grads of the part and its input/output gradient included. "
              "`peak−W`: the peak minus the weights and gradients alive at it. The `vs tp-sp-flash` "
              "columns compare with TP + sequence parallelism instead.\n")
        cmp = [m for m in ("metp", "metp-gpumm") if m in methods]
        cols = ["part", "config"]
        for a in cmp:
            cols += [f"{a} stored", f"{a} peak", f"{a} peak−W"]
            if "tp-sp-flash" in methods:
                cols += [f"{a} stored vs tp-sp-flash", f"{a} peak vs tp-sp-flash"]
        print("| " + " | ".join(cols) + " |")
        print("|---|---|" + "|".join("---:" for _ in cols[2:]) + "|")

        def pct(a, bb):
            return f"{100 * (1 - a / bb):.1f}" if bb else ""

        for k in configs:
            rt = by.get(k + ("tp-flash",))
            rs = by.get(k + ("tp-sp-flash",))
            if rt is None or "error" in rt:
                continue
            line = [k[0], _label(rt)]
            for a in cmp:
                ra = by.get(k + (a,))
                if ra is None or "error" in ra:
                    line += [""] * (5 if "tp-sp-flash" in methods else 3)
                    continue
                line += [pct(ra["stored_mib"], rt["stored_mib"]),
                         pct(ra["peak_mib"], rt["peak_mib"]),
                         pct(ra["peak_mib"] - ra["peak_weights_grads_mib"],
                             rt["peak_mib"] - rt["peak_weights_grads_mib"])]
                if "tp-sp-flash" in methods:
                    ok = rs is not None and "error" not in rs
                    line += [pct(ra["stored_mib"], rs["stored_mib"]) if ok else "",
                             pct(ra["peak_mib"], rs["peak_mib"]) if ok else ""]
            print("| " + " | ".join(line) + " |")
        print()
        for a in cmp:
            for part in parts:
                got = [(k, by.get(k + (a,)), by.get(k + ("tp-flash",))) for k in configs
                       if k[0] == part]
                got = [(k, ra, rt) for k, ra, rt in got
                       if ra and rt and "error" not in ra and "error" not in rt]
                if not got:
                    continue
                st = [100 * (1 - ra["stored_mib"] / rt["stored_mib"]) for _, ra, rt in got]
                pk = [100 * (1 - ra["peak_mib"] / rt["peak_mib"]) for _, ra, rt in got]
                win = [_label({"s": k[1], "p": k[2]}) for (k, ra, rt), v in zip(got, pk)
                       if v >= PAPER_CLAIM]
                print(f"- `{a}` vs `tp-flash`, {part}: stored saving {min(st):.1f} to "
                      f"{max(st):.1f} %; peak saving {min(pk):.1f} to {max(pk):.1f} %; peak "
                      f"saving ≥ {PAPER_CLAIM} % at: {', '.join(win) if win else 'none'}.")

    # Megatron's persistent buffer
    tpm = [m for m in ("tp", "tp-sp", "tp-sp-flash") if m in methods]
    if tpm:
        print("\n## Megatron's persistent \"mpu\" buffer (MiB, in `peak`, not in `stored`)\n")
        print("One per process on a GPU, shared by all layers: the unfused score matmul's input "
              "buffer [b·A/p, s, s] bf16 and/or the SP all-gather buffer [s, b, h] bf16 (same "
              "key, the larger wins). `tp-flash` uses none.\n")
        cols = ["part", "config"] + tpm
        print("| " + " | ".join(cols) + " |")
        print("|---|---|" + "|".join("---:" for _ in tpm) + "|")
        for k in configs:
            print("| " + " | ".join([k[0], _label({"s": k[1], "p": k[2]})]
                                    + [cell(by.get(k + (m,)), "persist_mib") for m in tpm]) + " |")

    # (3) traffic
    print("\n## Traffic: MiB sent per rank per fwd+bwd (counted from dispatched c10d ops)\n")
    print("Ring convention (send N; all-reduce 2(p−1)/p·N; all-gather, reduce-scatter, broadcast, "
          "reduce (p−1)/p·N, the rank average). `ring +dW` adds the all-reduce of the ring "
          "baseline's replicated weight gradients (bf16, 2(p−1)/p·|W|), due once per optimizer "
          "step, not per micro-batch; TP and METP have nothing comparable beyond the "
          "LayerNorm weights. Flash and unfused variants move the same bytes.\n")
    tcols = [m for m in methods if m not in ("metp-unfused", "metp-gpumm", "tp-flash",
                                             "tp-sp-flash")]
    cols = ["part", "config"] + tcols + (["ring +dW"] if "ring" in methods else []) \
        + (["metp stats sent / recv"] if "metp" in methods else [])
    print("| " + " | ".join(cols) + " |")
    print("|---|---|" + "|".join("---:" for _ in cols[2:]) + "|")
    for k in configs:
        line = [k[0], _label({"s": k[1], "p": k[2]})]
        for m in tcols:
            line.append(cell(by.get(k + (m,)), "sent_counted_mib", 1))
        if "ring" in methods:
            r = by.get(k + ("ring",))
            ok = r is not None and "error" not in r
            line.append(fmt(r["sent_counted_mib"] + 2 * (r["p"] - 1) * replicated_weight_bytes(r)
                            / r["p"] / MiB, 1) if ok else "")
        if "metp" in methods:
            r = by.get(k + ("metp",))
            ok = r is not None and "error" not in r
            line.append(f"{r['metp_stats_sent_mib']:,.1f} / {r['metp_stats_recv_mib']:,.1f}"
                        if ok else "")
        print("| " + " | ".join(line) + " |")

    if any("explain_peak" in r for r in rows):
        print("\n## Live tensors at the peak (`--explain`)\n")
        print("Grouped by (op that returned the storage, shape, dtype, phase it was allocated "
              "in); `(parameter)`, `(input x)`, `(output grad dy)` are the caller's.\n")
        for r in rows:
            e = r.get("explain_peak")
            if not e:
                continue
            print(f"- {r['part']} {_label(r)} `{r['method']}`: {e['peak_mib']:,.1f} MiB at "
                  f"`{e['op']}`")
            for nb, cnt, what, shape, dt, ph in e["top"]:
                print(f"    - {nb / MiB:,.1f} MiB: {cnt}× {what} {'×'.join(map(str, shape))} "
                      f"{dt} ({ph})")

    # checks and notes
    notes = []
    sdpa_ops = {}
    for r in rows:
        if "error" in r:
            notes.append(f"{r['part']} {_label(r)} {r['method']}: ERROR {r['error'][:300]}")
            continue
        tag = f"{r['part']} {_label(r)} {r['method']}"
        if abs(r["sent_counted_mib"] - r["sent_closed_form_mib"]) > 1e-6:
            notes.append(f"{tag}: counted traffic {r['sent_counted_mib']:.1f} MiB != closed form "
                         f"{r['sent_closed_form_mib']:.1f} MiB ({r['comm_ops']})")
        if abs(r["stored_mib"] - r["stored_analytic_mib"]) > 0.01 * max(1.0, r["stored_analytic_mib"]):
            notes.append(f"{tag}: stored {r['stored_mib']:.1f} MiB vs analytic "
                         f"{r['stored_analytic_mib']:.1f} MiB")
        if abs(r["persist_mib"] - r["persist_analytic_mib"]) > 1e-6:
            notes.append(f"{tag}: persistent buffer {r['persist_mib']:.1f} MiB vs analytic "
                         f"{r['persist_analytic_mib']:.1f} MiB")
        want = {"metp": "torch_flash", "metp-gpumm": "torch_flash", "metp-unfused": "reference",
                "ring": "torch_flash"}.get(r["method"])
        if want and set(r.get("kernels", {})) != {want}:
            notes.append(f"{tag}: attention kernels used {r.get('kernels')} (expected {want})")
        steps = {"metp": r["p"] ** 2, "metp-gpumm": r["p"] ** 2, "ring": r["p"],
                 "metp-unfused": 0}.get(r["method"])
        if steps is not None:
            flash_ops = r["sdpa_ops"]
            want_ops = {} if steps == 0 else {"_scaled_dot_product_flash_attention_for_cpu": steps,
                                              "_scaled_dot_product_flash_attention_for_cpu_backward":
                                              steps}
            if flash_ops != want_ops:
                notes.append(f"{tag}: fused ATen ops dispatched {flash_ops}, expected {want_ops}")
        if r["method"].endswith("flash"):
            sdpa_ops[json.dumps(r["sdpa_ops"], sort_keys=True)] = \
                sdpa_ops.get(json.dumps(r["sdpa_ops"], sort_keys=True), 0) + 1
    print("\n## Checks\n")
    if check.get("ok"):
        print(f"- `_scaled_dot_product_flash_attention_for_cpu` and its `_backward` run under "
              f"FakeTensorMode on CPU fake tensors with the fake group initialised: out "
              f"{check['out']}, lse {check['lse']}, dq {check['dq']} ({check['fake']}).")
    else:
        print(f"- `_scaled_dot_product_flash_attention_for_cpu` under FakeTensorMode FAILED: "
              f"{check.get('error')}")
    for ops, cnt in sdpa_ops.items():
        print(f"- tp-flash / tp-sp-flash rows ({cnt}): SDPA dispatched {ops}")
    ours = [r for r in rows if "error" not in r and not _is_tp(r["method"])]
    if ours:
        ops = {}
        for r in ours:
            for k, v in r["comm_ops"].items():
                ops[k] = ops.get(k, 0) + v
        print(f"- METP / ring ops under the fake group: {len(ours)} rows ran to the end (their "
              f"CPU path waits with `Work.wait(timeout)` on the fake works); c10d ops they "
              f"dispatched, summed: {json.dumps(ops, sort_keys=True)}.")
    if not notes:
        print("- traffic counted = closed form for every row; stored = analytic within 1 % and "
              "Megatron's persistent buffer = analytic for every row; every METP/ring row used "
              "the kernel it names, and the flash rows dispatched the CPU flash op and its "
              "backward once per ring step (p² for METP: p head groups × p K/V blocks; p for "
              "ring), all on fake tensors; `metp-unfused` dispatched none.")
    for n in notes:
        print(f"- {n}")
    print(f"\n{len(rows)} measurements in {wall:.1f} s.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 4K 16K 64K 128K 256K)")
    ap.add_argument("--p", type=int, nargs="+", help="group sizes (default 2 4 8)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    ap.add_argument("--part", choices=["attention", "layer", "both"], default="both")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--query-groups", type=int, default=None, help="GQA groups (default = heads)")
    ap.add_argument("--ffn", type=int, default=None, help="FFN size (default 4h)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--explain", action="store_true",
                    help="also list the live tensors at each case's peak (slower; diagnostics)")
    _bench.add_run_args(ap, jobs=2, timeout=900)
    args = ap.parse_args(argv)


    t0 = time.perf_counter()
    cases = _cases(args)
    groups = {}
    for c in cases:
        groups.setdefault((c["p"], c["part"]), (c["p"], []))[1].append(c)
    # largest workers first, so that --jobs 2 finishes them together
    groups = dict(sorted(groups.items(), key=lambda kv: -kv[0][0]))
    results = FR.run_cases(_measure, groups, setup=_setup, jobs=args.jobs, timeout=args.timeout)
    got = FR.map_isolated(_check_worker, [()], timeout=args.timeout)[0]
    check = got["ok"] if "ok" in got else {"ok": False, "error": got["error"].splitlines()[-1:]}

    order = {json.dumps(c, sort_keys=True): i for i, c in enumerate(cases)}
    results.sort(key=lambda r: order.get(json.dumps({k: r[k] for k in cases[0]}, sort_keys=True),
                                         1 << 30))
    _print_tables(results, args, check, time.perf_counter() - t0)
    if args.out:
        _bench.write_out(results, args.out)
        print(f"wrote {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
