"""Measure one rank's memory of a planned job: the real model under the fake group and FakeTensorMode.

``metp measure`` (and :func:`measure`) builds, for rank 0 of the job's model-parallel group, the
same megatron-core ``GPTModel`` that training builds for each mode of :mod:`megatron_metp.tools.plan`:

================  ===========================================================================
``tp``            stock Megatron TP over ``W = tp·metp`` ranks, local spec, no SP
``tp-sp``         the same with ``sequence_parallel=True``
``cp``            Megatron TP=``tp`` (+SP when tp>1) × context parallel ``metp`` with the
                  project's K/V ring as ``core_attention`` (``get_gpt_layer_metp_spec(...,
                  weight_ring=False)``)
``ring``          ring self-attention: TP=1, the K/V ring over all ``W`` ranks, weights
                  replicated (the same spec with TP=1)
``metp``          ``get_gpt_layer_metp_spec(groups)``: TP=``tp`` × METP=``metp``
``metp+vocab``    the same as ``megatron_metp.megatron.vocab.METPGPTModel`` (training's
                  ``Layout(vocab_parallel=True)``, Megatron-LM's ``--metp-vocab-parallel``):
                  word embedding and output layer split over TP×METP (vocabulary padded to
                  ``128·tp·metp``), the loss by ``ops.metp_output_cross_entropy``; also mode
                  ``metp`` of a job with ``vocab_parallel``
================  ===========================================================================

and runs one forward and one backward of one micro-batch of this rank's tokens with the loss
(Megatron's vocab-parallel cross-entropy; with the vocabulary split, the METP ring loss), as one
fake rank of :mod:`megatron_metp.tools.fakerank` (the fake process group, ``FakeTensorMode``
under ``torch.set_default_dtype(torch.bfloat16)``, MemTracker, the emulated Megatron DDP fp32
``main_grad`` buffer, and the CUDA-faithful kernels of
:mod:`megatron_metp.tools.cuda_accounting`: the norms keep what CUDA's fused kernels keep, and
the METP ops' fp32-accumulating matmuls take their CUDA branch; ``cpu_matmul=True`` keeps the
CPU branch). Further:

* Flash kernels: stock Megatron's local spec has only the unfused ``DotProductAttention``; with
  ``kernel="flash"`` its ``core_attention`` becomes
  :func:`megatron_metp.tools.standins.flash_core_attention_class` (PyTorch's fused causal
  kernel, grouped K/V read without repeating them, as TE's and flash-attn's kernels do); the
  ring/METP modes use the ops' ``torch_flash`` block kernel, or ``reference`` (fp32 block scores)
  for ``kernel="unfused"``.
* Pipeline parallelism: rank 0 is the first stage (embedding + ``L/pp`` layers). The 1F1B schedule
  keeps ``min(pp, microbatches)`` micro-batches in flight there, so that many forwards run before
  the first backward.

Not in the measurement (added from the plan, and said so in the report): the optimizer states
(Adam: fp32 master weights and two moments, 12 B per parameter, or 12/DP with the distributed
optimizer), the CUDA context, NCCL buffers, allocator fragmentation, kernel workspaces.

Every measurement runs in a forked child process (a fresh fake world each; megatron-core imported
once in the parent), at most ``jobs`` at a time.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Dict, List

from . import fakerank as FR
from . import plan as P

MiB = 2 ** 20


# ----------------------------------------------------------------------------- one measurement

def measure_here(model: "P.Model", job: "P.Job", mode: str, *, cpu_matmul: bool = False,
                 measure_tiles: str = "sampled", forward_only: bool = False) -> Dict:
    """Measure in *this* process (it must not have a process group yet; it gets a fake one).

    Returns a dict of bytes: ``peak`` (MemTracker's total: parameters, the fp32 gradient buffer,
    forward and backward allocations), ``params``, ``grad_buffer``, ``activation_peak`` (peak
    minus the two), ``stored`` (forward allocations alive after the last forward), ``sent``
    (bytes this rank sent in the fwd+bwd), plus layout facts. ``measure_tiles``:
    ``"sampled"`` runs the streaming layer's tile loops' first two and last passes
    (:func:`fakerank.tile_sampling`; the traffic still counts every pass), ``"full"`` all.
    ``forward_only``: the forwards alone (no backward is run; ``peak`` is the forwards' peak,
    ``phases`` holds only ``"forward"``, ``sent`` the forwards' bytes). A progress line per layer and phase goes to stderr (:mod:`.progress`).
    """
    from .progress import attach

    import torch
    import torch.nn.functional as Fn
    from torch._subclasses.fake_tensor import FakeTensorMode

    P.validate(model, job, modes=[mode])
    asked = mode
    mode, job = P.canonical(mode, job)  # "metp+vocab" -> "metp" with job.vocab_parallel
    if model.mla and mode != "metp":
        raise ValueError(f"metp measure: mode {mode} with multi-latent attention is not measured "
                         f"(megatron-core's MLASelfAttention needs Transformer Engine, absent "
                         f"here); measure mode metp, or use metp plan for the stock modes")
    lay = P.layout(mode, job)
    world = lay.t * lay.c * job.pp
    ep = P.moe.expert_parallel(job, lay) if model.moe else 1
    if model.moe and ep > lay.t * lay.c:
        world *= job.dp  # stock EP folded over DP ranks too (METP: EP over METP × CP × DP)
    FR.fake_world(world)

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor

    from ..megatron.build import build_metp_gpt, model_tree_summary
    from ..megatron.training import Layout as TrainingLayout
    from ..megatron.training import init_parallel
    from ..runtime.offload import ActivationOffloader

    # METP folds its groups into parallel_state; the stock modes are TP(+SP) x CP there; stock
    # experts with expert TP 1 as the config says (also at EP 1 under TP: parallel_state's
    # default expert TP would be TP, gathering the experts' tokens over the TP group)
    if model.moe and mode != "metp" and (ep > 1 or lay.t > 1):
        groups = _init_stock_ep(lay, job, ep)
    else:
        wide = mode == "metp" and model.moe and ep > lay.p  # EP wider than METP (wide_ep)
        groups = init_parallel(TrainingLayout(tp=lay.t, pp=job.pp, metp=lay.p, cp=lay.cp,
                                              mode="metp" if mode == "metp" else "tp",
                                              ep=ep if wide else None),
                               seq_length=model.seq)
    torch.set_default_dtype(torch.bfloat16)

    layers_here = model.layers // job.pp
    vocab = P.padded_vocab(model.vocab, lay.vocab_pad)
    config_class, mla_fields = _mla_config(model)
    cfg = config_class(
        num_layers=model.layers, hidden_size=model.hidden, num_attention_heads=model.heads,
        num_query_groups=model.groups, kv_channels=model.head_dim,
        qk_layernorm=model.qk_layernorm, add_qkv_bias=model.add_qkv_bias,
        ffn_hidden_size=model.ffn, tensor_model_parallel_size=lay.t,
        pipeline_model_parallel_size=job.pp, context_parallel_size=lay.c,
        sequence_parallel=lay.sp, use_cpu_initialization=True, perform_initialization=False,
        attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=model.bias,
        gated_linear_unit=model.swiglu, activation_func=Fn.silu if model.swiglu else Fn.gelu,
        bias_activation_fusion=model.swiglu, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        normalization=model.normalization,
        recompute_granularity=None if job.recompute == "none" else job.recompute,
        recompute_method=job.recompute_method if job.recompute == "full" else None,
        recompute_num_layers=job.recompute_num_layers if job.recompute == "full" else None,
        params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16,
        attention_softmax_in_fp32=False, batch_p2p_sync=False, **_moe_config(model, job, ep),
        **mla_fields)
    from .plan.settings import settings_for

    # the ops' CPU stand-in for a GPU flash kernel (torch's fused kernel; fp32 blocks: unfused)
    settings = settings_for(asked, job, model=model).replace(
        kernel="torch_flash" if job.kernel == "flash" else "reference")
    if model.moe and mode not in ("metp", "tp", "tp-sp"):
        raise ValueError(f"metp measure: mode {mode} with experts is not measured (modes metp, "
                         f"tp, tp-sp)")
    spec_transform = _standins(lay, job, model, layers_here)
    n = model.seq // lay.c  # this rank's tokens (METP × CP: s/(p·c))
    b = job.micro_batch
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    inflight = job.inflight
    t0 = time.perf_counter()
    with FakeTensorMode():
        gpt = build_metp_gpt(cfg, groups, settings, vocab_size=vocab,
                             max_sequence_length=model.seq, pre_process=first, post_process=last,
                             share_embeddings_and_output_weights=model.tied and job.pp == 1,
                             position_embedding_type="rope", spec_transform=spec_transform)
        offloader = ActivationOffloader.attached_to(gpt.decoder) if job.offload else None
        tree = model_tree_summary(gpt)
        params = list(gpt.parameters())
        n_params = sum(p.numel() for p in params)
        main_grad = FR.main_grad_buffer(params)
        tracker = FR.tracker()
        tracker.track_external(main_grad)
        counter = FR.comm_counter_class()(track_alloc=True)
        outs = []
        attach(tracker, f"measure {asked} ({layers_here} layers)", layers_here)
        with FR.measuring(tracker, counter, cuda_matmul=not cpu_matmul,
                          moe_imbalance=job.moe_imbalance), \
                FR.tile_sampling(measure_tiles) as sampled:
            for _ in range(inflight):
                tokens = torch.zeros(b, n, dtype=torch.long)
                pos = torch.zeros(b, n, dtype=torch.long)
                labels = torch.zeros(b, n, dtype=torch.long) if last else None
                out = gpt(tokens, pos, None, labels=labels)
                shape = out.shape
                if not last and out._base is None:
                    # sent to the next stage: Megatron-LM frees the data and keeps the graph
                    deallocate_output_tensor(out, True)
                outs.append((out, shape))
            after_fwd = FR.snap(tracker, "current")
            fwd_peak = FR.snap(tracker, "peak")
            out, shape = outs.pop(0)
            if not forward_only:
                _backward(out, shape, last, custom_backward)
        peak = FR.snap(tracker, "peak")
        phases = {}
        if gpt.decoder.layers and not forward_only:
            lastl = gpt.decoder.layers[-1]
            for name, mod in (("mlp backward", lastl.mlp),
                              ("attention backward", lastl.self_attention),
                              ("last layer", lastl)):
                st = tracker.memory_tracking.get(mod)
                if st is not None and st.local_peak:
                    phases[name] = max(st.local_peak.values())
        if last and not forward_only:
            st = tracker.memory_tracking.get(gpt.output_layer)
            if st is not None and st.local_peak:
                phases["output layer backward"] = max(st.local_peak.values())
        phases["forward"] = fwd_peak["total"]
    seconds = time.perf_counter() - t0
    params_b = 2 * n_params
    grad_b = 4 * n_params
    stored_b = after_fwd["cat"].get("ACT", 0)
    # the last layer's own working set: the most it held (forward or backward) beyond the
    # parameters, the gradient buffer and what the forward stored (the plan's "transient"
    # convention: the incoming gradient counts, the freed head does not)
    layer_transient = (phases["last layer"] - params_b - grad_b - stored_b
                       if "last layer" in phases else None)
    return {
        "mode": asked, "vocab_parallel": lay.vocab, "seq": model.seq, "tokens_per_rank": n,
        "layers_on_rank": layers_here,
        "inflight_microbatches": inflight, "n_params": n_params,
        "peak": peak["total"], "peak_phase": "bwd" if peak["total"] > fwd_peak["total"] else "fwd",
        "peak_by_category": peak["cat"],
        "params": params_b, "grad_buffer": grad_b,
        "activation_peak": peak["total"] - params_b - grad_b,
        "stored": stored_b, "layer_transient": layer_transient,
        "phases": phases,
        "sent": counter.sent, "comm_ops": counter.ops,
        "comm_bytes": counter.bytes_by_op,
        "max_4d": counter.max_alloc_4d, "max_4d_shape": counter.max_alloc_4d_shape,
        "metp_ring_sent": groups.metp.stats.bytes_sent if groups.metp.size > 1 else 0,
        "host_peak": offloader.stats.host_peak if offloader else 0,
        "offloaded_bytes": offloader.stats.offloaded_bytes if offloader else 0,
        "seconds": round(seconds, 3),
        "tiles": FR.sampled_text(sampled), "model_tree": tree,
    }


def _mla_config(model: "P.Model"):
    """``(config class, fields)``: megatron-core's ``MLATransformerConfig`` with the model's
    latent ranks and head widths (plain RoPE) for multi-latent attention, else
    ``TransformerConfig`` and none."""
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    if not model.mla:
        return TransformerConfig, {}
    return MLATransformerConfig, dict(
        multi_latent_attention=True, q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
        rope_type="rope")


def _backward(out, shape, last: bool, custom_backward) -> None:
    """The first micro-batch's backward: from the loss on the last stage, else from the
    gradient the next stage sends (``shape``, bf16; Megatron's ``custom_backward`` for a
    deallocated output)."""
    import torch

    if last:
        out.float().sum().backward()
        return
    grad = torch.zeros(shape, dtype=torch.bfloat16)
    if out.numel() == 1:
        custom_backward(out, grad)
    else:
        out.backward(grad)


def _moe_config(model: "P.Model", job: "P.Job", ep: int) -> Dict:
    """A MoE model's ``TransformerConfig`` fields (experts, top-k, expert FFN, layer frequency
    (a list with leading dense layers), the shared expert, EP, dispatcher); none for a dense
    model."""
    if not model.moe:
        return {}
    if job.moe_grouped_gemm:
        raise ValueError("--moe-grouped-gemm: the grouped experts run on the GPU only; metp "
                         "measure builds Megatron's SequentialMLP (drop --moe-grouped-gemm, or "
                         "use metp plan for the grouped GEMM's bytes)")
    return dict(num_moe_experts=model.experts, moe_router_topk=model.topk,
                moe_ffn_hidden_size=P.moe.expert_ffn(model),
                moe_layer_freq=([int(f) for f in P.moe.moe_layer_flags(model)]
                                if model.moe_first_dense else model.moe_layer_freq),
                moe_shared_expert_intermediate_size=model.moe_shared_ffn or None,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1,
                moe_token_dispatcher_type=job.moe_dispatcher, moe_grouped_gemm=False,
                moe_permute_fusion=False, moe_router_dtype=None)


def _init_stock_ep(lay, job, ep: int):
    """Megatron's parallel state of a stock MoE layout: TP × CP with expert parallelism ``ep``
    out of TP × CP × DP (parallel folding, expert TP 1)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..megatron.groups import METPGroups

    ps.initialize_model_parallel(tensor_model_parallel_size=lay.t,
                                 pipeline_model_parallel_size=job.pp,
                                 context_parallel_size=lay.c, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1,
                                 create_gloo_process_groups=False)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    return METPGroups.from_parallel_state()


