"""Megatron's ``parallel_state`` under METP, and the stall watch of Megatron-LM's loop.

The patched ``megatron/training/initialize.py`` calls, on every rank right after
``init_process_group``, :func:`install_stall_watch` (the last-seen records of
:mod:`.last_seen`) and then passes ``expert_model_parallel_size=
metp_expert_model_parallel_size(args)`` to its one ``initialize_model_parallel`` call, which
folds the expert groups onto the METP groups in ``parallel_state`` only (see
:mod:`megatron_metp.megatron.parallel`): ``args.expert_model_parallel_size`` stays 1. The model
builder (:mod:`.build`) then checks the result (:func:`check_metp_parallel_state`) and that no
METP ring spans two nodes (:func:`check_placement_once`).
"""

from __future__ import annotations

from .flags import CP_OUTER, metp_enabled
from .last_seen import install

__all__ = ["install_stall_watch", "metp_expert_model_parallel_size", "check_placement_once",
           "check_metp_parallel_state"]


def install_stall_watch(args) -> bool:
    """Install the last-seen records of Megatron-LM's loop (:func:`.last_seen.install`: a rank
    waiting on a stuck or dead peer ends within the timeout, naming it), METP on or off; returns
    whether they are installed. Called on every rank right after ``init_process_group``, before
    ``initialize_model_parallel``; once per process (a second call changes nothing)."""
    return install(args)


def metp_expert_model_parallel_size(args) -> int:
    """The ``expert_model_parallel_size`` to give ``parallel_state.initialize_model_parallel``.

    ``args.expert_model_parallel_size`` unless METP is on, then the METP size: the expert
    groups then coincide with the METP groups and expert data parallelism with pure DP, which is
    where METP-sharded weights reduce their gradients. ``args`` itself is not changed (Megatron
    asserts ``--num-experts`` whenever ``args.expert_model_parallel_size > 1``); with
    ``--num-experts`` :func:`.validate.validate_metp_args` has already set it to the METP size
    (:func:`.moe_args.fold_expert_parallel`). Reads ``args`` only: the stall watch is
    :func:`install_stall_watch`, called on its own.
    """
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if not metp_enabled(args):
        return ep
    p = args.metp_parallel_size
    if ep != 1 and not (getattr(args, "num_experts", None) and ep % p == 0):
        raise ValueError(f"--expert-model-parallel-size {ep} cannot be combined with "
                         f"--metp-parallel-size {p}")
    return max(ep, p)  # p, or EP wider than the METP group (whole METP groups)


_placement_checked = []


def check_placement_once(groups) -> None:
    """At start-up (the first model chunk built), every rank together: no METP ring spans two
    nodes (:func:`megatron_metp.runtime.placement.check_metp_groups_on_one_node`)."""
    if _placement_checked:
        return
    from ..runtime.placement import check_metp_groups_on_one_node

    check_metp_groups_on_one_node(groups.metp)
    _placement_checked.append(True)


def check_metp_parallel_state(args) -> None:
    """Raise if ``parallel_state`` does not have the METP layout ``args`` ask for.

    Catches a checkout where only some of the patches are applied: the context-parallel group
    must be the METP ring, the expert-model-parallel group the same ranks, and expert data
    parallelism pure data parallelism.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    p = args.metp_parallel_size
    c = getattr(args, CP_OUTER, 1)
    fix = "apply all of patches/ with scripts/apply_patches.sh MEGATRON_LM_DIR"
    cp = ps.get_context_parallel_world_size()
    if cp != p * c:
        raise RuntimeError(f"parallel_state has context-parallel size {cp}, but "
                           f"--metp-parallel-size {p} x --context-parallel-size {c} is {p * c}: "
                           f"validate_args did not map METP onto context parallelism ({fix})")
    ranks = dist.get_process_group_ranks
    cp_ranks = ranks(ps.get_context_parallel_group())
    ep_ranks = ranks(ps.get_expert_model_parallel_group())
    ep = max(getattr(args, "expert_model_parallel_size", 1) or 1, p)
    if ep > p:  # EP wider than METP: whole METP groups (checked by megatron/wide_ep.py)
        from ..megatron.ring_groups import metp_group_ranks

        folded = ps.get_expert_model_parallel_world_size() == ep and \
            set(metp_group_ranks(p)) <= set(ep_ranks)
    else:
        folded = ps.get_expert_model_parallel_world_size() == p and \
            (ep_ranks == cp_ranks if c == 1 else all(r in cp_ranks for r in ep_ranks))
    if not folded:
        raise RuntimeError(f"parallel_state's expert-model-parallel groups are not the METP "
                           f"rings (expert-model-parallel size "
                           f"{ps.get_expert_model_parallel_world_size()}, METP {p}): the "
                           f"initialize_model_parallel call does not fold them ({fix})")
    edp = ps.get_expert_data_parallel_group()
    if (c == 1 and ep == p and ranks(edp) != ranks(ps.get_data_parallel_group())) or \
            dist.get_world_size(edp) * ep != p * c * ps.get_data_parallel_world_size():
        raise RuntimeError("expert data-parallel groups differ from pure data-parallel groups "
                           "(x the outer context-parallel factor); METP-sharded gradients "
                           "would be reduced over the wrong ranks")
    dp = getattr(args, "data_parallel_size", None)
    if dp is not None and dp != ps.get_data_parallel_world_size():
        raise RuntimeError(f"args.data_parallel_size {dp} differs from parallel_state's "
                           f"{ps.get_data_parallel_world_size()}")

