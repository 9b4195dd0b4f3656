"""``metp plan --fastest --gpus N --seq S``: the fastest layout that fits, per family, at one
sequence length (issue 41, deliverable 5).

Families and layouts are those of the reach search (:func:`.search.layouts`): ``metp`` (TP ×
METP ≥ 2 × CP × PP × DP, the vocabulary ring on), ``stock`` (TP+SP × CP × PP × DP, a MoE
model's EP folded out of TP × CP × DP) and ``alst`` (ALST's published recipe over every GPU;
dense models only). Micro-batch 1, bf16, the distributed optimizer on. Every layout is tried
with each option set (each with the activation offload off and on, as many layers per stage as
the node's host memory holds, :mod:`.partial`; and Megatron's ``--optimizer-cpu-offload`` off
and on):

* recompute ``none`` (with the offload also with the fewest offloaded layers per stage that fit,
  bisected: a layer that saves more than its forward computes makes its copy wait,
  :mod:`.step_time`); ``selective`` (where the planner plans it: :func:`.job_checks.validate`);
  ``full`` in uniform chunks of ``k`` layers, every ``k`` dividing the layers of a stage;
* ``full`` with ``--recompute-method block --recompute-num-layers N``: the first ``N`` layers of
  each stage recompute, the others keep everything. A recomputed layer costs one more forward,
  so the fewest ``N`` that fits is the fastest of them: bisected over ``1 … L/PP`` (the device
  total falls as ``N`` grows);
* METP only: ``full`` (uniform, one layer a chunk) with the attention output kept
  (``Job.keep_attention_output = K``, ``--metp-keep-attention-output K``: the first ``K`` layers
  of each stage keep O and its log-sum-exp instead of re-running the attention forward): the
  most ``K`` that fits, bisected (:mod:`.step_time` prices what keeping saves).

A candidate fits when its planned per-rank total (the larger of the first and the last pipeline
stage) fits the device minus ``--reserve-gib`` and a node's host bytes (offloaded activations and
host optimizer, :func:`.search.node_host_bytes`) fit ``--host-memory-gib``; stock layouts on
Megatron's fp32 RoPE recipe stop at 2^24 tokens (:mod:`.positions`). Its time per sequence is
the iteration's time (:func:`.step_time.step_time`: ``(m + PP − 1)`` micro-batches of one stage
and the optimizer step, ``m = PP`` micro-batches, the global batch a written config states) over
the sequences of the iteration (``m × DP``). The fastest candidate of a family is the one of
least time per sequence, ties going to fewer options (recompute, offload, optimizer offload, kept
attention) and then the lower per-rank total, as the reach search breaks them.

Model FLOPs (``model_tflops_per_gpu``) are the planner's own count (:func:`.flops.layer_flops`
of the whole layer on one device: GEMMs, causal attention, its backward 2.5×; the output layer's
``2·s·h·V`` forward and twice that backward), without any recompute, divided by the time per
sequence and the GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .cost import step_cost
from .flops import layer_flops
from .hardware import HARDWARE
from .job_checks import validate
from .model import PRESET_NOTES, GiB, Job, Model
from .moe import active_twin
from .positions import position_cap
from .partial import resolve_offload
from .rank_memory import capacity_bytes, memory
from .internode import GPUS_PER_NODE
from .search import DEFAULT_HOST_GIB_PER_NODE, FAMILIES, FAMILY_NAMES, geometry, layouts


@dataclass
class Choice:
    """One layout × option set that fits at the sequence length, with its planned time."""

    family: str
    mode: str
    job: Job                 # as planned (the offload split resolved: offload_layers)
    recompute: str           # "none", "selective", "full (uniform, k)", "full (block, N)", ...
    total: float             # planned per-rank bytes, the larger stage
    host_per_node: float     # host bytes of a node
    micro_batch_s: float     # one micro-batch of one stage (step_time's step_s)
    iteration_s: float       # (m + PP − 1) micro-batches + the optimizer step
    sequences: int           # sequences per iteration: m × DP × micro-batch

    @property
    def time_s(self) -> float:
        """Time per sequence: the iteration over its sequences."""
        return self.iteration_s / self.sequences

    @property
    def options(self) -> int:
        """Memory-saving options used (the tie-break, as :attr:`.search.Candidate.options`)."""
        j = self.job
        return (j.recompute != "none") + bool(j.offload) + bool(j.optimizer_offload) + \
            bool(j.keep_attention_output) + bool(j.keep_intermediate)

    def key(self) -> Tuple[float, int, float]:
        return (round(self.time_s, 9), self.options, self.total)

    def describe(self) -> str:
        j = self.job
        if self.family == "alst":
            return (f"Ulysses {j.metp} + ZeRO-3, every layer recomputed, checkpoints and "
                    f"optimizer on the host")
        if self.family == "metp":
            parts = [f"TP {j.tp}", f"METP {j.metp}", f"CP {j.cp}"]
        else:
            parts = [f"TP {j.tp}" + ("+SP" if j.tp > 1 else ""),
                     f"CP {j.metp if self.mode == 'cp' else 1}"]
        parts += [f"PP {j.pp}", f"DP {j.dp}"]
        if j.ep:
            parts.append(f"EP {j.ep}")
        opts = [f"recompute {self.recompute}"]
        if j.offload:
            stage = "all" if j.offload_layers is None else str(j.offload_layers)
            opts.append(f"offload ({stage} layers per stage)")
        if j.optimizer_offload:
            opts.append("optimizer on host")
        if j.keep_intermediate:
            opts.append("MLP intermediate kept")
        return " × ".join(parts) + ", " + ", ".join(opts)


def model_flops(model: Model) -> float:
    """Model FLOPs of one sequence (no recompute): every layer's forward and backward on one
    device (:func:`.flops.layer_flops`) and the output layer's ``3 × 2·s·h·V``; a MoE model as
    the dense model of its active FFN (:func:`.moe.active_twin`)."""
    m = active_twin(model)
    f = layer_flops(m, Job(tp=1, metp=1), "tp")
    return m.layers * (f["forward"] + f["backward"]) + 3 * 2 * m.seq * m.hidden * m.vocab


def _smallest(fits: Callable[[int], bool], lo: int, hi: int) -> Optional[int]:
    """The smallest ``n`` in ``lo … hi`` with ``fits(n)`` (``fits`` monotone: false then true)."""
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> Optional[int]:
    """The largest ``n`` in ``lo … hi`` with ``fits(n)`` (``fits`` monotone: true then false)."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Fit:
    """Fits, per-rank total and host bytes per node of jobs at one sequence length, each
    planned once (one :func:`.rank_memory.memory` per pipeline stage; the same figures as
    :func:`.search.rank_total` and :func:`.search.node_host_bytes`), the offload split the
    node's host allows resolved once (:func:`.partial.resolve_offload`)."""

    def __init__(self, model: Model, mode: str, cap: float, host_cap: float):
        self.model, self.mode, self.cap, self.host_cap = model, mode, cap, host_cap
        self.planned: Dict[Job, Optional[Tuple[float, float, Job]]] = {}

    @property
    def tried(self) -> int:
        return len(self.planned)

    def plan(self, job: Job) -> Optional[Tuple[float, float, Job]]:
        """``(per-rank total, host bytes per node, the job with its offload split)``, or None
        when ``job`` is not valid or its offload holds no layer (the same job without it is
        tried on its own)."""
        if job not in self.planned:
            self.planned[job] = None
            try:
                validate(self.model, job, [self.mode])
            except ValueError:
                return None
            planned = job if self.mode == "alst" else resolve_offload(self.model, job, self.mode)
            if planned.offload and planned.offload_layers == 0:
                return None
            total = host = 0.0
            for stage in (("first", "last") if job.pp > 1 else ("first",)):
                mem = memory(self.model, planned, self.mode, stage=stage)
                total = max(total, mem.total)
                host = max(host, mem.act.host + mem.static["optimizer_host"])
            self.planned[job] = (total, GPUS_PER_NODE * host, planned)
        return self.planned[job]

    def __call__(self, job: Job) -> bool:
        p = self.plan(job)
        return p is not None and p[0] <= self.cap and p[1] <= self.host_cap


