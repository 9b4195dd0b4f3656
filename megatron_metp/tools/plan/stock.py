"""Transients of the stock Megatron layers (modes ``tp``, ``tp-sp``, and ``cp`` / ``ring`` with
their ring attention core): the last layer's forward and backward, step by step."""

from __future__ import annotations

from typing import Dict

from .model import BF16
from .ring import ring_backward_buffers, ring_forward_buffers


def _mlp_part(S: Dict[str, float]) -> float:
    return sum(v for k, v in S.items() if k.startswith("MLP"))


def stock_mlp_phases(model, lay, n, nl) -> Dict[str, Dict[str, float]]:
    """A stock Megatron MLP of width ``model.ffn`` (TP-sharded, SP when ``lay.sp``; the dense
    MLP, or a MoE layer's shared expert, ``SharedExpertMLP``): ``{"backward": ..., "forward":
    ...}``, its buffers at the largest step beyond what it saved. Backward, step by step: fc2
    ``dA = dy·W2`` (+ SP: ``dy`` all-gathered) and ``dW2``; the activation ``dZ`` while ``dA``
    is alive and the activation output (saved for fc2) is gone (fc1's ``dX`` and ``dW1`` are
    smaller). Forward: fc2's output ``[n, h]`` before TP's all-reduce / SP's reduce-scatter and
    the reduce-scatter's output ``[nl, h]``."""
    t, h, F = lay.t, model.hidden, model.ffn
    gather = BF16 * n * h if lay.sp else 0  # SP: the gradient all-gathered to all tokens
    dA = BF16 * n * F // t
    dW2 = BF16 * h * F // t
    if model.swiglu:
        act_step = {"d(fc2 input), d(silu), d(up) (bf16)": 3 * dA, "(product freed)": -dA}
    else:
        act_step = {"d(GeLU output), d(fc1 output) (bf16)": 2 * dA, "(GeLU output freed)": -dA}
    steps = [dict({"d(fc2 input) (bf16)": dA, "dW2 (bf16)": dW2},
                  **({"SP gradient all-gather (bf16)": gather} if gather else {})),
             act_step]
    forward = dict({"fc2 output before the TP reduction (bf16)": BF16 * n * h},
                   **({"SP reduce-scatter output (bf16)": BF16 * nl * h} if lay.sp else {}))
    return {"backward": max(steps, key=lambda d_: sum(d_.values())), "forward": forward}


def stock_phases(model, job, lay, n, nl, S, stock_core) -> Dict[str, Dict[str, float]]:
    """Backward transients of the last layer of a stock-layer mode (Megatron linears)."""
    t = lay.t
    h, A, G, d = model.hidden, model.heads, model.groups, model.head_dim
    hq, hk = A * d, G * d
    hqt, hkt, At = hq // t, hk // t, A // t
    b = job.micro_batch
    s = n * lay.c // b
    gather = BF16 * n * h if lay.sp else 0  # SP: the gradient all-gathered to all tokens
    mlp_saved = _mlp_part(S)
    half_ln = (S["norm inputs (2 LayerNorms)"] + S["norm outputs (2 LayerNorms)"]
               + S["norm statistics (fp32)"]) / 2
    mlp = stock_mlp_phases(model, lay, n, nl)
    ph: Dict[str, Dict[str, float]] = {"MLP backward (last layer)": mlp["backward"]}
    # attention backward (after the MLP and its norm are done): linear_proj, core, QKV
    base = {"(MLP and second-norm activations freed)": -(mlp_saved + half_ln)}
    dproj = BF16 * n * hqt
    proj_step = dict({"d(proj input) (bf16)": dproj, "dW_proj (bf16)": BF16 * h * hqt},
                     **({"SP gradient all-gather (bf16)": gather} if gather else {}))
    if stock_core:
        if job.kernel == "flash":
            core = {"d(proj input) (bf16)": dproj,
                    "flash backward dq, dk, dv (bf16)": BF16 * n * (hqt + 2 * hkt)}
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
    fwd = mlp["forward"]  # (the layer output after fc2's output, as Megatron forms them)
    ph["MLP forward (last layer)"] = dict(
        {k: v for k, v in fwd.items() if k.startswith("fc2")},
        **{"layer output (bf16)": BF16 * nl * h},
        **{k: v for k, v in fwd.items() if not k.startswith("fc2")})
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
