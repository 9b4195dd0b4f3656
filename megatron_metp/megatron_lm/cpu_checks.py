"""What a CPU run of Megatron-LM (:mod:`.cpu`, ``METP_CPU=1``) cannot do, refused before any rank
starts work (torch-free: the launcher's preflight runs these checks too)."""

from __future__ import annotations

import os

__all__ = ["check_cpu_args", "cpu_arg_problems"]


def check_cpu_args(args) -> None:
    """Refuse, before any rank starts work, what a CPU run of Megatron-LM cannot do."""
    problems = cpu_arg_problems(args)
    if problems:
        raise ValueError("METP_CPU=1 (Megatron-LM on CPU ranks) cannot be used with: " +
                         "; ".join(problems))


def cpu_arg_problems(args) -> list:
    """What a CPU run of Megatron-LM cannot do with ``args``, each naming the flag and the fix
    (reads ``args`` only; the launcher's preflight runs it too)."""
    problems = []
    if getattr(args, "distributed_backend", "nccl") != "gloo":
        problems.append(f"--distributed-backend {args.distributed_backend} (pass "
                        f"--distributed-backend gloo)")
    if getattr(args, "transformer_impl", "local") != "local":
        problems.append(f"--transformer-impl {args.transformer_impl} (Transformer Engine needs "
                        f"CUDA; pass --transformer-impl local)")
    if getattr(args, "gradient_accumulation_fusion", False):
        problems.append("gradient accumulation fusion is on (apex's CUDA kernel; pass "
                        "--no-gradient-accumulation-fusion)")
    for name, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format"),
                       ("tp_comm_overlap", "--tp-comm-overlap"),
                       ("use_flash_attn", "--use-flash-attn")):
        if getattr(args, name, None):
            problems.append(f"{flag} (needs CUDA; drop it for a CPU run)")
    load = getattr(args, "load", None)
    if getattr(args, "use_distributed_optimizer", False) and load and \
            not getattr(args, "no_load_optim", False) and \
            os.path.isfile(os.path.join(load, "latest_checkpointed_iteration.txt")):
        problems.append("--use-distributed-optimizer resuming from --load "
                        f"{load} (on CPU, without Apex/TE's Adam, the distributed optimizer of "
                        "core_v0.16.1 and of core_v0.19.0 cannot load its own state: torch's Adam "
                        "creates it lazily and DistributedOptimizer.state_dict asserts "
                        "len(steps) == 1; resume CPU runs without "
                        "--use-distributed-optimizer (DISTRIBUTED_OPTIMIZER=0), or pass "
                        "--no-load-optim to restart the optimizer)")
    from .moe_args import moe_cpu_problems

    return problems + moe_cpu_problems(args)