def _variants(fit: _Fit, base: Job, family: str, layers: int,
              skip: Callable[[str], bool] = lambda label: False
              ) -> Iterator[Tuple[str, Job]]:
    """``(recompute label, job)`` of every recompute option of ``base`` that fits (block and
    kept attention: the fastest count only, bisected), but those ``skip`` names. Without the
    activation offload, recompute only adds time: when ``none`` fits, nothing else is tried."""
    if not skip("none") and fit(base):
        yield "none", base
        if not base.offload:
            return
    if base.offload and base.offload_layers is None and not skip("offload"):
        # an offloaded layer whose saved tensors outgrow its forward's compute costs time
        # (.step_time): the fewest offloaded layers per stage that fit, the others on the device
        n = _smallest(lambda n: fit(replace(base, offload_layers=n)), 1, layers - 1)
        if n is not None:
            yield "offload", replace(base, offload_layers=n)
    sel = replace(base, recompute="selective")
    if not skip("selective") and fit(sel):
        yield "selective", sel
    full = replace(base, recompute="full", recompute_method="uniform", recompute_num_layers=1)
    for k in (d for d in range(1, layers + 1) if layers % d == 0):
        job = replace(full, recompute_num_layers=k)
        label = "full" if k == 1 else f"full (uniform, chunks of {k})"
        if not skip(label) and fit(job):
            yield label, job
    block = replace(full, recompute_method="block")
    if not skip("block"):
        n = _smallest(lambda n: fit(replace(block, recompute_num_layers=n)), 1, layers)
        if n is not None and n < layers:  # N = all layers: full recompute's time, tried above
            yield "block", replace(block, recompute_num_layers=n)
    if family == "metp" and not skip("keep") and fit(full):
        k = _largest(lambda k: fit(replace(full, keep_attention_output=k)), 1, layers)
        if k is not None:
            yield "keep", replace(full, keep_attention_output=k)


