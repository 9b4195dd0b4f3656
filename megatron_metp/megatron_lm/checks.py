"""Every METP precondition of a Megatron-LM command line, collected on a plain namespace.

:func:`metp_arg_problems` is what :func:`megatron_metp.megatron_lm.validate.validate_metp_args`
refuses inside the ranks (all problems in one ``ValueError``) and what the launcher's preflight
(:mod:`megatron_metp.megatron_lm.preflight`) prints before any rank starts: the same checks,
reading ``args`` only, importing neither Megatron nor megatron-core. The rules of each kind are
one function each here (:func:`metp_flag_problems`, :func:`kernel_problems`,
:func:`recompute_problems`, :func:`check_offload_layers_args`, :func:`check_keep_layers_args`) or
in the module named at the call.
"""

from __future__ import annotations

import argparse
import math
from typing import List

from ..megatron.packing_checks import mock_document_length_problems
from .resume import resume_layout_problems
from ..megatron.rope_checks import rope_reach_problems
from .settings_args import metp_settings
from .timeouts import megatron_lm_timeout_s

__all__ = ["metp_arg_problems", "metp_flag_problems", "kernel_problems", "recompute_problems",
           "check_offload_layers_args", "check_keep_layers_args"]


def metp_arg_problems(args) -> List[str]:
    """Every METP precondition ``args`` break, each naming the flag and the fix (empty: fine).

    Reads ``args`` only (a Megatron ``Namespace`` or any object with the same attribute names;
    missing ones count as Megatron's defaults) and imports neither Megatron nor megatron-core,
    so the launcher's preflight (:mod:`megatron_metp.megatron_lm.preflight`) runs the same
    checks in one process before any rank starts. ``args.world_size`` is the job's rank count.
    """
    p = getattr(args, "metp_parallel_size", 1)
    out = list(resume_layout_problems(args))
    for check in (check_offload_layers_args, check_keep_layers_args):
        try:
            check(args)
        except ValueError as exc:
            out.append(str(exc))
    if getattr(args, "metp_offload_activations", False) and (
            getattr(args, "cpu_offloading", False) or
            (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0):
        out.append("--metp-offload-activations with --cpu-offloading: two activation "
                   "offloads; keep one (--metp-offload-activations also works with "
                   "--recompute-granularity full, Megatron's does not)")
    out.extend(mock_document_length_problems(args))
    on = p is not None and p != 1
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    # METP's own rules, held once by the settings (the training loop and the planner ask them
    # too): tiles, the vocabulary ring, the ring baseline, the layout arithmetic
    rules = metp_settings(args).problems(
        num_experts=getattr(args, "num_experts", None) or 0,
        full_recompute=getattr(args, "recompute_granularity", None) == "full",
        **(dict(world_size=args.world_size, seq_length=getattr(args, "seq_length", None),
                # Megatron switches sequence parallelism off by itself when TP is 1
                sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and tp > 1)
           if on else {}))
    out.extend(rules)
    out.extend(rope_reach_problems(args))
    if not on:
        return out
    if any("must be >= 1" in x for x in rules):
        return out  # no divisibility to check against a size below 1
    out.extend(f"--metp-parallel-size {p} cannot be used with: {problem}"
               for problem in metp_flag_problems(args, p, tp))
    out.extend(_moe_problems(args, p))
    return out


def _moe_problems(args, p: int) -> List[str]:
    """MoE with METP: megatron-core's table (:mod:`megatron_metp.megatron.moe_checks`, E % p
    included; the GPU-only kernels are refused on CPU ranks by :mod:`.cpu`) and the Megatron-LM
    flags beyond it (:mod:`.moe_args`)."""
    from ..megatron.moe_checks import moe_args_problems
    from ..megatron.parallel import expert_parallel_problems
    from .moe_args import release_moe_problems

    out = moe_args_problems(args, p, on_cpu=False) + release_moe_problems(args, p)
    if getattr(args, "num_experts", None) and getattr(args, "world_size", None):
        out += expert_parallel_problems(  # EP wider than METP: whole METP groups
            world_size=args.world_size, metp_parallel_size=p, num_experts=args.num_experts,
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
            tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1) or 1,
            pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if (getattr(args, "expert_model_parallel_size", 1) or 1) > p and (
            getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)):
        out.append("--use-megatron-fsdp / --use-torch-fsdp2 with --expert-model-parallel-size "
                   "wider than --metp-parallel-size: EP wider than METP is wired into "
                   "Megatron's DDP only; drop the FSDP flag")
    return out


