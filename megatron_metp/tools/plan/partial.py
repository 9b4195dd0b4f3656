"""Partial host offload when the node's host memory binds: how many layers to offload.

``--offload-activations`` without a count plans every layer of a stage on the host, as
Megatron-LM's ``--metp-offload-activations`` runs it, as long as the node's host memory
(:mod:`.host`) holds what its ranks pin. When it does not, the plan offloads the most layers the
host holds and keeps the rest on the device (``--metp-offload-activations N`` with that ``N``,
which the report names): more layers offloaded never costs device memory (a kept layer keeps its
saved tensors, an offloaded one its per-row statistics), so the largest ``N`` that fits the host
is the best split for the device too, and :func:`.rank_memory.longest_seq` and the reach search
(:mod:`.search`) find it at every length they try. An explicit ``--offload-activations N`` is
planned as given (and may not fit). ``N = 0``, when the host cannot hold one layer (or one
recompute chunk), plans no offload at all.

What a node pins: every one of its :data:`.host.GPUS_PER_NODE` ranks its offloaded activations
and, with ``--optimizer-cpu-offload``, its optimizer states, the larger of the first and the last
pipeline stage (the same ``N`` for every stage: the flag is one number).

Kept attention (:mod:`.keep`) the same way, after the offload choice: ``--keep-attention-output``
without a count keeps ``O`` + LSE in the most layers per stage that the node's host memory (for
the offloaded layers) and the device (for the others) hold, :func:`resolve_keep`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

from .activation_memory import activations
from .hardware import HARDWARE
from .host import GPUS_PER_NODE, host_capacity_bytes
from .keep import recomputed_layers
from .model import KEEP_AUTO, GiB, Job, Model, canonical
from .parameters import static_memory


def offload_counts(job: Job, layers: int) -> List[int]:
    """The counts ``N`` a stage of ``layers`` layers can offload, ascending: with full recompute
    in uniform chunks of ``k`` layers the multiples of ``k`` (a chunk is offloaded or kept
    whole), else ``1..layers``."""
    step = job.recompute_num_layers if (job.recompute == "full" and
                                        job.recompute_method == "uniform") else 1
    return list(range(step, layers + 1, step))


def host_per_node(model: Model, job: Job, mode: str) -> float:
    """Pinned host bytes of one node: ``GPUS_PER_NODE`` × the larger stage's offloaded
    activations + optimizer states on the host."""
    worst = 0.0
    for stage in (("first", "last") if job.pp > 1 else ("first",)):
        act = activations(model, job, mode, stage=stage)
        worst = max(worst, act.host + static_memory(model, job, mode, stage)["optimizer_host"])
    return GPUS_PER_NODE * worst


def resolve_offload(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> Job:
    """``job`` with ``offload_layers`` set to the most layers per stage the node's host memory
    holds when ``job`` offloads every layer (``offload_layers=None``) and the host does not hold
    them all; otherwise ``job`` unchanged."""
    if not job.offload or job.offload_layers is not None:
        return job
    cap = host_capacity_bytes(job)
    if cap is None:
        return job
    m = model if seq is None else model.with_seq(seq)
    if host_per_node(m, job, mode) <= cap:
        return job
    counts = [0] + offload_counts(job, m.layers // job.pp)[:-1]
    lo, hi = 0, len(counts) - 1  # host bytes grow with N: the largest count that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if host_per_node(m, replace(job, offload_layers=counts[mid]), mode) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return replace(job, offload_layers=counts[lo])


def _device_fits(model: Model, job: Job, mode: str) -> bool:
    """The per-rank total (parameters, gradients, optimizer, activation peak; the first and the
    last stage) within the device's memory less ``--reserve-gib``."""
    cap = (HARDWARE[job.hardware].memory_gib - job.reserve_gib) * GiB
    for stage in (("first", "last") if job.pp > 1 else ("first",)):
        st = static_memory(model, job, mode, stage)
        total = st["params"] + st["grads"] + st["optimizer"] + \
            activations(model, job, mode, stage=stage).peak
        if total > cap:
            return False
    return True


def resolve_keep(model: Model, job: Job, mode: str, seq: Optional[int] = None) -> Job:
    """``job`` with ``keep_attention_output`` set to the most layers per stage whose ``O`` + LSE
    the node's host memory (offloaded layers) and the device (the others) hold, when ``job``
    asks for :data:`.model.KEEP_AUTO` in a METP mode (call it with the offload resolved:
    :func:`resolve_offload`); 0 when not even one layer fits (or the job does not fit without
    any). Otherwise ``job`` unchanged."""
    if job.keep_attention_output != KEEP_AUTO or canonical(mode, job)[0] != "metp":
        return job
    m = model if seq is None else model.with_seq(seq)
    cap = host_capacity_bytes(job)

    def fits(n: int) -> bool:
        j = replace(job, keep_attention_output=n)
        return (cap is None or not job.offload or host_per_node(m, j, mode) <= cap) and \
            _device_fits(m, j, mode)

    lo, hi = 0, recomputed_layers(job, m.layers // job.pp)
    while lo < hi:  # host and device bytes grow with N: the largest count that fits
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return replace(job, keep_attention_output=lo)
