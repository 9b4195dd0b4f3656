"""Plan a job before spending GPU hours: per-rank memory, traffic, overlap and the longest sequence.

``metp plan`` (:func:`main` in :mod:`megatron_metp.tools.cli`) takes a model geometry, the parallel
sizes, the micro-batch, the attention kernel, the recompute choice and a hardware preset, and
prints for each parallel mode, per rank:

* memory: parameters (bf16), gradients (Megatron DDP's fp32 ``main_grad`` buffer), Adam states
  (fp32 master copy + two moments, 12 B per parameter; with the distributed optimizer divided by
  the data-parallel group that reduces that parameter), stored activations per layer × layers on
  the rank (× micro-batches in flight under 1F1B), the embedding / output-layer activations
  including the fp32 logits of the loss, the transient buffers of one layer's backward, and the
  peak they add up to;
* bytes sent per layer per rank for one forward+backward (ring-algorithm convention);
* the full-overlap thresholds of METP's rings (tokens per rank above which one step's compute
  hides the next step's transfer);
* the longest sequence that fits in the device memory (binary search over ``s``).

Modes, all on the same ``W = tp·metp`` GPUs per pipeline stage:

================  ===========================================================================
``tp``            stock Megatron tensor parallelism over all ``W`` ranks, no SP
``tp-sp``         the same with sequence parallelism (Korthikanti et al. 2022)
``cp``            Megatron TP=``tp`` (+SP when tp>1) × context parallel ``metp`` (K/V ring)
``ring``          ring self-attention: the K/V ring over all ``W`` ranks, weights replicated
                  (``cp`` with TP=1)
``metp``          METP: weights and sequence sharded over ``metp`` (× ``tp``)
``metp+vocab``    METP with the vocabulary split too (``--metp-vocab-parallel``,
                  ``megatron_metp.megatron.vocab.METPGPTModel``): word embedding and output
                  layer ``[V/(t·p), h]`` per rank, ``V`` padded to a multiple of ``128·t·p``;
                  the loss runs ``ops.metp_output_cross_entropy`` (logits ``[s/p·b, V/(t·p)]``
                  one shard at a time). ``--vocab-parallel`` plans mode ``metp`` this way.
================  ===========================================================================

Where the numbers come from. The *stock* layers (``tp``, ``tp-sp``) follow Korthikanti et al.
(2022), "Reducing Activation Recomputation in Large Transformer Models" (bytes per layer, 16-bit:
``sbh(10 + 24/t + 5as/(ht))`` for TP, ``sbh(34/t + 5as/(ht))`` for TP+SP, see DESIGN.md §1/§4),
with the terms that megatron-core 0.16.1 actually keeps without dropout enumerated tensor by
tensor (no dropout masks; bf16 softmax output ``2as²b/t`` without a flash kernel; RoPE's rotated
q/k copies and cos/sin tables; the flash kernel's fp32 log-sum-exp). The *METP and ring* terms are
the buffers the ops keep and allocate, as their docstrings (``megatron_metp/ops/*.py``) and the
benchmarks (``benchmarks/mlp_memory.py``, ``benchmarks/attention_memory.py``) measure them:
a METP layer stores its input, the two LayerNorm inputs/outputs, every head group's attention
output and its fp32 log-sum-exp (and, with ``keep_intermediate``, ``x·W1ᵀ`` of every MLP shard);
its backward adds the weight/gradient ring buffers, fp32 accumulators, one head group's
recomputed Q/K/V and the K/V ring's blocks. With the vocabulary split (``metp+vocab``) the loss
keeps only a fp32 log-sum-exp per token; its forward and its backward (which recomputes the
logits) hold one shard's ``[tokens, V/(t·p)]`` logits in fp32 and bf16 at a time, next to the two
bf16 weight-shard buffers in flight and the two fp32 weight-gradient sums travelling the ring
(``ops/cross_entropy.py``); the embedding's backward sums its table gradient on the ring the same
way (``ops/embedding.py``). Both tables are METP-sharded parameters: gradients reduced over pure
DP, so the distributed optimizer shards their Adam states over DP, like the layer weights.
``metp measure`` builds the real models under the fake process group and reports the measured
peak next to this plan; ``tests/test_plan.py`` keeps the two within 5 %.

Conventions: bytes; bf16 parameters and activations; Adam; no dropout (METP has no attention
dropout; every mode is planned without it); LayerNorm; RoPE; no linear biases; the vocabulary
padded to a multiple of 128·TP as Megatron-LM pads it (128·TP·METP with the vocabulary split);
tied embeddings unless the model is untied (the repo's 7B/13B are). Not modelled: CUDA context,
NCCL buffers, allocator fragmentation, kernel workspaces (``--reserve-gib``, default 2 GiB, is
held back for them).

Where a GPU run may differ from the plan (and from ``metp measure``, which the plan follows):
LayerNorm statistics are fp32 on a GPU (planned: 8 B per token and norm; CPU: bf16); Megatron's
gradient-accumulation fusion writes weight gradients straight into ``main_grad`` on a GPU, while
here a tied output layer's bf16 gradient waits for the embedding's backward (planned and
measured: ``V/t·h·2`` bytes more during the backward); flash kernels allocate a small workspace.
The NVLink bandwidth of the overlap thresholds holds within one node (≤ 8 GPUs); a ring that
crosses nodes is limited by the network instead.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

GiB = 2 ** 30
MiB = 2 ** 20
BF16, FP32 = 2, 4
MODES = ("tp", "tp-sp", "cp", "ring", "metp", "metp+vocab")
MODE_NAMES = {
    "tp": "stock TP",
    "tp-sp": "TP+SP",
    "cp": "context parallel (ring) + TP",
    "ring": "ring self-attention",
    "metp": "METP",
    "metp+vocab": "METP + vocabulary split",
}
#: the modes that the METP vocabulary split applies to (``--vocab-parallel``)
VOCAB_MODES = ("metp", "metp+vocab")


# ----------------------------------------------------------------------------- model geometry

@dataclass(frozen=True)
class Model:
    """Transformer geometry (GPT: LayerNorm, RoPE, no biases, GeLU unless ``swiglu``)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    query_groups: Optional[int] = None
    swiglu: bool = False
    tied: bool = True
    name: str = "custom"

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def with_seq(self, seq: int) -> "Model":
        return replace(self, seq=int(seq))


#: The repo's model geometries (``configs/models/*.sh``): gpt-1.3b is GPT-3 XL's shape (GeLU,
#: tied embeddings); gpt-7b is Llama-2-7B's (SwiGLU 11008, untied); gpt-13b has 28 layers of
#: hidden 6144 with 48 heads of 128 (SwiGLU 16384, untied) so that TP×METP = 16 divides the heads.
#: 32000-token vocabulary. The configs use RMSNorm for 7B/13B; the plan and the measurement use
#: LayerNorm everywhere (a fused GPU RMSNorm keeps the same input and one fp32 statistic instead
#: of two, a difference below 0.1 % of a layer's activations). ``seq`` is a default only.
PRESETS: Dict[str, Model] = {
    "gpt-1.3b": Model(name="gpt-1.3b", hidden=2048, layers=24, heads=16, ffn=8192, vocab=32000,
                      seq=32768),
    "gpt-7b": Model(name="gpt-7b", hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000,
                    seq=131072, swiglu=True, tied=False),
    "gpt-13b": Model(name="gpt-13b", hidden=6144, layers=28, heads=48, ffn=16384, vocab=32000,
                     seq=262144, swiglu=True, tied=False),
}

#: config keys → Model fields / Job fields (``--config`` files: key=value, YAML ``key: value``
#: or the repo's ``configs/*.sh`` with ``: "${KEY:=value}"`` lines and ``source`` of a model file)
_MODEL_KEYS = {
    "hidden": "hidden", "hidden_size": "hidden",
    "layers": "layers", "num_layers": "layers",
    "heads": "heads", "num_attention_heads": "heads", "num_heads": "heads",
    "query_groups": "query_groups", "num_query_groups": "query_groups",
    "ffn": "ffn", "ffn_hidden_size": "ffn",
    "vocab": "vocab", "vocab_size": "vocab", "padded_vocab_size": "vocab",
    "seq": "seq", "seq_length": "seq", "seq_len": "seq",
    "swiglu": "swiglu", "untie": "untie", "untie_embeddings": "untie",
    "untie_embeddings_and_output_weights": "untie", "tied": "tied",
}
_JOB_KEYS = {
    "tp": "tp", "tensor_model_parallel_size": "tp",
    "metp": "metp", "metp_parallel_size": "metp",
    "pp": "pp", "pipeline_model_parallel_size": "pp",
    "dp": "dp",
    "micro_batch": "micro_batch", "micro_batch_size": "micro_batch",
    "vocab_parallel": "vocab_parallel", "metp_vocab_parallel": "vocab_parallel",
}


