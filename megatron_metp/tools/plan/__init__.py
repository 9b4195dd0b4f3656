"""Plan a job before spending GPU hours: per-rank memory, traffic, overlap and the longest sequence.

``metp plan`` (:func:`main` in :mod:`megatron_metp.tools.cli`) takes a model geometry, the parallel
sizes, the micro-batch, the attention kernel, the recompute choice and a hardware preset, and
prints for each parallel mode, per rank:

* memory: parameters (bf16), gradients (Megatron DDP's fp32 ``main_grad`` buffer), Adam states
  (fp32 master copy + two moments, 12 B per parameter; with the distributed optimizer divided by
  the data-parallel group that reduces that parameter), stored activations per layer × layers on
  the rank (× micro-batches in flight under 1F1B), the embedding / output-layer activations
  including the fp32 logits of the loss, the transient buffers of one layer's backward, and the
  peak they add up to;
* bytes sent per layer per rank for one forward+backward (ring-algorithm convention);
* the full-overlap thresholds of METP's rings (tokens per rank above which one step's compute
  hides the next step's transfer);
* the longest sequence that fits in the device memory (binary search over ``s``).

Modes, all on the same ``W = tp·metp`` GPUs per pipeline stage:

================  ===========================================================================
``tp``            stock Megatron tensor parallelism over all ``W`` ranks, no SP
``tp-sp``         the same with sequence parallelism (Korthikanti et al. 2022)
``cp``            Megatron TP=``tp`` (+SP when tp>1) × context parallel ``metp`` (K/V ring)
``ring``          ring self-attention: the K/V ring over all ``W`` ranks, weights replicated
                  (``cp`` with TP=1)
``metp``          METP: weights and sequence sharded over ``metp`` (× ``tp``)
``metp+vocab``    METP with the vocabulary split too (``--metp-vocab-parallel``,
                  ``megatron_metp.megatron.vocab.METPGPTModel``): word embedding and output
                  layer ``[V/(t·p), h]`` per rank, ``V`` padded to a multiple of ``128·t·p``;
                  the loss runs ``ops.metp_output_cross_entropy`` (logits ``[s/p·b, V/(t·p)]``
                  one shard at a time). ``--vocab-parallel`` plans mode ``metp`` this way.
================  ===========================================================================

Where the numbers come from. The *stock* layers (``tp``, ``tp-sp``) follow Korthikanti et al.
(2022), "Reducing Activation Recomputation in Large Transformer Models" (bytes per layer, 16-bit:
``sbh(10 + 24/t + 5as/(ht))`` for TP, ``sbh(34/t + 5as/(ht))`` for TP+SP, see DESIGN.md §1/§4),
with the terms that megatron-core 0.16.1 actually keeps without dropout enumerated tensor by
tensor (no dropout masks; bf16 softmax output ``2as²b/t`` without a flash kernel; RoPE's rotated
q/k copies and cos/sin tables; the flash kernel's fp32 log-sum-exp). The *METP and ring* terms are
the buffers the ops keep and allocate, as their docstrings (``megatron_metp/ops/*.py``) and the
benchmarks (``benchmarks/mlp_memory.py``, ``benchmarks/attention_memory.py``) measure them:
a METP layer stores its input, the two LayerNorm inputs/outputs, every head group's attention
output and its fp32 log-sum-exp (and, with ``keep_intermediate``, ``x·W1ᵀ`` of every MLP shard);
its backward adds the weight/gradient ring buffers, fp32 accumulators, one head group's
recomputed Q/K/V and the K/V ring's blocks. With the vocabulary split (``metp+vocab``) the loss
keeps only a fp32 log-sum-exp per token; its forward and its backward (which recomputes the
logits) hold one shard's ``[tokens, V/(t·p)]`` logits in fp32 and bf16 at a time, next to the two
bf16 weight-shard buffers in flight and the two fp32 weight-gradient sums travelling the ring
(``ops/cross_entropy.py``); the embedding's backward sums its table gradient on the ring the same
way (``ops/embedding.py``). Both tables are METP-sharded parameters: gradients reduced over pure
DP, so the distributed optimizer shards their Adam states over DP, like the layer weights.
``metp measure`` builds the real models under the fake process group and reports the measured
peak next to this plan; ``tests/test_plan.py`` keeps the two within 5 %.

Conventions: bytes; bf16 parameters and activations; Adam; no dropout (METP has no attention
dropout; every mode is planned without it); LayerNorm; RoPE; no linear biases; the vocabulary
padded to a multiple of 128·TP as Megatron-LM pads it (128·TP·METP with the vocabulary split);
tied embeddings unless the model is untied (the repo's 7B/13B are). Not modelled: CUDA context,
NCCL buffers, allocator fragmentation, kernel workspaces (``--reserve-gib``, default 2 GiB, is
held back for them).

Where a GPU run may differ from the plan (and from ``metp measure``, which the plan follows):
LayerNorm statistics are fp32 on a GPU (planned: 8 B per token and norm; CPU: bf16); Megatron's
gradient-accumulation fusion writes weight gradients straight into ``main_grad`` on a GPU, while
here a tied output layer's bf16 gradient waits for the embedding's backward (planned and
measured: ``V/t·h·2`` bytes more during the backward); flash kernels allocate a small workspace.
The NVLink bandwidth of the overlap thresholds holds within one node (≤ 8 GPUs); a ring that
crosses nodes is limited by the network instead.
The plan is split by concern; each module imports only those above it in this list, and every
name is re-exported here, so ``from megatron_metp.tools import plan as P; P.memory(...)`` reads
as when the plan was one module:

=======================  ====================================================================
``hardware``             the hardware presets, each with its datasheet source
``model``                ``Model`` and ``PRESETS``, ``Job``, ``Layout`` / ``layout()``,
                         ``canonical()``, ``padded_vocab()``; byte sizes, modes
``job_checks``           ``validate()``: the flag of a size that cannot be laid out
``config``               ``--config`` files: ``read_config()``, ``from_config()``
``parameters``           parameters and static memory (bf16 weights, ``main_grad``, Adam)
``ring``                 the K/V ring's buffers (modes ``ring``, ``cp`` and ``metp``)
``stock``                transients of the stock Megatron layers (``tp``, ``tp-sp``, ``cp``,
                         ``ring``)
``metp``                 transients of a METP layer
``moe``                  Mixture-of-Experts: experts over EP, the router, the routed-token
                         transient with and without MoE token tiles, the dispatchers' buffers,
                         the load-imbalance factor (``--moe-imbalance``)
``moe_time``             MoE in the step time: the token dispatch over the EP group's link,
                         the expert GEMMs at a rate for their shape, the busiest rank
``tiles``                the METP MLP's token tiles (rows per pass of its weight ring, as the
                         op resolves them: ``ops/tiles.py``)
``host``                 host RAM per node of each preset (with sources), ``--host-memory-gib``,
                         pinned host bytes per node against it
``vocab``                transients of the vocabulary split's ring loss and ring embedding
``recompute``            full recompute and host offload: device / host bytes per layer, and
                         what the last layer's phases re-form or bring back
``keep``                 kept attention (``--keep-attention-output [N]``): the layers that keep
                         the attention output and its LSE, their bytes, host or device
``activation_memory``    ``Activations`` / ``activations()``: stored per layer, head, phases
``partial``              ``resolve_offload()``: how many layers to offload when the node's host
                         memory cannot hold them all (partial offload); ``resolve_keep()``: how
                         many layers keep attention (``--keep-attention-output`` without N)
``rank_memory``          ``Memory`` / ``memory()``, ``worst_total()``, ``head_memory()``,
                         ``longest_seq()``
``traffic``              ``traffic_per_layer()``, ``forward_traffic_per_layer()``,
                         ``crossover_seq()``
``flops``                ``layer_flops()``: one layer's FLOPs on one rank
``cost``                 ``step_cost()``: FLOPs, traffic and host bytes with recompute/offload,
                         and the step time (``step_time``)
``host_link``            the host link one GPU gets (PCIe sustained, the node's host memory
                         shared by 8 GPUs), with sources
``rates``                published kernel rates (GEMM, attention forward/backward) by hardware
                         and kernel, with sources; ``--rates FILE``
``imbalance``            the K/V ring's per-step imbalance from the op's tile plan
                         (``ops/balance.py``)
``optimizer_time``       ``optimizer_s()``: one Adam step, on the GPU or the host
``collectives``          ``tp_exposed_s()``, ``grad_sync_s()``: TP collectives and the
                         data-parallel gradient sync as Megatron's default schedule exposes them
``step_time``            ``step_time()``: one micro-batch's time by component, the iteration's
``alst``, ``alst_time``  mode ``alst``: ALST's published recipe (Ulysses + ZeRO-3 + CPU Adam +
                         host-offloaded checkpoints, FA2), memory and time
``overlap``              ``overlap_thresholds()``
``internode``            ``internode_hop()``: the K/V ring's hop that crosses nodes (bytes,
                         overlap threshold on the inter-node link)
``search``               ``reach()`` / ``reach_report()`` (``--reach``): the longest sequence
                         over every valid layout of METP and of stock Megatron
``fastest``              ``fastest()`` / ``fastest_report()`` (``--fastest``): the fastest
                         layout that fits at one length, per family
``fit``                  ``fit_hint()``: the cheapest options under which a layout that does
                         not fit does
``launch``               a planned job as ``scripts/pretrain_gpt.sh`` settings, Megatron-LM
                         flags and a ``configs/*.sh``-style file
``recipe``               ``recipe_flags()``: the model file's ``MOE_ARGS`` (the load-balancing
                         loss, ...), carried by every launch line and written config
``summary``              ``plan()`` (the ``--json`` dict) and ``report()`` (the printed text)
``textwidth``            the units legend under the tables, the table in blocks of columns and
                         long lines wrapped to 100 columns (``--wide``: whole), ``unwrap()``
``figures``              ``charts()`` (``--png``)
=======================  ====================================================================

Setting a name on the package (``monkeypatch.setattr(P, "_metp_phases", ...)``) rebinds it in
the modules that call it too, as it did in the single module.
"""

