"""Attention and MLP variants of the newer model families (gpt-oss, GLM-4.5) with METP, checked
before any work.

What METP runs, what it refuses, and why (``docs/moe.md``, "Routers and model variants"):

* **MLP variants** ``glu_linear_offset`` (``--glu-linear-offset``: ``act(x_glu)·(x_lin + c)``)
  and ``activation_func_clamp_value`` (``--activation-func-clamp-value``: gpt-oss's clamped
  SwiGLU / quick-GeGLU): Megatron's own experts (``SequentialMLP``) apply both, so with every
  layer a MoE layer and no shared expert they run unchanged under METP (tested against stock).
  METP's MLP (the dense layers of ``--moe-layer-freq`` and of a dense model, the shared expert)
  computes a plain GeLU or SwiGLU, so a model with any METP MLP refuses them (and Megatron-LM's
  ``--quick-geglu``, gpt-oss's activation).
* **Attention sinks** ``softmax_type`` (``--softmax-type off-by-one|learnable``): a per-head
  logit in the softmax denominator, merged once per row into the K/V ring's log-sum-exp
  (:mod:`megatron_metp.ops.sinks`; tested against stock). Refused with TP > 1 (METP holds every
  head's sink), with packed documents (``--reset-attention-mask``: not tested together) and with
  the ring-attention baseline.
* **Alternating sliding windows** ``window_attn_skip_freq`` (``--window-attn-skip-freq``): METP
  refuses ``--window-size`` (its K/V ring attends causally over the whole sequence), and the
  pattern only applies with a window: refused too.

One table serves a ``TransformerConfig`` (:func:`check_variant_config`) and Megatron-LM's
``args`` (:func:`variant_args_problems`); it imports neither Megatron nor megatron-core. None of
these is new in core_v0.19.0: megatron-core 0.16.1's ``TransformerConfig`` has every field, and
Megatron-LM core_v0.16.1 generates ``--softmax-type``, ``--glu-linear-offset`` and
``--activation-func-clamp-value`` from it as core_v0.19.0 does (its ``ArgumentGroupFactory``;
``tests/test_moe_megatron_lm.py`` reads each release's parser), so both releases run them.
"""

from __future__ import annotations

import argparse
import ast
from typing import Callable, List, Union

__all__ = ["variant_problems", "check_variant_config", "variant_args_problems",
           "has_metp_mlp", "add_variant_preflight_flags", "layer_pattern"]


def has_metp_mlp(get: Callable) -> bool:
    """Whether any layer runs METP's MLP: a dense model, a dense layer of ``moe_layer_freq``
    (an int > 1 or a list with a 0), or a shared expert. ``get(name, default)`` reads a
    ``TransformerConfig`` field name."""
    if not get("num_moe_experts", None):
        return True
    if get("moe_shared_expert_intermediate_size", None):
        return True
    freq = get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return freq != 1
    return 0 in list(freq)


