"""The steps of Megatron's ``MoELayer`` (untiled, or one MoE token tile) in the plan: the token
dispatcher's buffers, and the forward and backward at their largest step beyond the routed rows
the layer stores (:mod:`.moe` turns them into the last MoE layer's MLP phases). ``N`` tokens
enter the layer, ``r = N·k·imbalance`` routed rows run on the busiest EP rank (:func:`routed_rows`),
``h`` the hidden size, ``f′`` the expert FFN (:func:`expert_ffn`).

**Dispatcher buffers** of one pass of ``N`` tokens over ``ep`` ranks (:func:`dispatcher`):
allgather: the gathered probabilities and routing map ``[N·ep, E]`` (fp32 + bool; the gathered
tokens ``[N·ep, h]`` go to Megatron's persistent global buffer, held for the step:
:func:`.moe.mpu_buffer`), the combine's output ``[N·ep, h]`` before its reduce-scatter,
and in the backward the gathered output gradient ``[N·ep, h]`` beside the experts' output
gradient; alltoall: the permuted rows sent ``[N·k, h]``, in the combine the ``[r, h]`` rows
beside the ``[N·k, h]`` ones exchanged (the received ``[r, h]`` of the dispatch are the experts'
stored input), in the backward the output gradient's ``[N·k, h]`` rows beside the ``[r, h]``
received back, or with several local experts those received rows beside their copy sorted by
expert. With EP 1 nothing is exchanged: the permutation's input gradient ``[N, h]``.

**The backward's steps** (:func:`moe_backward`, read from megatron-core 0.16.1 and measured:
``metp measure`` of stock TP 2 + SP × EP 2 and TP 4 + SP × EP 4 under full recompute, both
dispatchers): the combine's backward forms the experts' output gradient ``[r, h]`` beside the
dispatcher's buffers above, which are freed before the first expert's backward; the experts then
run beside that output gradient (:func:`backward_rows`); the dispatch's backward (the input
gradient ``[N·ep, h]`` before its reduce-scatter, or the ``[N·k, h]`` rows sent back) runs after
the experts have freed their stored rows, so it never sets the peak. The largest of the first
two steps counts, not their sum (the sum over-planned stock's full-recompute peak by 8 % at EP 2
and 19 % at EP 4).
"""

from __future__ import annotations

from typing import Dict

from .model import BF16, FP32, Job, Model


def expert_ffn(model: Model) -> int:
    return model.moe_ffn or model.ffn


def routed_rows(model: Model, job: Job, tokens: int) -> float:
    """Routed rows the busiest EP rank runs for ``tokens`` tokens: ``tokens·k·imbalance``."""
    return tokens * model.topk * job.moe_imbalance


def dispatcher(model: Model, job: Job, ep: int, N: int) -> Dict[str, Dict[str, float]]:
    """The dispatcher's buffers of one pass of ``N`` tokens beyond the routed rows the experts
    keep: ``{"dispatch": ..., "combine": ..., "backward": ...}`` (bytes; see the module
    docstring; the allgather's gathered tokens are in :func:`.moe.mpu_buffer`, not here);
    ``"backward"``: those beside the experts' output gradient ``[r, h]`` when the combine's
    backward has formed it, before the experts' backward (:func:`moe_backward`). With one rank
    in the group nothing is gathered or exchanged: the backward's input gradient ``[N, h]``
    (the permutation's) is all."""
    h, E = model.hidden, model.experts
    if ep == 1:
        return {"dispatch": {}, "combine": {},
                "backward": {"the permutation's input gradient [N, h] (bf16)": BF16 * N * h}}
    if job.moe_dispatcher == "allgather":
        g = N * ep
        # (the gathered tokens [N·ep, h] land in Megatron's global buffer: :func:`.moe.mpu_buffer`)
        return {"dispatch": {"allgather: gathered probabilities and routing map [N·ep, E] "
                             "(fp32 + bool)": (FP32 + 1) * g * E},
                "combine": {"allgather: combined output [N·ep, h] before its reduce-scatter "
                            "(bf16)": BF16 * g * h},
                "backward": {"allgather: gathered output gradient [N·ep, h] (bf16)":
                             BF16 * g * h}}
    r = routed_rows(model, job, N)
    sent = BF16 * N * model.topk * h
    back = {"alltoall: the output gradient's rows [N·k, h] (bf16)": sent}
    if E // ep > 1:  # sorted by local expert: the rows received back beside their sorted copy
        back = max(back, {"alltoall: the output gradient's rows received back [r, h], beside "
                          "their copy sorted by expert (bf16)": BF16 * r * h},
                   key=lambda d: sum(d.values()))
    return {"dispatch": {"alltoall: permuted rows sent [N·k, h] (bf16)": sent},
            "combine": {"alltoall: the experts' output [r, h] and the rows received back "
                        "[N·k, h] (bf16)": BF16 * r * h + sent},
            "backward": back}


