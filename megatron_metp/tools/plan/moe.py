"""Mixture-of-Experts in the plan: Megatron's ``MoELayer`` (router, experts, the allgather or
alltoall token dispatcher) in place of the MLP, beside METP attention or the stock layers
(issue 30, DESIGN.md §10).

**Parameters** of a MoE layer: the router ``[E, h]`` (every rank of the layer holds it whole;
its gradient reduces over DP × CP like the norms') and ``E / EP`` experts of ``(k + 1)·f′·h``
elements on each rank of the expert-parallel group (``k = 2`` with SwiGLU, ``f′`` the expert FFN,
expert TP 1). Under METP the experts are sharded over the METP group (EP = p, Megatron's expert
groups are the METP ranks) and their gradients reduce over expert-DP = CP × DP; with ``--ep``
``p·e`` (EP wider than the METP group) over ``e`` METP groups, expert-DP = CP·DP/e, and the
METP-sharded weights, which ride in Megatron's expert buffers, shard their distributed-optimizer
state over that expert-DP too (:func:`.parameters.params`); stock Megatron
with parallel folding takes EP out of TP × CP × DP, expert-DP = TP·CP·DP / EP. Dense layers
(``--moe-layer-freq N``: layers 0, N, 2N, ... are MoE, the others dense) keep the mode's MLP.

**Tokens.** ``N`` tokens enter a rank's MoE layer (METP: ``s/(p·c)``; stock: ``s/(t·c)``, the
sequence-parallel shard), each routed to ``k`` experts; the busiest EP rank runs
``r = N·k·imbalance`` routed rows, ``imbalance`` the stated factor (``--moe-imbalance``; 1 =
every EP rank gets the mean).

**Routed-token bytes** per routed row (:func:`routed_row_bytes`, read from megatron-core
0.16.1's expert ``MLP`` with the weighted SwiGLU): kept for the backward the experts' input
(``2h``, bf16), fc1's output (``2k·f′``: gate|up), fc2's input (``2f′``) and the row's
probability (4 B); the backward adds the experts' output gradient (``2h``) and the activation
and fc1-output gradients (``(2k + 2)·f′``): with ``--moe-grouped-gemm`` (every expert at once)
that is issue 30's ``n·k·(4h + 12f′)`` (17 GiB per 131,072 tokens per rank for Qwen3-30B-A3B);
Megatron's default ``SequentialMLP`` runs the experts one after another, so only one expert's
gradients are alive beside the output gradient (:func:`.moe_steps.backward_rows`).

**MoE token tiles** (mode ``metp``, :class:`megatron_metp.megatron.moe_tiles.TiledMoELayer`):
the router runs once over the rank's tokens, the routed part over ``T`` tiles of
``ceil(N/T)`` tokens, each tile's routed rows re-formed in its own backward, so a layer keeps
none of them and its phases hold one tile's (with the input gradient ``[N, h]``, the
probabilities' gradient ``[N, E]`` fp32 and this rank's experts' weight gradients summed over
the tiles); ``T`` as the layer resolves it (:func:`tile_count`: ``METP_MOE_TOKEN_TILES``, else
the fewest tiles within ``METP_TILE_BUDGET_MIB``, 1 GiB). ``--no-moe-token-tiles`` plans one
tile (``METP_MOE_TOKEN_TILES=1``).

**Dispatcher buffers and the MoE layer's forward and backward steps**: :mod:`.moe_steps`.

**Activations** (:func:`moe_layer`): a MoE layer stores the router's ``[N, E]`` logits,
probabilities and routing map, with one tile ``r`` routed rows of ``2h + 6f′ + 4`` bytes, and
its shared expert's tensors (:func:`shared_stored`: stock's fc1 output and fc2 input; none under
METP); the shared expert's forward and backward are phases of their own
(:func:`shared_phases`); the last layer's
MLP phases become the MoE's (forward: the output ``[N, h]`` and the combine's buffers; backward:
the gradients of the routed rows, the dispatcher's backward buffers and one expert's bf16 weight
gradient; with tiles, one tile's rows re-formed and their gradients); the attention backward runs after the MoE's stored tensors are freed. Under full recompute stock
Megatron's dispatcher also keeps its last call's routing on the device until the layer's
recompute (:func:`dispatch_state`; METP's layer drops it). With
``--moe-layer-freq`` > 1 the stored bytes per layer are the stage's average and the last
layer's phases those of its kind.

**Time** (:mod:`.moe_time`): the token dispatch over the link the EP group spans, the expert
GEMMs at a rate for their shape (sequential or grouped) on the busiest EP rank, the router and
the shared expert; :func:`active_twin` (the dense model of the active FFN, ``k·f′`` per token)
remains the model FLOPs' and the per-layer ring traffic's model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Tuple

from .metp import metp_phases
from .model import BF16, FP32, Job, Model
from .moe_steps import (backward_rows, dispatcher, expert_ffn, moe_backward, moe_forward,
                        routed_rows)
from .stock import stock_mlp_phases

#: phase and stored-item names
MOE_FREED = "(MoE layer's stored activations freed)"
DISPATCHERS = ("allgather", "alltoall")


def moe_layer_flags(model: Model) -> List[bool]:
    """Which layers are MoE (Megatron's ``--moe-layer-freq N``: ``i % N == 0``; the first
    ``moe_first_dense`` dense, ``--moe-layer-freq ([0]*N+[1]*(L-N))``)."""
    if not model.moe:
        return [False] * model.layers
    return [i >= model.moe_first_dense and i % model.moe_layer_freq == 0
            for i in range(model.layers)]


def layer_freq_arg(model: Model) -> str:
    """``--moe-layer-freq``'s value: ``N``, or ``([0]*k+[1]*(L-k))`` with ``k`` leading dense
    layers."""
    k = model.moe_first_dense
    return f"([0]*{k}+[1]*{model.layers - k})" if k else str(model.moe_layer_freq)


def stage_layers(model: Model, pp: int, stage: str = "first") -> Tuple[int, int]:
    """``(MoE layers, dense layers)`` of the first (or last) pipeline stage."""
    L = model.layers // pp
    flags = moe_layer_flags(model)
    flags = flags[:L] if stage == "first" or pp == 1 else flags[-L:]
    return sum(flags), L - sum(flags)


def expert_elements(model: Model) -> Tuple[int, int]:
    """``(router, one expert)`` elements of a MoE layer."""
    k = 2 if model.swiglu else 1
    f = expert_ffn(model)
    return model.experts * model.hidden, (k + 1) * f * model.hidden


def expert_parallel(job: Job, lay) -> int:
    """EP: for mode ``metp`` the METP group (``p``) or ``job.ep`` when given (a multiple of
    ``p``: EP wider than the METP group, over METP × CP × DP,
    :mod:`megatron_metp.megatron.wide_ep`); ``job.ep`` (default 1) for stock modes."""
    if lay.mode in ("metp", "metp+vocab"):
        return job.ep or lay.p
    return job.ep or 1


def expert_dp(job: Job, lay, ep: int) -> int:
    """The expert-data-parallel size, over which expert gradients reduce (and the distributed
    optimizer shards their states): the ranks of the layer's sequence shards and DP (TP × CP ×
    DP; METP: p × CP × DP) over EP."""
    return lay.t * lay.c * job.dp // ep


def routed_row_bytes(model: Model) -> Tuple[int, int]:
    """``(stored, backward)`` bytes per routed row (see the module docstring): stored the
    experts' input (bf16), fc1's output (bf16; gate|up with SwiGLU), fc2's input (bf16) and the
    row's probability (fp32, kept by the weighted activation); the backward's largest step adds
    the output gradient (bf16) and, all experts at once (grouped GEMM), the gradients of fc2's
    input and fc1's output (bf16)."""
    h, f = model.hidden, expert_ffn(model)
    k = 2 if model.swiglu else 1
    return BF16 * (h + k * f + f) + FP32, BF16 * (h + k * f + f)