def _label(label: str, job: Job, layers: int) -> str:
    """The printed name of a recompute option (block: its count; kept attention: its layers)."""
    if label == "block":
        return f"full (block, {job.recompute_num_layers} of {layers} layers)"
    if label == "offload":  # the offload's own words name the count (Choice.describe)
        return "none"
    if label == "keep":
        return f"full, attention output kept ({job.keep_attention_output} of {layers} layers)"
    return label


def _choice(model: Model, family: str, mode: str, job: Job, label: str, fit: _Fit) -> Choice:
    total, host, planned = fit.plan(job)
    c = step_cost(model, planned, mode)
    seqs = (c["microbatches"] if mode != "alst" else 1) * job.dp * job.micro_batch
    return Choice(family, mode, planned, label, total, host, c["step_s"], c["iteration_s"],
                  seqs)


def family_choices(model: Model, gpus: int, family: str, hardware: str = "H100-80GB",
                   reserve_gib: float = 2.0, host_gib: float = DEFAULT_HOST_GIB_PER_NODE,
                   moe: Optional[Dict] = None, kernel: Optional[str] = None,
                   rates_file: Optional[str] = None) -> Tuple[List[Choice], int]:
    """``(every fitting choice of family, fastest first; candidates tried)`` at ``model.seq``."""
    moe = dict({"moe_dispatcher": "alltoall"}, **(moe or {})) if model.moe else {}
    common = dict(distributed_optimizer=True, hardware=hardware, reserve_gib=reserve_gib,
                  attention_kernel=kernel, rates_file=rates_file)
    cap, host_cap = capacity_bytes(Job(hardware=hardware, reserve_gib=reserve_gib)), \
        host_gib * GiB
    out: List[Choice] = []
    tried = 0
    for mode, fields in layouts(model, gpus, family):
        cap_pos = position_cap(mode)
        if cap_pos and model.seq > cap_pos:
            continue  # Megatron's fp32 RoPE recipe: positions collide past 2^24
        fit = _Fit(model, mode, cap, host_cap)
        if mode == "alst":
            job = Job(**common, **fields, recompute="full", offload=True, optimizer_offload=True,
                      host_memory_gib=host_gib)
            if fit(job):
                out.append(_choice(model, family, mode, job, "full (every layer)", fit))
            tried += fit.tried
            continue
        layers = model.layers // fields["pp"]
        for act in (False, True):
            for keep in ((False, True) if family == "metp" else (False,)):
                host = {"offload": True, "host_memory_gib": host_gib} if act else {}
                # the optimizer on the host only adds time (CPU Adam, .optimizer_time): with it
                # the options are tried that do not fit without it, and block / kept attention
                # again unless their count is already the best (the memory it frees may allow
                # fewer recomputed layers or more kept ones)
                done = set()

                def skip(label: str) -> bool:  # without offload, none fitting is fastest
                    return label in done or ("none" in done and not act)

                for off in (False, True):
                    base = Job(**common, **fields, **moe, **host, optimizer_offload=off,
                               keep_intermediate=keep)
                    for label, job in _variants(fit, base, family, layers, skip):
                        if label not in ("block", "keep", "offload") or \
                                {"block": job.recompute_num_layers,
                                 "offload": job.offload_layers,
                                 "keep": layers + 1 - (job.keep_attention_output or 0)
                                 }[label] == 1:
                            done.add(label)
                        out.append(_choice(model, family, mode, job,
                                           _label(label, job, layers), fit))
        tried += fit.tried
    out.sort(key=Choice.key)
    return out, tried


