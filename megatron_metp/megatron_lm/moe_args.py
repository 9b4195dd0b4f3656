"""Mixture-of-Experts flags of a Megatron-LM command line with METP.

With ``--num-experts E`` and ``--metp-parallel-size p`` Megatron's ``MoELayer`` runs beside the
METP attention with its experts sharded over the METP ring (:mod:`megatron_metp.megatron.moe`):
expert-model-parallel size ``EP = p``, expert-tensor-parallel size 1, expert data parallelism
over the outer context-parallel factor × DP. Two places must agree on ``EP = p``:

* ``parallel_state`` (the expert groups = the METP rings): the patched
  ``initialize_model_parallel`` call takes
  :func:`megatron_metp.megatron_lm.parallel_state.metp_expert_model_parallel_size`;
* ``args.expert_model_parallel_size``, which ``core_transformer_config_from_args`` copies into
  the ``TransformerConfig``: left at 1, Megatron marks the expert weights as dense and reduces
  their gradients over the wrong ranks, with no error. :func:`fold_expert_parallel` sets it to
  ``p`` inside ``validate_args`` (Megatron then checks ``E % EP`` itself), and the METP builder
  refuses a config where it is not ``p``
  (:func:`megatron_metp.megatron.moe.fold_expert_parallel_into_config`).

What METP refuses with experts is :mod:`megatron_metp.megatron.moe_checks` (one table for
megatron-core configs and Megatron-LM ``args``); :func:`release_moe_problems` adds the
Megatron-LM flags that table does not read (those of one release only, and the parts of the
expert-parallel overlap), :func:`moe_cpu_problems` what Megatron's MoE cannot do on CPU ranks
(METP or stock). All read ``args`` only (Megatron-LM core_v0.16.1 and core_v0.19.0 names; a flag
missing from a release reads as its default) and import neither Megatron nor megatron-core, so
the launcher's preflight runs them before any rank starts.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from ..megatron.moe_checks import moe_enabled

__all__ = ["release_moe_problems", "moe_cpu_problems", "fold_expert_parallel",
           "add_moe_preflight_flags", "RELEASE_ONLY"]

#: the flags read here that only one supported Megatron-LM release has (its tag); the others
#: are in both (tests/test_moe_megatron_lm.py reads each release's parser)
RELEASE_ONLY = {
    "--moe-extended-tp": "core_v0.16.1", "--moe-use-legacy-grouped-gemm": "core_v0.16.1",
    "--overlap-dispatch-backward-with-experts-wgrad": "core_v0.19.0",
    "--moe-paged-stash": "core_v0.19.0", "--expert-tensor-parallel-num-weight-shards":
        "core_v0.19.0", "--moe-single-grouped-weight": "core_v0.19.0",
    "--moe-single-grouped-bias": "core_v0.19.0"}

# (flag, args attribute, why) refused with experts and METP, beyond moe_checks' table
_REFUSED_SWITCHES = (
    ("--delay-wgrad-compute", "delay_wgrad_compute",
     "part of the expert-parallel communication overlap, not wired into the METP layers"),
    ("--ep-overlap-early-attn-memory-release", "ep_overlap_early_attn_memory_release",
     "part of the expert-parallel communication overlap, not wired into the METP layers"),
    ("--overlap-dispatch-backward-with-experts-wgrad",
     "overlap_dispatch_backward_with_experts_wgrad",
     "core_v0.19.0's expert-parallel overlap, not wired into the METP layers"),
    ("--moe-extended-tp", "moe_extended_tp",
     "core_v0.16.1's extended tensor parallelism of the experts; METP shards the experts over "
     "its ring"),
    ("--moe-paged-stash", "moe_paged_stash",
     "core_v0.19.0's paged stash of routed activations, not wired into the METP layers"),
)

# (flag, args attribute, why): MoE switches that need CUDA kernels, refused on CPU ranks
_GPU_ONLY_SWITCHES = (
    ("--moe-grouped-gemm", "moe_grouped_gemm",
     "grouped GEMM runs on the GPU only; without it Megatron's SequentialMLP runs the experts "
     "one by one"),
    ("--moe-use-legacy-grouped-gemm", "moe_use_legacy_grouped_gemm",
     "grouped GEMM runs on the GPU only"),
    ("--moe-single-grouped-weight", "moe_single_grouped_weight",
     "a grouped-GEMM weight layout, GPU only"),
    ("--moe-single-grouped-bias", "moe_single_grouped_bias",
     "a grouped-GEMM weight layout, GPU only"),
    ("--moe-permute-fusion", "moe_permute_fusion", "Transformer Engine's fused permutation"),
    ("--moe-router-fusion", "moe_router_fusion", "Transformer Engine's fused router"),
)


def release_moe_problems(args, p: int) -> List[str]:
    """The Megatron-LM MoE flags METP (``p`` > 1) refuses beyond
    :func:`megatron_metp.megatron.moe_checks.moe_args_problems`, each naming the flag and the
    fix; empty without ``--num-experts``."""
    if not moe_enabled(args) or p <= 1:
        return []
    out = [f"{flag} ({why}); drop it" for flag, name, why in _REFUSED_SWITCHES
           if getattr(args, name, False)]
    shards = getattr(args, "expert_tensor_parallel_num_weight_shards", None)
    if shards is not None and shards > 1:
        out.append(f"--expert-tensor-parallel-num-weight-shards {shards} (each expert lives "
                   f"whole on one METP rank); drop it")
    return out


def moe_cpu_problems(args) -> List[str]:
    """What Megatron's MoE cannot do on CPU ranks (METP or stock), each naming the flag."""
    if not moe_enabled(args):
        return []
    return [f"{flag} ({why}; drop it for a CPU run)"
            for flag, name, why in _GPU_ONLY_SWITCHES if getattr(args, name, False)]


