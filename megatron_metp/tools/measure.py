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
(Megatron's vocab-parallel cross-entropy; with the vocabulary split, the METP ring loss). How,
without a cluster or real allocations:

* torch's ``fake`` process group (``init_process_group("fake", rank=0, world_size=W·pp,
  store=FakeStore())``): every collective and send/recv is a no-op with the true shapes;
* ``FakeTensorMode``: nothing is allocated, every shape and dtype is exact; the model is built
  under ``torch.set_default_dtype(torch.bfloat16)`` (bf16 parameters, as ``--bf16`` training);
* ``torch.distributed._tools.mem_tracker.MemTracker`` follows every storage and reports the peak.
* Megatron DDP's fp32 gradient buffer is reproduced: one fp32 ``main_grad`` buffer for all
  parameters, and a post-accumulate hook per parameter that adds ``param.grad`` into it and frees
  ``param.grad`` (what DDP's hooks do), so the measured peak includes it.
* The METP ops' fp32-accumulating matmuls take their CUDA branch (one fp32 product, see
  ``megatron_metp.ops._accum.mm_acc``), emulated on CPU fake tensors as
  ``benchmarks/attention_memory.py --methods metp-gpumm`` does, so the figure estimates a GPU run;
  ``cpu_matmul=True`` keeps the CPU branch (fp32 copies of both operands).
* Flash kernels: stock Megatron's local spec has only the unfused ``DotProductAttention``; with
  ``kernel="flash"`` its ``core_attention`` becomes :class:`SDPAFlashCoreAttention` (PyTorch's
  fused causal kernel, the CPU flash op on fake tensors); the ring/METP modes use the ops'
  ``torch_flash`` block kernel, or ``reference`` (fp32 block scores) for ``kernel="unfused"``.
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

import multiprocessing as mp
import os
import pickle
import time
import traceback
from typing import Dict, List

from . import plan as P

MiB = 2 ** 20


# ----------------------------------------------------------------------------- helpers (child)

def tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        """MemTracker that also records the largest forward+backward allocation (ACT+TEMP)."""

        work_peak = 0

        def _pre_fw_hook(self, module, inputs):
            # Pipeline stages run the model once per micro-batch in flight; MemTracker's
            # per-module stats allow one call, so restart them at the root (the global peak,
            # which is what is reported, is kept).
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                fqn = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {fqn} == {"Global"}:
                    self.reset_mod_stats()
            return super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                work = sum(v for k, v in snap.items() if getattr(k, "name", None) in ("ACT", "TEMP"))
                self.work_peak = max(self.work_peak, work)

    return _Tracker


def snap(tracker, kind) -> Dict:
    total, cats = 0, {}
    for dev_snap in tracker.get_tracker_snapshot(kind).values():
        for k, v in dev_snap.items():
            if k == "Total":
                total += v
            else:
                name = getattr(k, "name", str(k))
                cats[name] = cats.get(name, 0) + v
    return {"total": total, "cat": cats}


def _comm_counter_class():
    """TorchDispatchMode counting the bytes this rank sends (ring convention: a send ``N``;
    all-reduce ``2(p−1)/p·N``; all-gather / reduce-scatter of a full ``N`` and broadcast / reduce
    of ``N``: ``(p−1)/p·N``), per process-group size ``p`` of the op; it also keeps the largest
    4-D tensor any op allocated (attention scores are 4-D)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    def nbytes(t):
        return t.numel() * t.element_size()

    tensors = flat_tensors

    def group_size(args):
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                    return pg.size()
                except Exception:  # noqa: BLE001 - not a process group
                    continue
        return None

    class _Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sent = 0
            self.ops = {}
            self.max_4d = 0
            self.max_4d_shape = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func._schema.name.split("::")[-1]
                p = group_size(args) or 1
                if name == "send":
                    sent = sum(nbytes(t) for t in tensors(args[0]))
                elif name == "allreduce_":
                    sent = 2 * (p - 1) * sum(nbytes(t) for t in tensors(args[0])) // p
                elif name == "_allgather_base_":
                    sent = (p - 1) * nbytes(args[1])
                elif name == "_reduce_scatter_base_":
                    sent = (p - 1) * nbytes(args[0])
                elif name in ("broadcast_", "reduce_"):
                    sent = (p - 1) * sum(nbytes(t) for t in tensors(args[0])) // p
                else:
                    sent = 0
                self.ops[name] = self.ops.get(name, 0) + 1
                self.sent += sent
                return func(*args, **(kwargs or {}))
            out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):
                for t in tensors(out):
                    if t.dim() == 4 and nbytes(t) > self.max_4d:
                        self.max_4d = nbytes(t)
                        self.max_4d_shape = [list(t.shape), str(t.dtype).replace("torch.", "")]
            return out

    return _Counter


def megatron_cpu_classes():
    """``CpuSPNorm`` (LayerNorm accepting sequence parallelism) and ``SDPAFlashCoreAttention``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class CpuSPNorm(torch.nn.LayerNorm):
        """torch LayerNorm with WrappedTorchNorm's signature that accepts sequence parallelism
        (Megatron's own refuses SP; apex/TE are not installed here). Parameters are tagged
        ``sequence_parallel`` as Megatron's fused norms tag them."""

        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                     zero_centered_gamma=False, normalization="LayerNorm"):
            super().__init__(hidden_size, eps=eps)
            for prm in self.parameters():
                prm.sequence_parallel = config.sequence_parallel

    class SDPAFlashCoreAttention(MegatronModule):
        """Megatron ``core_attention`` running PyTorch's fused causal attention
        (``scaled_dot_product_attention``; the flash op on CPU fake tensors). Stores what a flash
        kernel stores: q, k, v, the output and the fp32 log-sum-exp; never an s×s score."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     cp_comm_type=None, softmax_scale=None, pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            rep = query.shape[2] // key.shape[2]
            if rep > 1:
                key = key.repeat_interleave(rep, dim=2)
                value = value.repeat_interleave(rep, dim=2)
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            sq, b = query.shape[:2]
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return CpuSPNorm, SDPAFlashCoreAttention


def flat_tensors(a) -> list:
    """The tensors in ``a``: a tensor, or (nested) lists and tuples of them, in order."""
    import torch

    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in flat_tensors(x)]
    return []


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


def _gpu_matmul_branch():
    """Make the METP ops' ``mm_acc`` take its CUDA branch on CPU fake tensors; returns undo."""
    from ..ops._accum import emulate_cuda_branch

    return [emulate_cuda_branch()]