def tiled(job: Job, lay) -> bool:
    """Whether the MoE layers run :class:`~megatron_metp.megatron.moe_tiles.TiledMoELayer`
    (mode ``metp``; stock Megatron's ``MoELayer`` never tiles)."""
    return lay.mode in ("metp", "metp+vocab") and job.moe_token_tiles


def tile_count(model: Model, job: Job, lay, N: int) -> int:
    """MoE token tiles of a rank's ``N`` tokens: 1 (stock, or ``--no-moe-token-tiles`` =
    ``METP_MOE_TOKEN_TILES=1``), else as the METP MoE layer resolves them
    (:func:`megatron_metp.megatron.moe_tiles.resolve_moe_tiles`: the job's
    ``--metp-moe-token-tiles`` (``Job.moe_tile_count``), else ``METP_MOE_TOKEN_TILES``, or the
    fewest tiles whose routed bytes ``k·(4h + 12f′)`` per token fit ``METP_TILE_BUDGET_MIB``)."""
    if not tiled(job, lay):
        return 1
    import warnings

    with warnings.catch_warnings():  # megatron-core's "TE/Apex not installed" on import
        warnings.simplefilter("ignore")
        from ...megatron.moe_tiles import resolve_moe_tiles, routed_row_bytes as row
    return resolve_moe_tiles(N, row(model.hidden, expert_ffn(model), model.topk, elem=BF16,
                                    gated=model.swiglu), job.moe_tile_count)