def fastest(model: Model, gpus: int, hardware: str = "H100-80GB", reserve_gib: float = 2.0,
            host_gib: float = DEFAULT_HOST_GIB_PER_NODE, families: Tuple[str, ...] = FAMILIES,
            **kw) -> Dict:
    """``{"choices": {family: fitting choices, fastest first}, "tried": {family: n},
    "search_s": seconds}`` at ``model.seq`` on ``gpus`` GPUs (ALST: dense models only)."""
    if hardware not in HARDWARE:
        raise ValueError(f"--hardware {hardware!r}: choose from {', '.join(HARDWARE)}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus!r}")
    t0 = time.perf_counter()
    choices, tried = {}, {}
    for fam in families:
        if model.moe and fam == "alst":
            continue
        choices[fam], tried[fam] = family_choices(model, gpus, fam, hardware, reserve_gib,
                                                  host_gib, **kw)
    return {"choices": choices, "tried": tried, "search_s": time.perf_counter() - t0}


def best_overall(res: Dict) -> Optional[Choice]:
    """The fastest choice of the families Megatron-LM runs (``metp``, ``stock``), or None."""
    bests = [c[0] for f, c in res["choices"].items() if f != "alst" and c]
    return min(bests, key=Choice.key) if bests else None


def _parallel(c: Choice) -> Dict[str, int]:
    """The sizes of a choice's layout by their Megatron-LM names (ALST: Ulysses over all)."""
    j = c.job
    if c.family == "alst":
        return {"ulysses": j.metp, "pp": 1, "dp": 1}
    if c.family == "metp":
        return {"tp": j.tp, "metp": j.metp, "cp": j.cp, "pp": j.pp, "dp": j.dp, "ep": j.ep}
    return {"tp": j.tp, "metp": 1, "cp": j.metp if c.mode == "cp" else 1, "pp": j.pp,
            "dp": j.dp, "ep": j.ep}


def choice_json(model: Model, gpus: int, c: Optional[Choice],
                launch_model: Optional[Model] = None) -> Optional[Dict]:
    """``fastest.<family>`` of the JSON: ``step_s`` (time per sequence), ``tokens_per_s_per_gpu``,
    ``layout``, ``flags`` (Megatron-LM's; None for ALST), ``total`` (bytes per rank), ...;
    ``launch_model``: the model the flags and launch line name (a ``--config``'s, whose
    vocabulary is the tokenizer's before Megatron adds its end-of-document token), else
    ``model``."""
    if c is None:
        return None
    from .launch import launch_line, megatron_flags

    j = c.job
    launchable = c.family != "alst"
    job = replace(j, host_memory_gib=None) if launchable else j
    lm = launch_model or model
    return {"step_s": c.time_s, "tokens_per_s_per_gpu": model.seq / (c.time_s * gpus),
            "model_tflops_per_gpu": model_flops(model) / (c.time_s * gpus) / 1e12,
            "layout": c.describe(), "mode": c.mode,
            "parallel": _parallel(c),
            "recompute": c.recompute, "recompute_method": j.recompute_method,
            "recompute_num_layers": j.recompute_num_layers, "offload": j.offload,
            "offload_layers": j.offload_layers, "optimizer_offload": j.optimizer_offload,
            "keep_attention_output": j.keep_attention_output,
            "flags": megatron_flags(lm, job, c.mode) if launchable else None,
            "launch": launch_line(lm, job, c.mode) if launchable else None,
            "total": c.total, "host_per_node": c.host_per_node,
            "micro_batch_s": c.micro_batch_s, "iteration_s": c.iteration_s,
            "sequences_per_iteration": c.sequences, "options": c.options}


def without_offload(cands: List[Choice]) -> Optional[Choice]:
    """The fastest of ``cands`` that keeps its activations on the device (no
    ``--metp-offload-activations``; ALST's recipe always offloads: None)."""
    return next((c for c in cands if not c.job.offload), None)


def fastest_json(model: Model, gpus: int, res: Dict) -> Dict:
    """The ``--json`` dict: ``fastest.{metp,stock,alst}`` (None where nothing fits), the
    fastest without activation offload per family (``without_activation_offload``), the
    search's counts and runtime."""
    ch, lm = res["choices"], res.get("launch_model")
    return {"seq": model.seq, "gpus": gpus, "model": model.name,
            "fastest": {f: choice_json(model, gpus, ch[f][0] if ch[f] else None, lm)
                        for f in FAMILIES if f in ch},
            "without_activation_offload": {f: choice_json(model, gpus, without_offload(ch[f]), lm)
                                           for f in FAMILIES if f in ch and f != "alst"},
            "fitting": {f: len(c) for f, c in res["choices"].items()},
            "tried": res["tried"], "search_s": res["search_s"]}