from __future__ import annotations

import sys
import types

from .hardware import HARDWARE, Hardware
from .model import (BF16, FP32, GiB, MiB, MODE_NAMES, MODES, PEER_MODES, PRESETS, VOCAB_MODES, Job, Layout,
                    Model, canonical, layout, padded_vocab)
from .job_checks import validate
from .config import from_config, microbatches, read_config
from .parameters import Params, layer_weights, params, static_memory  # noqa: F401
from .ring import ring_backward_buffers, ring_forward_buffers
from .stock import stock_phases  # noqa: F401
from .metp import metp_phases, unfused_live_block  # noqa: F401
from .vocab import vocab_embedding_backward, vocab_embedding_forward, vocab_loss_phases
from .activation_memory import Activations, activations
from .rank_memory import (Memory, capacity_bytes, head_memory, longest_seq, memory, seq_step,
                          worst_total)
from .traffic import crossover_seq, forward_traffic_per_layer, traffic_per_layer
from .recompute import recompute_and_offload
from .cost import layer_flops, step_cost
from .rates import RATES, Rates, default_kernel, load_rates, resolve_rates
from .step_time import step_time
from .overlap import overlap_thresholds
from .internode import internode_hop
from .summary import plan, report
from .textwidth import fmt_bytes, fmt_tokens
from .search import reach, reach_report
from .fit import FitHint, fit_hint
from .launch import config_text, launch_line, megatron_flags
from .recipe import merge_recipe, recipe_flags
from .figures import COLORS, charts
from . import (activation_memory, alst, alst_time, config, cost, fastest, figures, fit, flops,
               hardware, host_link, imbalance, internode, job_checks, keep, launch, metp, model,
               moe, moe_time,
               optimizer_time, overlap, partial, rates, recipe, search, parameters, rank_memory,
               recompute, ring, stock, summary, traffic, vocab)