def tile_tokens(model: Model, job: Job, lay, N: int) -> int:
    """Tokens of the largest MoE tile (the op's balanced tiles: ``ceil(N/T)``)."""
    return -(-N // tile_count(model, job, lay, N))


def mpu_buffer(model: Model, job: Job, lay, N: int) -> float:
    """Bytes of Megatron's global ``"mpu"`` buffer that the allgather dispatcher gathers a
    pass's tokens into (``gather_from_sequence_parallel_region(..., use_global_buffer=True)``
    over the TP × EP group, expert TP 1): ``[T·ep, h]`` bf16, ``T`` the tokens of one pass (one
    MoE tile under METP, else ``N``), allocated at the first MoE layer's dispatch and held for
    the whole step (the same buffer as stock SP's all-gathers: the larger sets its size). None
    with EP 1 (nothing gathered) or the alltoall dispatcher."""
    ep = expert_parallel(job, lay)
    if not model.moe or job.moe_dispatcher != "allgather" or ep == 1:
        return 0.0
    return BF16 * tile_tokens(model, job, lay, N) * ep * model.hidden


def shared_stored(model: Model, lay, N: int) -> Dict[str, float]:
    """What a MoE layer's shared expert (``--moe-shared-expert-intermediate-size F_s``) keeps
    for its backward beyond the pre-MLP norm's output it reads (counted with the norms).

    Stock Megatron's ``SharedExpertMLP`` is an ``MLP`` of width ``F_s``, TP-sharded as the
    dense one and on all ``n`` tokens of the TP group (SP all-gathers its input, saving the
    local shard: the norm output): fc1's output ``[n, k·F_s/t]`` (gate|up; the fused SwiGLU
    keeps only its input) and fc2's input ``[n, F_s/t]`` (bf16). METP's
    :class:`~megatron_metp.megatron.shared_expert.METPSharedExpertMLP` runs the METP MLP op,
    which saves its input and its weights only and re-forms ``x·W1ᵀ`` in the backward
    (``--keep-intermediate`` is refused with experts): nothing more. The optional sigmoid gate
    (``--moe-shared-expert-gate``, not a plan setting) would add its ``[N, h]`` ungated output
    and ``[N, 1]`` score."""
    Fs = model.moe_shared_ffn
    if not model.moe or not Fs or lay.mode in ("metp", "metp+vocab"):
        return {}
    n = N * lay.t if lay.sp else N  # the TP group's tokens (SP: the shard's N gathered)
    if model.swiglu:
        return {"MoE shared expert: fc1 output, gate|up (bf16)": BF16 * n * 2 * Fs // lay.t,
                "MoE shared expert: silu(gate)·up = fc2 input (bf16)": BF16 * n * Fs // lay.t}
    return {"MoE shared expert: fc1 output (bf16)": BF16 * n * Fs // lay.t,
            "MoE shared expert: GeLU output (bf16)": BF16 * n * Fs // lay.t}


def shared_phases(model: Model, job: Job, lay, N: int, S: Dict[str, float],
                  routed: float) -> Dict[str, Dict[str, float]]:
    """The shared expert's forward and backward transients in the last MoE layer, relative to
    everything stored: the mode's MLP of width ``F_s`` (METP's op, :func:`.metp.metp_phases`;
    stock's, :func:`.stock.stock_mlp_phases`). Its forward runs before the router (nothing of
    the router's and routed experts' ``routed`` bytes formed yet), its backward after theirs
    (freed by then; the routed part's input gradient ``[N, h]`` held to be summed with the
    shared expert's)."""
    if not model.moe_shared_ffn:
        return {}
    twin = replace(model, ffn=model.moe_shared_ffn)
    if lay.mode in ("metp", "metp+vocab"):
        ph = metp_phases(twin, job, lay, N, S)
        fwd, bwd = ph["MLP forward (last layer)"], ph["MLP backward (last layer)"]
    else:
        ph = stock_mlp_phases(twin, lay, N * lay.t if lay.sp else N, N)
        fwd, bwd = ph["forward"], ph["backward"]
    return {"MLP shared expert forward (last layer)":
            dict({"(MoE router and routed experts' tensors not formed yet)": -routed}, **fwd),
            "MLP shared expert backward (last layer)":
            dict({"(MoE router and routed experts' tensors freed)": -routed,
                  "the routed part's input gradient [tokens, h], held (bf16)":
                      BF16 * N * model.hidden}, **bwd)}


def moe_stored(model: Model, job: Job, lay, N: int) -> Dict[str, float]:
    """What one MoE layer keeps for its backward beyond its norms (one micro-batch): the
    router's, the routed rows' (untiled) and the shared expert's (:func:`shared_stored`)."""
    S = {"MoE router: logits, probabilities and routing map [tokens, E] (bf16, fp32, bool)":
         (BF16 + FP32 + 1) * N * model.experts,
         "MoE router: top-k indices (int64)": 8 * N * model.topk}
    if tile_count(model, job, lay, N) == 1:  # untiled: the routed rows kept (module docstring)
        stored, _ = routed_row_bytes(model)
        S["MoE routed rows: experts' input, fc1's output, fc2's input, probability"] = \
            routed_rows(model, job, N) * stored
    S.update(shared_stored(model, lay, N))
    return S


def moe_phases(model: Model, job: Job, lay, N: int) -> Dict[str, Dict[str, float]]:
    """The MoE layer's forward and backward transients (the last layer's MLP phases), relative
    to everything stored."""
    ep = expert_parallel(job, lay)
    T = tile_tokens(model, job, lay, N)
    stored, _ = routed_row_bytes(model)
    rt = routed_rows(model, job, T)
    disp = dispatcher(model, job, ep, T)
    k = 2 if model.swiglu else 1
    wgrad = {"one expert's fc1 weight gradient (bf16)": BF16 * k * expert_ffn(model) *
             model.hidden}
    out_n = BF16 * N * model.hidden
    grads = backward_rows(model, job, ep, rt)
    if T < N:
        tile = f"one tile of {T:,} tokens ({rt:,.0f} routed rows)"
        fwd = {"MoE output [tokens, h], filled tile by tile (bf16)": out_n,
               f"{tile}: routed rows formed": rt * stored,
               **max(disp["dispatch"], disp["combine"], key=lambda d: sum(d.values()))}
        local = model.experts // ep
        _, one = expert_elements(model)
        bwd = {"MoE input gradient [tokens, h], filled tile by tile (bf16)": out_n,
               "routing probabilities' gradient [tokens, E] (fp32)": FP32 * N * model.experts,
               "this rank's experts' weight gradients, summed over the tiles (bf16)":
                   BF16 * local * one,
               f"{tile}: routed rows re-formed": rt * stored,
               **{f"{tile}: {k_}": v for k_, v in moe_backward(grads, disp, wgrad).items()}}
    else:
        fwd = moe_forward(model, job, ep, N)
        bwd = moe_backward(grads, disp, wgrad)
    if model.moe_shared_ffn:  # computed first, added to the routed output at the end
        fwd["the shared expert's output [tokens, h], held (bf16)"] = out_n
    return {"MLP forward (last layer)": fwd, "MLP backward (last layer)": bwd}


def dispatch_state(model: Model, job: Job, lay, stage: str, N: int) -> Dict[str, float]:
    """What stock Megatron's token dispatcher keeps of its last call as attributes until the
    layer's next call: under full recompute (the next call is the layer's recompute in the
    backward) every MoE layer holds it on the device for the whole step, beside its
    checkpointed input (not offloaded: no saved tensor). Alltoall: the probabilities ``[N, E]``
    (bf16), the routing map ``[N, E]`` (bool) and the permutation indices ``[N·k]`` (int64);
    allgather: the local map ``[N·ep, E/ep]`` (bool), the local probabilities and indices
    ``[r]`` (bf16, int64). Per layer, the stage's MoE share. Mode ``metp``'s
    :class:`~megatron_metp.megatron.moe_tiles.TiledMoELayer` drops it after each call: none.
    Without recompute autograd keeps the routing anyway (:func:`moe_stored`)."""
    if lay.mode in ("metp", "metp+vocab") or job.recompute != "full":
        return {}
    n_moe, n_dense = stage_layers(model, job.pp, stage)
    E = model.experts
    if job.moe_dispatcher == "allgather":
        b = N * E + routed_rows(model, job, N) * (BF16 + 8)
        what = "local map, local probabilities, indices"
    else:
        b = N * E * (BF16 + 1) + 8 * N * model.topk
        what = "probabilities, routing map, indices"
    return {f"MoE dispatcher's last call kept to the recompute ({what})":
            b * n_moe / (n_moe + n_dense)}


def held_gradients(model: Model, job: Job, lay, stage: str, dy: float) -> float:
    """Bytes the first layer's backward holds beyond the last layer's under stock full
    recompute: the dispatcher of every MoE layer whose backward is done keeps its recompute
    call's probabilities (alltoall ``probs``, allgather ``local_probs``) until the next step,
    and with them their autograd graph down to the checkpoint's detached input, whose ``.grad``
    (that layer's input gradient ``[N, h]``, ``dy``) stays alive; the layer just above the
    first one's is the first one's incoming gradient (counted). Measured: 4 MoE layers, the
    first layer's re-run forward 2 such gradients above the last layer's. Mode ``metp`` drops
    the dispatch state after each call (:func:`dispatch_state`): none."""
    if not dispatch_state(model, job, lay, stage, 1):
        return 0.0
    L = model.layers // job.pp
    flags = moe_layer_flags(model)
    flags = flags[:L] if stage == "first" or job.pp == 1 else flags[-L:]
    return sum(flags[2:]) * dy


def moe_layer(model: Model, job: Job, lay, stage: str, N: int, S: Dict[str, float],
              X: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """Turn the mode's dense layer (stored ``S``, updated in place; phases ``X``) into the
    stage's MoE layers: the dense MLP's stored tensors weighted by the stage's dense share, the
    MoE's (router, routed rows, shared expert) by its MoE share; the last layer's MLP phases the
    MoE's and its shared expert's when it is a MoE layer, its attention backward after the MoE's
    stored tensors are freed. Returns the phases."""
    n_moe, n_dense = stage_layers(model, job.pp, stage)
    L = n_moe + n_dense
    if not n_moe:
        return X
    for key in [k for k in S if k.startswith("MLP")]:
        S[key] *= n_dense / L
    moe = moe_stored(model, job, lay, N)
    for key, v in moe.items():
        S[key] = v * n_moe / L
    flags = moe_layer_flags(model)
    last_is_moe = flags[L - 1] if stage == "first" or job.pp == 1 else flags[-1]
    if not last_is_moe:
        return X
    X = dict(X)
    X.update(moe_phases(model, job, lay, N))
    X.update(shared_phases(model, job, lay, N, S, sum(moe.values()) -
                           sum(shared_stored(model, lay, N).values())))
    att = "attention backward (last layer)"
    if att in X:
        X[att] = dict(X[att], **{MOE_FREED: -sum(moe.values())})
    return X


def params_split(model: Model, job: Job, lay, stage: str = "first") -> Dict[str, int]:
    """Elements of a stage's MoE layers on one rank: ``expert`` (E/EP experts per MoE layer),
    ``router`` (replicated), ``dense_mlp_layers`` (layers whose MLP is the mode's dense one),
    ``shared`` (the shared experts' elements, whole: sharded as the dense MLP's)."""
    n_moe, n_dense = stage_layers(model, job.pp, stage)
    router, one = expert_elements(model)
    ep = expert_parallel(job, lay)
    k = 2 if model.swiglu else 1
    return {"expert": n_moe * (model.experts // ep) * one if model.moe else 0,
            "router": n_moe * router if model.moe else 0, "dense_mlp_layers": n_dense,
            "shared": n_moe * (k + 1) * model.moe_shared_ffn * model.hidden,
            "ep": ep, "expert_dp": expert_dp(job, lay, ep)}


def check(model: Model, job: Job, mode: str, lay) -> None:
    """``ValueError`` naming the flag for MoE settings that cannot be laid out or planned."""
    if not model.moe:
        for flag, given in (("--ep", job.ep not in (0, 1)),
                            ("--moe-token-dispatcher-type", job.moe_dispatcher != "allgather"),
                            ("--moe-imbalance", job.moe_imbalance != 1.0),
                            ("--no-moe-token-tiles", not job.moe_token_tiles),
                            ("--moe-grouped-gemm", job.moe_grouped_gemm)):
            if given:
                raise ValueError(f"{flag}: a MoE setting, and the model has no experts "
                                 f"(--num-experts, or --preset qwen3-30b-a3b); drop {flag}")
        return
    for flag, v in (("--moe-router-topk", model.topk), ("--moe-layer-freq", model.moe_layer_freq)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer with --num-experts, got {v!r}")
    if model.moe_ffn is not None and (not isinstance(model.moe_ffn, int) or model.moe_ffn < 1):
        raise ValueError(f"--moe-ffn-hidden-size must be a positive integer, got "
                         f"{model.moe_ffn!r}")
    if model.topk > model.experts:
        raise ValueError(f"--moe-router-topk {model.topk} exceeds --num-experts "
                         f"{model.experts}")
    if job.moe_dispatcher not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {job.moe_dispatcher!r}: the plan "
                         f"knows {', '.join(DISPATCHERS)} (flex is refused with METP)")
    if not (isinstance(job.moe_imbalance, (int, float)) and job.moe_imbalance >= 1):
        raise ValueError(f"--moe-imbalance must be a number >= 1 (the busiest EP rank's routed "
                         f"rows over the mean), got {job.moe_imbalance!r}")
    if mode == "alst":
        raise ValueError("--modes alst: ALST's recipe is planned for dense models only; drop "
                         "alst for a MoE model (--num-experts)")
    if job.keep_intermediate:
        raise ValueError("--keep-intermediate keeps METP's dense MLP intermediate; a MoE model's "
                         "experts run Megatron's MoELayer: drop --keep-intermediate")
    ep = expert_parallel(job, lay)
    if mode in ("metp", "metp+vocab"):
        ranks = lay.c * job.dp  # METP × CP × DP: the ranks an EP group of whole METP groups spans
        if not isinstance(job.ep, int) or job.ep < 0 or ep % lay.p or ranks % ep:
            valid = [m for m in range(lay.p, ranks + 1, lay.p)
                     if not ranks % m and not model.experts % m]
            raise ValueError(f"--ep {job.ep}: METP shards the experts over whole METP groups: "
                             f"EP a multiple of --metp {lay.p} dividing METP × CP × DP = "
                             f"{ranks}; valid: {', '.join(map(str, valid))}")
        if lay.t > 1:
            raise ValueError(f"--tp {lay.t} with --num-experts: METP runs MoE with TP 1 "
                             f"(expert TP is not supported); use --tp 1")
    else:
        if not lay.sp and lay.t > 1:
            raise ValueError(f"mode {mode}: Megatron runs MoE with TP > 1 only with sequence "
                             f"parallelism; plan mode tp-sp (or cp) instead of {mode}")
        ranks = lay.t * lay.c * job.dp
        if not isinstance(job.ep, int) or job.ep < 0 or ranks % ep:
            raise ValueError(f"--ep {job.ep} must divide TP × CP × DP = {ranks} (parallel "
                             f"folding: the expert-parallel ranks come out of them)")
    if model.experts % ep:
        raise ValueError(f"--num-experts {model.experts} is not divisible by EP = {ep}"
                         + (" (--metp: METP shards the experts over its group)"
                            if mode in ("metp", "metp+vocab") else " (--ep)"))


def active_twin(model: Model) -> Model:
    """The dense model of the active FFN (``k·f′`` per token) that the step-time model plans
    in place of a MoE model (the routed experts' FLOPs; the dispatch is not timed)."""
    if not model.moe:
        return model
    return replace(model, ffn=model.topk * expert_ffn(model), experts=0, topk=0, moe_ffn=None,
                   moe_layer_freq=1)


def describe(model: Model, job: Job, lay, N: int) -> str:
    """One line for the report: experts, EP, dispatcher, imbalance, tiles."""
    ep = expert_parallel(job, lay)
    T = tile_tokens(model, job, lay, N)
    n_moe, _ = stage_layers(model, 1)
    stored, grads = routed_row_bytes(model)
    tiles = (f"MoE token tiles of {T:,} tokens" if T < N else
             "MoE token tiles: whole (the rank's tokens fit the budget)" if tiled(job, lay)
             else "no MoE token tiles")
    return (f"MoE: {model.experts} experts of {expert_ffn(model)}, top-{model.topk}, "
            f"{n_moe} of {model.layers} layers; EP {ep}, expert-DP "
            f"{expert_dp(job, lay, ep)}; {job.moe_dispatcher} dispatcher; load imbalance "
            f"{job.moe_imbalance:g}× (--moe-imbalance); routed rows "
            f"{routed_rows(model, job, N):,.0f} per rank, {stored} B each stored untiled; "
            f"{'grouped GEMM' if job.moe_grouped_gemm else 'SequentialMLP'} experts; {tiles}")
