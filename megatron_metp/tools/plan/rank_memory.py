"""The whole rank: static memory + activation peak (:func:`memory`), the larger of the first and
the last pipeline stage, the vocabulary side of a rank, and the longest sequence that fits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .activation_memory import Activations, activations
from .hardware import HARDWARE
from .host import host_fits
from .model import BF16, FP32, GiB, Job, Model, canonical, layout, padded_vocab
from .parameters import params, static_memory
from .partial import resolve_keep, resolve_offload
from .vocab import loss_tile_count, loss_tile_rows, token_chunk


@dataclass
class Memory:
    mode: str
    layout: str
    seq: int
    static: Dict[str, float]
    act: Activations
    job: Optional[Job] = None  # the job planned: with the offload split of .partial resolved

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
    """Per-rank memory of rank 0 (the first pipeline stage), or of the last stage; with
    ``--offload-activations`` and no count, as many layers offloaded as the node's host memory
    holds (:func:`.partial.resolve_offload`); with ``--keep-attention-output`` and no count, as
    many layers keeping attention as the host and the device hold
    (:func:`.partial.resolve_keep`)."""
    return stage_memories(model, job, mode, seq, (stage,))[0]


def stage_memories(model: Model, job: Job, mode: str, seq: Optional[int] = None,
                   stages: Tuple[str, ...] = ("first",)) -> List[Memory]:
    """:func:`memory` of each of ``stages``, the offload and keep counts resolved once for all
    of them (they are one number per job: the resolution looks at every stage itself)."""
    m = model if seq is None else model.with_seq(seq)
    lay = layout(mode, job)
    if mode == "alst":
        from .alst import alst_activations, alst_static
        return [Memory(mode, lay.describe(), m.seq, alst_static(m, job),
                       alst_activations(m, job), job) for _ in stages]
    job = resolve_keep(m, resolve_offload(m, job, mode), mode)
    return [Memory(mode, lay.describe(), m.seq, static_memory(m, job, mode, stage),
                   activations(m, job, mode, stage=stage), job) for stage in stages]


def worst_total(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> float:
    """The larger per-rank total of the first and the last pipeline stage."""
    return max(m.total for m in stage_memories(model, job, mode, seq, pipeline_ends(job)))


def pipeline_ends(job: Job) -> Tuple[str, ...]:
    """The stages whose memory can differ: the first, and the last when ``job.pp > 1``."""
    return ("first", "last") if job.pp > 1 else ("first",)


def head_memory(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> Dict[str, float]:
    """The vocabulary side of one rank, in bytes: the word embedding + output-layer tables of
    rank 0 (``tables``: bf16; ``table_grads``: their fp32 main_grad; ``table_optimizer``: their
    Adam states, distributed over the DP group that reduces them when the job says so), the
    rows of each table on a rank (``rows``), and the loss's logits on the stage that computes it:
    ``logits_block`` (one fp32 logits tensor: ``[tokens, V/t]``, or one vocabulary shard's
    ``[chunk, V/(t·p)]`` with the split, whose ring loss tiles the tokens: ``loss_token_chunk``),
    ``logits_stored`` (kept for backward: Megatron keeps
    the fp32 softmax ``[tokens, V/t]``; the split keeps none) and ``logits_at_once`` (the most
    logits bytes alive at one time: the bf16 product and its fp32 copy); with the split also the
    token tiles of the loss's backward (``loss_tiles`` passes of ``loss_tile_rows`` rows)."""
    mode, job = canonical(mode, job)
    s = model.seq if seq is None else int(seq)
    lay = layout(mode, job)
    prm = params(model, job, mode)
    V = padded_vocab(model.vocab, lay.vocab_pad)
    rows = V // lay.vocab_shards
    n = s * job.micro_batch // lay.c
    emb = prm.embedding
    dp = prm.dp_sharded if prm.embedding_sharded else prm.dp_replicated
    chunk = token_chunk(n, rows) if lay.vocab else n  # the ring loss tiles its tokens
    block = FP32 * chunk * rows
    return {"rows": rows, "tables": BF16 * emb, "table_grads": FP32 * emb,
            "table_optimizer": 12 * emb / (dp if job.distributed_optimizer else 1),
            "logits_block": block, "logits_stored": 0 if lay.vocab else block,
            "logits_at_once": BF16 * chunk * rows + block, "loss_token_chunk": chunk,
            "loss_tiles": loss_tile_count(n, model.hidden) if lay.vocab else 1,
            "loss_tile_rows": loss_tile_rows(n, model.hidden) if lay.vocab else n}


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
                limit: int = 1 << 28) -> int:
    """Largest ``s`` (a multiple of :func:`seq_step`) whose planned per-rank total fits in
    ``capacity`` bytes (default: the hardware's memory minus ``reserve_gib``) and, with host
    offload, whose pinned host bytes fit the node's host memory (:mod:`.host`); 0 if none."""
    cap = capacity_bytes(job) if capacity is None else capacity
    q = seq_step(job, mode)
    def fits(s):  # the device total per GPU, and the pinned host bytes per node (.host)
        mems = stage_memories(model, job, mode, s, pipeline_ends(job))
        return max(m.total for m in mems) <= cap and (
            not job.offload or host_fits(job, mems[0].act.host))
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