def fold_expert_parallel(args, p: int) -> Optional[str]:
    """Set ``args.expert_model_parallel_size = p`` for a MoE job under METP ``p`` (so the
    ``TransformerConfig`` built from ``args`` shards the experts as ``parallel_state`` does);
    return the note to print, ``None`` when nothing changed (dense, or ``p`` 1). Idempotent.
    A multiple of ``p`` given with ``--expert-model-parallel-size`` stays (EP wider than the
    METP group); any other value than 1 is refused before this runs."""
    if p <= 1 or not moe_enabled(args):
        return None
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if ep > p and not ep % p:  # EP wider than the METP group (megatron/wide_ep.py): kept
        return (f"--num-experts {args.num_experts}: experts sharded over {ep // p} METP rings "
                f"(--expert-model-parallel-size {ep}, {args.num_experts // ep} experts per "
                f"rank), METP-sharded gradients summed over their {ep // p} replicas, expert "
                f"tensor parallelism 1")
    args.expert_model_parallel_size = p
    return (f"--num-experts {args.num_experts}: experts sharded over each METP ring, "
            f"expert-model-parallel size {p} ({args.num_experts // p} experts per rank), "
            f"expert tensor parallelism 1")


def add_moe_preflight_flags(ap: argparse.ArgumentParser) -> None:
    """The MoE flags the checks read (:func:`megatron_metp.megatron.moe_checks.moe_args_problems`,
    :func:`release_moe_problems`, :func:`moe_cpu_problems`), with Megatron-LM's destinations and
    defaults (core_v0.16.1 and core_v0.19.0), for the preflight's small parser."""
    for opt in ("--moe-shared-expert-intermediate-size", "--moe-latent-size",
                "--expert-tensor-parallel-num-weight-shards"):
        ap.add_argument(opt, type=int, default=None)
    ap.add_argument("--moe-token-dispatcher-type", default="allgather")
    # the shared expert has no biases (moe_checks: --disable-bias-linear with shared experts)
    ap.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    ap.add_argument("--cuda-graph-impl", default="none")
    switches = {name for _, name, _ in _REFUSED_SWITCHES + _GPU_ONLY_SWITCHES}
    switches |= {"moe_enable_deepep", "moe_shared_expert_overlap", "moe_use_upcycling",
                 "overlap_moe_expert_parallel_comm", "enable_cuda_graph", "external_cuda_graph"}
    for name in sorted(switches):
        ap.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true")