__all__ = [
    "GiB", "MiB", "BF16", "FP32", "MODES", "MODE_NAMES", "VOCAB_MODES", "PEER_MODES",
    "Model", "PRESETS", "Job", "Layout", "layout", "canonical", "padded_vocab", "validate",
    "read_config", "from_config", "microbatches", "Hardware", "HARDWARE",
    "Params", "params", "static_memory",
    "ring_forward_buffers", "ring_backward_buffers", "unfused_live_block",
    "vocab_loss_phases", "vocab_embedding_forward", "vocab_embedding_backward",
    "Activations", "activations",
    "Memory", "memory", "worst_total", "head_memory", "seq_step", "capacity_bytes", "longest_seq",
    "traffic_per_layer", "forward_traffic_per_layer", "crossover_seq", "overlap_thresholds",
    "recompute_and_offload", "layer_flops", "step_cost", "internode_hop", "step_time",
    "RATES", "Rates", "default_kernel", "load_rates", "resolve_rates",
    "fmt_bytes", "fmt_tokens", "plan", "report", "COLORS", "charts", "reach", "reach_report",
    "FitHint", "fit_hint", "config_text", "launch_line", "megatron_flags", "merge_recipe",
    "recipe_flags",
]

#: the name tests/test_plan.py patches on the package (``monkeypatch.setattr(P, "_metp_phases",
#: ...)``): :class:`_Package` rebinds :func:`.metp.metp_phases` for it
_metp_phases = metp_phases
_OLD_NAMES = {"_metp_phases": "metp_phases"}

#: the modules whose names :class:`_Package` rebinds
_step_time_module = sys.modules[__name__ + ".step_time"]  # (the name is the function's)
_MODULES = (hardware, model, job_checks, config, moe, parameters, ring, stock, metp, vocab,
            recompute, keep, activation_memory, partial, rank_memory, traffic, flops, cost,
            overlap, internode, summary, figures, search, fastest, fit, launch, recipe, rates,
            host_link, imbalance,
            alst, alst_time, optimizer_time, _step_time_module)
_UNSET = object()


class _Package(types.ModuleType):
    """The package's type: rebinding a name on it (a test's ``monkeypatch.setattr``) also rebinds
    it in each of :data:`_MODULES` that holds the same object, so that the formulas calling it
    see the new one (the plan tests' negative controls patch ``P.vocab_loss_phases`` and
    ``P._metp_phases`` and expect :func:`activations` to call the patched function)."""

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get(name, _UNSET)
        super().__setattr__(name, value)
        if old is _UNSET or isinstance(old, types.ModuleType):
            return
        name = _OLD_NAMES.get(name, name)
        for mod in _MODULES:
            if mod.__dict__.get(name, _UNSET) is old:
                setattr(mod, name, value)


sys.modules[__name__].__class__ = _Package