def check_offload_layers_args(args) -> None:
    """``ValueError`` naming ``--metp-offload-activations N`` when ``N`` does not fit the job's
    pipeline stages or recompute chunks (before any model is built)."""
    n = getattr(args, "metp_offload_activations", False)
    if n is True or not n:
        return
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or \
            getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        raise ValueError(f"--metp-offload-activations {n} with a virtual pipeline: every model "
                         f"chunk of a stage has its own layers and offloader; give no N (every "
                         f"layer) or drop the virtual pipeline")
    layers = _stage_layers(args)
    from ..runtime.offload import check_offload_layers

    cfg = argparse.Namespace(recompute_granularity=getattr(args, "recompute_granularity", None),
                             recompute_method=getattr(args, "recompute_method", None),
                             recompute_num_layers=getattr(args, "recompute_num_layers", None))
    check_offload_layers(n, layers, cfg, what=f"--metp-offload-activations {n}")


def check_keep_layers_args(args) -> None:
    """``ValueError`` naming ``--metp-keep-attention-output N`` when ``N`` exceeds the layers of
    a pipeline stage or a virtual pipeline splits the stage into model chunks (before any model
    is built)."""
    n = getattr(args, "metp_keep_attention_output", None)
    if n is True or not n:
        return
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or \
            getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        raise ValueError(f"--metp-keep-attention-output {n} with a virtual pipeline: every model "
                         f"chunk of a stage has its own layers; give no N (every layer) or drop "
                         f"the virtual pipeline")
    from ..megatron.settings import check_kept_attention_layers

    check_kept_attention_layers(n, _stage_layers(args), f"--metp-keep-attention-output {n}")