# ----------------------------------------------------------------------------- one measurement

def measure_here(model: "P.Model", job: "P.Job", mode: str, *, cpu_matmul: bool = False) -> Dict:
    """Measure in *this* process (it must not have a process group yet; it gets a fake one).

    Returns a dict of bytes: ``peak`` (MemTracker's total: parameters, the fp32 gradient buffer,
    forward and backward allocations), ``params``, ``grad_buffer``, ``activation_peak`` (peak
    minus the two), ``stored`` (forward allocations alive after the last forward), ``sent``
    (bytes this rank sent in the fwd+bwd), plus layout facts.
    """
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist
    import torch.nn.functional as Fn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import megatron_metp.cpu as mcpu

    P.validate(model, job, modes=[mode])
    asked = mode
    mode, job = P.canonical(mode, job)  # "metp+vocab" -> "metp" with job.vocab_parallel
    lay = P.layout(mode, job)
    world = lay.t * lay.c * job.pp
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mcpu.enable(force=True)  # a throwaway child process: CPU fake tensors only
    try:
        from megatron_metp import finite
        finite.enable_finite_checks(False)  # a data-dependent check cannot run on fake tensors
    except ImportError:
        pass

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..megatron.groups import METPGroups
    from ..megatron.parallel import initialize_model_parallel
    from ..megatron.spec import get_gpt_layer_metp_spec
    from ..megatron.vocab import METPGPTModel

    if mode == "metp":
        initialize_model_parallel(lay.t, job.pp, lay.c, seq_length=model.seq,
                                  create_gloo_process_groups=False)
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=lay.t,
                                     pipeline_model_parallel_size=job.pp,
                                     context_parallel_size=lay.c,
                                     create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    groups = METPGroups.from_parallel_state()
    torch.set_default_dtype(torch.bfloat16)

    layers_here = model.layers // job.pp
    vocab = P.padded_vocab(model.vocab, lay.vocab_shards)
    cfg = TransformerConfig(
        num_layers=model.layers, hidden_size=model.hidden, num_attention_heads=model.heads,
        num_query_groups=model.groups, kv_channels=model.hidden // model.heads,
        ffn_hidden_size=model.ffn, tensor_model_parallel_size=lay.t,
        pipeline_model_parallel_size=job.pp, context_parallel_size=lay.c,
        sequence_parallel=lay.sp, use_cpu_initialization=True, perform_initialization=False,
        attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
        gated_linear_unit=model.swiglu, activation_func=Fn.silu if model.swiglu else Fn.gelu,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16,
        attention_softmax_in_fp32=False, batch_p2p_sync=False)
    CpuSPNorm, SDPAFlash = megatron_cpu_classes()
    if mode in ("tp", "tp-sp"):
        spec = get_gpt_layer_local_spec()
        if job.kernel == "flash":
            spec.submodules.self_attention.submodules.core_attention = SDPAFlash
    else:
        spec = get_gpt_layer_metp_spec(groups, weight_ring=mode == "metp",
                                       kernel="torch_flash" if job.kernel == "flash" else "reference",
                                       keep_intermediate=job.keep_intermediate)
    block = spec
    if lay.sp:
        spec.submodules.input_layernorm = CpuSPNorm
        spec.submodules.pre_mlp_layernorm = CpuSPNorm
        block = TransformerBlockSubmodules(layer_specs=[spec] * layers_here, layer_norm=CpuSPNorm)
    undo = [] if (cpu_matmul or mode in ("tp", "tp-sp")) else _gpu_matmul_branch()

    n = model.seq // lay.c  # this rank's tokens
    b = job.micro_batch
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    inflight = job.inflight
    t0 = time.perf_counter()
    try:
        with FakeTensorMode():
            cls, extra = (METPGPTModel, {"metp_groups": groups}) if lay.vocab else (GPTModel, {})
            gpt = cls(config=cfg, transformer_layer_spec=block, vocab_size=vocab,
                      max_sequence_length=model.seq, pre_process=first, post_process=last,
                      share_embeddings_and_output_weights=model.tied and job.pp == 1,
                      position_embedding_type="rope", **extra)
            params = list(gpt.parameters())
            n_params = sum(p.numel() for p in params)
            main_grad = main_grad_buffer(params)
            tracker = tracker_class()()
            tracker.track_external(main_grad)
            counter = _comm_counter_class()()
            outs = []
            with tracker, counter:
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
                after_fwd = snap(tracker, "current")
                fwd_peak = snap(tracker, "peak")
                out, shape = outs.pop(0)
                if last:
                    out.float().sum().backward()
                else:  # the gradient received from the next stage
                    grad = torch.zeros(shape, dtype=torch.bfloat16)
                    if out.numel() == 1:
                        custom_backward(out, grad)
                    else:
                        out.backward(grad)
            peak = snap(tracker, "peak")
            phases = {}
            if gpt.decoder.layers:
                lastl = gpt.decoder.layers[-1]
                for name, mod in (("mlp backward", lastl.mlp),
                                  ("attention backward", lastl.self_attention)):
                    st = tracker.memory_tracking.get(mod)
                    if st is not None and st.local_peak:
                        phases[name] = max(st.local_peak.values())
            if last:
                st = tracker.memory_tracking.get(gpt.output_layer)
                if st is not None and st.local_peak:
                    phases["output layer backward"] = max(st.local_peak.values())
            phases["forward"] = fwd_peak["total"]
    finally:
        for u in undo:
            u()
    seconds = time.perf_counter() - t0
    params_b = 2 * n_params
    grad_b = 4 * n_params
    return {
        "mode": asked, "vocab_parallel": lay.vocab, "seq": model.seq, "tokens_per_rank": n,
        "layers_on_rank": layers_here,
        "inflight_microbatches": inflight, "n_params": n_params,
        "peak": peak["total"], "peak_phase": "bwd" if peak["total"] > fwd_peak["total"] else "fwd",
        "peak_by_category": peak["cat"],
        "params": params_b, "grad_buffer": grad_b,
        "activation_peak": peak["total"] - params_b - grad_b,
        "stored": after_fwd["cat"].get("ACT", 0),
        "phases": phases,
        "sent": counter.sent, "comm_ops": counter.ops,
        "max_4d": counter.max_4d, "max_4d_shape": counter.max_4d_shape,
        "metp_ring_sent": groups.metp.stats.bytes_sent if groups.metp.size > 1 else 0,
        "seconds": round(seconds, 3),
    }


