"""Set up Megatron's parallel state with METP as its context-parallel dimension.

World = TP × METP × CP × PP × DP. METP is placed on Megatron's CP axis, so Megatron itself sizes DP,
splits batches in the dual-chunk order, slices RoPE and shapes pipeline messages; with Megatron's
default rank order (``tp-cp-ep-dp-pp``) a METP ring's neighbours are adjacent right after TP —
on the same node whenever TP·METP ≤ GPUs per node.

Gradients: METP-sharded weights are marked ``allreduce=False``, which sends them down Megatron's
expert-parameter path (DDP's expert buffers over the *expert data-parallel* group, the distributed
optimizer's expert shards, grad norms over the expert model-parallel group). Folding
``expert_model_parallel_size = METP`` makes the expert groups coincide with the METP groups, so
that expert-DP group is exactly pure DP (checked in the tests for TP×METP×PP×DP layouts), while
replicated parameters reduce over DP×METP as under CP. Scaling matches too: a sharded weight's
gradient already holds the sum over the METP group (the op's ring reduce), and DDP scales expert
gradients by ``1/|DP×CP|`` like dense ones.

METP × CP (``context_parallel_size = c``, the *outer* factor): Megatron's CP size is ``p·c``
and ``expert_model_parallel_size = p``; under the default order the expert (METP) groups are
``p`` adjacent ranks inside each CP group, the CP group is the sequence ring (K/V of each head
group over ``p·c`` ranks, sequence split in ``2·p·c`` dual chunks), and the expert data-parallel
group is the ``c`` METP groups of the CP group × DP: what METP-sharded weights reduce over
(scaled ``1/|DP×CP|`` like dense ones, CP = ``p·c``). World = TP × p × c × PP × DP.

Mixture-of-Experts (:mod:`.moe`): the experts are sharded over these same expert (= METP) groups,
EP = p, and reduce over the same expert-DP group; each METP group also gets a process group of its
own (:mod:`.ring_groups`), so the METP rings never share a communicator with Megatron's token
dispatchers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:  # the checks above initialize_model_parallel run without torch (the preflight)
    from .groups import METPGroups


def validate_metp_config(*, world_size: int, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1, metp_parallel_size: int = 1,
                         context_parallel_size: int = 1, seq_length: Optional[int] = None,
                         num_experts: Optional[int] = None,
                         sequence_parallel: bool = False,
                         expert_model_parallel_size: int = 1) -> int:
    """Check a METP configuration before any rank starts work; return the DP size.

    Raises ``ValueError`` naming the flag and the fix (the first of
    :func:`metp_config_problems`).
    """
    problems = metp_config_problems(
        world_size=world_size, tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        metp_parallel_size=metp_parallel_size, context_parallel_size=context_parallel_size,
        seq_length=seq_length, num_experts=num_experts, sequence_parallel=sequence_parallel,
        expert_model_parallel_size=expert_model_parallel_size)
    if problems:
        raise ValueError(problems[0])
    return world_size // (tensor_model_parallel_size * metp_parallel_size *
                          context_parallel_size * pipeline_model_parallel_size)


def metp_config_problems(*, world_size: int, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1, metp_parallel_size: int = 1,
                         context_parallel_size: int = 1, seq_length: Optional[int] = None,
                         num_experts: Optional[int] = None,
                         sequence_parallel: bool = False,
                         expert_model_parallel_size: int = 1) -> List[str]:
    """Every problem of a METP layout (world = TP × METP × CP × PP × DP), each naming the flag
    and the fix; empty when it can run. A size below 1 is reported alone (the rest of the
    arithmetic would be meaningless). ``expert_model_parallel_size`` (with ``num_experts``): 1
    (folded to p), p, or a multiple of p that divides the ranks of a pipeline stage and the
    expert count (:func:`expert_parallel_problems`)."""
    t, pp, p = tensor_model_parallel_size, pipeline_model_parallel_size, metp_parallel_size
    sizes = [f"{flag} must be >= 1, got {v}" for flag, v in (
        ("--tensor-model-parallel-size", t), ("--pipeline-model-parallel-size", pp),
        ("--metp-parallel-size", p), ("--context-parallel-size", context_parallel_size)) if v < 1]
    if sizes:
        return sizes
    out = []
    c = context_parallel_size  # the outer factor: Megatron's CP group has p·c ranks
    if p > 1 and num_experts and num_experts % p:
        out.append(f"--num-experts {num_experts} is not divisible by --metp-parallel-size {p} "
                   f"(the experts are sharded over the METP group: expert parallelism = METP); "
                   f"choose a multiple of {p}")
    if p > 1 and sequence_parallel:
        out.append("--sequence-parallel cannot be combined with --metp-parallel-size > 1: "
                   "METP already shards the sequence; drop --sequence-parallel")
    if p > 1 and num_experts:
        out += expert_parallel_problems(world_size=world_size, tensor_model_parallel_size=t,
                                        pipeline_model_parallel_size=pp, metp_parallel_size=p,
                                        num_experts=num_experts,
                                        expert_model_parallel_size=expert_model_parallel_size)
    model = t * p * c * pp
    if world_size % model:
        out.append(f"world size {world_size} is not divisible by TP×METP×CP×PP = "
                   f"{t}×{p}×{c}×{pp} = {model}; change --tensor-model-parallel-size / "
                   f"--metp-parallel-size / --context-parallel-size / "
                   f"--pipeline-model-parallel-size or the number of GPUs")
    if seq_length is not None and p * c > 1 and seq_length % (2 * p * c):
        what = "2×METP" if c == 1 else "2×METP×CP"
        out.append(f"--seq-length {seq_length} is not divisible by {what} = "
                   f"{2 * p * c} (the sequence is split into "
                   f"{'2·p' if c == 1 else '2·p·c'} balanced chunks); pad or change "
                   f"--seq-length")
    return out


def valid_expert_parallel_sizes(*, world_size: int, metp_parallel_size: int, num_experts: int,
                                tensor_model_parallel_size: int = 1,
                                pipeline_model_parallel_size: int = 1) -> List[int]:
    """The ``--expert-model-parallel-size`` values METP ``p`` can run: ``p·e`` dividing the
    ranks of a pipeline stage (``world / (TP·PP)``) and the expert count (:mod:`.wide_ep`)."""
    p = metp_parallel_size
    stage = world_size // max(1, tensor_model_parallel_size * pipeline_model_parallel_size)
    return [m for m in range(p, stage + 1, p) if not stage % m and not num_experts % m]


def expert_parallel_problems(*, world_size: int, metp_parallel_size: int, num_experts: int,
                             expert_model_parallel_size: int = 1,
                             tensor_model_parallel_size: int = 1,
                             pipeline_model_parallel_size: int = 1) -> List[str]:
    """``--expert-model-parallel-size`` with METP ``p``: 1 (the experts sharded over the METP
    group, EP = p), else a multiple of p that divides ``world / (TP·PP)`` and ``--num-experts``
    (EP = p·e over METP × CP or METP × DP, :mod:`.wide_ep`); the refusal names the valid
    values."""
    ep, p = expert_model_parallel_size or 1, metp_parallel_size
    if ep in (1, p):
        return []
    valid = valid_expert_parallel_sizes(
        world_size=world_size, metp_parallel_size=p, num_experts=num_experts,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size)
    stage = world_size // max(1, tensor_model_parallel_size * pipeline_model_parallel_size)
    if ep % p == 0 and ep in valid:
        return []
    why = (f"not a multiple of --metp-parallel-size {p}" if ep % p else
           f"does not divide the {stage} ranks of a pipeline stage" if stage % ep else
           f"does not divide --num-experts {num_experts}")
    return [f"--expert-model-parallel-size {ep} {why} (the expert-parallel group must be whole "
            f"METP groups: p·e ranks over METP × CP or METP × DP); valid values with "
            f"--metp-parallel-size {p}, {world_size} ranks and --num-experts {num_experts}: "
            f"{', '.join(map(str, valid)) or 'none'} (docs/moe.md)"]


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              metp_parallel_size: int = 1, *, seq_length: Optional[int] = None,
                              num_experts: Optional[int] = None,
                              ring_timeout_s: Optional[float] = None,
                              hostname: Optional[str] = None,
                              **megatron_kwargs) -> METPGroups:
    """Megatron's ``initialize_model_parallel`` with METP on the CP axis; returns the groups.

    ``megatron_kwargs`` go to ``megatron.core.parallel_state.initialize_model_parallel`` (for
    example ``virtual_pipeline_model_parallel_size``, ``order``); ``context_parallel_size`` there
    is the outer factor ``c`` of METP × CP (Megatron's CP group: ``p·c`` ranks).

    Timeout: every group waits the one job timeout (:mod:`megatron_metp.runtime.watchdog`):
    ``ring_timeout_s``, else ``METP_RING_TIMEOUT_S`` (default 600 s). Megatron's groups are made
    with it (``distributed_timeout_minutes`` = seconds / 60), the default group is set to it, and
    the METP rings wait it. A ``distributed_timeout_minutes`` given here instead is the setting
    (the rings derive theirs from it); a ``ring_timeout_s`` longer than it is refused.

    Placement: the ranks then check together that no METP ring spans two hosts
    (:func:`megatron_metp.runtime.placement.check_metp_groups_on_one_node`; ``hostname``
    replaces this rank's host name, for tests) and raise ``METPPlacementError`` naming the fix.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..runtime.watchdog import apply_to_process_groups, job_timeout_s
    from .groups import METPGroups

    if not dist.is_initialized():
        raise ValueError("initialize torch.distributed first (torchrun/srun + "
                         "torch.distributed.init_process_group)")
    cp = megatron_kwargs.pop("context_parallel_size", 1)
    ep = megatron_kwargs.pop("expert_model_parallel_size", 1)
    if metp_parallel_size > 1 and ep % metp_parallel_size and ep != 1:
        raise ValueError(f"expert_model_parallel_size {ep} (--expert-model-parallel-size) "
                         f"cannot be combined with --metp-parallel-size {metp_parallel_size}: "
                         f"METP folds the expert groups onto its own (MoE experts are sharded "
                         f"over whole METP groups: EP = METP, or a multiple of it with "
                         f"experts); leave it at 1 or give a multiple of {metp_parallel_size}")
    minutes = megatron_kwargs.pop("distributed_timeout_minutes", None)
    if minutes is None:
        timeout_s = job_timeout_s() if ring_timeout_s is None else float(ring_timeout_s)
    else:
        timeout_s = float(minutes) * 60.0
        if ring_timeout_s is not None and ring_timeout_s > timeout_s:
            raise ValueError(f"ring_timeout_s {ring_timeout_s:g} s is longer than "
                             f"distributed_timeout_minutes {minutes:g} ({timeout_s:g} s), which "
                             f"bounds every process group: give one of them")
        if ring_timeout_s is not None:
            timeout_s = float(ring_timeout_s)
    validate_metp_config(world_size=dist.get_world_size(),
                         tensor_model_parallel_size=tensor_model_parallel_size,
                         pipeline_model_parallel_size=pipeline_model_parallel_size,
                         metp_parallel_size=metp_parallel_size, context_parallel_size=cp,
                         seq_length=seq_length, num_experts=num_experts,
                         expert_model_parallel_size=ep)
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                 pipeline_model_parallel_size=pipeline_model_parallel_size,
                                 context_parallel_size=cp * metp_parallel_size,
                                 expert_model_parallel_size=max(ep, metp_parallel_size),
                                 distributed_timeout_minutes=(timeout_s / 60.0 if minutes is None
                                                              else minutes),
                                 **megatron_kwargs)
    apply_to_process_groups(timeout_s)
    from .ring_groups import create_metp_ring_groups

    # the METP rings' own communicators, on every rank
    create_metp_ring_groups(timeout_s, p=metp_parallel_size)
    groups = METPGroups.from_parallel_state(timeout_s=timeout_s, context_parallel_size=cp)
    if metp_parallel_size > 1:  # no METP ring may span two nodes (refused on every rank)
        from ..runtime.placement import check_metp_groups_on_one_node

        check_metp_groups_on_one_node(groups.metp, hostname=hostname)
    return groups