def _coerce(v: str):
    v = v.strip().strip('"').strip("'")
    low = v.lower()
    if low in ("true", "yes", "on", "1") and low != "1":
        return True
    if low in ("false", "no", "off", "none", ""):
        return False if low != "none" else None
    try:
        return int(float(v)) if re.fullmatch(r"[0-9.eE+-]+", v) else v
    except ValueError:
        return v


def read_config(path: str, _seen: Optional[set] = None) -> Dict[str, object]:
    """Key/values of a config file: ``key=value`` / ``key: value`` lines (YAML-like, one level),
    ``export KEY=value``, and bash ``: "${KEY:=value}"`` defaults; ``source FILE`` lines (the repo's
    ``configs/*.sh`` source ``models/*.sh``) are followed relative to the file. Keys are lowered
    and ``-`` becomes ``_``; unknown keys are kept (and ignored by :func:`from_config`)."""
    _seen = _seen or set()
    path = os.path.abspath(path)
    if path in _seen:
        return {}
    _seen.add(path)
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    out: Dict[str, object] = {}
    base = os.path.dirname(path)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip() if not raw.strip().startswith("#") else ""
        if not line:
            continue
        m = re.match(r'^(?:source|\.)\s+(.+)$', line)
        if m:
            target = m.group(1).strip()
            for pat in ('$(dirname "${BASH_SOURCE[0]}")', "$(dirname ${BASH_SOURCE[0]})",
                        '$(dirname "$0")', "$(dirname $0)"):
                target = target.replace(pat, base)
            target = target.strip('"').strip("'")
            if not os.path.isabs(target):
                target = os.path.join(base, target)
            if os.path.isfile(target):
                out.update(read_config(target, _seen))
            continue
        for m in re.finditer(r'\$\{([A-Za-z_][A-Za-z0-9_]*):?=([^}]*)\}', line):
            out.setdefault(m.group(1).lower(), _coerce(m.group(2)))
        if line.startswith(":"):
            continue
        m = re.match(r'^(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*[:=]\s*(.*)$', line)
        if m and not m.group(2).startswith("="):
            out[m.group(1).lower().replace("-", "_")] = _coerce(m.group(2))
    return out


def from_config(path: str) -> Tuple[Dict[str, object], Dict[str, object]]:
    """``(model fields, job fields)`` found in a config file (see :func:`read_config`)."""
    kv = read_config(path)
    model, job = {}, {}
    for k, v in kv.items():
        if k in _MODEL_KEYS and v is not None:
            model[_MODEL_KEYS[k]] = v
        elif k in _JOB_KEYS and v is not None:
            job[_JOB_KEYS[k]] = v
    if "untie" in model:
        model["tied"] = not bool(model.pop("untie"))
    if "tied" in model:
        model["tied"] = bool(model["tied"])
    if model.get("swiglu") is not None:
        model["swiglu"] = bool(model["swiglu"])
    if "vocab_parallel" in job:
        job["vocab_parallel"] = bool(job["vocab_parallel"])
    return model, job


# ----------------------------------------------------------------------------- hardware

@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float     # device memory, the datasheet's figure
    bf16_tflops: float    # dense bf16 tensor-core peak, TFLOP/s
    link_gbps: float      # NVLink bandwidth per direction, GB/s (10^9 B/s)
    measured_tflops: Optional[float] = None  # a matmul rate measured by this project
    source: str = ""


#: Sources (public datasheets):
#: * A100-80GB (SXM): NVIDIA A100 Tensor Core GPU datasheet — BF16 tensor core 312 TFLOP/s dense
#:   (624 with sparsity), 80 GB HBM2e, NVLink 3 600 GB/s total = 300 GB/s per direction.
#: * H100-80GB (SXM5): NVIDIA H100 Tensor Core GPU datasheet — BF16 tensor core 1,979 TFLOP/s
#:   *with sparsity*, i.e. 989 TFLOP/s dense; 80 GB HBM3; NVLink 4 900 GB/s total = 450 GB/s per
#:   direction.
#: * H200-141GB (SXM): NVIDIA H200 Tensor Core GPU datasheet — same compute as H100 SXM
#:   (989 TFLOP/s dense bf16), 141 GB HBM3e, NVLink 900 GB/s total = 450 GB/s per direction.
#:   Measured here (DESIGN.md §4, one H200, 2026-11-30): bf16 matmul 708 TFLOP/s.
HARDWARE: Dict[str, Hardware] = {
    "A100-80GB": Hardware("A100-80GB", 80, 312, 300,
                          source="NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, NVLink3 "
                                 "600 GB/s total (300 per direction), 80 GB"),
    "H100-80GB": Hardware("H100-80GB", 80, 989, 450,
                          source="NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense (1979 "
                                 "sparse), NVLink4 900 GB/s total (450 per direction), 80 GB"),
    "H200-141GB": Hardware("H200-141GB", 141, 989, 450, measured_tflops=708,
                           source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, NVLink "
                                  "900 GB/s total (450 per direction), 141 GB; measured bf16 "
                                  "matmul 708 TFLOP/s (DESIGN.md §4)"),
}


# ----------------------------------------------------------------------------- the job

@dataclass(frozen=True)
class Job:
    """Parallel sizes and training choices (see the module docstring for the modes)."""

    tp: int = 1
    metp: int = 8
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    microbatches: int = 0          # per step; 0 = enough to fill the pipeline (≥ pp)
    kernel: str = "flash"          # "flash" or "unfused"
    keep_intermediate: bool = False  # METP MLP: keep x·W1ᵀ instead of recomputing it
    distributed_optimizer: bool = False
    vocab_parallel: bool = False   # METP only: word embedding + output layer split over TP×METP
    precision: str = "bf16"
    hardware: str = "H100-80GB"
    reserve_gib: float = 2.0

    @property
    def width(self) -> int:
        return self.tp * self.metp

    @property
    def inflight(self) -> int:
        """Micro-batches whose activations the first pipeline stage holds at once (1F1B)."""
        if self.pp == 1:
            return 1
        return min(self.pp, self.microbatches) if self.microbatches else self.pp


@dataclass(frozen=True)
class Layout:
    """How one mode uses the ``W`` GPUs: TP size ``t``, sequence-sharding size ``c``, SP, and the
    number of shards of each transformer-layer weight."""

    mode: str
    t: int
    c: int
    sp: bool
    weight_shards: int
    vocab: bool = False  # word embedding / output layer split over t·c (METP vocabulary)

    @property
    def vocab_shards(self) -> int:
        """Shards of each vocabulary table: ``t·c`` with the METP split, else TP's ``t``."""
        return self.t * self.c if self.vocab else self.t

    def describe(self) -> str:
        if self.mode in ("tp", "tp-sp"):
            return f"TP={self.t}" + ("+SP" if self.sp else "")
        if self.mode in VOCAB_MODES:
            return f"METP={self.c}" + (f"×TP={self.t}" if self.t > 1 else "") + \
                ("+vocab" if self.vocab else "")
        if self.mode == "ring":
            return f"ring={self.c}"
        return f"TP={self.t}{'+SP' if self.sp else ''}×CP={self.c}"


