"""``metp plan --reach``: the longest sequence a model can train on a number of GPUs, searched
over every valid layout of each family, and the best layout per family.

Families (``world = gpus``, micro-batch 1, the distributed optimizer on, bf16):

* ``metp``: TP ``t`` × METP ``p`` × CP ``c`` × PP × DP, the vocabulary ring on (mode ``metp``
  with ``vocab_parallel``; ``c`` the outer factor of Megatron's CP group of size ``p·c``). The
  METP group stays inside a node (``t·p`` divides the GPUs of a node, ``p ≥ 2``), ``t·p`` divides
  the heads, the K/V groups and the FFN (the head-group loop: at most as many METP·TP shards as
  K/V groups).
* ``stock``: stock Megatron, TP ``t`` (+SP when ``t > 1``) inside a node × CP × PP × DP (mode
  ``tp-sp`` without CP, ``cp`` with it: the K/V ring over the CP ranks, weights whole over them).

Options, for every layout: recompute none / full (uniform, one layer a chunk) / full + host
offload of the layer inputs (``--metp-offload-activations``, the project's offload, planned for
the stock layers the same way; as many layers per stage as ``host_gib`` per node holds, the rest
kept on the device: :mod:`.partial`), each with and without Megatron's
``--optimizer-cpu-offload``. A layout fits at ``s`` when its planned per-rank total (the larger of the first and the last
pipeline stage) fits the device minus the reserve and the host bytes of a node (offloaded
activations + offloaded optimizer, eight ranks of the larger stage) fit ``host_gib`` per node.
``s`` is searched in multiples of the layout's step (:func:`.rank_memory.seq_step`), doubling
then bisecting, up to ``limit`` tokens, and for layouts on Megatron's fp32 RoPE recipe (stock)
up to 2^24 tokens (:mod:`.positions`: their positions collide past it; the report says so); the best candidate of a family is the longest sequence,
ties going to fewer options (no offload before offload) and then the lower per-rank total.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Tuple

from .hardware import HARDWARE
from .internode import GPUS_PER_NODE, internode_hop
from .job_checks import validate
from .model import GiB, Job, Model
from .positions import FP32_EXACT_POSITIONS, REASON as POSITIONS_REASON, position_cap
from .rank_memory import capacity_bytes, pipeline_ends, seq_step, stage_memories

#: host memory of one node by default: DGX H100 / H200 have 2 TB of system memory (NVIDIA DGX
#: H100/H200 user guide, hardware overview) = 2·10¹² B = 1,862 GiB
DEFAULT_HOST_GIB_PER_NODE = 2e12 / GiB

RECOMPUTE_OPTIONS: Tuple[Tuple[str, Dict], ...] = (
    ("none", {}),
    ("full", {"recompute": "full"}),
    ("full + offload", {"recompute": "full", "offload": True}),
)
FAMILIES = ("metp", "stock", "alst")
FAMILY_NAMES = {"metp": "METP (TP × METP × CP × PP × DP)",
                "stock": "stock Megatron (TP+SP × CP × PP × DP)",
                "alst": "ALST (Ulysses over all GPUs + ZeRO-3, optimizer and checkpoints on the "
                        "host; its published recipe)"}


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Candidate:
    family: str
    mode: str
    job: Job
    recompute: str           # a name of RECOMPUTE_OPTIONS
    seq: int = 0             # the longest sequence that fits (0: none)
    total: float = 0.0       # planned per-rank total at ``seq`` (bytes, the larger stage)
    host_per_node: float = 0.0  # host bytes of a node at ``seq``
    offload_layers: Optional[int] = None  # layers per stage offloaded at ``seq`` (.partial)
    internode: Optional[Dict[str, float]] = field(default=None, repr=False)
    time_s: Optional[float] = None  # planned time of one sequence at ``seq`` (step_cost)
    capped: bool = False     # stopped at 2^24 tokens by Megatron's fp32 RoPE recipe (.positions)

    @property
    def options(self) -> int:
        """How many memory-saving options the candidate uses (the tie-break)."""
        return (self.recompute != "none") + ("offload" in self.recompute) + \
            int(self.job.optimizer_offload)

    def describe(self) -> str:
        j = self.job
        if self.family == "alst":
            return f"Ulysses {j.metp} + ZeRO-3, checkpoints and optimizer on the host"
        if self.family == "metp":
            parts = [f"TP {j.tp}", f"METP {j.metp}", f"CP {j.cp}"]
        else:
            parts = [f"TP {j.tp}" + ("+SP" if j.tp > 1 else ""),
                     f"CP {j.metp if self.mode == 'cp' else 1}"]
        parts += [f"PP {j.pp}", f"DP {j.dp}"]
        if j.ep:  # a MoE model's stock layout (METP: EP = METP)
            parts.append(f"EP {j.ep}")
        opts = [f"recompute {self.recompute}"]
        if self.offload_layers is not None:
            opts[0] += f" ({self.offload_layers} layers per stage offloaded, the rest kept)"
        if j.optimizer_offload:
            opts.append("optimizer on host")
        return " × ".join(parts) + ", " + ", ".join(opts)


def layouts(model: Model, gpus: int, family: str,
            gpus_per_node: int = GPUS_PER_NODE) -> Iterator[Tuple[str, Dict]]:
    """``(mode, Job fields)`` of every layout of ``family`` on ``gpus`` GPUs (before the checks
    of :func:`.job_checks.validate`, which :func:`candidates` applies)."""
    node = min(gpus, gpus_per_node)
    for t in _divisors(node):
        for pp in _divisors(gpus // t):
            if model.layers % pp:
                continue
            rest = gpus // (t * pp)
            if family == "metp":
                for p in _divisors(node // t):
                    if p < 2 or rest % p:
                        continue
                    for c in _divisors(rest // p):
                        fields = dict(tp=t, metp=p, cp=c, pp=pp, dp=rest // (p * c),
                                      vocab_parallel=True)
                        # MLA + MoE (DeepSeek): EP = p, or wider (a multiple of p over METP ×
                        # CP × DP, megatron/wide_ep.py) dividing the experts (DeepSeek-V3's 256
                        # experts do not fit 8 ranks); other MoE models: EP = p
                        for ep in ([e for e in _divisors(rest) if e % p == 0 and
                                    model.experts % e == 0] if model.moe and model.mla
                                   else [0]):
                            yield "metp", dict(fields, ep=0 if ep == p else ep)
            elif family == "alst":
                if t == 1 and pp == 1:  # one layout: Ulysses over every GPU
                    yield "alst", dict(tp=1, metp=gpus, pp=1, dp=1)
            elif family == "stock":
                for c in _divisors(rest):
                    if c == 1:
                        fields = dict(tp=t, metp=1, pp=pp, dp=rest)
                    else:
                        fields = dict(tp=t, metp=c, pp=pp, dp=rest // c)
                    # MoE: every EP out of TP × CP × DP (parallel folding) dividing the experts
                    for ep in ([e for e in _divisors(rest * t) if model.experts % e == 0]
                               if model.moe else [0]):
                        yield ("tp-sp" if c == 1 else "cp"), dict(fields, ep=ep)
            else:
                raise ValueError(f"--reach: unknown family {family!r}; choose from "
                                 f"{', '.join(FAMILIES)}")


class _StageMemories:
    """:func:`.rank_memory.memory` of each pipeline stage (the first; the last too when
    ``job.pp > 1``) of one ``(model, job, mode)``, computed once per sequence length: the search
    asks for a length's device total and its host bytes, and again for the length it keeps (a
    cache only; the plan of a length does not change during a search)."""

    def __init__(self, model: Model, job: Job, mode: str):
        self.model, self.job, self.mode = model, job, mode
        self._at: Dict[int, list] = {}

    def __call__(self, s: int) -> list:
        if s not in self._at:
            self._at[s] = stage_memories(self.model, self.job, self.mode, s,
                                         pipeline_ends(self.job))
        return self._at[s]


def _host_of(mems: list) -> float:
    """The larger stage's offloaded activations and host optimizer state per rank, times
    GPUS_PER_NODE ranks."""
    worst = 0.0
    for mem in mems:
        worst = max(worst, mem.act.host + mem.static["optimizer_host"])
    return GPUS_PER_NODE * worst


def _total_of(mems: list) -> float:
    """The larger per-rank device total of the stages."""
    return max(mem.total for mem in mems)


def node_host_bytes(model: Model, job: Job, mode: str, s: int) -> float:
    """Host bytes of one node at sequence ``s``: the larger stage's offloaded
    activations and host optimizer state per rank, times GPUS_PER_NODE ranks."""
    return _host_of(_StageMemories(model, job, mode)(s))


def rank_total(model: Model, job: Job, mode: str, s: int) -> float:
    """The planned per-rank device total (bytes) at sequence ``s``, the larger of the first and
    the last pipeline stage."""
    return _total_of(_StageMemories(model, job, mode)(s))


#: the names tests/test_plan_cp.py calls them by
_host_per_node, _total = node_host_bytes, rank_total


def longest(model: Model, job: Job, mode: str, host_gib: float = DEFAULT_HOST_GIB_PER_NODE,
            limit: int = 1 << 28, _mems: Optional[_StageMemories] = None) -> int:
    """Longest ``s`` (a multiple of the layout's step) whose per-rank total fits the device
    and whose host bytes per node fit ``host_gib``; 0 if none. (``_mems``: the plans already
    made of this model, job and mode, :class:`_StageMemories`.)"""
    cap, host_cap = capacity_bytes(job), host_gib * GiB
    q = seq_step(job, mode)
    mems = _StageMemories(model, job, mode) if _mems is None else _mems

    def fits(k: int) -> bool:
        at = mems(k * q)
        return _total_of(at) <= cap and _host_of(at) <= host_cap

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * q <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi * q > limit:  # treat the first step beyond the limit as not fitting
        hi = limit // q + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * q


def candidates(model: Model, gpus: int, family: str, hardware: str = "H100-80GB",
               reserve_gib: float = 2.0, host_gib: float = DEFAULT_HOST_GIB_PER_NODE,
               optimizer_offload: Tuple[bool, ...] = (False, True),
               recompute: Tuple[str, ...] = tuple(n for n, _ in RECOMPUTE_OPTIONS),
               limit: int = 1 << 28, moe: Optional[Dict] = None) -> List[Candidate]:
    """Every valid layout × option of ``family`` with its longest sequence, best first; ``moe``:
    a MoE model's Job fields (default the alltoall dispatcher, balanced routing, METP's MoE
    token tiles; stock layouts search EP themselves)."""
    if hardware not in HARDWARE:
        raise ValueError(f"--hardware {hardware!r}: choose from {', '.join(HARDWARE)}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus!r}")
    opts = dict(RECOMPUTE_OPTIONS)
    for name in recompute:
        if name not in opts:
            raise ValueError(f"--reach-recompute {name!r}: choose from {', '.join(opts)}")
    out: List[Candidate] = []
    # MoE: the alltoall dispatcher (the smaller buffers at EP > 1), balanced routing
    moe = dict({"moe_dispatcher": "alltoall"}, **(moe or {})) if model.moe else {}
    for mode, fields in layouts(model, gpus, family):
        for name in recompute:
            for off in optimizer_offload:
                if mode == "alst" and (name != "full + offload" or not off):
                    continue  # ALST's recipe: checkpoints and optimizer on the host
                # with the offload, the node's host memory sets how many layers go there
                host = {"host_memory_gib": host_gib} if opts[name].get("offload") else {}
                job = Job(distributed_optimizer=True, hardware=hardware, reserve_gib=reserve_gib,
                          optimizer_offload=off, **fields, **opts[name], **host, **moe)
                q = seq_step(job, mode)
                try:
                    validate(model.with_seq(q), job, [mode])
                except ValueError:
                    continue  # not a valid layout of this model (divisibility, layers, ...)
                cand = Candidate(family, mode, job, name)
                cap = position_cap(mode, job)
                mems = _StageMemories(model, job, mode)
                cand.seq = longest(model, job, mode, host_gib, min(limit, cap or limit), mems)
                # capped: the next step past 2^24 would fit the memory, not the positions
                cand.capped = bool(cap and cap < limit and cand.seq + q > cap and
                                   longest(model, job, mode, host_gib, cand.seq + q,
                                           mems) > cand.seq)
                if cand.seq:
                    at = mems(cand.seq)
                    cand.total = _total_of(at)
                    cand.host_per_node = _host_of(at)
                    cand.internode = internode_hop(model, job, mode, cand.seq)
                    cand.offload_layers = None if mode == "alst" else at[0].job.offload_layers
                out.append(cand)
    out.sort(key=lambda c: (-c.seq, c.options, c.total))
    return out


def reach(model: Model, gpus: int, hardware: str = "H100-80GB", reserve_gib: float = 2.0,
          host_gib: float = DEFAULT_HOST_GIB_PER_NODE, families: Tuple[str, ...] = FAMILIES,
          limit: int = 1 << 28, **kw) -> Dict[str, List[Candidate]]:
    """``{family: candidates best first}`` (see :func:`candidates`); ALST's recipe is planned
    for dense models only (a MoE model: ``metp`` and ``stock``)."""
    return {f: candidates(model, gpus, f, hardware, reserve_gib, host_gib, limit=limit, **kw)
            for f in families if not (model.moe and f == "alst")}


def launch_job(model: Model, cand: Candidate) -> Tuple[Model, Job]:
    """``(model at the candidate's sequence, job with the offload split it planned)``: what
    :mod:`.launch` writes for a candidate of ``metp`` or ``stock`` (not ``alst``)."""
    return model.with_seq(cand.seq), replace(cand.job, offload_layers=cand.offload_layers,
                                             host_memory_gib=None)


def best_launch(model: Model, res: Dict[str, List["Candidate"]]) -> Optional[Candidate]:
    """The longest-reaching best candidate of the families Megatron-LM runs (``metp``, then
    ``stock`` on a tie); None when neither fits."""
    bests = [c for f in ("metp", "stock") for c in res.get(f, [])[:1] if c.seq]
    return max(bests, key=lambda c: c.seq) if bests else None


def geometry(model: Model) -> str:
    """``name h=… L=… a=…[, G K/V groups] ffn=… vocab=…``: the model line of a search's
    report (``--reach``, ``--fastest``)."""
    g = f", {model.groups} K/V groups" if model.groups != model.heads else ""
    return (f"{model.name} h={model.hidden} L={model.layers} a={model.heads}{g} "
            f"ffn={model.ffn} vocab={model.vocab}")


def reach_report(model: Model, gpus: int, hardware: str = "H100-80GB", reserve_gib: float = 2.0,
                 host_gib: float = DEFAULT_HOST_GIB_PER_NODE, top: int = 3,
                 limit: int = 1 << 28,
                 res: Optional[Dict[str, List[Candidate]]] = None,
                 width: Optional[int] = None) -> str:
    """The text ``metp plan --reach`` prints: per family the ``top`` layouts, the best one's
    Megatron-LM flags and ``scripts/pretrain_gpt.sh`` line, and the ratio of the two families'
    best (``res``: :func:`reach`'s result, computed here when not given), with the units
    legend; long lines wrapped to ``width`` columns (None: whole, ``metp plan --reach --wide``)."""
    from .launch import launch_line, megatron_flags
    from .textwidth import LEGEND, wrap_lines
    from .textwidth import fmt_bytes, fmt_tokens

    if res is None:
        res = reach(model, gpus, hardware, reserve_gib, host_gib, limit=limit)
    hw = HARDWARE[hardware]
    lines = [f"# reach (planned): {geometry(model)} on {gpus} × {hw.name} "
             f"({hw.memory_gib:g} GB − {reserve_gib:g} GiB reserve; host ≤ {host_gib:,.0f} GiB "
             f"per node of {GPUS_PER_NODE}); micro-batch 1, bf16, distributed optimizer; every "
             f"valid layout × recompute none / full / full + offload × optimizer CPU offload "
             f"off / on"]
    best = {}
    for fam, cands in res.items():
        fitting = [c for c in cands if c.seq]
        lines.append("")
        lines.append(f"## {FAMILY_NAMES[fam]}: {len(cands)} layouts × options, "
                     f"{len(fitting)} fit at some length")
        if not fitting:
            lines.append("  nothing fits")
            continue
        best[fam] = fitting[0]
        if any(position_cap(c.mode, c.job) for c in cands):
            lines.append(f"  capped at 2^24 tokens ({sum(c.capped for c in cands)} layouts × "
                         f"options stop there): {POSITIONS_REASON}")
        for i, c in enumerate(fitting[:top]):
            hop = c.internode
            kv = ""
            if hop and hop["crosses"]:
                kv = (f"; K/V ring crosses {hop['nodes']} nodes, {hop['tokens_per_rank']:,} "
                      f"tokens/rank vs inter-node threshold {hop['threshold_forward']:,.0f} "
                      f"({'hidden' if hop['hidden'] else 'NOT hidden'})")
            c.time_s = sequence_time(model, c)
            lines.append(f"  {'best' if i == 0 else f'#{i + 1}  '} {fmt_tokens(c.seq):>10} "
                         f"tokens  {c.describe()}: {fmt_bytes(c.total)} per rank, host "
                         f"{fmt_bytes(c.host_per_node)} per node, {c.time_s:,.0f} s per "
                         f"sequence{kv}"
                         + (" (capped: positions < 2^24)" if c.capped else "")
                         + (" (exact RoPE angles past 2^24)" if c.seq > FP32_EXACT_POSITIONS
                            else ""))
        if fam != "alst":  # ALST's recipe runs on DeepSpeed, not Megatron-LM
            m, j = launch_job(model, fitting[0])
            flags = " ".join(megatron_flags(m, j, fitting[0].mode))
            lines.append(f"  best, Megatron-LM flags: {flags}")
            lines.append(f"  best, launch: {launch_line(m, j, fitting[0].mode)}")
    if "metp" in best and "stock" in best:
        m, s = best["metp"].seq, best["stock"].seq
        lines.append("")
        lines.append(f"# best METP ÷ best stock Megatron: {fmt_tokens(m)} / {fmt_tokens(s)} = "
                     f"{m / s:.2f}×" if s else f"# best METP {fmt_tokens(m)}; stock: nothing fits")
    lines.append(LEGEND)
    return "\n".join(wrap_lines(lines, width))


def sequence_time(model: Model, cand: Candidate) -> float:
    """Planned time of one sequence of ``cand.seq`` tokens (one micro-batch, the step-time model
    :func:`.step_time.step_time`, the default kernel of the hardware; ALST: FlashAttention-2)."""
    from .cost import step_cost

    return step_cost(model.with_seq(cand.seq), cand.job, cand.mode)["step_s"]


def best(model: Model, gpus: int, family: str, **kw) -> Optional[Candidate]:
    """The best fitting candidate of ``family`` (None when nothing fits)."""
    for c in candidates(model, gpus, family, **kw):
        if c.seq:
            return c
    return None


__all__ = ["Candidate", "DEFAULT_HOST_GIB_PER_NODE", "FAMILIES", "RECOMPUTE_OPTIONS", "best",
           "best_launch", "launch_job",
           "sequence_time",
           "candidates", "layouts", "longest", "reach", "reach_report"]