def moe_forward(model: Model, job: Job, ep: int, N: int) -> Dict[str, float]:
    """The untiled MoE forward at its largest step, beyond the routed rows it stores (read from
    megatron-core 0.16.1's ``MoELayer.forward``, whose locals hold the dispatch's tensors to its
    end, and measured as :func:`moe_backward`): alltoall holds the permuted rows sent ``[N·k, h]``
    and, with several local experts, the rows received ``[r, h]`` (the experts keep their copy
    sorted by expert) throughout; beside them the largest of the experts' outputs (the
    ``SequentialMLP``'s per-expert outputs with their concatenation, ``2·[r, h]``; one ``[r, h]``
    grouped or with one local expert), the output beside its copy sorted back (``2·[r, h]``),
    the combine's input ``[r, h]`` beside its output (allgather: the ``[N·ep, h]`` unpermuted
    rows; alltoall: the ``[N·k, h]`` rows received back), and that output beside the MoE output
    ``[N, h]``. EP 1 exchanges nothing: the unpermuted rows are the MoE output."""
    h, r, local = model.hidden, routed_rows(model, job, N), model.experts // ep
    out = {"MoE output [tokens, h] (bf16)": BF16 * N * h}
    rows = BF16 * r * h
    several = local > 1
    experts = {"the experts' outputs and their concatenation [r, h] (bf16, SequentialMLP)":
               2 * rows} if several and not job.moe_grouped_gemm else \
        {"the experts' output [r, h] (bf16)": rows}
    held: Dict[str, float] = {}
    if job.moe_dispatcher == "allgather" and ep == 1:
        steps = [experts, dict(out, **{"the experts' output [r, h] (bf16)": rows})]
    elif job.moe_dispatcher == "allgather":
        g = {"allgather: unpermuted rows [N·ep, h] before the reduce-scatter (bf16)":
             BF16 * N * ep * h}
        steps = [experts, dict(g, **{"the experts' output [r, h] (bf16)": rows}), dict(g, **out)]
    else:  # EP 1: the all-to-alls return their input (received = sent, received back = output)
        sent = BF16 * N * model.topk * h
        held = {"alltoall: permuted rows sent [N·k, h], held (bf16)": sent}
        if several and ep > 1:
            held["alltoall: rows received [r, h], held beside the experts' sorted copy (bf16)"] = \
                rows
        back = {"alltoall: rows received back [N·k, h] (bf16)": sent}
        steps = [experts, {"the experts' output and its copy sorted back [r, h] (bf16)":
                           2 * rows if several else rows}, dict(back, **out)]
        if ep > 1:
            steps.append(dict(back, **{"the experts' output [r, h] (bf16)": rows}))
    return dict(held, **max(steps, key=lambda d: sum(d.values())))


#: the item of :func:`moe_backward` holding the experts' output gradient
OUTPUT_GRADIENT = "experts' output gradient [routed rows, h] (bf16)"


def moe_backward(grads: Dict[str, float], disp: Dict[str, Dict[str, float]],
                 wgrad: Dict[str, float]) -> Dict[str, float]:
    """The routed part's backward at its largest step, beyond what it stores: the experts' output
    gradient ``[r, h]`` and the larger of (a) the dispatcher's buffers beside it when the
    combine's backward forms it (``disp["backward"]``, freed before the experts run) and (b) the
    experts' backward at its largest step (the rest of ``grads``, :func:`backward_rows`, with one
    expert's weight gradient ``wgrad``). See the module docstring's "backward's steps"."""
    out = {OUTPUT_GRADIENT: grads[OUTPUT_GRADIENT]}
    experts = dict({k: v for k, v in grads.items() if k != OUTPUT_GRADIENT}, **wgrad)
    out.update(max(disp["backward"], experts, key=lambda d: sum(d.values())))
    return out


def backward_rows(model: Model, job: Job, ep: int, rows: float) -> Dict[str, float]:
    """The routed rows' backward at its largest step, beyond what they store: the experts'
    output gradient ``[rows, h]`` and either every expert's activation and fc1-output gradients
    at once (``--moe-grouped-gemm``: ``(2k + 2)·f′`` per row, the issue's ``4h + 12f′`` in all)
    or, expert after expert (``SequentialMLP``, Megatron's default), one expert's, while the
    input gradients of the experts done replace their freed activations (``2h`` per row over
    the ``(2k + 2)·f′`` they free, when larger)."""
    h, f = model.hidden, expert_ffn(model)
    k = 2 if model.swiglu else 1
    act = BF16 * (k * f + f)
    out = {OUTPUT_GRADIENT: BF16 * rows * h}
    if job.moe_grouped_gemm:
        out["every expert's activation and fc1-output gradients (bf16, grouped GEMM)"] = \
            rows * act
        return out
    local = max(1, model.experts // ep)
    out["one expert's activation, fc1-output and input gradients (bf16)"] = \
        rows / local * (act + BF16 * h)
    out["input gradients of the experts done over their freed activations (bf16)"] = \
        rows * max(0, BF16 * h - act)
    return out