# ----------------------------------------------------------------------------- driver (forks)

def _child(conn, model, job, mode, kwargs):
    try:
        res = measure_here(model, job, mode, **kwargs)
        conn.send(("ok", pickle.dumps(res)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def preload() -> None:
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


def measure(model: "P.Model", job: "P.Job", modes, *, jobs: int = 1, timeout: float = 600.0,
            cpu_matmul: bool = False) -> List[Dict]:
    """Measure each mode (a list, or one name) in its own forked child; ``jobs`` at a time.

    A failed measurement comes back as ``{"mode": ..., "error": traceback}``.
    """
    if isinstance(modes, str):
        modes = [modes]
    P.validate(model, job, modes=modes)
    preload()
    ctx = mp.get_context("fork")
    todo = list(enumerate(modes))
    results: Dict[int, Dict] = {}
    running = []
    while todo or running:
        while todo and len(running) < max(1, jobs):
            i, mode = todo.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(send, model, job, mode,
                                                    {"cpu_matmul": cpu_matmul}))
            proc.start()
            send.close()
            running.append((i, mode, proc, recv, time.monotonic()))
        still = []
        for i, mode, proc, recv, t0 in running:
            if recv.poll(0.05):
                try:
                    status, value = recv.recv()
                except EOFError:
                    status, value = "error", f"measurement child for {mode} died"
                results[i] = pickle.loads(value) if status == "ok" else {"mode": mode,
                                                                         "error": value}
                proc.join(timeout=10)
                recv.close()
            elif not proc.is_alive() and not recv.poll(0):
                results[i] = {"mode": mode, "error": f"measurement child for {mode} exited "
                                                     f"{proc.exitcode} without a result"}
                recv.close()
            elif time.monotonic() - t0 > timeout:
                proc.kill()
                proc.join()
                results[i] = {"mode": mode, "error": f"measurement of {mode} timed out after "
                                                     f"{timeout:g} s"}
                recv.close()
            else:
                still.append((i, mode, proc, recv, t0))
        running = still
    return [results[i] for i in range(len(modes))]
