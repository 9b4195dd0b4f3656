"""What METP accepts of Megatron's Mixture-of-Experts settings, checked before any work.

METP runs Megatron's stock ``MoELayer`` with the experts sharded over the METP group: expert
parallelism ``EP = p`` (the expert-model-parallel groups *are* the METP groups, see
:mod:`megatron_metp.megatron.parallel`), so rank ``r`` of a METP group holds experts
``r·E/p … (r+1)·E/p − 1`` and the expert data-parallel group (``c × DP`` ranks under METP × CP)
is where their gradients reduce — the same group METP-sharded weights reduce over.

``TransformerConfig.expert_model_parallel_size`` must then be ``p`` as well: Megatron marks an
expert weight as expert-parallel (``allreduce = False``: its gradient reduces over expert-DP,
not DP×CP) only when that field is ``> 1``. Left at 1, expert weights are reduced over DP×CP —
summing different experts' gradients — and train wrong without any error (the tests measure the
error). :func:`moe_problems` refuses it.

One table of checks serves both megatron-core builders (a ``TransformerConfig``) and Megatron-LM's
``args`` (:func:`moe_args_problems`): each entry names the command-line flag and the alternative.

EP wider than p (a multiple of p, :mod:`.wide_ep`) runs with the megatron-core builders and
through Megatron-LM (``wire_wide_expert_parallel``). Not supported yet, refused (see
``docs/moe.md``): expert tensor parallelism > 1, TP > 1 with experts, EP not a multiple of p, the
``flex`` dispatcher / DeepEP, shared experts, MoE latent projections, EP communication overlap,
CUDA graphs, upcycling; on CPU, grouped GEMM and the fused permute / router kernels (GPU only).
"""

from __future__ import annotations

from typing import Callable, List, Optional

__all__ = ["moe_problems", "check_moe_config", "moe_args_problems", "check_moe_args",
           "moe_enabled"]


def moe_enabled(config) -> bool:
    """Whether ``config`` (a ``TransformerConfig`` or Megatron-LM ``args``) has experts."""
    return bool(getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None))


def _on_cpu() -> bool:
    import torch  # here, not at the top: the launcher's preflight (on_cpu given) runs without torch

    return not torch.cuda.is_available()


