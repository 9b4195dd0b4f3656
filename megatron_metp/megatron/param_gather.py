"""Megatron DDP's overlapped parameter all-gather (``--overlap-param-gather``) over METP modules.

With the distributed optimizer and ``overlap_param_gather``, Megatron's
``DistributedDataParallel`` all-gathers the updated parameters lazily: a forward pre-hook on
every module waits for the all-gather of the bucket group holding that module's *own*
parameters (``module.parameters(recurse=False)``), and that wait dispatches the next bucket
group's all-gather. A METP module reads its submodules' weights without calling them
(:class:`~.modules.METPSelfAttention` hands ``linear_qkv.weight`` and ``linear_proj.weight`` to
one fused op, :class:`~.modules.METPMLP` ``linear_fc1``/``linear_fc2``'s, MLA its projections,
the streaming layer the whole layer's), so those submodules' pre-hooks never fire: the
METP-sharded weights (``allreduce = False``: a bucket group of their own) were never gathered
and each data-parallel rank trained on its own stale copy (core_v0.16.1, tiny METP 2 × DP 2,
global batch 2: iteration-2 lm loss 7.148952 instead of 7.141282).

:func:`cover_submodule_weights` makes DDP's pre-hook of such a module (one whose
``reads_submodule_weights`` is true: a class attribute, or the streaming layer's property, true
when it runs as the op) also wait for its submodules' parameters, before the fused op reads
them: ``finish_param_sync`` of every bucket group they are in (a no-op for one already
finished). DDP's own switch stays in charge (Megatron-LM disables the pre-hooks for the first
iteration, evaluation and checkpoints, and syncs all parameters then): the covering hook is the
one DDP registers and removes.

``--overlap-grad-reduce`` needs nothing: the METP ops hand each weight gradient back through
autograd (Megatron's placeholder once it is in ``main_grad``, :mod:`megatron_metp.ops._grads`),
so DDP's per-parameter hook marks it ready and each bucket reduces after its last gradient.
"""

from __future__ import annotations

__all__ = ["cover_submodule_weights", "reads_submodule_weights"]


def reads_submodule_weights(module) -> bool:
    """Whether ``module``'s forward reads its submodules' parameters without calling them."""
    return bool(getattr(module, "reads_submodule_weights", False))


def cover_submodule_weights(ddp) -> int:
    """Make Megatron's ``DistributedDataParallel`` ``ddp`` (with ``overlap_param_gather``) wait,
    in the forward pre-hook of each module that :func:`reads_submodule_weights`, for the
    all-gather of every parameter below it. Call it right after DDP is built (its pre-hooks are
    re-registered). Returns how many modules it covers (0 without overlapped param gather)."""
    if not getattr(ddp, "use_forward_hook", False):
        return 0
    readers = {m for m in ddp.module.modules() if reads_submodule_weights(m)}
    if not readers:
        return 0
    make_hook = ddp._make_forward_pre_hook  # megatron-core's, one per module

    def make_covering_hook():
        hook = make_hook()

        def covering(module, *args):
            for sub in (module.modules() if module in readers else (module,)):
                hook(sub, *args)  # waits for sub's own parameters (recurse=False)

        return covering

    ddp.disable_forward_pre_hook(param_sync=False)  # nothing gathered yet: DDP was just built
    ddp._make_forward_pre_hook = make_covering_hook
    ddp.enable_forward_pre_hook()
    return len(readers)
