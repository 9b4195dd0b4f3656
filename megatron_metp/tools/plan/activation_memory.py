"""Activation memory of one rank: what each layer and the head (RoPE table, final norm, loss)
store for the backward, and the transients of each phase (from :mod:`.stock`, :mod:`.metp` and
:mod:`.vocab`), whose largest sets the activation peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from . import mla
from .metp import metp_phases
from .moe import dispatch_state, held_gradients, moe_layer, mpu_buffer
from .streaming import streaming_applies, streaming_phases
from .model import BF16, FP32, Job, Model, canonical, layout, padded_vocab
from .keep import kept_bytes, kept_not_re_formed, kept_split
from .recompute import recompute_and_offload
from .stock import stock_phases
from .vocab import vocab_embedding_backward, vocab_embedding_forward, vocab_loss_phases

#: the item of the last layer's phases that takes the head's activations out (gone by then)
HEAD_FREED = "(head activations freed)"


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
    host: float = 0.0                  # offloaded to host memory (all layers, all in flight)
    offloaded_layers: int = 0          # layers per stage offloaded (--offload-activations [N])
    kept_attention_layers: int = 0     # layers per stage keeping O + LSE (--keep-attention-output)
    kept_attention_host_layers: int = 0  # of those, the offloaded ones (O + LSE on the host)

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
    def layer_transient(self) -> float:
        """The largest transient of a single layer's phase (forward, recompute or backward of
        the last layer; not the loss's or the embedding's): what the layer holds beyond the
        parameters, the gradient buffer and what the forward stored, as ``metp measure`` measures
        it. The incoming gradient counts; the head's activations, freed by the time the last
        layer's backward runs (and not yet formed in its forward), do not: they belong to the
        head, and subtracting them made the row negative (−63 GiB for Llama-3-8B at 1M tokens
        on TP 8). Never below 0 (a layer that frees more of its own stored tensors than it
        allocates holds no transient)."""
        own = [sum(x for kk, x in v.items() if kk != HEAD_FREED)
               for k, v in self.phases.items() if "(last layer)" in k]
        return max(own + [0.0])

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


@dataclass
class _Geometry:
    """The sizes :func:`activations` and its parts read (one rank, one micro-batch)."""

    s: int          # sequence length
    lay: object     # the mode's layout (.model.layout)
    n: int          # tokens through this rank's attention / MLP
    nl: int         # tokens of the norms / residual stream on this rank
    Vr: int         # rows of each vocabulary table on this rank
    L: int          # layers on the rank (its pipeline stage)
    last: bool      # holds the output layer and the loss
    first: bool     # holds the embedding


def _geometry(model: Model, job: Job, mode: str, s: int, stage: str) -> _Geometry:
    lay = layout(mode, job)
    n = s * job.micro_batch // lay.c
    V = padded_vocab(model.vocab, lay.vocab_pad)
    return _Geometry(s=s, lay=lay, n=n, nl=n // lay.t if lay.sp else n,
                     Vr=V // lay.vocab_shards, L=model.layers // job.pp,
                     last=job.pp == 1 or stage == "last", first=job.pp == 1 or stage == "first")


def _metp_stored(model: Model, job: Job, g: _Geometry, S: Dict[str, float]):
    """What a METP layer (the separate ops) keeps beyond its norms, added to ``S``; returns its
    phases (:mod:`.metp`)."""
    t, n = g.lay.t, g.n
    k = 2 if model.swiglu else 1
    if model.mla:  # multi-latent attention (.mla): the latent ring's op
        mla.metp_stored(model, n, S, job.recompute)
        X = metp_phases(model, job, g.lay, n, S)
        freed = X["attention backward (last layer)"]["(MLP and second-norm activations freed)"]
        X.update(mla.metp_phases(model, n, g.lay.c, g.lay.p, S, job.kernel))
        X["attention backward (last layer)"]["(MLP and second-norm activations freed)"] = freed
        return X
    if job.recompute != "selective":  # selective core_attn: re-formed in backward instead
        S["attention outputs, every head group (bf16)"] = \
            BF16 * n * (model.heads * model.head_dim // t)
        S["attention log-sum-exp (fp32)"] = FP32 * n * (model.heads // t)
    if job.keep_intermediate:
        S["MLP x·W1ᵀ of every shard (keep_intermediate)"] = BF16 * n * k * model.ffn // t
    return metp_phases(model, job, g.lay, n, S)


def _stock_stored(model: Model, job: Job, mode: str, g: _Geometry, S: Dict[str, float]):
    """What a stock Megatron layer (TP, TP+SP, CP, or the ring core) keeps beyond its norms,
    added to ``S``; returns ``(phases, persistent buffer bytes, Korthikanti's formula or
    None)``."""
    lay, s, n, t, c, b = g.lay, g.s, g.n, g.lay.t, g.lay.c, job.micro_batch
    h, A, G, d, F = model.hidden, model.heads, model.groups, model.head_dim, model.ffn
    hq, hk = A * d, G * d
    hqt, hkt, At = hq // t, hk // t, A // t
    gqa, flash = G < A, job.kernel == "flash"
    stock_core = mode in ("tp", "tp-sp")
    persistent, kor = 0.0, None
    S["RoPE cos/sin for q and k (bf16)"] = 4 * BF16 * (s // c) * d  # [s/c, 1, 1, d]
    if model.mla:  # megatron-core's MLASelfAttention (.mla)
        S["RoPE cos/sin for q and k (bf16)"] = 4 * BF16 * (s // c) * model.qk_pos_emb_head_dim
        mla.stock_stored(model, n, t, S)
        persistent = BF16 * n * h if lay.sp else 0.0
    elif stock_core:
        # v is a view of the QKV output, so it stays alive; the unfused core repeats grouped
        # k, v to the query heads (and the output is freed), flash kernels read them as
        # they are (TE, flash-attn; the fake-rank stand-in passes enable_gqa)
        repeated = gqa and not flash
        if not repeated:
            S["QKV projection output (bf16)"] = BF16 * n * (hq + 2 * hk) // t
        if repeated:
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
    if model.qk_layernorm and not model.mla:
        # stock SelfAttention's q/k norms keep their inputs: q is a reshaped copy of its
        # split, k a view of the QKV projection output, which it keeps alive (counted above
        # where v's view keeps it anyway); q's split [s, b, G/t, (A/G)·d] reshapes to
        # [s, b, A/t, d] as a view, no copy, when either of its middle sizes is 1: one query
        # group on the rank (G = t; measured: TP 4 of 4 groups) or one head per group (A = G)
        if G // t > 1 and gqa:
            S["q norm input: q's reshaped copy (bf16)"] = BF16 * n * hqt
        if not stock_core or (gqa and not flash):
            S["QKV projection output, kept by k's norm (bf16)"] = \
                BF16 * n * (hq + 2 * hk) // t
        S["q/k norm statistics (fp32)"] = 2 * FP32 * n * (At + G // t)
    if model.swiglu:
        # Megatron-LM's default --bias-swiglu-fusion: the fused SwiGLU keeps only its input
        # (fc1's output) and recomputes silu(gate) in backward; fc2 keeps its input
        S["MLP fc1 output, gate|up (bf16)"] = BF16 * n * 2 * F // t
        S["MLP silu(gate)·up = fc2 input (bf16)"] = BF16 * n * F // t
    else:
        S["MLP fc1 output (bf16)"] = BF16 * n * F // t
        S["MLP GeLU output (bf16)"] = BF16 * n * F // t
    if model.mla:
        return mla.stock_phases(model, job, lay, n, g.nl, S, stock_phases), persistent, kor
    if stock_core:
        sbh = s * b * h
        kor = (sbh * (10 + 24 / t) if not lay.sp else sbh * 34 / t) + \
            (5 * A * s * s * b / t if not flash else 0)
    return stock_phases(model, job, lay, n, g.nl, S, stock_core), persistent, kor


def _streaming_phases(model: Model, job: Job, g: _Geometry, off: int):
    """The streaming layer's phases (:mod:`.streaming`: the op saves its input only and
    re-forms nothing whole) and the host bytes of its per-layer stashes."""
    n, nl, t, h = g.n, g.nl, g.lay.t, model.hidden
    # the last layer's phases: on the host only when every layer is offloaded (a partial
    # offload keeps the last layers on the device)
    X = streaming_phases(model, job, g.lay, n, host=off == g.L and off > 0)
    for name, items in X.items():
        # the layer's output y: written over x's storage when offloaded (x's device copy,
        # not stored, lives on as y), else allocated once the attention outputs are formed
        if "forward: rows" in name or ("forward" in name and off == g.L and off > 0):
            items["the layer's input x and output y (one [tokens, h], bf16)"] = BF16 * nl * h
    hq, hk = model.heads * model.head_dim, model.groups * model.head_dim
    # an offloaded layer's attention outputs and d(qkv) on the host, one layer at a time: every
    # group's O and dq (the recompute's kept q projections) from the recompute on; in group
    # g's backward the O stashes of groups ≥ g and the d(kv) stashes of groups < g (the last
    # group's d(kv) stay on the device: ops/layer_reads.py)
    p = g.lay.p
    host_stash = BF16 * n * (hq + max((p - i) * hq + i * 2 * hk for i in range(p)) / p) \
        // t if off else 0.0
    return X, host_stash


def _kept_last_layer(X: Dict[str, Dict[str, float]]) -> None:
    """The streaming layer's phases when the last layer keeps its attention output on the
    device (:mod:`.keep`): its O stashes and log-sum-exps are the kept ones, counted with what
    the layer stores, so its phases drop them (the attention backward's "groups left": the
    stored count holds them all until the layer's backward is done)."""
    for items in X.values():
        for key in list(items):
            if key.startswith(("every group's attention output O", "every group's log-sum-exp",
                               "the O stashes (bf16, not offloaded)")):
                items[key] = 0.0


def _head(model: Model, job: Job, g: _Geometry, off: int, streaming: bool):
    """What the rank keeps outside its layers (RoPE table, final norm, loss) and the host bytes
    of what of it goes to the host: ``(head, host_head)``."""
    nl, n, h = g.nl, g.n, model.hidden
    head: Dict[str, float] = {"RoPE angle table (fp32)": FP32 * (g.s // g.lay.c) * model.head_dim}
    host_head = 0.0
    rope = head["RoPE angle table (fp32)"]
    if off and job.recompute == "full" and rope >= 2 ** 20 and not streaming:
        host_head += rope  # a checkpoint argument: its first save goes to the host
    if g.last:
        if off == g.L:  # the final norm runs in the last layer's group: its input to the host
            head["final norm output (bf16)"] = BF16 * nl * h
            host_head += BF16 * nl * h
        else:
            head["final norm input + output (bf16)"] = 2 * BF16 * nl * h
        head["final norm statistics (fp32)"] = 8 * nl
        if g.lay.vocab:
            head["loss: log-sum-exp and per-token loss [tokens] (fp32)"] = 2 * FP32 * n
        else:
            head["loss: fp32 logits / softmax [tokens, V/t]"] = FP32 * n * g.Vr
            head["loss: targets and masks"] = 21 * n
    return head, host_head


def _layer_phases(model: Model, g: _Geometry, X, shifts, head, dy: float):
    """Every layer phase of ``X`` as a full transient set: the incoming gradient, the tied
    output-layer gradient held, what recompute / the host brings back (``shifts``), and the
    head's activations already freed (last stage)."""
    phases: Dict[str, Dict[str, float]] = {}
    head_gone = {HEAD_FREED: -(sum(head.values())
                               - head["RoPE angle table (fp32)"])}
    for name, items in X.items():
        ph = dict(head_gone) if g.last else {}
        if "forward" not in name:
            ph["incoming gradient [tokens, h] (bf16)"] = dy
            if g.last and model.tied:
                # autograd sums the tied weight's two gradients before accumulating them, so the
                # output layer's bf16 dW waits for the embedding's backward (Megatron's
                # gradient-accumulation fusion on GPU writes it to main_grad instead)
                ph["tied output-layer weight gradient, held (bf16)"] = BF16 * g.Vr * model.hidden
        ph.update(items)
        forward = "forward" in name
        shift = shifts["forward" if forward else "mlp" if name.startswith("MLP") else "backward"]
        if shift:
            ph["re-formed by recompute / brought back from the host"] = shift
        phases[name] = ph
        if forward and shifts.get("recompute") is not None:  # run again in backward
            # beside the gradient arriving at the chunk, which Megatron's
            # CheckpointFunction.backward holds while it re-runs the forward
            phases[name.replace("forward", "recompute")] = dict(
                ph, **{"incoming gradient [tokens, h] (bf16)": dy,
                       "re-formed by recompute / brought back from the host":
                       shifts["recompute"]})
    if not g.last:
        phases = {k: {kk: vv for kk, vv in v.items() if kk != HEAD_FREED}
                  for k, v in phases.items()}
        # the gradient received from the next stage stays referenced by the schedule while
        # the stage runs backward (it is the incoming gradient of the last MLP itself)
        for k_, v_ in phases.items():
            if "backward" in k_ and not k_.startswith("MLP"):
                v_["gradient received from the next stage, held (bf16)"] = dy
    return phases


def _embedding_phases(model: Model, g: _Geometry, S, head, dy: float):
    """The embedding's backward (first stage): one micro-batch's activations are gone; the
    embedding's bf16 weight gradient, and with tied weights the output layer's gradient held
    until now and their sum; with the vocabulary ring also its forward lookup."""
    n, h, Vr, p = g.n, model.hidden, g.Vr, g.lay.p
    if not g.first:
        return {}
    emb = {"(this micro-batch's activations freed)":
           -(g.L * sum(S.values()) + sum(head.values()) - head["RoPE angle table (fp32)"])}
    if g.lay.vocab:
        emb["incoming gradient [tokens, h] (bf16)"] = BF16 * n * h
        if not g.last:
            emb["gradient received from the next stage, held (bf16)"] = dy
        emb.update(vocab_embedding_backward(n, h, Vr, p))
    else:
        emb["embedding weight gradient (bf16)"] = BF16 * Vr * h
    if g.last and model.tied:
        emb["tied output-layer weight gradient, held (bf16)"] = BF16 * Vr * h
        emb["sum of the two (bf16)"] = BF16 * Vr * h
    out = {"embedding (backward)": emb}
    if g.lay.vocab:
        # the ring lookup of the last micro-batch in flight: its output (the first layer's
        # stored input) is formed, the rest of its activations not yet
        out["embedding (forward)"] = {
            "(this micro-batch's activations not formed yet)":
                emb["(this micro-batch's activations freed)"] + BF16 * n * h,
            **vocab_embedding_forward(n, h, Vr, p)}
    return out


def activations(model: Model, job: Job, mode: str, seq: Optional[int] = None,
                stage: str = "first") -> Activations:
    """Activation memory of a rank of the first pipeline stage (rank 0; with PP=1 it is also
    the last) or, with ``stage="last"``, of the last stage (output layer and loss, one
    micro-batch in flight under 1F1B).

    Per layer: the norms' tensors, then what the mode's layer keeps (:func:`_metp_stored`,
    :func:`_stock_stored`), then recompute / offload (:mod:`.recompute`) or the streaming layer
    (:func:`_streaming_phases`); outside the layers :func:`_head`; the transients of every
    phase from the layers', the loss's and the embedding's phase functions."""
    mode, job = canonical(mode, job)
    g = _geometry(model, job, mode, model.seq if seq is None else int(seq), stage)
    h, nl = model.hidden, g.nl
    S: Dict[str, float] = {"norm inputs (2 LayerNorms)": 2 * BF16 * nl * h,
                           "norm outputs (2 LayerNorms)": 2 * BF16 * nl * h,
                           "norm statistics (fp32)": 2 * 8 * nl}
    if mode == "metp":
        X, persistent, kor = _metp_stored(model, job, g, S), 0.0, None
    else:
        X, persistent, kor = _stock_stored(model, job, mode, g, S)
    if model.moe:  # Megatron's MoELayer in place of the MLP (.moe)
        X, kor = moe_layer(model, job, g.lay, stage, nl, S, X), None
        # the allgather dispatcher's tokens in Megatron's global buffer (one per rank)
        persistent = max(persistent, mpu_buffer(model, job, g.lay, nl))
    dy = BF16 * nl * h  # the gradient arriving at a block
    off = offloaded_layers(job, g.L)
    # the streaming op runs METP's own MLP: a MoE model's layers run as separate ops
    streaming = mode == "metp" and not (model.moe or model.mla) and streaming_applies(job, g.lay, mode)
    S, host_layer, shifts = recompute_and_offload(S, job, g.L, BF16 * nl * h, offloaded=off,
                                                  frees_output=mode == "metp")
    if model.moe:  # stock Megatron's dispatcher keeps its last call's routing (.moe)
        S.update(dispatch_state(model, job, g.lay, stage, nl))
    # kept attention (.keep): O + LSE of the first kept layers on the host (the offloaded ones),
    # of the rest on the device
    kept_host, kept_dev = kept_split(job, mode, g.L, off)
    kept = kept_bytes(model, job, mode, g.s) if kept_host + kept_dev else 0.0
    if kept_dev:
        S[f"kept attention O + LSE, {kept_dev} of {g.L} layers (bf16 + fp32)"] = \
            kept_dev * kept / g.L
    if kept_dev and not streaming:  # the last chunk's device-kept O + LSE: not formed again
        shifts = kept_not_re_formed(shifts, job, g.L, kept_host, kept_host + kept_dev, kept)
    host_stash = 0.0
    if streaming:
        X, host_stash = _streaming_phases(model, job, g, off)
        if kept_host and kept_host == off:  # every offloaded layer's O stash is its kept O
            host_stash -= BF16 * g.n * (model.heads * model.head_dim // g.lay.t)
        if kept_dev and kept_host + kept_dev == g.L:  # the last layer keeps O on the device
            _kept_last_layer(X)
        shifts = {"forward": 0.0, "mlp": 0.0, "backward": 0.0}
    head, host_head = _head(model, job, g, off, streaming)
    phases: Dict[str, Dict[str, float]] = {}
    if g.last and g.lay.vocab:
        phases.update(vocab_loss_phases(g.n, h, g.Vr, g.lay.p, job.micro_batch))
    elif g.last:
        phases.update(_output_layer_phases(model, g))
    phases.update(_layer_phases(model, g, X, shifts, head, dy))
    held = held_gradients(model, job, g.lay, stage, dy) if model.moe else 0.0
    if held:  # the first layer's backward: the last layer's phases and the gradients held above
        phases.update({k.replace("(last layer)", "(first layer)"): dict(
            v, **{"input gradients of the MoE layers done, held by their dispatchers": held})
            for k, v in list(phases.items()) if "(last layer)" in k and "forward" not in k})
    phases.update(_embedding_phases(model, g, S, head, dy))
    inflight = job.inflight if g.first else 1
    # the streaming layer's stashes live in one layer's forward or backward: the final norm's
    # input (the head's host copy) is back on the device before the first layer backward
    host = inflight * (g.L * host_layer + kept_host * kept) + \
        max(inflight * host_head, host_stash)
    return Activations(stored_layer=S, head=head, phases=phases, persistent=persistent,
                       layers=g.L, inflight=inflight, korthikanti_layer=kor, host=host,
                       offloaded_layers=off, kept_attention_layers=kept_host + kept_dev,
                       kept_attention_host_layers=kept_host)


def _output_layer_phases(model: Model, g: _Geometry) -> Dict[str, Dict[str, float]]:
    """The stock output layer and loss (last stage, no vocabulary ring): bf16 logits forward,
    the fp32 logits freed and the gradients formed in backward."""
    n, h, Vr = g.n, model.hidden, g.Vr
    out = {"loss (forward): bf16 logits": {"bf16 logits [tokens, V/t]": BF16 * n * Vr},
           "output layer (backward)": {
               "(fp32 logits freed)": -FP32 * n * Vr,
               "bf16 logits gradient": BF16 * n * Vr,
               "output-layer input gradient (bf16)": BF16 * n * h,
               "output-layer weight gradient (bf16)": BF16 * Vr * h}}
    if g.lay.sp:
        out["output layer (backward)"]["SP reduce-scatter of the input gradient"] = BF16 * g.nl * h
    return out


def offloaded_layers(job: Job, layers: int) -> int:
    """Layers of a stage whose saved tensors go to the host: 0 without ``--offload-activations``,
    ``job.offload_layers`` when set (``metp plan --offload-activations N``, or the split
    :mod:`.partial` chose), else all ``layers``."""
    if not job.offload:
        return 0
    return layers if job.offload_layers is None else min(int(job.offload_layers), layers)
