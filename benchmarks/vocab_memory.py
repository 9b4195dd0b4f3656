#!/usr/bin/env python
"""Per-rank memory of embedding + output layer + loss: METP vocab vs Megatron TP+SP vs replicated.

For rank 0 of a group of ``p`` ranks this measures one forward and one backward of
``embedding → (transformer stand-in) → output layer → cross-entropy → loss.sum()`` along three
paths:

* ``metp-vocab``       the METP vocabulary ops: ``megatron_metp.ops.metp_embedding`` on this rank's
                       tokens ``[b, s/p]`` with the table shard ``[V/p, h]``, then
                       ``metp_output_cross_entropy`` with the (untied) output shard ``[V/p, h]``;
                       the shards go round the METP ring, the loss is an online log-sum-exp over
                       the shards and over chunks of ``token_chunk`` tokens, so no logits block
                       is larger than ``[token_chunk, V/p]`` fp32 (``--token-chunk``; default the
                       op's auto chunk, ``2**28 // (V/p)`` tokens, 1 GiB of fp32); its backward
                       runs the ring once per token tile (``--token-tile``; default the op's
                       auto tile, ``METP_TILE_BUDGET_MIB`` of fp32 ``dX``: 65,536 tokens at
                       h = 4096) and writes ``dX`` into the hidden states as the METP GPT model
                       does (``grad_into_hidden``; ``--no-grad-into-hidden``: a new tensor).
                       ``V`` is padded to a multiple of ``128·p``
                       (``padded_vocab_size(V, 128, 1, p)``).
* ``tp-sp``            stock Megatron, TP = ``p`` with sequence parallelism, as ``GPTModel`` runs:
                       megatron-core's ``LanguageModelEmbedding`` (its ``VocabParallelEmbedding``
                       ``[V/p, h]`` on the full tokens ``[b, s]``, reduce-scattered to
                       ``[s/p, b, h]``), the output ``ColumnParallelLinear(h → V,
                       gather_output=False)`` (SP all-gathers its input to ``[s, b, h]`` in
                       Megatron's global buffer; logits ``[s, b, V/p]`` bf16) and
                       ``tensor_parallel.vocab_parallel_cross_entropy`` (fp32 copy of the logits,
                       kept as the softmax for backward), labels transposed as
                       ``compute_language_model_loss`` does. ``V`` padded to ``128·p``.
* ``metp-replicated``  what METP does without the vocabulary feature (``metp measure``'s ``metp``
                       mode with t = 1): the same megatron-core modules with TP = 1 — the whole
                       table ``[V, h]`` and the whole output layer ``[V, h]`` on every rank, this
                       rank's tokens ``[b, s/p]``, logits ``[s/p, b, V]`` bf16 and their fp32 copy
                       in ``vocab_parallel_cross_entropy`` (TP = 1). ``V`` padded to 128.

All three use real code (no emulation of Megatron): megatron-core 0.16.1 modules and functions
under ``megatron.core.parallel_state`` initialised with TP = ``p`` (tp-sp) or TP = 1; the METP ops
over ``METPGroup.from_process_group(WORLD)``. The transformer stand-in is the identity (the
hidden states entering the output layer are the embeddings; the layers themselves are measured by
``mlp_memory.py`` / ``attention_memory.py``). Megatron's embedding dropout has p = 0 (a no-op).
The METP path repeats by hand what ``LanguageModelEmbedding`` does around its word embedding
without SP, ``transpose(0, 1)`` to ``[s/p, b, h]``, into a tensor of its own (a copy, as the final
norm's output the loss gets in the model; the embedding's output is then freed).

How (no cluster, no real allocation), as ``mlp_memory.py`` (``megatron_metp/tools/fakerank.py``): one
subprocess per ``p`` with ``init_process_group("fake", rank=0, world_size=p, store=FakeStore())``
(collectives and send/recv are no-ops with true shapes); everything is built under
``FakeTensorMode`` with ``torch.set_default_dtype(torch.bfloat16)``;
``torch.distributed._tools.mem_tracker.MemTracker`` follows every storage and reports the peak.
Megatron DDP's fp32 ``main_grad`` buffer is reproduced as ``metp measure`` does (one fp32 buffer
for the parameters, a post-accumulate hook adds ``param.grad`` into it and frees it), so the peak
includes it (``--no-main-grad`` leaves it out). ``megatron_metp.megatron.cpu.enable(force=True)`` (CPU
shims, this worker process only) and ``finite.enable_finite_checks(False)``.

Approximations, all explicit:

* Token selection. The METP ops pick, per visiting shard, the rows of the tokens (ids or labels)
  that fall in it with static-shape masked gathers (``index_select`` of every token's clamped row,
  then ``masked_fill``), so there is nothing data-dependent to approximate: every step gathers
  ``[s/p·b, h]`` rows whatever the ids, as on a GPU. (An op that called ``nonzero`` would have a
  data-dependent output size, which ``FakeTensorMode`` refuses: its row shows the error.) The
  Megatron paths' boolean masks (``x[mask] = 0``) keep static shapes too.
* ``check_token_ids=False`` / ``check_labels=False``: the ops' id checks read two numbers
  (``.item()``) and cannot run on fake tensors; they allocate two int64 scalars (and do one
  two-element all-reduce).
* The loss's fp32-accumulating backward matmuls (``mm_acc``) take their CUDA branch (one fp32
  product,
  ``torch.mm(a, b, out_dtype=float32)``), emulated on the CPU fake tensors as ``metp measure``
  does, so the figures estimate a GPU run (``--cpu-matmul`` keeps the CPU branch, which also
  makes fp32 copies of both operands).
* Tensor-level allocations only (what a caching allocator hands out, not rounded); kernel
  workspaces, allocator fragmentation, NCCL buffers and the CUDA context are not seen; the
  optimizer is not modelled.

Columns (MiB, rank 0):

* ``V``: the vocabulary asked for; ``V pad``: the padded vocabulary of that path.
* ``tables``: the two bf16 tables this rank holds (word embedding + output layer).
* ``grad buf``: the fp32 ``main_grad`` buffer of those tables (Megatron DDP).
* ``peak``: the largest total of tracked bytes during fwd+bwd (tables, grad buffer, tokens and
  labels, every forward and backward allocation); ``in``: fwd or bwd; ``bwd peak``: the largest
  total during the backward alone (the tracker is entered again for it).
* ``largest tensor``: the largest single tensor the rank ever holds (the tables included, the flat
  DDP buffer excluded): shape, dtype, MiB.
* ``vocab width``: the widest vocabulary axis of any tensor the rank holds: ``V/p`` or ``V``.
  Found without guessing from shapes (``s/p`` can equal ``V``): every case is run a second time,
  unmeasured, with ``V + 128·p`` rows; an axis that grows by ``128`` spans ``V/p`` rows, one that
  grows by ``128·p`` spans the full vocabulary.
* ``full-V``: how many tensors the rank allocates (tables included) that span the full vocabulary
  (an axis growing by ``128·p``, or a flattened tensor of at least ``V·h`` elements that grows
  with ``V``). 0 means: no rank holds full-vocabulary logits nor a whole table.

``--top K`` also prints, per row, the K largest groups of storages alive at the peak (op that made
them, shape, dtype, fwd/bwd), from ``megatron_metp.tools.fakerank.live_storage_class``.

For ``metp-vocab`` rows the script checks that the largest tensor is at most the
``[s/p·b, V/p]`` fp32 logits bound, that the largest tensor with a vocabulary axis is at most the
``[token_chunk, V/p]`` fp32 chunk bound, that ``vocab width`` is ``V/p`` and that ``full-V`` is 0.
The loss's token chunk is resolved once per case from the measured run's ``V`` and passed
explicitly to the loss in both runs (the twin keeps the same chunks); ``--token-chunk all``
measures the loss untiled (one chunk of all ``s/p·b`` tokens). The embedding keeps its own auto
chunk (``2**28 // h`` tokens).

Usage::

    python benchmarks/vocab_memory.py                  # V 32000, 128256; s 32K..256K; p=8
    python benchmarks/vocab_memory.py --vocab 50257 --seq 65536 --p 4 8
    python benchmarks/vocab_memory.py --out vocab.csv  # also CSV (or .json)
    python benchmarks/vocab_memory.py --vocab 128256 --seq 4194304 --paths metp-vocab \
        --token-chunk all                              # the loss untiled, for comparison
    python benchmarks/vocab_memory.py --vocab 128256 --seq 6291456 --paths metp-vocab \
        --token-tile 0 --no-grad-into-hidden           # the loss backward as before its tiles
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402  (benchmarks/_bench.py: table and output helpers)
from _bench import REPO, MiB  # noqa: E402,F401

from megatron_metp.tools import fakerank as FR  # noqa: E402  (the fake-rank harness)

BF16 = 2
FP32 = 4
DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default

PATHS = {
    "metp-vocab": "METP vocabulary ops: table and output shards [V/p, h] on the ring, "
                  "tokens [b, s/p]",
    "tp-sp": "Megatron TP=p + SP: VocabParallelEmbedding, ColumnParallelLinear, "
             "vocab_parallel_cross_entropy; tokens [b, s]",
    "metp-replicated": "METP without vocab sharding: whole tables [V, h] (TP=1 modules), "
                       "tokens [b, s/p]",
}
DEFAULT_PATHS = list(PATHS)
DEFAULT_VOCAB = [32000, 128256]
DEFAULT_SEQ = [32768, 65536, 131072, 262144]
DEFAULT_P = [8]
DEFAULT_HIDDEN = 4096
RESULT_TAG = "VOCAB_MEMORY_RESULT "


# --------------------------------------------------------------------------- closed forms

def padded_vocab(vocab, path, p):
    """Padded vocabulary of each path (Megatron pads to ``128·t``, METP vocab to ``128·t·p``)."""
    from megatron_metp.ops.vocab import padded_vocab_size

    if path == "metp-vocab":
        return padded_vocab_size(vocab, DIVISIBLE_BY, 1, p)
    if path == "tp-sp":
        return padded_vocab_size(vocab, DIVISIBLE_BY, p)
    if path == "metp-replicated":
        return padded_vocab_size(vocab, DIVISIBLE_BY)
    raise ValueError(path)


def logits_bound(case):
    """Bytes of one ``[s/p·b, V/p]`` fp32 logits block: no METP tensor may be larger."""
    p = case["p"]
    return (case["s"] // p) * case["b"] * (padded_vocab(case["vocab"], "metp-vocab", p) // p) * FP32


def loss_token_chunk(case):
    """The loss's token chunk of a case: ``case["token_chunk"]`` (an int, or ``"all"``: every
    token of the rank in one chunk, i.e. untiled), else the op's own choice
    (``METP_LOSS_TOKEN_CHUNK`` or auto) for this case's ``V/p``, at most the rank's tokens."""
    from megatron_metp.ops.vocab import LOSS_TOKEN_CHUNK_ENV, resolve_token_chunk

    p, tokens = case["p"], (case["s"] // case["p"]) * case["b"]
    chunk = case.get("token_chunk")
    if chunk == "all":
        return tokens
    chunk = resolve_token_chunk(chunk, padded_vocab(case["vocab"], "metp-vocab", p) // p,
                                LOSS_TOKEN_CHUNK_ENV)
    return min(chunk, tokens)


def loss_tile_count(case):
    """Token tiles of the loss's backward in a case (``case["token_tile"]``: rows, 0 = whole;
    else ``METP_LOSS_TOKEN_TILE`` or the op's auto tile)."""
    from megatron_metp.ops.vocab import loss_tiles

    tokens = (case["s"] // case["p"]) * case["b"]
    return len(loss_tiles(case.get("token_tile"), tokens, case["h"], FP32))


def chunk_bound(case):
    """Bytes of one ``[token_chunk, V/p]`` fp32 logits chunk: no METP tensor with a vocabulary
    axis may be larger."""
    p = case["p"]
    return loss_token_chunk(case) * (padded_vocab(case["vocab"], "metp-vocab", p) // p) * FP32


# --------------------------------------------------------------------------- worker side

def _recorder_class():
    """Dispatch mode listing every tensor an op allocates (new storages only; not c10d), in order:
    ``[(op, shape, dtype, nbytes), ...]``; ``add`` records tensors made elsewhere (the tables)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_metp.tools.fakerank import flat_tensors as tensors

    class _Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.allocs = []

        def add(self, t, what):
            self.allocs.append((what, list(t.shape), str(t.dtype).replace("torch.", ""),
                                t.numel() * t.element_size()))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace != "c10d" and not any(r.alias_info is not None
                                                    for r in func._schema.returns):
                # ops such as _unsafe_view declare no alias but return an input's storage
                seen = [t.untyped_storage() for t in tensors(list(args) +
                                                             list((kwargs or {}).values()))]
                for t in tensors(out):
                    if not any(t.untyped_storage() is st for st in seen):
                        self.add(t, func._schema.name.split("::")[-1])
            return out

    return _Recorder


_STATE = {"tp": None}


def _ensure_tp(t):
    """megatron-core's parallel state with TP = ``t`` over the fake world (re-made on change)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if _STATE["tp"] != t:
        if _STATE["tp"] is not None:
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=t, create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(1234)
        _STATE["tp"] = t
    ps.destroy_global_memory_buffer()  # a fresh (fake) SP all-gather buffer per run
    ps._set_global_memory_buffer()
    return ps


def _stand_in(hidden):
    """The transformer stand-in: identity (hidden states entering the output layer = embeddings)."""
    return hidden


def _build_metp(case, V, group, token_chunk, token_tile=None, grad_into_hidden=True):
    import torch

    from megatron_metp.ops import metp_embedding, metp_output_cross_entropy

    v, h = V // case["p"], case["h"]

    class _METPVocab(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Parameter(torch.empty(v, h))
            self.output = torch.nn.Parameter(torch.empty(v, h))

        def forward(self, tokens, labels):
            x = metp_embedding(tokens, self.embedding, group=group, vocab_size=V,
                               check_token_ids=False, label="word embeddings")
            # [b, s/p, h] -> [s/p, b, h], a tensor of its own (for b = 1 the transpose alone
            # would be a view), as the final norm's output the model's loss gets
            hidden = _stand_in(x.transpose(0, 1).clone(memory_format=torch.contiguous_format))
            del x  # the embedding's output is not kept (nothing saved it)
            return metp_output_cross_entropy(hidden, self.output, labels, group=group,
                                             vocab_size=V, check_labels=False,
                                             label="output layer", token_chunk=token_chunk,
                                             token_tile=token_tile,
                                             grad_into_hidden=grad_into_hidden)

    return _METPVocab()


def _build_megatron(case, V, t):
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps = _ensure_tp(t)
    h = case["h"]
    heads = t * max(1, h // (128 * t))
    cfg = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=heads, tensor_model_parallel_size=t,
        sequence_parallel=t > 1, use_cpu_initialization=True, perform_initialization=False,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True,
        pipeline_dtype=torch.bfloat16)
    tp_group = ps.get_tensor_model_parallel_group()

    class _MegatronVocab(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = LanguageModelEmbedding(config=cfg, vocab_size=V,
                                                    max_sequence_length=case["s"],
                                                    position_embedding_type="rope",
                                                    tp_group=tp_group)
            self.output_layer = ColumnParallelLinear(h, V, config=cfg,
                                                     init_method=cfg.init_method, bias=False,
                                                     skip_bias_add=False, gather_output=False,
                                                     tp_group=tp_group)

        def forward(self, tokens, labels):
            hidden = _stand_in(self.embedding(tokens, None))  # [s(/t with SP), b, h]
            logits, _ = self.output_layer(hidden)  # [s, b, V/t]
            # GPTModel.compute_language_model_loss: [b, s] -> [s, b], loss back to [b, s]
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits,
                                                                labels.transpose(0, 1).contiguous())
            return loss.transpose(0, 1).contiguous()

    return _MegatronVocab()


def _gpu_matmul_branch():
    """Make the METP ops' ``mm_acc`` take its CUDA branch; returns undo."""
    from megatron_metp.ops.cuda_emulation import emulate_cuda

    return emulate_cuda(kernels=False)


def _run_once(case, V, measure_memory):
    """One fwd+bwd with ``V`` padded rows; the allocation list, and the memory figures if asked."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp import METPGroup
    from megatron_metp.tools.fakerank import main_grad_buffer

    path, s, b, p = case["path"], case["s"], case["b"], case["p"]
    n_tok = s if path == "tp-sp" else s // p
    undo = []
    if path == "metp-vocab" and not case.get("cpu_matmul"):
        undo.append(_gpu_matmul_branch())
    try:
        with FakeTensorMode():
            if path == "metp-vocab":
                group = METPGroup.from_process_group(dist.group.WORLD, name="bench-vocab")
                model = _build_metp(case, V, group, loss_token_chunk(case),
                                    case.get("token_tile"), case.get("grad_into_hidden", True))
            else:
                model = _build_megatron(case, V, p if path == "tp-sp" else 1)
            params = [prm for prm in model.parameters()]
            n_params = sum(prm.numel() for prm in params)
            main_grad = main_grad_buffer(params) if case["main_grad"] else None
            tokens = torch.zeros(b, n_tok, dtype=torch.long)
            labels = torch.zeros(b, n_tok, dtype=torch.long)
            rec = _recorder_class()()
            for name, prm in model.named_parameters():
                rec.add(prm, "param " + name)
            tracker = live = None
            if measure_memory:
                tracker = FR.tracker()
                tracker.track_external(tokens, labels,
                                       *([main_grad] if main_grad is not None else []))
                modes = [tracker, rec]
                if case.get("top"):
                    live = FR.live_storage_class()()
                    for name, prm in model.named_parameters():
                        live.add(prm, "param " + name)
                    for t, what in ((tokens, "tokens"), (labels, "labels"),
                                    (main_grad, "main_grad")):
                        if t is not None:
                            live.add(t, what)
                    modes.append(live)
                with contextlib.ExitStack() as stack:
                    for m in modes:
                        stack.enter_context(m)
                    loss = model(tokens, labels)
                fwd_peak = FR.snap(tracker, "peak")
                if live is not None:
                    live.phase = "bwd"
                # entered again: MemTracker's peak restarts from what is alive now, so the
                # second peak is the backward's own
                with contextlib.ExitStack() as stack:
                    for m in modes:
                        stack.enter_context(m)
                    loss.sum().backward()
                bwd_peak = FR.snap(tracker, "peak")
                peak = max(fwd_peak, bwd_peak, key=lambda snap: snap["total"])
            else:
                with rec:
                    loss = model(tokens, labels)
                    loss.sum().backward()
            loss_shape = list(loss.shape)
    finally:
        for u in undo:
            u()
    out = {"allocs": rec.allocs, "n_params": n_params, "loss_shape": loss_shape}
    if measure_memory:
        out.update(peak=peak, fwd_peak=fwd_peak, bwd_peak=bwd_peak, work_peak=tracker.work_peak)
        if live is not None:
            out["top_at_peak"] = [[nb / MiB, c, what, shape, dt, ph]
                                  for nb, c, what, shape, dt, ph in live.top(case["top"])]
            out["live_peak_op"] = live.peak_op
    return out


def _vocab_axes(a, b, V, step, p):
    """Compare two allocation lists (rows ``V`` and ``V + step``): per tensor, its vocabulary axes.

    Returns ``[(alloc, rows, full)]`` for the tensors that grow with ``V``: ``rows`` the widest
    vocabulary axis (``None`` for a flattened one), ``full`` whether it spans the full vocabulary.
    """
    if len(a) != len(b) or any(x[0] != y[0] or len(x[1]) != len(y[1]) for x, y in zip(a, b)):
        raise RuntimeError(f"the V and V+{step} runs allocated different tensor sequences "
                           f"({len(a)} vs {len(b)}): cannot tell vocabulary axes apart")
    out = []
    for x, y in zip(a, b):
        grow = [(d1, d2 - d1) for d1, d2 in zip(x[1], y[1]) if d2 != d1]
        if not grow:
            continue
        full = any(g == step for _, g in grow)
        # a vocabulary axis grows by step (V rows) or step/p (V/p rows); anything else is a
        # flattened tensor (e.g. a ring's flat gradient buffer), judged by its size by the caller
        rows = max((d for d, g in grow if g in (step, step // p)), default=None)
        out.append((x, rows, full))
    return out


def _desc(x):
    return None if x is None else {"op": x[0], "shape": x[1], "dtype": x[2], "mib": x[3] / MiB}


def _measure(case):
    path, p, h = case["path"], case["p"], case["h"]
    V = padded_vocab(case["vocab"], path, p)
    step = DIVISIBLE_BY * p  # keeps every path's divisibility
    t0 = time.perf_counter()
    main = _run_once(case, V, True)
    twin = _run_once(case, V + step, False)
    seconds = time.perf_counter() - t0
    allocs = main["allocs"]
    largest = max(allocs, key=lambda x: x[3])
    axes = _vocab_axes(allocs, twin["allocs"], V, step, p)
    full = [x for x, rows, f in axes if f or (rows is None and math.prod(x[1]) >= V * h)]
    widest = max((rows for _, rows, _ in axes if rows is not None), default=0)
    largest_vocab = max((x for x, _, _ in axes), key=lambda x: x[3], default=None)
    peak, fwd_peak = main["peak"], main["fwd_peak"]
    cat = {"PARAM": 0, "GRAD": 0, "ACT": 0, "TEMP": 0, "OTH": 0}
    cat.update(peak["cat"])
    rows = V if path == "metp-replicated" else V // p
    if main["n_params"] != 2 * rows * h:
        raise RuntimeError(f"{path}: {main['n_params']} parameters, expected two tables of "
                           f"[{rows}, {h}]")
    return {
        "V_padded": V, "rows": rows,
        "tables_mib": main["n_params"] * BF16 / MiB,
        "grad_buf_mib": (main["n_params"] * FP32 / MiB) if case["main_grad"] else 0.0,
        "peak_mib": peak["total"] / MiB,
        "peak_phase": "bwd" if peak["total"] > fwd_peak["total"] else "fwd",
        "fwd_peak_mib": fwd_peak["total"] / MiB,
        "bwd_peak_mib": main["bwd_peak"]["total"] / MiB,
        "peak_by_category_mib": {k: v / MiB for k, v in cat.items()},
        "work_peak_mib": main["work_peak"] / MiB,
        "largest": _desc(largest),
        "largest_vocab": _desc(largest_vocab),
        "vocab_width": widest,
        "vocab_width_is": "V" if widest == V else f"V/{p}" if widest == V // p else str(widest),
        "full_vocab_tensors": len(full),
        "full_vocab_largest": _desc(max(full, key=lambda x: x[3], default=None)),
        "n_allocs": len(allocs),
        "top_at_peak": main.get("top_at_peak"),
        "live_peak_op": main.get("live_peak_op"),
        "logits_bound_mib": logits_bound(case) / MiB,
        "loss_token_chunk": loss_token_chunk(case) if path == "metp-vocab" else None,
        "loss_tiles": loss_tile_count(case) if path == "metp-vocab" else None,
        "chunk_bound_mib": chunk_bound(case) / MiB,
        "loss_shape": main["loss_shape"],
        "measure_seconds": round(seconds, 3),
    }


# --------------------------------------------------------------------------- driver

def make_cases(vocabs=DEFAULT_VOCAB, seqs=DEFAULT_SEQ, ps_=DEFAULT_P, hidden=DEFAULT_HIDDEN,
               batch=1, paths=DEFAULT_PATHS, main_grad=True, cpu_matmul=False, top=0,
               token_chunk=None, token_tile=None, grad_into_hidden=True):
    cases = []
    for p in ps_:
        for V in vocabs:
            for s in seqs:
                if s % p:
                    raise ValueError(f"s={s} must be divisible by p={p}")
                for path in paths:
                    if path not in PATHS:
                        raise ValueError(f"unknown path {path!r}; choose from {list(PATHS)}")
                    cases.append({"vocab": V, "s": s, "b": batch, "h": hidden, "p": p,
                                  "path": path, "main_grad": main_grad,
                                  "cpu_matmul": cpu_matmul, "top": top,
                                  "token_chunk": token_chunk, "token_tile": token_tile,
                                  "grad_into_hidden": grad_into_hidden})
    return cases


def run(cases, jobs=1, timeout=600):
    """Measure ``cases`` (see :func:`make_cases`): one worker process per ``p``; results in the
    order of ``cases``, each the case plus its figures (or ``error``)."""
    by_p = {}
    for c in cases:
        # tp-sp cases last in each worker: the parallel state changes TP at most twice
        by_p.setdefault(c["p"], []).append(c)
    groups = {p: (p, sorted(cs, key=lambda c: c["path"] == "tp-sp")) for p, cs in by_p.items()}
    results = FR.run_cases(_measure, groups, jobs=jobs, timeout=timeout)
    order = {json.dumps(c, sort_keys=True): i for i, c in enumerate(cases)}
    keys = list(cases[0]) if cases else []
    results.sort(key=lambda r: order.get(json.dumps({k: r.get(k) for k in keys}, sort_keys=True),
                                         1 << 30))
    return results


def check_row(r):
    """Problems with a ``metp-vocab`` row's claims (empty list: none)."""
    if "error" in r or r["path"] != "metp-vocab":
        return []
    out = []
    if r["largest"]["mib"] > r["logits_bound_mib"] + 1e-9:
        out.append(f"largest tensor {r['largest']['shape']} {r['largest']['dtype']} "
                   f"{r['largest']['mib']:.1f} MiB > [s/p·b, V/p] fp32 bound "
                   f"{r['logits_bound_mib']:.1f} MiB")
    if r.get("largest_vocab") and r["largest_vocab"]["mib"] > r["chunk_bound_mib"] + 1e-9:
        out.append(f"largest tensor with a vocabulary axis {r['largest_vocab']['shape']} "
                   f"{r['largest_vocab']['dtype']} {r['largest_vocab']['mib']:.1f} MiB > "
                   f"[token_chunk, V/p] fp32 chunk bound {r['chunk_bound_mib']:.1f} MiB")
    if r["vocab_width"] != r["V_padded"] // r["p"]:
        out.append(f"widest vocabulary axis {r['vocab_width']} != V/p = {r['V_padded'] // r['p']}")
    if r["full_vocab_tensors"]:
        out.append(f"{r['full_vocab_tensors']} tensors span the full vocabulary, e.g. "
                   f"{r['full_vocab_largest']}")
    return out


def _k(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _shape(d):
    return "[" + ", ".join(str(x) for x in d["shape"]) + f"] {d['dtype']}"


def _tiles(rows, args):
    """The loss backward's token tiles of the metp-vocab rows, for the table header."""
    got = sorted({(r["s"] // r["p"] * r["b"], r["loss_tiles"]) for r in rows
                  if r.get("loss_tiles")})
    whole = [_k(n) for n, t in got if t == 1]
    tiled = [f"{t} at {_k(n)}" for n, t in got if t > 1]
    out = ([f"untiled at {', '.join(whole)}"] if whole else []) + tiled
    where = "dX into the hidden states" if not args.no_grad_into_hidden else "dX a new tensor"
    return "; ".join(out) + f" tokens per rank ({where})"


def _chunks(rows):
    """The loss token chunks of the metp-vocab rows, for the table header."""
    got = sorted({(r["s"] // r["p"] * r["b"], r["loss_token_chunk"]) for r in rows
                  if r.get("loss_token_chunk")})
    tiled = sorted({c for n, c in got if c < n})
    whole = [_k(n) for n, c in got if c >= n]
    out = [f"{', '.join(map(str, tiled))} tokens" if tiled else "",
           f"untiled at {', '.join(whole)} tokens per rank" if whole else ""]
    return "; ".join(x for x in out if x) or "n/a"


def print_tables(rows, args):
    fmt = _bench.fmt
    print("# Vocabulary: word embedding + output layer + loss, one forward+backward, rank 0 of p "
          "(fake process group + FakeTensorMode + MemTracker)\n")
    hs = sorted({r["h"] for r in rows})
    print(f"h={','.join(map(str, hs))}, b={args.batch}, bf16 tables, untied, "
          f"{'fp32 DDP grad buffer included' if not args.no_main_grad else 'no DDP grad buffer'}, "
          f"transformer stand-in = identity, "
          f"{'CPU' if args.cpu_matmul else 'CUDA (emulated)'} fp32-accumulation matmul branch, "
          f"loss token chunk {_chunks(rows)}, loss backward tiles {_tiles(rows, args)}. "
          f"Memory in MiB. Columns are explained in the module docstring.\n")
    cols = ["V", "s", "p", "path", "V pad", "tables", "grad buf", "peak", "in", "bwd peak",
            "largest tensor", "largest MiB", "vocab width", "full-V"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---:" if c in ("V pad", "tables", "grad buf", "peak", "bwd peak",
                                          "largest MiB", "full-V") else "---" for c in cols)
          + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['vocab']} | {_k(r['s'])} | {r['p']} | {r['path']} | error: "
                  f"{r['error'][:200]} |" + " |" * (len(cols) - 5))
            continue
        vals = [r["vocab"], _k(r["s"]), r["p"], r["path"], r["V_padded"], r["tables_mib"],
                r["grad_buf_mib"], r["peak_mib"], r["peak_phase"], r["bwd_peak_mib"],
                _shape(r["largest"]),
                r["largest"]["mib"], f"{r['vocab_width_is']} = {r['vocab_width']}",
                r["full_vocab_tensors"]]
        print("| " + " | ".join(fmt(v) for v in vals) + " |")

    by = {(r["vocab"], r["s"], r["h"], r["p"], r["path"]): r for r in rows}
    configs = []
    for r in rows:
        key = (r["vocab"], r["s"], r["h"], r["p"])
        if key not in configs:
            configs.append(key)
    paths = [m for m in DEFAULT_PATHS if m in args.paths]
    print("\n## Peak per rank (MiB) and METP vocab's peak relative to the others\n")
    head = ["V", "s", "p"] + paths
    ratios = [(a, f"metp-vocab / {a}") for a in ("tp-sp", "metp-replicated")
              if "metp-vocab" in paths and a in paths]
    head += [name for _, name in ratios]
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|" + "|".join("---:" for _ in head[3:]) + "|")
    for key in configs:
        line = [str(key[0]), _k(key[1]), str(key[3])]
        for m in paths:
            r = by.get(key + (m,))
            line.append("n/a" if r is None else "err" if "error" in r else fmt(r["peak_mib"], 0))
        for other, _ in ratios:
            ra, rb = by.get(key + ("metp-vocab",)), by.get(key + (other,))
            ok = ra and rb and "error" not in ra and "error" not in rb
            line.append(f"{ra['peak_mib'] / rb['peak_mib']:.3f}" if ok else "")
        print("| " + " | ".join(line) + " |")

    notes = []
    for r in rows:
        if "error" in r:
            continue
        for msg in check_row(r):
            notes.append(f"V={r['vocab']} s={_k(r['s'])} p={r['p']} metp-vocab: {msg}")
    print("\nChecks (metp-vocab rows): largest tensor <= the [s/p·b, V/p] fp32 logits bound, "
          "largest tensor with a vocabulary axis <= the [token_chunk, V/p] fp32 chunk bound, "
          "widest vocabulary axis = V/p, no tensor spanning the full vocabulary"
          + (": all pass." if not notes else ":"))
    for n in notes:
        print(f"- {n}")
    if any(r.get("top_at_peak") for r in rows):
        print("\n## Alive at each peak (largest groups: MiB, count, op, shape, dtype, allocated "
              "in)\n")
        for r in rows:
            if r.get("top_at_peak"):
                print(f"- V={r['vocab']} s={_k(r['s'])} p={r['p']} {r['path']} (peak after "
                      f"{r['live_peak_op']}): " + "; ".join(
                          f"{mib:,.0f} {c}× {what} {shape} {dt} {ph}"
                          for mib, c, what, shape, dt, ph in r["top_at_peak"]))
    return notes


def _token_chunk_arg(text):
    if text == "all":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'all', got {text!r}")
    return value


def _token_tile_arg(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (0 = whole), got "
                                         f"{text!r}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=DEFAULT_VOCAB,
                    help="vocabulary sizes before padding (default 32000 128256)")
    ap.add_argument("--seq", type=int, nargs="+", default=DEFAULT_SEQ,
                    help="sequence lengths s (default 32768 65536 131072 262144)")
    ap.add_argument("--p", type=int, nargs="+", default=DEFAULT_P,
                    help="group sizes p = METP size = Megatron TP size (default 8)")
    ap.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN,
                    help="hidden size h (default 4096)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch b (default 1)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=DEFAULT_PATHS,
                    help="paths to measure (default all three)")
    ap.add_argument("--top", type=int, default=0,
                    help="also list the K largest storage groups alive at each peak")
    ap.add_argument("--no-main-grad", action="store_true",
                    help="leave out Megatron DDP's fp32 main_grad buffer")
    ap.add_argument("--cpu-matmul", action="store_true",
                    help="keep mm_acc's CPU branch (fp32 operand copies) instead of the CUDA one")
    ap.add_argument("--token-chunk", default=None, type=_token_chunk_arg,
                    help="tokens per chunk of the METP loss (metp_output_cross_entropy's "
                         "token_chunk): a positive integer, or 'all' (untiled). Default: "
                         "$METP_LOSS_TOKEN_CHUNK or the op's auto chunk (2**28 // (V/p))")
    ap.add_argument("--token-tile", default=None, type=_token_tile_arg,
                    help="token rows per tile of the METP loss's backward (token_tile; one pass "
                         "of the ring each): a non-negative integer, 0 = whole (untiled). "
                         "Default: $METP_LOSS_TOKEN_TILE or the op's auto tile")
    ap.add_argument("--no-grad-into-hidden", action="store_true",
                    help="the METP loss's dX as a new tensor instead of in the hidden states' "
                         "storage (grad_into_hidden=False; the METP GPT model writes it there)")
    _bench.add_run_args(ap)
    args = ap.parse_args(argv)

    cases = make_cases(args.vocab, args.seq, args.p, args.hidden, args.batch, args.paths,
                       not args.no_main_grad, args.cpu_matmul, args.top, args.token_chunk,
                       args.token_tile, not args.no_grad_into_hidden)
    t0 = time.perf_counter()
    results = run(cases, jobs=args.jobs, timeout=args.timeout)
    notes = print_tables(results, args)
    print(f"\n{len(results)} measurements (each with an unmeasured V+128·p twin run) in "
          f"{time.perf_counter() - t0:.1f} s ({len(set(c['p'] for c in cases))} worker processes).")
    if args.out:
        _bench.write_out(results, args.out)
        print(f"wrote {args.out}")
    return 1 if notes or any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