def _stage_layers(args) -> int:
    """The fewest layers a pipeline stage of ``args`` has."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    layers = args.num_layers // pp
    for flag in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, flag, None):
            layers = min(layers, getattr(args, flag))
    return layers


def metp_flag_problems(args, p: int, tp: int) -> List[str]:
    """Everything in ``args`` METP cannot honour, each naming the flag and the fix."""
    out = []

    def flag(name, default=None):
        return getattr(args, name, default)

    if flag("use_legacy_models"):
        out.append("--use-legacy-models (METP needs megatron-core models)")
    experts = bool(flag("num_experts"))  # MoE: EP / ETP are checked by .moe_args
    if not experts and (flag("expert_model_parallel_size", 1) or 1) != 1:
        out.append(f"--expert-model-parallel-size {flag('expert_model_parallel_size')} (METP uses "
                   f"the expert groups for its weight gradients; leave it at 1)")
    etp = flag("expert_tensor_parallel_size")
    if not experts and etp is not None and etp != tp:
        out.append(f"--expert-tensor-parallel-size {etp} (must equal "
                   f"--tensor-model-parallel-size {tp} or be unset)")
    if flag("hierarchical_context_parallel_sizes"):
        out.append("--hierarchical-context-parallel-sizes")
    if flag("hybrid_context_parallel"):
        out.append("--hybrid-context-parallel")
    if flag("attention_dropout"):
        out.append(f"--attention-dropout {flag('attention_dropout')} (the METP K/V ring has no "
                   f"attention dropout; pass --attention-dropout 0)")
    if flag("window_size") is not None:
        out.append(f"--window-size {flag('window_size')} (sliding-window attention; the METP K/V "
                   f"ring attends causally over the whole sequence: drop it, which equals a "
                   f"window >= --seq-length)")
    if flag("spec") is not None:
        out.append("--spec (METP builds its own layer spec)")
    if flag("exit_duration_in_mins"):
        out.append(f"--exit-duration-in-mins {flag('exit_duration_in_mins')} (untested with "
                   f"METP: it needs a run of a minute or more; to end before a time limit with a "
                   f"checkpoint that resumes exactly, pass --exit-signal-handler and let Slurm "
                   f"send the signal, sbatch --signal=TERM@<seconds before the limit>, or stop "
                   f"after N iterations with --exit-interval N)")
    for name, opt in (("experimental_attention_variant", "--experimental-attention-variant"),
                      ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path")):
        if flag(name) is not None:
            out.append(opt)
    if flag("mtp_num_layers"):
        out.append(f"--mtp-num-layers {flag('mtp_num_layers')} (multi-token prediction is not "
                   f"built with METP: its extra layers and their loss would not go round the "
                   f"METP rings; drop the flag, which trains the main next-token objective, as "
                   f"DeepSeek-V3's own fine-tunes without MTP do)")
    from ..megatron.mla_checks import mla_problems

    out.extend(mla_problems(args, tp=tp,
                            weight_ring=not getattr(args, "metp_disable_weight_ring", False),
                            keep_attention=getattr(args, "metp_keep_attention_output", None)))
    for name, opt in (("qk_l2_norm", "--qk-l2-norm (METP's attention takes --qk-layernorm)"),
                      ("rotary_interleaved", "--rotary-interleaved"),
                      ("squared_relu", "--squared-relu (METP supports GeLU and --swiglu)")):
        if flag(name):
            out.append(opt)
    if not flag("no_persist_layer_norm", True) and \
            (flag("normalization") == "RMSNorm" or not _have_module("apex")):
        out.append("persistent layer norm: pass --no-persist-layer-norm (METP's layers use "
                   "Megatron's local norms, torch's LayerNorm/RMSNorm without apex)")
    shards = tp * p
    heads = flag("num_attention_heads")
    if heads is not None and heads % shards:
        out.append(f"--num-attention-heads {heads} (not divisible by TP x METP = {shards})")
    groups = flag("num_query_groups") if flag("group_query_attention") else None
    if groups is not None and groups % shards:
        out.append(f"--num-query-groups {groups} (not divisible by TP x METP = {shards})")
    ffn = flag("ffn_hidden_size")
    if ffn is not None and ffn % shards:
        out.append(f"--ffn-hidden-size {ffn} (not divisible by TP x METP = {shards})")
    timeout = flag("metp_ring_timeout")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        out.append(f"--metp-ring-timeout {timeout} (must be a positive, finite number of "
                   f"seconds)")
    else:  # the one timeout is --distributed-timeout-minutes; a longer ring timeout is refused
        try:
            megatron_lm_timeout_s(args)
        except ValueError as exc:
            out.append(str(exc))
    out.extend(recompute_problems(args))
    out.extend(kernel_problems(args))
    from .yarn_args import yarn_problems

    out.extend(yarn_problems(args))
    from ..megatron.variant_checks import variant_args_problems

    out.extend(variant_args_problems(args))
    from ..megatron.packing_checks import packing_problems

    out.extend(packing_problems(args))
    return out


def kernel_problems(args) -> List[str]:
    """Megatron's kernel and precision flags METP cannot honour (the others are mapped with a
    note by :mod:`.validate`)."""
    out = []
    if getattr(args, "fp8", None):
        out.append(f"--fp8-format {args.fp8} (METP's shard GEMMs run in bf16/fp16 with fp32 "
                   f"accumulation, not under Transformer Engine's fp8 recipe; drop --fp8-format "
                   f"and the other --fp8-* flags)")
    if getattr(args, "fp4", None):
        out.append(f"--fp4-format {args.fp4} (no fp4 shard GEMMs in METP; drop it)")
    if getattr(args, "tp_comm_overlap", False):
        out.append("--tp-comm-overlap (Transformer Engine's userbuffer overlap of TP all-gathers "
                   "and reduce-scatters; METP has none of those and overlaps its own ring "
                   "transfers with compute already: drop it)")
    kernel = getattr(args, "metp_attention_kernel", "auto")
    if getattr(args, "use_flash_attn", False) and kernel not in ("auto", "flash_attn"):
        out.append(f"--use-flash-attn with --metp-attention-kernel {kernel} (with METP, "
                   f"--use-flash-attn means --metp-attention-kernel flash_attn; keep one)")
    if getattr(args, "use_flash_attn", False) and not _have_module("flash_attn"):
        out.append("--use-flash-attn (the flash-attn package is not installed here; drop the "
                   "flag: --metp-attention-kernel auto uses PyTorch's flash kernel)")
    return out


def recompute_problems(args) -> List[str]:
    """Megatron's activation recompute/offload flags METP refuses (``--recompute-granularity
    full`` works: whole layers, rings included, re-run in backward; ``selective`` runs the
    ``--recompute-modules`` of :mod:`megatron_metp.megatron.selective` and refuses the others,
    one line per module)."""
    from ..megatron.selective import selective_problems

    out = []
    # validate_metp_args runs before validate_args turns --recompute-activations into
    # recompute_granularity='selective' (and --cpu-offloading-num-layers into --cpu-offloading)
    if getattr(args, "recompute_granularity", None) == "selective" or \
            getattr(args, "recompute_activations", False):
        given = ("--recompute-activations" if getattr(args, "recompute_activations", False)
                 else "--recompute-granularity selective")
        out.extend(selective_problems(
            getattr(args, "recompute_modules", None), given=given,
            weight_ring=not getattr(args, "metp_disable_weight_ring", False),
            offload=bool(getattr(args, "metp_offload_activations", False))))
    if getattr(args, "distribute_saved_activations", False):
        out.append("--distribute-saved-activations (it splits the checkpointed layer inputs over "
                   "TP only and needs TP > 1; with METP they are already sharded over the METP "
                   "ring: drop the flag)")
    if getattr(args, "cpu_offloading", False) or \
            (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        out.append("--cpu-offloading / --cpu-offloading-num-layers (Megatron's activation "
                   "offload; with METP use METP's own offload, --metp-offload-activations, "
                   "instead)")
    if getattr(args, "fine_grained_activation_offloading", False):  # core_v0.19.0's flag
        out.append("--fine-grained-activation-offloading (Megatron's per-module offload, not "
                   "wired into the METP layers; use --metp-offload-activations instead)")
    return out


def _have_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
