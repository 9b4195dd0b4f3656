"""``metp plan``'s fit hint: when a mode does not fit, the cheapest options under which the same
layout does (:func:`fit_hint`).

The options are those the reach search (:mod:`.search`) tries, added to what the job already
has, never taken away: recompute none / full (uniform, one layer a chunk) / full + host offload
of the layer inputs (``--offload-activations``, as many layers per stage as the node's host
memory holds), Megatron's ``--optimizer-cpu-offload``, and two that cost no compute: the
distributed optimizer and, in mode ``metp``, the vocabulary split (``--vocab-parallel``).
Cheapest is ordered as :attr:`.search.Candidate.options` orders the search's ties: fewest
options that cost time (recompute, offload, optimizer offload), then fewest options in all,
then the lower per-rank total. A candidate fits as in the search: its planned per-rank total
(the larger of the first and the last pipeline stage) within the device minus the reserve, and
the host bytes of a node (offloaded activations + offloaded optimizer, 8 ranks) within the
node's host memory (``--host-memory-gib``, else the preset's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from .host import host_capacity_bytes
from .job_checks import validate
from .model import GiB, Job, Model, canonical
from .rank_memory import capacity_bytes, memory
from .search import DEFAULT_HOST_GIB_PER_NODE, RECOMPUTE_OPTIONS, node_host_bytes, rank_total


@dataclass
class FitHint:
    mode: str
    job: Job                  # the job with the options added (offload split resolved)
    flags: Tuple[str, ...]    # the ``metp plan`` flags added
    total: float              # planned per-rank bytes (the larger stage)
    host_per_node: float      # host bytes of a node
    costly: int               # options that cost time (recompute, offload, optimizer offload)
    model: Model = dataclasses.field(default=None, repr=False)  # at the job's sequence length

    def as_dict(self) -> Dict:
        from .launch import launch_line, megatron_flags

        return {"flags": list(self.flags), "total": self.total,
                "host_per_node": self.host_per_node,
                "megatron_lm_args": megatron_flags(self.model, self.job, self.mode),
                "pretrain_gpt_sh": launch_line(self.model, self.job, self.mode)}


def _level(job: Job) -> int:
    """The job's place in :data:`.search.RECOMPUTE_OPTIONS` (selective counts as none)."""
    if job.recompute != "full":
        return 0
    return 2 if job.offload else 1


def _variants(job: Job, mode: str) -> Iterator[Tuple[Job, Tuple[str, ...], int]]:
    """``(job, flags added, time-costing options added)`` of every option set above ``job``."""
    vocab_choices = (job.vocab_parallel,) if mode != "metp" or job.vocab_parallel else \
        (False, True)
    for _, fields in RECOMPUTE_OPTIONS[_level(job):]:
        rec: Dict = {}
        rec_flags: List[str] = []
        if fields.get("recompute") == "full" and job.recompute != "full":
            rec.update(recompute="full", recompute_method="uniform", recompute_num_layers=1)
            rec_flags += ["--recompute", "full"]
        if fields.get("offload") and not job.offload:
            rec.update(offload=True, offload_layers=None)
            rec_flags.append("--offload-activations")
        for vocab in vocab_choices:
            for dist in sorted({job.distributed_optimizer, True}):
                for off in sorted({job.optimizer_offload, True}):
                    flags = list(rec_flags)
                    if dist and not job.distributed_optimizer:
                        flags.append("--distributed-optimizer")
                    if vocab and not job.vocab_parallel:
                        flags.append("--vocab-parallel")
                    if off and not job.optimizer_offload:
                        flags.append("--optimizer-cpu-offload")
                    if not flags:
                        continue
                    costly = ("recompute" in rec) + ("offload" in rec) + \
                        int(off and not job.optimizer_offload)
                    yield (dataclasses.replace(job, distributed_optimizer=dist,
                                               vocab_parallel=vocab, optimizer_offload=off,
                                               **rec), tuple(flags), costly)


def fits(model: Model, job: Job, mode: str) -> Tuple[bool, float, float]:
    """``(fits, per-rank total, host bytes per node)`` as the reach search counts them."""
    host_cap = host_capacity_bytes(job)
    host_cap = DEFAULT_HOST_GIB_PER_NODE * GiB if host_cap is None else host_cap
    total = rank_total(model, job, mode, model.seq)
    host = node_host_bytes(model, job, mode, model.seq)
    return total <= capacity_bytes(job) and host <= host_cap, total, host


def fit_hint(model: Model, job: Job, mode: str) -> Optional[FitHint]:
    """The cheapest options (see the module) under which ``mode`` of this layout fits, or None
    when none does (or the mode is ALST's recipe, which has no such options)."""
    if mode == "alst":
        return None
    asked = mode
    mode, job = canonical(mode, job)
    # mode metp+vocab is mode metp with --vocab-parallel: the re-plan needs that flag too
    given = ("--vocab-parallel",) if asked != mode and job.vocab_parallel else ()
    found: List[FitHint] = []
    for cand, flags, costly in _variants(job, mode):
        try:
            validate(model, cand, [mode])
        except ValueError:
            continue  # e.g. the optimizer offload without the distributed optimizer
        ok, total, host = fits(model, cand, mode)
        if ok:
            resolved = memory(model, cand, mode).job  # the offload split the host allows
            found.append(FitHint(mode, dataclasses.replace(
                cand, offload_layers=resolved.offload_layers), given + flags, total, host, costly,
                model=model))
    if not found:
        return None
    return min(found, key=lambda h: (h.costly, len(h.flags), h.total))


__all__ = ["FitHint", "fit_hint", "fits"]