def moe_problems(get: Callable, metp_parallel_size: int, *, on_cpu: Optional[bool] = None,
                 ep_unset_ok: bool = False) -> List[str]:
    """Every MoE setting METP of size ``p = metp_parallel_size`` cannot run, each naming the flag
    and the alternative; ``[]`` without experts.

    ``get(name, default)`` reads a setting by its ``TransformerConfig`` name (``num_moe_experts``,
    ``expert_model_parallel_size``, ...). ``ep_unset_ok``: an ``expert_model_parallel_size`` of 1
    is accepted (Megatron-LM's ``args`` before the hooks set it to ``p``); otherwise it must be
    ``p`` or a multiple of ``p`` dividing the expert count (EP wider than the METP group,
    :mod:`.wide_ep`; the world-size arithmetic is :func:`.parallel.expert_parallel_problems`'s).
    ``on_cpu`` (default: no CUDA device) refuses the GPU-only kernels."""
    E = get("num_moe_experts", None)
    if not E:
        return []
    p = int(metp_parallel_size)
    cpu = _on_cpu() if on_cpu is None else on_cpu
    out = []
    ep = get("expert_model_parallel_size", 1) or 1
    wide = ep > p and not ep % p
    if wide and E % ep:
        out.append(f"--num-experts {E} is not divisible by --expert-model-parallel-size {ep}; "
                   f"choose a multiple of {ep}")
    elif ep != p and not wide and not (ep_unset_ok and ep == 1):
        out.append(f"expert_model_parallel_size {ep} (--expert-model-parallel-size) with "
                   f"--metp-parallel-size {p}: METP shards the experts over its own group, so "
                   f"TransformerConfig.expert_model_parallel_size must be {p} or a multiple of "
                   f"it (left at 1, expert gradients are reduced over DP×CP and come out "
                   f"wrong); set it to {p} or {2 * p}, {3 * p}, ... (EP wider than the METP "
                   f"group, docs/moe.md)")
    if E % p:
        out.append(f"--num-experts {E} is not divisible by --metp-parallel-size {p} (the "
                   f"experts are sharded over the METP group); choose a multiple of {p}")
    t = get("tensor_model_parallel_size", 1) or 1
    if t > 1:
        out.append(f"--tensor-model-parallel-size {t} with --num-experts: METP shards the "
                   f"experts over its group, not over TP; use TP 1 and a larger "
                   f"--metp-parallel-size")
    etp = get("expert_tensor_parallel_size", None)
    if etp is not None and etp > 1:
        out.append(f"--expert-tensor-parallel-size {etp}: expert tensor parallelism is not "
                   f"supported with METP; use 1 (experts are sharded over the METP group)")
    dispatcher = get("moe_token_dispatcher_type", "allgather")
    if dispatcher == "flex" or get("moe_enable_deepep", False):
        out.append("--moe-token-dispatcher-type flex (DeepEP / HybridEP): use allgather or "
                   "alltoall with METP")
    if get("moe_shared_expert_intermediate_size", None) and get("add_bias_linear", True):
        out.append("--moe-shared-expert-intermediate-size with linear biases: the shared expert "
                   "has none (as in stock Megatron); add --disable-bias-linear")
    if get("moe_latent_size", None):
        out.append("--moe-latent-size (MoE latent projections): not supported with METP; "
                   "drop it")
    if get("overlap_moe_expert_parallel_comm", False) or get("moe_shared_expert_overlap", False):
        out.append("--overlap-moe-expert-parallel-comm / --moe-shared-expert-overlap "
                   "(EP communication overlap): not supported with METP; drop it")
    graphs = get("cuda_graph_impl", "none")
    if (graphs not in (None, "none")) or get("enable_cuda_graph", False) or \
            get("external_cuda_graph", False):
        out.append(f"--cuda-graph-impl {graphs if graphs not in (None, 'none') else 'local'} "
                   f"(CUDA graphs) with --num-experts and METP: not supported; use "
                   f"--cuda-graph-impl none")
    if get("moe_use_upcycling", False):
        out.append("--moe-use-upcycling: not supported with METP; upcycle with stock Megatron, "
                   "save, then load the MoE checkpoint with METP")
    if cpu:
        for name, flag in (("moe_grouped_gemm", "--moe-grouped-gemm"),
                           ("moe_permute_fusion", "--moe-permute-fusion"),
                           ("moe_router_fusion", "--moe-router-fusion")):
            if get(name, False):
                out.append(f"{flag} runs on GPU only (Transformer Engine / grouped_gemm "
                           f"kernels); drop it on CPU (SequentialMLP and the unfused paths run "
                           f"there)")
    return out


def check_moe_config(config, metp_parallel_size: int, *, on_cpu: Optional[bool] = None) -> None:
    """Raise ``ValueError`` listing :func:`moe_problems` of a ``TransformerConfig``."""
    problems = moe_problems(lambda name, default: getattr(config, name, default),
                            metp_parallel_size, on_cpu=on_cpu)
    if problems:
        raise ValueError("--metp-parallel-size with MoE does not support: " + "; ".join(problems))


#: Megatron-LM ``args`` names that differ from the ``TransformerConfig`` field
_ARG_NAMES = {"num_moe_experts": "num_experts"}


def moe_args_problems(args, metp_parallel_size: int, *, on_cpu: Optional[bool] = None) -> List[str]:
    """:func:`moe_problems` of Megatron-LM ``args`` (``--num-experts`` ...), where an
    ``--expert-model-parallel-size`` left at 1 is fine (the hooks set it to ``p``)."""
    def get(name, default):
        return getattr(args, _ARG_NAMES.get(name, name), default)

    return moe_problems(get, metp_parallel_size, on_cpu=on_cpu, ep_unset_ok=True)


def check_moe_args(args, metp_parallel_size: int, *, on_cpu: Optional[bool] = None) -> None:
    """Raise ``ValueError`` listing :func:`moe_args_problems`."""
    problems = moe_args_problems(args, metp_parallel_size, on_cpu=on_cpu)
    if problems:
        raise ValueError("--metp-parallel-size with MoE does not support: " + "; ".join(problems))