def variant_problems(get: Callable) -> List[str]:
    """Every variant METP cannot run, each naming the flag and the alternative; ``get(name,
    default)`` reads a ``TransformerConfig`` field name."""
    out = []
    softmax = get("softmax_type", "vanilla") or "vanilla"
    tp = get("tensor_model_parallel_size", 1) or 1
    if softmax != "vanilla" and tp > 1:
        out.append(f"--softmax-type {softmax} (attention sinks) with "
                   f"--tensor-model-parallel-size {tp}: METP holds every head's sink; use TP 1 "
                   f"and a larger --metp-parallel-size")
    if softmax != "vanilla" and get("metp_disable_weight_ring", False):
        out.append(f"--softmax-type {softmax} (attention sinks) with "
                   f"--metp-disable-weight-ring (the ring self-attention baseline has none); "
                   f"drop --metp-disable-weight-ring")
    if softmax != "vanilla" and get("reset_attention_mask", False):
        out.append(f"--softmax-type {softmax} (attention sinks) with packed documents "
                   f"(--reset-attention-mask): not tested together yet; drop one")
    skip = get("window_attn_skip_freq", None)
    if skip is not None:
        out.append(f"--window-attn-skip-freq {skip} (alternating sliding windows: METP's K/V "
                   f"ring attends causally over the whole sequence and refuses --window-size); "
                   f"drop it")
    if get("moe_shared_expert_intermediate_size", None):
        # megatron-core 0.19's shared-expert layouts: METP's shared expert is METP's MLP (its
        # own GEMMs, fc1 as [gate; up] halves), so neither applies
        if get("use_grouped_gemm_for_shared_expert", False):
            out.append("--use-grouped-gemm-for-shared-expert (METP runs the shared expert as "
                       "its own MLP on the weight ring, not as a grouped GEMM); drop it")
        if get("moe_shared_expert_glu_interleave_size", None) is not None:
            out.append(f"--moe-shared-expert-glu-interleave-size "
                       f"{get('moe_shared_expert_glu_interleave_size', None)} (METP's shared "
                       f"expert holds fc1 as [gate; up] halves, stock's default layout); drop "
                       f"it")
    if has_metp_mlp(get):
        offset = get("glu_linear_offset", 0.0) or 0.0
        clamp = get("activation_func_clamp_value", None)
        where = ("METP's MLP (dense layers, shared experts) computes a plain GeLU or SwiGLU; "
                 "Megatron's routed experts apply it, so it runs when every layer is a MoE "
                 "layer (--moe-layer-freq 1) without a shared expert")
        if offset:
            out.append(f"--glu-linear-offset {offset} ({where}); drop it")
        if clamp is not None:
            out.append(f"--activation-func-clamp-value {clamp} ({where}); drop it")
        if get("quick_geglu", False):  # Megatron-LM's flag (a config names quick_gelu instead,
            # which METP's MLP refuses when it is built)
            out.append(f"--quick-geglu ({where}); use --swiglu, or MoE layers only")
    return out


def check_variant_config(config) -> None:
    """Raise ``ValueError`` listing :func:`variant_problems` of a ``TransformerConfig``."""
    problems = variant_problems(lambda name, default: getattr(config, name, default))
    if problems:
        raise ValueError("--metp-parallel-size does not support: " + "; ".join(problems))


def variant_args_problems(args) -> List[str]:
    """:func:`variant_problems` of Megatron-LM ``args`` (``--num-experts`` is ``num_experts``
    there, ``num_moe_experts`` on the config)."""
    def get(name, default):
        return getattr(args, "num_experts" if name == "num_moe_experts" else name, default)

    return variant_problems(get)


def layer_pattern(text: str) -> Union[int, List[int]]:
    """``--moe-layer-freq``'s value as Megatron-LM reads it: ``"N"`` an int, else a list
    expression of 0/1 literals such as ``([0]*1+[1]*3)`` (only literals, ``+`` and ``*``)."""
    text = str(text).strip()
    if "[" not in text:
        return int(text)

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(f"--moe-layer-freq {text!r}: not a list of 0/1 built with + and *")
    return list(ev(ast.parse(text, mode="eval")))


def add_variant_preflight_flags(ap: argparse.ArgumentParser) -> None:
    """The flags :func:`variant_args_problems` reads, with Megatron-LM's destinations and
    defaults (core_v0.16.1 and core_v0.19.0 alike), for the preflight's small parser."""
    ap.add_argument("--softmax-type", default="vanilla")
    ap.add_argument("--quick-geglu", action="store_true")
    ap.add_argument("--glu-linear-offset", type=float, default=0.0)
    ap.add_argument("--activation-func-clamp-value", type=float, default=None)
    ap.add_argument("--window-attn-skip-freq", type=layer_pattern, default=None)
    ap.add_argument("--moe-layer-freq", type=layer_pattern, default=1)