def layout(mode: str, job: Job) -> Layout:
    W = job.width
    if mode == "tp":
        return Layout(mode, W, 1, False, W)
    if mode == "tp-sp":
        return Layout(mode, W, 1, W > 1, W)
    if mode == "cp":
        return Layout(mode, job.tp, job.metp, job.tp > 1, job.tp)
    if mode == "ring":
        return Layout(mode, 1, W, False, 1)
    if mode in VOCAB_MODES:
        return Layout(mode, job.tp, job.metp, False, W,
                      vocab=mode == "metp+vocab" or job.vocab_parallel)
    raise ValueError(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")


def canonical(mode: str, job: Job) -> Tuple[str, Job]:
    """``("metp+vocab", job)`` → ``("metp", job with vocab_parallel)``; other modes unchanged."""
    if mode == "metp+vocab":
        return "metp", replace(job, vocab_parallel=True)
    return mode, job


def padded_vocab(vocab: int, t: int, multiple: int = 128) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by (128) × TP``."""
    m = multiple * t
    return -(-vocab // m) * m


def validate(model: Model, job: Job, modes: Sequence[str] = MODES) -> None:
    """``ValueError`` naming the flag for sizes that cannot be laid out."""
    for flag, v in (("--hidden", model.hidden), ("--layers", model.layers),
                    ("--heads", model.heads), ("--ffn", model.ffn), ("--vocab", model.vocab),
                    ("--seq", model.seq), ("--query-groups", model.groups), ("--tp", job.tp),
                    ("--metp", job.metp), ("--pp", job.pp), ("--dp", job.dp),
                    ("--micro-batch", job.micro_batch)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if job.microbatches < 0:
        raise ValueError(f"--microbatches must be >= 0, got {job.microbatches}")
    if model.hidden % model.heads:
        raise ValueError(f"--hidden {model.hidden} is not divisible by --heads {model.heads}")
    if model.heads % model.groups:
        raise ValueError(f"--heads {model.heads} is not divisible by --query-groups "
                         f"{model.groups}")
    if model.layers % job.pp:
        raise ValueError(f"--layers {model.layers} is not divisible by --pp {job.pp}")
    if job.kernel not in ("flash", "unfused"):
        raise ValueError(f"--kernel must be 'flash' or 'unfused', got {job.kernel!r}")
    if job.precision != "bf16":
        raise ValueError(f"--precision {job.precision!r}: only bf16 is planned")
    if job.hardware not in HARDWARE:
        raise ValueError(f"--hardware {job.hardware!r}: choose from {', '.join(HARDWARE)}")
    if job.vocab_parallel:
        other = [m for m in modes if m not in VOCAB_MODES]
        if other:
            raise ValueError(f"--vocab-parallel splits METP's word embedding and output layer "
                             f"over TP×METP: it applies to mode metp only, not to "
                             f"{', '.join(other)}; drop --vocab-parallel, or pass --modes metp "
                             f"(mode metp+vocab plans the split next to the other modes)")
    for mode in modes:
        lay = layout(mode, job)
        mode = canonical(mode, job)[0]
        if lay.weight_shards == 1:
            shards_flag = "1"
        elif mode == "cp" or job.metp == 1:
            shards_flag = "--tp"
        elif job.tp > 1 and lay.weight_shards == job.width:
            shards_flag = "--tp × --metp"
        else:
            shards_flag = "--metp"
        if mode == "cp" and job.metp == 1:
            raise ValueError("--metp 1: context parallelism (mode cp) needs --metp > 1 "
                             "(it is the CP size); drop cp from --modes")
        for flag, count in (("--heads", model.heads), ("--query-groups", model.groups),
                            ("--ffn", model.ffn)):
            if count % lay.weight_shards:
                raise ValueError(f"{flag} {count} is not divisible by {shards_flag} = "
                                 f"{lay.weight_shards} (mode {mode}: {lay.describe()})")
        if lay.c > 1 and model.seq % (2 * lay.c):
            flag = "--metp" if mode in ("metp", "cp") else "--tp × --metp"
            raise ValueError(f"--seq {model.seq} is not divisible by 2 × {flag} = {2 * lay.c} "
                             f"(mode {mode} splits the sequence into 2·{lay.c} chunks)")
        if lay.sp and (model.seq // lay.c) % lay.t:
            raise ValueError(f"--seq {model.seq} is not divisible by the SP size --tp "
                             f"{'× --metp ' if mode == 'tp-sp' else ''}= {lay.t * lay.c} "
                             f"(mode {mode})")


# ----------------------------------------------------------------------------- parameters

def _layer_weights(model: Model) -> Tuple[int, int, int]:
    """``(attention matrices, MLP matrices, norms)`` elements of one layer (no biases)."""
    h, d = model.hidden, model.head_dim
    hq, hk = model.heads * d, model.groups * d
    k = 2 if model.swiglu else 1
    attn = h * (hq + 2 * hk) + hq * h
    mlp = k * model.ffn * h + model.ffn * h
    norms = 2 * 2 * h  # two LayerNorms, weight and bias
    return attn, mlp, norms


@dataclass
class Params:
    layer_sharded: int     # elements of METP/TP-sharded layer matrices on this rank
    layer_replicated: int  # norms (and, for ring/cp, matrices replicated over the ring)
    embedding: int         # word embedding (+ output layer when untied), on this rank
    final_norm: int
    dp_sharded: int        # data-parallel size over which the distributed optimizer shards
    dp_replicated: int
    embedding_sharded: bool = False  # METP vocabulary split: the tables reduce over dp_sharded

    @property
    def total(self) -> int:
        return self.layer_sharded + self.layer_replicated + self.embedding + self.final_norm

    @property
    def sharded(self) -> int:
        """Elements whose gradients are reduced over ``dp_sharded`` (METP-sharded ones)."""
        return self.layer_sharded + (self.embedding if self.embedding_sharded else 0)


def params(model: Model, job: Job, mode: str, stage: str = "first") -> Params:
    """Parameter elements held by one rank of ``stage`` ("first" or "last" pipeline stage)."""
    mode, job = canonical(mode, job)
    lay = layout(mode, job)
    attn, mlp, norms = _layer_weights(model)
    L = model.layers // job.pp
    V = padded_vocab(model.vocab, lay.vocab_shards)
    emb = 0
    first = stage == "first" or job.pp == 1
    last = stage == "last" or job.pp == 1
    if first:
        emb += V * model.hidden // lay.vocab_shards
    if last and (not model.tied or job.pp > 1):
        emb += V * model.hidden // lay.vocab_shards
    final = 2 * model.hidden if last else 0
    if mode == "metp":
        sharded, repl = L * (attn + mlp) // lay.weight_shards, L * norms
        dp_sh, dp_rep = job.dp, job.dp * lay.c
    elif mode in ("tp", "tp-sp"):
        sharded, repl = L * (attn + mlp) // lay.t, L * norms
        dp_sh = dp_rep = job.dp
    else:  # ring, cp: TP shards, replicated over the ring; DP×CP reduces them
        sharded, repl = L * (attn + mlp) // lay.t, L * norms
        dp_sh = dp_rep = job.dp * lay.c
    return Params(sharded, repl, emb, final, dp_sh, dp_rep, embedding_sharded=lay.vocab)


def static_memory(model: Model, job: Job, mode: str, stage: str = "first") -> Dict[str, float]:
    """Parameters (bf16), gradient buffer (fp32 main_grad), Adam states (fp32 master + 2 moments)
    without and with the distributed optimizer (sharded over the DP group that reduces each
    parameter: pure DP for METP-sharded weights — with the vocabulary split also METP's word
    embedding and output layer — DP×ring for parameters replicated over a ring)."""
    mode, job = canonical(mode, job)
    p = params(model, job, mode, stage)
    sharded = p.sharded
    repl = p.total - sharded
    opt_plain = 12 * p.total
    if mode == "metp":
        opt_dist = 12 * sharded / p.dp_sharded + 12 * repl / p.dp_replicated
    else:
        opt_dist = 12 * p.total / p.dp_sharded
    return {"n_params": p.total, "params": BF16 * p.total, "grads": FP32 * p.total,
            "optimizer": opt_dist if job.distributed_optimizer else opt_plain,
            "optimizer_plain": opt_plain, "optimizer_distributed": opt_dist}


# ----------------------------------------------------------------------------- activations

@dataclass
class Activations:
    """Activation bytes of one rank (one micro-batch unless said otherwise)."""

    stored_layer: Dict[str, float]     # kept for backward by one layer
    head: Dict[str, float]             # kept outside the layers (rope table, final norm, logits)
    phases: Dict[str, Dict[str, float]]  # transient terms of each phase (relative to all stored)
    persistent: float                  # Megatron's persistent "mpu" buffer (bf16)
    layers: int                        # layers on the rank
    inflight: int                      # micro-batches in flight on the rank
    korthikanti_layer: Optional[float] = None  # the paper's formula, for stock modes

    @property
    def stored_per_layer(self) -> float:
        return sum(self.stored_layer.values())

    @property
    def stored(self) -> float:
        """Everything the forward passes leave for the backward (all layers, all in flight;
        the RoPE table is computed once and shared)."""
        rope = self.head.get("RoPE angle table (fp32)", 0)
        return self.inflight * (self.layers * self.stored_per_layer + sum(self.head.values())
                                - rope) + rope

    def phase_totals(self) -> Dict[str, float]:
        return {k: sum(v.values()) for k, v in self.phases.items()}

    @property
    def transient(self) -> float:
        return max(self.phase_totals().values())

    @property
    def peak_phase(self) -> str:
        tot = self.phase_totals()
        return max(tot, key=tot.get)

    @property
    def peak(self) -> float:
        return self.stored + self.persistent + self.transient

    @property
    def forward_peak(self) -> float:
        """The largest total during the forward passes (phases named ``forward``)."""
        fwd = [v for k, v in self.phase_totals().items() if "forward" in k]
        return self.stored + self.persistent + max(fwd + [0.0])


def activations(model: Model, job: Job, mode: str, seq: Optional[int] = None,
                stage: str = "first") -> Activations:
    """Activation memory of a rank of the first pipeline stage (rank 0; with PP=1 it is also
    the last) or, with ``stage="last"``, of the last stage (output layer and loss, one
    micro-batch in flight under 1F1B)."""
    mode, job = canonical(mode, job)
    s = model.seq if seq is None else int(seq)
    lay = layout(mode, job)
    t, c = lay.t, lay.c
    b = job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hq, hk = A * d, G * d
    gqa = G < A
    k = 2 if model.swiglu else 1
    T = s * b
    n = T // c                       # tokens through this rank's attention / MLP
    nl = n // t if lay.sp else n     # tokens of the norms / residual stream on this rank
    vocab = lay.vocab
    V = padded_vocab(model.vocab, lay.vocab_shards)
    Vr = V // lay.vocab_shards       # rows of each vocabulary table on this rank
    L = model.layers // job.pp
    last = job.pp == 1 or stage == "last"   # holds the output layer and the loss
    first = job.pp == 1 or stage == "first"  # holds the embedding
    flash = job.kernel == "flash"
    ln = {"norm inputs (2 LayerNorms)": 2 * BF16 * nl * h,
          "norm outputs (2 LayerNorms)": 2 * BF16 * nl * h,
          "norm statistics (fp32)": 2 * 8 * nl}
    S: Dict[str, float] = dict(ln)
    X: Dict[str, Dict[str, float]] = {}
    persistent = 0.0
    kor = None
    dy = BF16 * nl * h  # the gradient arriving at a block

    if mode == "metp":
        hqt, At = hq // t, A // t
        S["attention outputs, every head group (bf16)"] = BF16 * n * hqt
        S["attention log-sum-exp (fp32)"] = FP32 * n * At
        if job.keep_intermediate:
            S["MLP x·W1ᵀ of every shard (keep_intermediate)"] = BF16 * n * k * F // t
        X = _metp_phases(model, job, lay, n, S)
    else:
        stock_core = mode in ("tp", "tp-sp")
        hqt, hkt, At = hq // t, hk // t, A // t
        S["RoPE cos/sin for q and k (bf16)"] = 4 * BF16 * (s // c) * d  # [s/c, 1, 1, d]
        if stock_core:
            if not gqa:  # v is a view of it; with GQA v is repeated and the output freed
                S["QKV projection output (bf16)"] = BF16 * n * (hq + 2 * hk) // t
            if gqa:
                S["rotated q (bf16)"] = BF16 * n * hqt
                S["k, v repeated to the query heads (bf16)"] = 2 * BF16 * n * hqt
            else:
                S["rotated q, k (bf16)"] = BF16 * n * (hqt + hkt)
            if flash:
                S["flash output = proj input (bf16)"] = BF16 * n * hqt
                S["flash log-sum-exp (fp32)"] = FP32 * n * At
            else:
                S["softmax output [b, a/t, s, s] (bf16)"] = BF16 * b * At * s * s
                S["causal mask [s, s] (bool)"] = s * s
                S["attention context = proj input (bf16)"] = BF16 * n * hqt
                persistent = BF16 * b * At * s * s
            if lay.sp:
                persistent = max(persistent, BF16 * n * h)
        else:  # ring core: heads-first q, k, v, output, lse; the proj input is a seq-first copy
            S["ring core q, k, v heads-first (bf16)"] = BF16 * n * (hqt + 2 * hkt)
            S["ring core output heads-first (bf16)"] = BF16 * n * hqt
            S["ring core log-sum-exp (fp32)"] = FP32 * n * At
            S["proj input, seq-first copy (bf16)"] = BF16 * n * hqt
            if lay.sp:
                persistent = BF16 * n * h
        if model.swiglu:
            S["MLP fc1 output, gate|up (bf16)"] = BF16 * n * 2 * F // t
            # megatron-core 0.16's glu: silu(gate) * (up + glu_linear_offset): the sum is a copy
            S["MLP silu(gate), up + offset, product (bf16)"] = 3 * BF16 * n * F // t
        else:
            S["MLP fc1 output (bf16)"] = BF16 * n * F // t
            S["MLP GeLU output (bf16)"] = BF16 * n * F // t
        if stock_core:
            sbh = s * b * h
            kor = (sbh * (10 + 24 / t) if not lay.sp else sbh * 34 / t) + \
                (5 * A * s * s * b / t if not flash else 0)
        X = _stock_phases(model, job, lay, n, nl, S, stock_core)

    head: Dict[str, float] = {}
    head["RoPE angle table (fp32)"] = FP32 * (s // c) * d
    if last:
        head["final norm input + output (bf16)"] = 2 * BF16 * nl * h
        head["final norm statistics (fp32)"] = 8 * nl
        if vocab:
            head["loss: log-sum-exp and per-token loss [tokens] (fp32)"] = 2 * FP32 * n
        else:
            head["loss: fp32 logits / softmax [tokens, V/t]"] = FP32 * n * Vr
            head["loss: targets and masks"] = 21 * n
    inflight = job.inflight if first else 1
    phases: Dict[str, Dict[str, float]] = {}
    if last and vocab:
        phases.update(vocab_loss_phases(n, h, Vr, lay.c, b))
    elif last:
        phases["loss (forward): bf16 logits"] = {"bf16 logits [tokens, V/t]": BF16 * n * Vr}
        phases["output layer (backward)"] = {
            "(fp32 logits freed)": -FP32 * n * Vr,
            "bf16 logits gradient": BF16 * n * Vr,
            "output-layer input gradient (bf16)": BF16 * n * h,
            "output-layer weight gradient (bf16)": BF16 * Vr * h}
        if lay.sp:
            phases["output layer (backward)"]["SP reduce-scatter of the input gradient"] = \
                BF16 * nl * h
    head_gone = {"(head activations freed)": -(sum(head.values())
                                               - head["RoPE angle table (fp32)"])}
    for name, items in X.items():
        ph = dict(head_gone) if last else {}
        if "forward" not in name:
            ph["incoming gradient [tokens, h] (bf16)"] = dy
            if last and model.tied:
                # autograd sums the tied weight's two gradients before accumulating them, so the
                # output layer's bf16 dW waits for the embedding's backward (Megatron's
                # gradient-accumulation fusion on GPU writes it to main_grad instead)
                ph["tied output-layer weight gradient, held (bf16)"] = BF16 * Vr * h
        ph.update(items)
        phases[name] = ph
    if not last:
        phases = {k: {kk: vv for kk, vv in v.items() if kk != "(head activations freed)"}
                  for k, v in phases.items()}
        # the gradient received from the next stage stays referenced by the schedule while
        # the stage runs backward (it is the incoming gradient of the last MLP itself)
        for k_, v_ in phases.items():
            if "backward" in k_ and not k_.startswith("MLP"):
                v_["gradient received from the next stage, held (bf16)"] = dy
    # the embedding's backward (first stage): one micro-batch's activations are gone; the
    # embedding's bf16 weight gradient, and with tied weights the output layer's gradient
    # held until now and their sum
    emb = {"(this micro-batch's activations freed)":
           -(L * sum(S.values()) + sum(head.values()) - head["RoPE angle table (fp32)"])}
    if vocab:
        emb["incoming gradient [tokens, h] (bf16)"] = BF16 * n * h
        if not last:
            emb["gradient received from the next stage, held (bf16)"] = dy
        emb.update(vocab_embedding_backward(n, h, Vr, lay.c))
    else:
        emb["embedding weight gradient (bf16)"] = BF16 * Vr * h
    if last and model.tied:
        emb["tied output-layer weight gradient, held (bf16)"] = BF16 * Vr * h
        emb["sum of the two (bf16)"] = BF16 * Vr * h
    if first:
        phases["embedding (backward)"] = emb
    if first and vocab:
        # the ring lookup of the last micro-batch in flight: its output (the first layer's
        # stored input) is formed, the rest of its activations not yet
        phases["embedding (forward)"] = {
            "(this micro-batch's activations not formed yet)":
                emb["(this micro-batch's activations freed)"] + BF16 * n * h,
            **vocab_embedding_forward(n, h, Vr, lay.c)}
    return Activations(stored_layer=S, head=head, phases=phases, persistent=persistent,
                       layers=L, inflight=inflight, korthikanti_layer=kor)


def vocab_loss_phases(n: int, h: int, v: int, p: int, b: int = 1) -> Dict[str, Dict[str, float]]:
    """Transients of ``ops.metp_output_cross_entropy`` (``n`` tokens of this rank, ``b`` folded
    in; a ``[v, h]`` output-layer shard, ``v = V/(t·p)``; a ring of ``p``), at each pass's
    largest step.

    Forward: the bf16 weight-shard buffers in flight (a clone of the own shard and the receive
    buffer, ``p > 1``), the running max / sum / target logit ``[n]`` fp32, and one shard's logits
    ``X·W_jᵀ`` in bf16 with their fp32 copy (``.float()``; exp and the shift run in place; the
    op releases each block before forming the next).
    Backward (the logits recomputed): the fp32 ``dX`` accumulator ``[n, h]``, two bf16 weight
    buffers and the weight-gradient sum's two fp32 buffers travelling the ring (one with
    ``p = 1``), and per shard the largest of: bf16 logits + their fp32 softmax; fp32 ``dZ`` + its
    bf16 copy; bf16 ``dZ`` + the fp32 product of ``dX += dZ·W_j`` ``[n, h]`` or of
    ``dW_j += dZᵀ·X`` ``[v, h]`` (``mm_acc``'s CUDA branch). At the end the fp32 ``dX`` and
    ``dW`` with their bf16 copies (the ring buffers and the second sum are gone by then)."""
    ring = p > 1
    logits = (BF16 + FP32) * n * v
    fwd = {"(log-sum-exp and loss not formed yet)": -2 * FP32 * n,
           "running max, sum, target logit [tokens] (fp32)": 3 * FP32 * n,
           "one shard's logits [tokens, V/(t·p)]: bf16 product + fp32 copy": logits}
    if b > 1:
        fwd["labels in token order (int64)"] = 8 * n
    if ring:
        fwd["output-layer shards in flight: own copy + received (bf16)"] = 2 * BF16 * v * h
    common = {"dX accumulator (fp32)": FP32 * n * h, "loss gradient [tokens] (fp32)": FP32 * n}
    if ring:
        common["output-layer shards in flight: own copy + held (bf16)"] = 2 * BF16 * v * h
        common["weight-gradient sum: two travelling buffers (fp32)"] = 2 * FP32 * v * h
    else:
        common["weight-gradient sum (fp32)"] = FP32 * v * h
    step = max(logits, BF16 * n * v + FP32 * max(n, v) * h)
    bwd = dict(common, **{"one shard's logits / dZ (fp32 + bf16), or bf16 dZ + an fp32 product":
                          step})
    end = {"dX (fp32) and its bf16 copy": (FP32 + BF16) * n * h,
           "dW (fp32 sum) and its bf16 copy": (FP32 + BF16) * v * h}
    if sum(end.values()) > sum(bwd.values()):
        bwd = end
    return {"loss (forward): one vocab shard's logits": fwd,
            "output layer + loss (backward): vocab ring": bwd}


def vocab_embedding_forward(n: int, h: int, v: int, p: int) -> Dict[str, float]:
    """Forward of ``ops.metp_embedding`` besides its output: the table shards in flight (a
    clone of the own shard and the receive buffer, bf16, ``p > 1``) and one step's looked-up
    rows ``[n, h]`` (bf16) with the clamped row ids (int64) and masks."""
    out = {"one shard's looked-up rows [tokens, h] (bf16)": BF16 * n * h,
           "row ids (int64) and masks (bool) of one shard": 10 * n}
    if p > 1:
        out["table shards in flight: own copy + received (bf16)"] = 2 * BF16 * v * h
    return out


def vocab_embedding_backward(n: int, h: int, v: int, p: int) -> Dict[str, float]:
    """Backward of ``ops.metp_embedding`` (``[v, h]`` table shard, ring of ``p``): the incoming
    gradient in fp32, the table-gradient sum travelling the ring (two fp32 buffers, one with
    ``p = 1``), and either a step's masked gradient rows (fp32 ``[n, h]``) or, at the end, the
    bf16 copy of the complete sum (the table's gradient)."""
    out = {"incoming gradient in fp32 [tokens, h]": FP32 * n * h,
           "table-gradient sum: travelling buffers (fp32)": (2 if p > 1 else 1) * FP32 * v * h}
    step = max(FP32 * n * h, BF16 * v * h)
    out["masked gradient rows (fp32), or the bf16 table gradient at the end"] = step
    return out


def _mlp_part(S: Dict[str, float]) -> float:
    return sum(v for k, v in S.items() if k.startswith("MLP"))


def _stock_phases(model, job, lay, n, nl, S, stock_core) -> Dict[str, Dict[str, float]]:
    """Backward transients of the last layer of a stock-layer mode (Megatron linears)."""
    t = lay.t
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hq, hk = A * d, G * d
    hqt, hkt, At = hq // t, hk // t, A // t
    b = job.micro_batch
    s = n * lay.c // b
    gather = BF16 * n * h if lay.sp else 0  # SP: the gradient all-gathered to all tokens
    mlp_saved = _mlp_part(S)
    half_ln = (S["norm inputs (2 LayerNorms)"] + S["norm outputs (2 LayerNorms)"]
               + S["norm statistics (fp32)"]) / 2
    ph: Dict[str, Dict[str, float]] = {}
    # MLP backward, step by step (each step's buffers; the largest step counts):
    # fc2: dA = dy·W2 (+ SP: dy all-gathered) and dW2; activation: dZ while dA is alive and the
    # activation output (saved for fc2) is gone; fc1: dX (+ SP reduce-scatter) and dW1.
    dA = BF16 * n * F // t
    dW2 = BF16 * h * F // t
    if model.swiglu:
        act_step = {"d(fc2 input), d(silu), d(up) (bf16)": 3 * dA, "(product freed)": -dA}
    else:
        act_step = {"d(GeLU output), d(fc1 output) (bf16)": 2 * dA, "(GeLU output freed)": -dA}
    steps = [dict({"d(fc2 input) (bf16)": dA, "dW2 (bf16)": dW2},
                  **({"SP gradient all-gather (bf16)": gather} if gather else {})),
             act_step]
    ph["MLP backward (last layer)"] = max(steps, key=lambda d_: sum(d_.values()))
    # attention backward (after the MLP and its norm are done): linear_proj, core, QKV
    base = {"(MLP and second-norm activations freed)": -(mlp_saved + half_ln)}
    dproj = BF16 * n * hqt
    proj_step = dict({"d(proj input) (bf16)": dproj, "dW_proj (bf16)": BF16 * h * hqt},
                     **({"SP gradient all-gather (bf16)": gather} if gather else {}))
    if stock_core:
        if job.kernel == "flash":
            core = {"d(proj input) (bf16)": dproj,
                    "flash backward dq, dk, dv (bf16)": 3 * BF16 * n * hqt}
        else:
            core = {"d(context) (bf16)": dproj,
                    "d(probs), d(masked scores), d(scores) [b, a/t, s, s] (bf16)":
                    3 * BF16 * b * At * s * s}
    else:
        core = _ring_core_bwd(job, n, lay.c, hqt, hkt, At)
        base["(proj input freed)"] = -S["proj input, seq-first copy (bf16)"]
    step = max([proj_step, core], key=lambda d_: sum(d_.values()))
    ph["attention backward (last layer)"] = dict(base, **step)
    # end of the last layer's forward: the MLP output (before TP's all-reduce / SP's
    # reduce-scatter) and the layer output (the next stage's input, or the final norm's)
    ph["MLP forward (last layer)"] = dict(
        {"fc2 output before the TP reduction (bf16)": BF16 * n * h,
         "layer output (bf16)": BF16 * nl * h},
        **({"SP reduce-scatter output (bf16)": BF16 * nl * h} if lay.sp else {}))
    # attention forward of the last layer, where it holds more than its stored activations
    later = mlp_saved + half_ln
    if stock_core and job.kernel == "unfused":
        ph["attention forward (last layer)"] = {
            "(rest of the last layer not formed yet)":
                -(later + S["attention context = proj input (bf16)"]),
            "scores [b, a/t, s, s] before the softmax (bf16)": BF16 * b * At * s * s}
    elif not stock_core:
        fwd = {"(rest of the last layer not formed yet)":
               -(later + S["proj input, seq-first copy (bf16)"]
                 + S["ring core output heads-first (bf16)"] + S["ring core log-sum-exp (fp32)"]),
               "QKV output and rotated q, k held by the caller (bf16)":
                   BF16 * n * ((hqt + 2 * hkt) + (hqt + hkt))}
        fwd.update(ring_forward_buffers(n, hqt, hkt, At, lay.c, job))
        ph["attention forward (last layer)"] = fwd
    return ph


def _ring_core_bwd(job, n, p, hqt, hkt, At) -> Dict[str, float]:
    """The ring core's backward (``METPRingCoreAttention`` → ``ring_attention``): d(proj input),
    the heads-first copy of the output gradient, and ``ring_attention_backward``'s buffers."""
    out = {"d(proj input) (bf16)": BF16 * n * hqt,
           "dout heads-first (bf16)": BF16 * n * hqt}
    out.update(ring_backward_buffers(n, hqt, hkt, At, p, job))
    return out


def ring_forward_buffers(n, hq, hk, A, p, job) -> Dict[str, float]:
    """Buffers of ``ops.ring_attention.ring_attention_forward`` at its largest step (rank 0's
    diagonal block): fp32 output and log-sum-exp accumulators, the K/V ring's packed and
    received blocks, and the block kernel's output with the merge's fp32 temporaries (flash), or
    the reference kernel's three fp32 score blocks (scores, minus lse, exp)."""
    b = job.micro_batch
    out = {"output accumulator (fp32)": FP32 * n * hq,
           "log-sum-exp accumulator (fp32)": FP32 * n * A}
    if p > 1:
        out["K/V ring: own packed + received block (bf16)"] = 2 * BF16 * 2 * n * hk
    if hk < hq:
        out["K/V expanded to the query heads (bf16)"] = 2 * BF16 * n * hq
    if job.kernel == "flash":
        out["block output (bf16) + lse (fp32)"] = BF16 * n * hq + FP32 * n * A
        out["merge: fp32 copy of the block output and its weighted copy"] = 2 * FP32 * n * hq
    else:
        out["reference kernel: scores, scores − lse, exp blocks (fp32)"] = \
            3 * FP32 * b * A * (n // b) ** 2
    return out


def ring_backward_buffers(n, hq, hk, A, p, job) -> Dict[str, float]:
    """Buffers of ``ops.ring_attention.ring_attention_backward`` for ``n`` local tokens (``b``
    folded in) of ``hq``/``hk`` query/key widths and ``A`` heads, at its largest step on rank 0.

    Alive throughout: the fp32 ``dq`` accumulator; with ``p > 1`` this rank's packed K/V block
    and the block held (bf16), and the travelling dK/dV sum's buffers (fp32; the second one from
    the first hand-on). Rank 0's steps: first the block of rank ``p−1`` (dual-chunk: the second
    half of the queries against all keys, so the kernel gets contiguous copies of the query,
    output and output-gradient halves), then ``p−2`` … 1 (the same shape, both sum buffers
    alive), then its own diagonal block (all × all, causal, both buffers). GQA: the block kernel
    expands K/V to the query heads and folds dK/dV back.
    """
    b = job.micro_batch
    gqa = hk < hq
    kv = 2 * n * hk
    ts = FP32 * kv
    base = {"dq accumulator (fp32)": FP32 * n * hq}
    if p > 1:
        base["K/V ring: own packed + held block (bf16)"] = 2 * BF16 * kv
    flash = job.kernel == "flash"

    def kernel(nq, nk, copies_q):
        if flash:
            d = {"block kernel dq, dk, dv (bf16)": BF16 * (nq * hq + 2 * nk * hq)}
            if copies_q:
                d["contiguous q, out, dout halves (bf16) + lse (fp32)"] = \
                    3 * BF16 * nq * hq + FP32 * nq * A
        else:
            blk = b * A * (nq // b) * (nk // b)
            d = {"reference kernel: scores, P, dP, dS blocks (fp32)": 4 * FP32 * blk,
                 "reference kernel: fp32 q, k, v, dout copies": FP32 * (2 * nq * hq + 2 * nk * hq),
                 "reference kernel: dv (fp32)": FP32 * nk * hq}
        if gqa:
            d["K/V expanded to the query heads, dK/dV folded (bf16)"] = \
                BF16 * (2 * nk * hq + 2 * nk * hk)
        return d

    steps = []
    diag = dict(base, **kernel(n, n, False))
    diag["dK/dV travelling sum (fp32)"] = (2 if p > 1 else 1) * ts
    steps.append(diag)
    if p > 1:
        off = dict(base, **kernel(n // 2, n, True))
        off["dK/dV travelling sum (fp32)"] = (2 if p > 2 else 1) * ts
        steps.append(off)
    return max(steps, key=lambda d_: sum(d_.values()))


def _metp_phases(model, job, lay, n, S) -> Dict[str, Dict[str, float]]:
    """Backward transients of the last METP layer: the buffers ``ops/mlp.py`` and
    ``ops/attention.py`` allocate (see their docstrings and ``benchmarks/mlp_memory.py``'s
    ``metp_peak_model``), at each op's largest step. The ops' fp32-accumulating matmuls are taken
    on their CUDA branch (one fp32 product the size of the result)."""
    t, p = lay.t, lay.c
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hq, hk = A * d, G * d
    k = 2 if model.swiglu else 1
    sh = t * p
    f = F // sh                        # FFN units of one MLP shard
    hqg, hkg, Ag = hq // sh, hk // sh, A // sh  # one head group's widths
    Wm = k * f * h + h * f             # one MLP shard, elements
    Wa = (hqg + 2 * hkg) * h + h * hqg  # one head group's weights, elements
    ph: Dict[str, Dict[str, float]] = {}
    dxacc = {"dx accumulator (fp32)": FP32 * n * h}

    # MLP: weight ring (own packed + held, bf16), travelling gradient sum (two fp32 buffers),
    # then one shard's z (recomputed unless kept), f(z), d(f(z)), dz and an fp32 product.
    z = 0 if job.keep_intermediate else BF16 * n * k * f
    a = BF16 * n * f
    dz = BF16 * n * k * f
    halves = 2 * BF16 * n * f if model.swiglu else 0
    ring = ({"MLP weight ring: own packed + held shard (bf16)": 2 * BF16 * Wm,
             "MLP gradient sum: two travelling buffers (fp32)": 2 * FP32 * Wm}
            if p > 1 else {"MLP gradient sum (fp32)": FP32 * Wm})
    steps = [z + a + a + halves + dz,
             z + a + dz + FP32 * n * h,
             z + a + dz + FP32 * k * f * h,
             z + a + dz + FP32 * h * f]
    ph["MLP backward (last layer)"] = dict(dxacc, **ring, **{
        "one shard's z, f(z), dz and an fp32 product": max(steps)})

    # attention: head-group loop; per group recompute q, k, v, run the K/V ring backward, then
    # RoPE-transpose and join dq, dk, dv, and accumulate dW and dx in fp32
    base = {"(MLP and second-norm activations freed)":
            -(S["norm inputs (2 LayerNorms)"] + S["norm outputs (2 LayerNorms)"]
              + S["norm statistics (fp32)"]) / 2
            - S.get("MLP x·W1ᵀ of every shard (keep_intermediate)", 0)}
    common = dict(dxacc)
    if p > 1:
        common["head-group weights: own packed + 2 receive buffers (bf16)"] = 3 * BF16 * Wa
    common["head-group weight gradients: filling, in flight, kept (fp32)"] = \
        min(p, 3) * FP32 * Wa
    common["recomputed q, k, v heads-first (bf16)"] = BF16 * n * (hqg + 2 * hkg)
    common["o_g seq-first copy, d(o_g) (bf16)"] = 2 * BF16 * n * hqg
    ring_step = dict(common, **{"d(o_g) heads-first (bf16)": BF16 * n * hqg},
                     **ring_backward_buffers(n, hqg, hkg, Ag, p, job))
    grads32 = FP32 * n * (hqg + 2 * hkg)  # dq, dk, dv in fp32 (after RoPE: new dq, dk)
    rope_step = dict(common, **{"ring dq, dk, dv (fp32)": grads32,
                                "RoPE transpose of dq: temporaries and result (fp32)":
                                    4 * FP32 * n * hqg})
    join_step = dict(common, **{"RoPE-transposed dq, dk and dv (fp32)": grads32,
                                "dq reshaped (fp32)": FP32 * n * hqg,
                                "joined d(qkv) (fp32)": grads32})
    dx_step = dict(common, **{"RoPE-transposed dq, dk and dv (fp32)": grads32,
                              "d(qkv) (bf16)": BF16 * n * (hqg + 2 * hkg),
                              "fp32 product of dx += d(qkv)·W / dW += d(qkv)ᵀ·x":
                                  FP32 * max(n * h, (hqg + 2 * hkg) * h)})
    step = max([ring_step, rope_step, join_step, dx_step], key=lambda d_: sum(d_.values()))
    ph["attention backward (last layer)"] = dict(base, **step)

    # forward of the last layer: fp32 output accumulator, weight buffers, one head group's
    # q, k, v and the K/V ring forward (the last group's output not stored yet) ...
    later = (-base["(MLP and second-norm activations freed)"]
             + BF16 * n * hqg + FP32 * n * Ag)
    fwd = {"(rest of the last layer not formed yet)": -later,
           "y accumulator (fp32)": FP32 * n * h,
           "recomputed q, k, v heads-first (bf16)": BF16 * n * (hqg + 2 * hkg)}
    if p > 1:
        fwd["head-group weights: own packed + 2 receive buffers (bf16)"] = 3 * BF16 * Wa
    fwd.update(ring_forward_buffers(n, hqg, hkg, Ag, p, job))
    ph["attention forward (last layer)"] = fwd
    # ... and the MLP forward: y in fp32 plus one fp32 product, the weight ring, z and f(z)
    mlp_fwd = {"(kept z of the last layer not formed yet)":
               -S.get("MLP x·W1ᵀ of every shard (keep_intermediate)", 0),
               "y accumulator + fp32 product (fp32)": 2 * FP32 * n * h,
               "one shard's z and f(z) (bf16)": BF16 * n * k * f + BF16 * n * f}
    if p > 1:
        mlp_fwd["MLP weight ring: own packed + received shard (bf16)"] = 2 * BF16 * Wm
    ph["MLP forward (last layer)"] = mlp_fwd
    return ph


def unfused_live_block(model: Model, job: Job, seq: Optional[int] = None) -> int:
    """METP without a fused kernel: one head group's fp32 scores of one ring step,
    ``b·(a/p)·(s/p)²·4`` bytes — the paper's O(1/p³) live intermediate."""
    s = model.seq if seq is None else seq
    sh = job.width
    return job.micro_batch * (model.heads // sh) * (s // job.metp) ** 2 * FP32


# ----------------------------------------------------------------------------- whole rank

@dataclass
class Memory:
    mode: str
    layout: str
    seq: int
    static: Dict[str, float]
    act: Activations

    @property
    def activation_peak(self) -> float:
        return self.act.peak

    @property
    def measured_part(self) -> float:
        """What ``metp measure`` measures: parameters + fp32 gradient buffer + activation peak."""
        return self.static["params"] + self.static["grads"] + self.act.peak

    @property
    def total(self) -> float:
        return self.measured_part + self.static["optimizer"]


def memory(model: Model, job: Job, mode: str, seq: Optional[int] = None,
           stage: str = "first") -> Memory:
    """Per-rank memory of rank 0 (the first pipeline stage), or of the last stage."""
    m = model if seq is None else model.with_seq(seq)
    lay = layout(mode, job)
    return Memory(mode, lay.describe(), m.seq, static_memory(m, job, mode, stage),
                  activations(m, job, mode, stage=stage))


def worst_total(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> float:
    """The larger per-rank total of the first and the last pipeline stage."""
    tot = memory(model, job, mode, seq).total
    if job.pp > 1:
        tot = max(tot, memory(model, job, mode, seq, "last").total)
    return tot


def head_memory(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> Dict[str, float]:
    """The vocabulary side of one rank, in bytes: the word embedding + output-layer tables of
    rank 0 (``tables``: bf16; ``table_grads``: their fp32 main_grad; ``table_optimizer``: their
    Adam states, distributed over the DP group that reduces them when the job says so), the
    rows of each table on a rank (``rows``), and the loss's logits on the stage that computes it:
    ``logits_block`` (one fp32 logits tensor: ``[tokens, V/t]``, or one vocabulary shard's
    ``[tokens, V/(t·p)]`` with the split), ``logits_stored`` (kept for backward: Megatron keeps
    the fp32 softmax ``[tokens, V/t]``; the split keeps none) and ``logits_at_once`` (the most
    logits bytes alive at one time: the bf16 product and its fp32 copy)."""
    mode, job = canonical(mode, job)
    s = model.seq if seq is None else int(seq)
    lay = layout(mode, job)
    prm = params(model, job, mode)
    V = padded_vocab(model.vocab, lay.vocab_shards)
    rows = V // lay.vocab_shards
    n = s * job.micro_batch // lay.c
    emb = prm.embedding
    dp = prm.dp_sharded if prm.embedding_sharded else prm.dp_replicated
    block = FP32 * n * rows
    return {"rows": rows, "tables": BF16 * emb, "table_grads": FP32 * emb,
            "table_optimizer": 12 * emb / (dp if job.distributed_optimizer else 1),
            "logits_block": block, "logits_stored": 0 if lay.vocab else block,
            "logits_at_once": BF16 * n * rows + block}


# ----------------------------------------------------------------------------- traffic

def traffic_per_layer(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> Dict[str, float]:
    """Bytes one rank sends per layer in one forward+backward (ring convention: a send ``N``,
    all-reduce ``2(p−1)/p·N``, all-gather / reduce-scatter / broadcast / reduce ``(p−1)/p·N``).
    The vocabulary split adds no per-layer traffic (its rings run once per step, at the head)."""
    mode, job = canonical(mode, job)
    s = model.seq if seq is None else seq
    lay = layout(mode, job)
    t, c = lay.t, lay.c
    b = job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hk = G * d
    hq = A * d
    k = 2 if model.swiglu else 1
    n = s * b // c
    out: Dict[str, float] = {}
    N = n * h * BF16  # one activation [tokens, h] of this rank's tokens
    if t > 1:
        if lay.sp:
            out["TP+SP: all-gather/reduce-scatter, 5 per block"] = 2 * 5 * (t - 1) * N / t
        else:
            out["TP: all-reduce fwd + bwd, per block"] = 2 * 4 * (t - 1) * N / t
    if mode in ("ring", "cp"):
        kva = 2 * n * (hk // t) * BF16
        out["K/V ring: fwd K/V, bwd K/V + fp32 dK/dV"] = 4 * (c - 1) * kva
    if mode == "metp":
        p = c
        sh = t * p
        wa = ((hq + 2 * hk) * h + h * hq) // sh * BF16
        wm = (k * F * h + F * h) // sh
        kv = 2 * n * (hk // sh) * BF16
        out["attention weights: bcast fwd+bwd, fp32 reduce"] = 4 * (p - 1) * wa
        out["attention K/V ring (every head group)"] = 4 * p * (p - 1) * kv
        out["MLP weight ring fwd+bwd, fp32 gradient ring"] = (p - 1) * (2 * wm * BF16 + wm * FP32)
    return out


def crossover_seq(model: Model, job: Job, versus: str = "tp-sp") -> Optional[int]:
    """Smallest sequence length from which METP sends no more bytes per layer than ``versus``
    (both are affine in ``s``), or None when METP's slope is not smaller."""
    s1, s2 = 2 * job.width * 64, 2 * job.width * 128
    f = lambda m, s: sum(traffic_per_layer(model, job, m, s).values())  # noqa: E731
    a1, a2 = f("metp", s1), f("metp", s2)
    b1, b2 = f(versus, s1), f(versus, s2)
    slope_m, slope_v = (a2 - a1) / (s2 - s1), (b2 - b1) / (s2 - s1)
    if slope_v <= slope_m:
        return None
    s = (a1 - b1) / (slope_v - slope_m) + s1
    return max(0, int(math.ceil(s)))


# ----------------------------------------------------------------------------- overlap

def overlap_thresholds(model: Model, job: Job, hw: Hardware, measured: bool = False) -> Dict[str, float]:
    """Tokens per rank above which one ring step's compute hides the next step's transfer.

    * MLP weight ring (DESIGN.md §1): a step computes ``2(k+1)·(s·b/p)·h·F/p`` FLOPs and receives
      ``(k+1)·h·F/p`` bf16 elements, so forward needs ``s·b/p ≥ F_rate/B``; the backward sends
      the weight and its fp32 gradient (3×) for ``(6k+4)/(2k+2)``× the FLOPs (recompute included).
    * Attention head-group weights: projections alone give the same ``s·b/p ≥ F_rate/B``.
    * K/V ring (one block of a head group per step; off-diagonal causal blocks are half full):
      ``2·n²·b·d·a_g`` FLOPs against ``4·n·b·d·g_g`` bytes, so ``s/p ≥ 2·(F_rate/B)·g/a``;
      backward ~2.5× the FLOPs for 3× the bytes.
    """
    rate = (hw.measured_tflops if measured and hw.measured_tflops else hw.bf16_tflops) * 1e12
    fb = rate / (hw.link_gbps * 1e9)
    k = 2 if model.swiglu else 1
    ratio = model.groups / model.heads
    return {
        "F/B (FLOP per byte)": fb,
        "MLP weight ring, forward: tokens/rank": fb,
        "MLP weight ring, backward: tokens/rank": fb * 6 * (k + 1) / (6 * k + 4),
        "attention weights: tokens/rank": fb,
        "K/V ring, forward: s/p": 2 * fb * ratio,
        "K/V ring, backward: s/p": 2 * fb * ratio * 3 / 2.5,
    }


# ----------------------------------------------------------------------------- longest sequence

def seq_step(job: Job, mode: str) -> int:
    lay = layout(mode, job)
    q = 2 * lay.c if lay.c > 1 else 1
    if lay.sp:
        q = q * lay.t // math.gcd(q, lay.t)
    return q * 256 // math.gcd(q, 256)


def capacity_bytes(job: Job) -> float:
    return (HARDWARE[job.hardware].memory_gib - job.reserve_gib) * GiB


def longest_seq(model: Model, job: Job, mode: str, capacity: Optional[float] = None,
                limit: int = 1 << 24) -> int:
    """Largest ``s`` (a multiple of :func:`seq_step`) whose planned per-rank total fits in
    ``capacity`` bytes (default: the hardware's memory minus ``reserve_gib``); 0 if none."""
    cap = capacity_bytes(job) if capacity is None else capacity
    q = seq_step(job, mode)
    fits = lambda s: worst_total(model, job, mode, s) <= cap  # noqa: E731
    if not fits(q):
        return 0
    lo, hi = 1, 2
    while hi * q <= limit and fits(hi * q):
        lo, hi = hi, hi * 2
    if hi * q > limit:
        return lo * q
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * q):
            lo = mid
        else:
            hi = mid
    return lo * q


# ----------------------------------------------------------------------------- report

def fmt_bytes(x: float) -> str:
    if abs(x) >= GiB:
        return f"{x / GiB:,.2f} GiB"
    return f"{x / MiB:,.1f} MiB"


def fmt_tokens(s: int) -> str:
    if s >= 1024 and s % 1024 == 0:
        return f"{s // 1024}K"
    if s >= 1024:
        return f"{s / 1024:,.2f}K"
    return f"{s:,}"


#: one colour per mode in every chart
COLORS = {"tp": "#1f77b4", "tp-sp": "#ff7f0e", "cp": "#9467bd", "ring": "#2ca02c",
          "metp": "#d62728", "metp+vocab": "#8c564b"}


def plan(model: Model, job: Job, modes: Sequence[str] = MODES) -> Dict:
    """Everything :func:`report` prints, as a dict (bytes, tokens)."""
    validate(model, job, modes)
    hw = HARDWARE[job.hardware]
    out = {"model": asdict(model), "job": asdict(job), "hardware": asdict(hw), "modes": {}}
    for mode in modes:
        mem = memory(model, job, mode)
        a = mem.act
        out["modes"][mode] = {
            "layout": mem.layout,
            "static": mem.static,
            "stored_layer": a.stored_layer, "stored_per_layer": a.stored_per_layer,
            "korthikanti_layer": a.korthikanti_layer,
            "layers": a.layers, "inflight": a.inflight, "head": a.head,
            "persistent": a.persistent, "phases": a.phase_totals(),
            "peak_phase": a.peak_phase, "transient": a.transient,
            "activation_peak": a.peak, "measured_part": mem.measured_part, "total": mem.total,
            "last_stage_total": memory(model, job, mode, stage="last").total
            if job.pp > 1 else None,
            "traffic_per_layer": traffic_per_layer(model, job, mode),
            "vocab": head_memory(model, job, mode),
            "longest_seq": longest_seq(model, job, mode),
        }
    out["overlap"] = overlap_thresholds(model, job, hw)
    if hw.measured_tflops:
        out["overlap_measured"] = overlap_thresholds(model, job, hw, measured=True)
    if "metp" in modes and "tp-sp" in modes and job.width > 1:
        out["crossover_vs_tp_sp"] = crossover_seq(model, job, "tp-sp")
    return out


def report(model: Model, job: Job, modes: Sequence[str] = MODES) -> str:
    """The text ``metp plan`` prints."""
    res = plan(model, job, modes)
    hw = HARDWARE[job.hardware]
    lines = []
    g = f", {model.groups} query groups" if model.groups != model.heads else ""
    lines.append(f"# plan: {model.name} h={model.hidden} L={model.layers} a={model.heads}{g} "
                 f"ffn={model.ffn}{' (SwiGLU)' if model.swiglu else ''} vocab={model.vocab} "
                 f"s={model.seq:,} b={job.micro_batch}, bf16, {job.kernel} attention, "
                 f"{'keep' if job.keep_intermediate else 'recompute'} METP MLP intermediate"
                 + (", METP vocabulary split (--vocab-parallel)" if job.vocab_parallel else ""))
    lines.append(f"# GPUs per model replica: TP×METP = {job.tp}×{job.metp} = {job.width} per "
                 f"stage × PP {job.pp} × DP {job.dp}; distributed optimizer "
                 f"{'on' if job.distributed_optimizer else 'off'}; {hw.name}: "
                 f"{hw.memory_gib:g} GB − {job.reserve_gib:g} GiB reserve, "
                 f"{hw.bf16_tflops:g} TFLOP/s bf16 dense, {hw.link_gbps:g} GB/s per direction "
                 f"({hw.source})")
    lines.append("# all figures planned (formulas of megatron_metp/plan.py); per rank, rank 0"
                 + (" (first pipeline stage)" if job.pp > 1 else ""))
    lines.append("")
    cols = list(modes)
    rows = []

    def row(label, f):
        rows.append([label] + [f(res["modes"][m]) for m in cols])

    row("layout", lambda r: r["layout"])
    row("parameters (bf16)", lambda r: fmt_bytes(r["static"]["params"]))
    row("  embedding + output layer", lambda r: fmt_bytes(r["vocab"]["tables"]) +
        f" ({r['vocab']['rows']:,} rows)")
    row("gradients (fp32 main_grad)", lambda r: fmt_bytes(r["static"]["grads"]))
    row("Adam states (no dist. opt.)", lambda r: fmt_bytes(r["static"]["optimizer_plain"]))
    row("Adam states (dist. opt.)", lambda r: fmt_bytes(r["static"]["optimizer_distributed"]))
    row("stored / layer", lambda r: fmt_bytes(r["stored_per_layer"]))
    row("  Korthikanti / layer", lambda r: fmt_bytes(r["korthikanti_layer"])
        if r["korthikanti_layer"] else "")
    row("stored × layers × in flight", lambda r: f"{fmt_bytes(r['stored_per_layer'] * r['layers'] * r['inflight'])}"
        f" ({r['layers']}×{r['inflight']})")
    row("head stored (RoPE, norm, loss)",
        lambda r: fmt_bytes(r["inflight"] * sum(r["head"].values())))
    row("  loss: fp32 logits block", lambda r: fmt_bytes(r["vocab"]["logits_block"]))
    row("  loss: logits alive at once", lambda r: fmt_bytes(r["vocab"]["logits_at_once"]))
    row("persistent Megatron buffer", lambda r: fmt_bytes(r["persistent"]))
    row("transient (one layer / loss)", lambda r: fmt_bytes(r["transient"]))
    row("  at", lambda r: r["peak_phase"].split(" (")[0])
    row("activation peak", lambda r: fmt_bytes(r["activation_peak"]))
    row("TOTAL per rank" + (" (first stage)" if job.pp > 1 else ""),
        lambda r: fmt_bytes(r["total"]))
    if job.pp > 1:
        row("TOTAL per rank (last stage)", lambda r: fmt_bytes(r["last_stage_total"]))
    row("fits " + hw.name, lambda r: "yes" if max(r["total"], r["last_stage_total"] or 0)
        <= capacity_bytes(job) else "NO")
    row("bytes sent / layer (fwd+bwd)", lambda r: fmt_bytes(sum(r["traffic_per_layer"].values())))
    row("longest sequence that fits", lambda r: fmt_tokens(r["longest_seq"]))
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(str(r[i + 1])) for r in rows + [[""] + cols]) for i in range(len(cols))]
    lines.append(" " * w0 + " | " + " | ".join(c.rjust(w) for c, w in zip(cols, ws)))
    lines.append("-" * (w0 + 3 + sum(ws) + 3 * (len(ws) - 1)))
    for r in rows:
        lines.append(r[0].ljust(w0) + " | " + " | ".join(str(v).rjust(w) for v, w in zip(r[1:], ws)))
    lines.append("")
    ov = res["overlap"]
    lines.append(f"# full-overlap thresholds on {hw.name} (F/B = {ov['F/B (FLOP per byte)']:,.0f} "
                 f"FLOP/byte, datasheet rates): tokens per rank s·b/p")
    for key, v in ov.items():
        if key.startswith("F/B"):
            continue
        extra = ""
        if "overlap_measured" in res:
            extra = f"   (measured {hw.measured_tflops:g} TFLOP/s: {res['overlap_measured'][key]:,.0f})"
        lines.append(f"  {key:<40s} {v:>10,.0f}{extra}")
    if job.width > 8:
        lines.append(f"  (a group of {job.width} GPUs crosses nodes: the inter-node link, not "
                     f"NVLink, sets B for the ring steps that cross it)")
    if any(m in VOCAB_MODES for m in modes):
        n = model.seq * job.micro_batch // job.metp
        lines.append(f"  this job: s·b/p = {n:,} tokens per METP rank "
                     f"({'above' if n >= ov['MLP weight ring, forward: tokens/rank'] else 'below'} "
                     f"the MLP threshold)")
    if res.get("crossover_vs_tp_sp") is not None:
        lines.append(f"# METP sends fewer bytes per layer than TP+SP from s ≈ "
                     f"{res['crossover_vs_tp_sp']:,} tokens on")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- charts

def charts(model: Model, job: Job, path: str, modes: Sequence[str] = MODES,
           seqs: Optional[Iterable[int]] = None) -> List[str]:
    """Two PNGs: per-rank memory vs sequence length (``path``) and the longest sequence per mode
    (``path`` with ``-longest`` before the extension). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validate(model, job, modes)
    cap = capacity_bytes(job)
    longest = {m: longest_seq(model, job, m) for m in modes}
    top = max(max(longest.values()), 4 * seq_step(job, "metp"))
    if seqs is None:
        seqs = sorted({int(top * f) for f in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
                                                1.0, 1.1, 1.25)})
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in modes:
        q = seq_step(job, m)
        xs = sorted({max(q, (s // q) * q) for s in seqs})
        ys = [worst_total(model, job, m, s) / GiB for s in xs]
        ax.plot([x / 1024 for x in xs], ys, marker="o", ms=3, color=COLORS[m],
                label=f"{MODE_NAMES[m]} "
                f"({layout(m, job).describe()})")
    ax.axhline(cap / GiB, color="k", ls="--", lw=1,
               label=f"{job.hardware} − {job.reserve_gib:g} GiB reserve")
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel("planned memory per rank (GiB)")
    ax.set_ylim(0, 2.5 * cap / GiB)
    ax.set_title(f"{model.name}: per-rank memory, {job.width} GPUs per stage, {job.kernel} "
                 f"attention (planned)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    root, ext = os.path.splitext(path)
    path2 = f"{root}-longest{ext or '.png'}"
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{MODE_NAMES[m]}\n{layout(m, job).describe()}" for m in modes]
    vals = [longest[m] / 1024 for m in modes]
    bars = ax.bar(names, vals, color=[COLORS[m] for m in modes])
    for bar, v in zip(bars, vals):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}K" if v else "does not fit",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("longest sequence (K tokens)")
    ax.set_title(f"{model.name}: longest sequence on {job.width}×{job.hardware} per stage "
                 f"(planned)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path2, dpi=120)
    plt.close(fig)
    return [path, path2]
