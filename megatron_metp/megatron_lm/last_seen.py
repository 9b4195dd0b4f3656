"""Where each rank was last seen, under Megatron-LM's own loop: no silent stall.

Megatron-LM's ``pretrain()`` marks nothing, so a rank stuck in its code (the dataset builder
looping on rank 0, a rank that never reaches a barrier) used to leave its peers waiting the
process group's timeout and then failing with gloo's ``Timed out waiting …ms for recv``, naming
nobody. :func:`install` (called on every rank by the patched ``initialize.py``, through
:func:`megatron_metp.megatron_lm.parallel_state.install_stall_watch`, right after
``init_process_group``) wraps the cheap points of that loop so that each rank records where it is
in the job's store (torch's default ``TCPStore``; :func:`megatron_metp.runtime.watchdog.enter`,
one ~100-byte ``set``):

* ``torch.distributed.barrier`` — label ``barrier in <function> (<file>:<line>)``; the wait is
  bounded by the job timeout (gloo: the barrier's own timeout; NCCL: ``Work.wait(timeout)``, the
  host stops waiting, NCCL's watchdog ends the op at the group's timeout) and a timed-out or
  broken wait raises :class:`~megatron_metp.runtime.watchdog.StalledRankError` naming the ranks
  that reported no failure, each with its last label and its age;
* ``megatron.training.training.build_train_valid_test_datasets`` — ``building datasets``;
* ``megatron.training.training.train_step`` — ``iteration N (train_step)``, and inside it
  ``forward-backward of iteration N`` (the schedule: the METP ring exchanges), ``gradient reduce
  of iteration N`` (``config.finalize_model_grads_func``: DDP's reduce over DP × CP) and
  ``optimizer step of iteration N`` (``optimizer.step``: the grad-norm reduce and the
  distributed optimizer's parameter gather). Every process group gives the ops started inside
  ``train_step`` at most the job timeout (:func:`~megatron_metp.runtime.watchdog.waits_at_most`;
  each group's own timeout is back after it), so a rank stopped anywhere in it ends its peers'
  wait within the one timeout with the rank, its last label and its age named;
* ``megatron.training.training.save_checkpoint`` — ``save of iteration N``, which first runs the
  project's pre-save agreement check (:func:`megatron_metp.runtime.agree.check_pending`) on the
  METP groups of the model, so a disagreement between scheduled exchanges is refused before
  Megatron-LM writes the checkpoint.

A transport error (timeout, closed connection) raised inside the last three becomes a
``StalledRankError`` too (:func:`~megatron_metp.runtime.watchdog.bounded`); any other error is
the rank's own (its DataLoader worker killed, say) and is recorded so that its peers blame it,
not themselves. The job timeout is
:func:`~megatron_metp.megatron_lm.timeouts.megatron_lm_timeout_s` (60 ×
``--distributed-timeout-minutes``, or a shorter ``--metp-ring-timeout`` /
``METP_RING_TIMEOUT_S``): the barriers and everything inside ``train_step`` wait at most that;
building the datasets and the saves keep the process group's ``--distributed-timeout-minutes``.

NCCL (not testable without GPUs): the ops' waits are stream-ordered, so what ends a stalled op
is NCCL's watchdog, at the deadline the op got when it was posted — inside ``train_step`` the job
timeout (above). :func:`install` sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only: the
watchdog aborts the communicators of the timed-out op but does not kill the process) where the
user has not set it, before Megatron creates its groups, so the error reaches the main thread at
its next wait or op on that group ("NCCL communicator was aborted"), inside the bounded region,
which names the ranks; torch's default (3) would kill the process from the watchdog thread
naming nobody. A user's own setting wins (e.g. 3, to end even a rank stuck in a CUDA call).

Test hook (never set in a real job): ``METP_TEST_STALL_RANK=R`` and ``METP_TEST_STALL_AT=TEXT``
make rank ``R`` stop for good when it records a label containing ``TEXT`` (after recording it).
"""

from __future__ import annotations

import datetime
import inspect
import os
import sys
import time
from typing import List

import torch.distributed as dist

from ..runtime import overrides, watchdog
from .timeouts import megatron_lm_timeout_s

__all__ = ["install", "remember_groups", "installed"]

_installed: List[bool] = []
_groups: list = []  # METPGroups of the model chunks built (pre-save agreement check)


def installed() -> bool:
    """Whether :func:`install` wrapped Megatron-LM's loop in this process."""
    return bool(_installed)


def remember_groups(groups) -> None:
    """Record a model chunk's :class:`~megatron_metp.megatron.groups.METPGroups` (for the
    pre-save agreement check of Megatron-LM's ``--save``)."""
    _groups.append(groups)


def _stall_if_asked(label: str) -> None:
    """The test hook (module docstring): called right after ``label`` was recorded."""
    stall_rank = overrides.raw("METP_TEST_STALL_RANK") or ""
    at = overrides.raw("METP_TEST_STALL_AT") or ""
    if stall_rank and at and at in label and str(dist.get_rank()) == stall_rank:
        print(f"[METP_TEST_STALL] rank {stall_rank} stops for good at {label!r}", flush=True)
        while True:  # the test's stalled rank: ended by the launcher once its peer fails
            time.sleep(3600)