def fastest_report(model: Model, gpus: int, res: Dict, hardware: str = "H100-80GB",
                   reserve_gib: float = 2.0, host_gib: float = DEFAULT_HOST_GIB_PER_NODE,
                   top: int = 3, width: Optional[int] = None) -> str:
    """The text ``metp plan --fastest`` prints: per family the ``top`` fastest choices, the
    fastest one's figures, Megatron-LM flags and launch line, and the METP ÷ stock ratio."""
    from .textwidth import LEGEND, fmt_bytes, fmt_tokens, wrap_lines

    hw = HARDWARE[hardware]
    lines = [f"# fastest (planned): {geometry(model)} at {model.seq:,} tokens "
             f"({fmt_tokens(model.seq)}) on {gpus} × {hw.name} ({hw.memory_gib:g} GB − "
             f"{reserve_gib:g} GiB reserve; host ≤ {host_gib:,.0f} GiB per node); micro-batch 1, "
             f"bf16, distributed optimizer; every valid layout × recompute none / selective / "
             f"full / block N / full with the attention output kept × activation offload × "
             f"optimizer CPU offload; time per sequence = iteration / its sequences"
             + ("; a MoE model's EP searched (METP: multiples of METP)" if model.moe else "")]
    if model.name in PRESET_NOTES:
        lines.append(f"# {model.name}: {PRESET_NOTES[model.name]}")
    best = {}
    for fam, cands in res["choices"].items():
        lines.append("")
        lines.append(f"## {FAMILY_NAMES[fam]}: {res['tried'][fam]} layouts × options tried, "
                     f"{len(cands)} fit at {fmt_tokens(model.seq)}")
        if not cands:
            lines.append("  nothing fits")
            continue
        best[fam] = cands[0]
        for i, c in enumerate(cands[:top]):
            lines.append(f"  {'fastest' if i == 0 else f'#{i + 1}     '} {c.time_s:,.2f} s per "
                         f"sequence  {c.describe()}: {fmt_bytes(c.total)} per rank, host "
                         f"{fmt_bytes(c.host_per_node)} per node")
        d = choice_json(model, gpus, cands[0], res.get("launch_model"))
        lines.append(f"  fastest: {d['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                     f"{d['model_tflops_per_gpu']:,.0f} TFLOP/s per GPU (model FLOPs), "
                     f"iteration {d['iteration_s']:,.2f} s of {d['sequences_per_iteration']} "
                     f"sequence(s)")
        if d["flags"] is not None:
            lines.append(f"  fastest, Megatron-LM flags: {' '.join(d['flags'])}")
            lines.append(f"  fastest, launch: {d['launch']}")
            kept = without_offload(cands)
            if kept is not cands[0]:
                lines.append("  fastest without activation offload: " + (
                    f"{kept.time_s:,.2f} s per sequence  {kept.describe()}: "
                    f"{fmt_bytes(kept.total)} per rank" if kept else "nothing fits"))
    lines.append("")
    if "metp" in best:
        other = best.get("stock")
        lines.append(f"# fastest METP ÷ fastest stock Megatron: {best['metp'].time_s:,.2f} s / "
                     f"{other.time_s:,.2f} s = {best['metp'].time_s / other.time_s:.2f}×"
                     if other else f"# fastest METP {best['metp'].time_s:,.2f} s per sequence; "
                     f"stock Megatron: nothing fits")
    kept = {f: without_offload(c) for f, c in res["choices"].items() if f != "alst"}
    if kept.get("metp") and kept.get("stock"):
        lines.append(f"# without activation offload: fastest METP ÷ fastest stock Megatron: "
                     f"{kept['metp'].time_s:,.2f} s / {kept['stock'].time_s:,.2f} s = "
                     f"{kept['metp'].time_s / kept['stock'].time_s:.2f}×")
    if "metp" in best and "alst" in best:
        lines.append(f"# fastest METP ÷ ALST: {best['metp'].time_s / best['alst'].time_s:.2f}×")
    lines.append(f"# searched in {res['search_s']:.2f} s")
    lines.append(LEGEND)
    return "\n".join(wrap_lines(lines, width))


__all__ = ["Choice", "DEFAULT_HOST_GIB_PER_NODE", "best_overall", "choice_json", "family_choices",
           "fastest", "fastest_json", "fastest_report", "model_flops", "without_offload"]