def _standins(lay, job: "P.Job", model: "P.Model", layers_here: int):
    """The ``spec_transform`` that puts the CPU stand-ins of GPU modules into the spec the
    builder chose (:mod:`.standins`): with ``kernel="flash"`` stock layers' ``core_attention``
    becomes PyTorch's fused causal kernel (as TE's and flash-attn's); with sequence parallelism
    the norms become ones that accept it (a dense layer spec then becomes the stage's block)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from .standins import flash_core_attention_class, put_norms, sp_norm_class

    stock = lay.mode in ("tp", "tp-sp")

    def transform(spec):
        layer_specs = getattr(spec, "layer_specs", None)
        for ls in layer_specs if layer_specs is not None else [spec]:
            if stock and job.kernel == "flash":
                ls.submodules.self_attention.submodules.core_attention = \
                    flash_core_attention_class()
        if not lay.sp:
            return spec
        norm = sp_norm_class()
        if layer_specs is not None:
            for ls in layer_specs:
                put_norms(ls, norm, model.qk_layernorm)
            spec.layer_norm = norm
            return spec
        put_norms(spec, norm, model.qk_layernorm)
        return TransformerBlockSubmodules(layer_specs=[spec] * layers_here, layer_norm=norm)

    return transform


# ----------------------------------------------------------------------------- driver (forks)

def _depths(model: "P.Model", job: "P.Job", measure_layers: str):
    """``None`` (measure every layer) or the two depths per stage to extrapolate from."""
    step = job.recompute_num_layers if job.recompute == "full" and \
        job.recompute_method == "uniform" else 1
    return FR.layer_depths(model.layers // job.pp, measure_layers, step=step,
                           offload=job.offload)


def _runs(model: "P.Model", job: "P.Job", mode: str, measure_layers: str):
    """``([(model, job), ...], coefficients, method)``: the stages to measure for ``mode`` and
    how their figures combine (:func:`fakerank.combine`). The offload split is the plan's
    (:func:`plan.memory`: every layer, ``--offload-activations N``, or as many as the node's host
    memory holds), each measured stage offloading all but the kept layers of the full one
    (:func:`fakerank.partial_offload_points`). The kept attention is the plan's too
    (``--keep-attention-output [N]``, no N resolved as the plan resolves it): every layer of a
    stage keeping it extrapolates as any stage does; the first ``N`` of ``L`` layers only give
    slopes in layers and in kept layers (:func:`fakerank.partial_keep_points`, as the dry run),
    or every layer is measured beside a partial offload or chunks of several layers."""
    L = model.layers // job.pp
    planned = P.memory(model, job, mode).act
    off = planned.offloaded_layers
    if job.offload:  # the split the plan made, explicit (0: nothing to offload)
        job = replace(job, offload_layers=off if 0 < off < L else None) if off else \
            replace(job, offload=False, offload_layers=None, host_memory_gib=None,
                    offload_prefetch=True)
    kept = planned.kept_attention_layers
    if job.keep_attention_output is not None:  # the count the plan keeps (0: none)
        job = replace(job, keep_attention_output=kept or None)
    depths = _depths(model, job, measure_layers)
    step = job.recompute_num_layers if job.recompute == "full" and \
        job.recompute_method == "uniform" else 1
    if 0 < kept < L and (job.offload_layers is not None or step > 1 or
                         (depths and max(depths[1], 3) >= L)):
        depths = None
    if depths is None:
        return [(model, job)], [1.0], None
    if 0 < kept < L:
        points, coef = FR.partial_keep_points(L, kept, depths)
        runs = [(replace(model, layers=d * job.pp), replace(job, keep_attention_output=k))
                for d, k in points]
        said = ", ".join(f"{d} layers ({k} keeping attention)" for d, k in points)
        return runs, coef, f"measured on {said}, combined linearly to {L} layers with {kept} " \
                           f"keeping it"
    if job.offload_layers is not None:
        points, coef = FR.partial_offload_points(L, job.offload_layers, depths, step=step)
        runs = [(replace(model, layers=d * job.pp), replace(job, offload_layers=n))
                for d, n in points]
        method = (f"measured on {', '.join(f'{d} layers ({n} offloaded)' for d, n in points)}, "
                  f"combined linearly to {L} layers with {job.offload_layers} offloaded")
        return runs, coef, method
    a, b = depths
    times = (L - b) / (b - a)
    return ([(replace(model, layers=d * job.pp), job) for d in depths], [-times, 1 + times],
            f"measured on {a} and {b} layers, extrapolated linearly to {L}")


def measure(model: "P.Model", job: "P.Job", modes, *, jobs: int = 1, timeout: float = 600.0,
            cpu_matmul: bool = False, measure_layers: str = "full",
            measure_tiles: str = "sampled") -> List[Dict]:
    """Measure each mode (a list, or one name) in its own forked child; ``jobs`` at a time.

    ``measure_layers``: ``"full"`` builds every layer of the stage; ``N`` (or ``"auto"``: 2 when
    a stage has more than 4 layers) measures ``N-1`` and ``N`` layers per stage and extrapolates
    every byte and message count linearly to the stage's layers (as the Megatron-LM dry run
    does; exact where each layer adds the same, which the fake-tensor measurements show); with
    a partial offload the measured stages keep as many layers as the full one, or three stages
    give the slopes in layers and in kept layers (:func:`_runs`).
    ``measure_tiles``: ``"sampled"`` (default) or ``"full"`` (:func:`measure_here`).
    A failed measurement comes back as ``{"mode": ..., "error": traceback}``.
    """
    if isinstance(modes, str):
        modes = [modes]
    P.validate(model, job, modes=modes)
    FR.tile_sampling(measure_tiles)  # refuses an unknown value before any work
    plans = [_runs(model, job, m, measure_layers) for m in modes]
    FR.preload_megatron()
    runs = [(m, mdl, jb) for m, (rs, _, _) in zip(modes, plans) for mdl, jb in rs]
    t0 = time.perf_counter()
    print(f"measure: {len(runs)} measurement(s) of {', '.join(modes)} ({jobs} at a time)",
          file=sys.stderr, flush=True)
    got = FR.map_isolated(lambda mode, mdl, jb: measure_here(mdl, jb, mode, cpu_matmul=cpu_matmul,
                                                             measure_tiles=measure_tiles),
                          runs, jobs=jobs, timeout=timeout, what=lambda a: a[0])
    print(f"measure: {len(runs)} measurement(s) done | elapsed {time.perf_counter() - t0:,.1f} s",
          file=sys.stderr, flush=True)
    out = []
    i = 0
    for mode, (rs, coef, method) in zip(modes, plans):
        parts, i = got[i:i + len(rs)], i + len(rs)
        err = next((g["error"] for g in parts if "error" in g), None)
        if err:
            out.append({"mode": mode, "error": err})
            continue
        if method is None:
            res = parts[0]["ok"]
            res["method"] = f"measured on all {res['layers_on_rank']} layers; {res['tiles']}"
            out.append(res)
            continue
        vals = [g["ok"] for g in parts]
        skip = ("seq", "tokens_per_rank", "inflight_microbatches", "max_4d", "seconds")
        res = {k: (v if k in skip else FR.combine([r.get(k) for r in vals], coef))
               for k, v in vals[-1].items()}
        res["layers_on_rank"] = model.layers // job.pp
        res["seconds"] = round(sum(r["seconds"] for r in vals), 3)
        res["method"] = f"{method}; {res['tiles']}"
        out.append(res)
    return out