def _bounded_barrier(original, timeout_s: float):
    default_group = inspect.signature(original).parameters["group"].default

    def barrier(group=default_group, async_op=False, device_ids=None):
        caller = sys._getframe(1)
        label = (f"barrier in {caller.f_code.co_name} "
                 f"({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})")
        watchdog.enter(label)
        _stall_if_asked(label)
        if async_op:
            return original(group=group, async_op=True, device_ids=device_ids)
        t0 = time.monotonic()
        td = datetime.timedelta(seconds=timeout_s)
        try:
            pg = dist.distributed_c10d._get_default_group() \
                if group is None or group is dist.GroupMember.WORLD else group
            if dist.distributed_c10d._rank_not_in_group(pg):
                return None  # as torch's barrier: nothing to wait for
            if device_ids is None and dist.get_backend(pg) == "gloo":
                # gloo's barrier itself ends at the timeout (no op left running that would hold
                # the process at exit until the group's own timeout)
                opts = dist.BarrierOptions()
                opts.timeout = td
                pg.barrier(opts).wait()
            else:  # NCCL: the host waits at most the timeout (the watchdog aborts the op)
                original(group=group, async_op=True, device_ids=device_ids).wait(timeout=td)
        except watchdog.StalledRankError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised unless a peer did not answer
            if not watchdog.is_transport_error(exc):
                watchdog.record_own_error(label, exc)  # this rank's own: its peers name it
                raise
            raise watchdog.explain(label, exc, timeout_s=timeout_s,
                                   waited_s=time.monotonic() - t0) from exc

    barrier.metp_wrapped = original
    return barrier


def _phase(original, label: str):
    """``original`` run inside the bounded region ``label`` (a phase of ``train_step``)."""
    def phase(*args, **kwargs):
        with watchdog.bounded(label):
            _stall_if_asked(label)
            return original(*args, **kwargs)

    phase.metp_wrapped = original
    return phase


_TRAIN_STEP_ARGS = ("forward_step_func", "data_iterator", "model", "optimizer",
                    "opt_param_scheduler", "config", "forward_backward_func")


def _train_step(original, timeout_s: float):
    """Megatron-LM's ``train_step`` (its positional arguments are :data:`_TRAIN_STEP_ARGS` in
    every release supported) as a bounded region ``iteration N (train_step)`` whose process
    groups wait at most ``timeout_s``, with its three phases labelled (module docstring). The
    optimizer's ``step`` and the config's ``finalize_model_grads_func`` are wrapped for the call
    only (restored after it)."""
    def train_step(*args, **kwargs):
        label = _iteration_label(*args, **kwargs)
        n = label.split()[1]
        given = dict(zip(_TRAIN_STEP_ARGS, args), **kwargs)
        fbf = given.get("forward_backward_func")
        if fbf is not None:
            wrapped = _phase(fbf, f"forward-backward of iteration {n}")
            if len(args) > 6:
                args = args[:6] + (wrapped,) + args[7:]
            else:
                kwargs["forward_backward_func"] = wrapped
        optimizer, config = given.get("optimizer"), given.get("config")
        finalize = getattr(config, "finalize_model_grads_func", None)
        own_step = optimizer is not None and "step" in vars(optimizer)
        step = getattr(optimizer, "step", None)
        with watchdog.bounded(label), watchdog.waits_at_most(timeout_s):
            _stall_if_asked(label)
            try:
                if finalize is not None:
                    config.finalize_model_grads_func = _phase(
                        finalize, f"gradient reduce of iteration {n}")
                if step is not None:
                    optimizer.step = _phase(step, f"optimizer step of iteration {n}")
                return original(*args, **kwargs)
            finally:
                if finalize is not None:
                    config.finalize_model_grads_func = finalize
                if step is not None:
                    if own_step:
                        optimizer.step = step
                    else:
                        del optimizer.step

    train_step.metp_wrapped = original
    train_step.__name__ = getattr(original, "__name__", "train_step")
    train_step.__doc__ = original.__doc__
    return train_step


def _marked(original, label_of):
    def wrapper(*args, **kwargs):
        label = label_of(*args, **kwargs)
        with watchdog.bounded(label):  # records the label
            _stall_if_asked(label)
            return original(*args, **kwargs)

    wrapper.metp_wrapped = original
    wrapper.__name__ = getattr(original, "__name__", "wrapper")
    wrapper.__doc__ = original.__doc__
    return wrapper


def _iteration_label(*args, **kwargs) -> str:
    it = kwargs.get("iteration")
    if it is None:
        from megatron.training import get_args

        it = getattr(get_args(), "curr_iteration", 0)
    return f"iteration {int(it) + 1} (train_step)"


def _save(original):
    def save_checkpoint(iteration, *args, **kwargs):
        label = f"save of iteration {iteration}"
        with watchdog.bounded(label):
            _stall_if_asked(label)
            from ..runtime.agree import check_pending

            for groups in _groups:
                check_pending(groups.metp, f"before Megatron-LM's save of iteration {iteration}")
            return original(iteration, *args, **kwargs)

    save_checkpoint.metp_wrapped = original
    return save_checkpoint


def install(args) -> bool:
    """Wrap Megatron-LM's loop (see the module docstring) once per process; returns whether it
    is installed. Needs ``torch.distributed`` initialised with more than one rank and
    ``megatron.training`` importable (else nothing is changed)."""
    if _installed:
        return True
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    try:
        from megatron.training import training
    except ImportError:
        return False
    timeout_s = megatron_lm_timeout_s(args)
    watchdog.set_job_timeout(timeout_s)
    # NCCL: the watchdog aborts a timed-out op's communicators and leaves the error to the main
    # thread (module docstring); read by each ProcessGroupNCCL Megatron creates after this
    overrides.default_nccl_async_error_handling()
    dist.barrier = _bounded_barrier(dist.barrier, timeout_s)
    training.build_train_valid_test_datasets = _marked(
        training.build_train_valid_test_datasets, lambda *a, **k: "building datasets")
    training.train_step = _train_step(training.train_step, timeout_s)
    training.save_checkpoint = _save(training.save_checkpoint)
    _installed.append(True)
    return True
