"""What a Megatron-LM ``--load`` checkpoint was saved with, read without unpickling it, and the
resumes METP refuses before any rank starts work.

Megatron-LM (``torch_dist`` format) stores the run's ``args`` in ``iter_NNNNNNN/common.pt``
(core_v0.16.1) or in the ``common_state`` byte object of rank 0's ``.distcp`` shard
(core_v0.19.0), a ``torch.save`` zip whose ``data.pkl`` is a pickle. :func:`saved_args` walks that pickle's opcodes
with :mod:`pickletools` (nothing is executed) and returns the plain integer and boolean fields of
the saved ``args`` it finds, e.g. ``metp_parallel_size``.

What crosses layouts (measured on CPU ranks, the tiny configs, ``docs/megatron-lm.md``): the
weights always do (METP shards are stock TP's shards of size TP×METP); the optimizer state of the
plain optimizer does between two METP runs or two stock runs. It does not between a METP run
and a stock one: METP's optimizer is Megatron's chain of two (dense weights, and the
METP-sharded weights on the expert route), a stock run's a single one, and Megatron fails deep
in ``load_state_dict`` (``KeyError: 'pre_wd_mult'``, ``Expected 2 entries in state dict``).
Nor does it between the distributed optimizer and the plain one (``--use-distributed-optimizer``
on one side only): they store different keys, and Megatron fails with ``KeyError:
chained_0.optimizer.state.exp_avg…`` (core_v0.19.0, CPU ranks, reported in issue 32).
:func:`resume_layout_problems` names both cases (the launcher's preflight lists them before any
rank starts) and :func:`check_resume_layout` refuses them inside the ranks, each naming the cause
and what loads instead.
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from typing import Dict, List, Optional

__all__ = ["checkpoint_dir", "saved_args", "check_resume_layout", "resume_layout_problems"]

#: saved ``args`` fields :func:`saved_args` returns
_FIELDS = ("metp_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
           "context_parallel_size", "use_distributed_optimizer")


def checkpoint_dir(load: str, ckpt_step: Optional[int] = None) -> Optional[str]:
    """The iteration directory ``--load load`` resumes from (Megatron-LM's
    ``latest_checkpointed_iteration.txt``, or ``--ckpt-step``'s iteration, which Megatron-LM
    takes over the tracker when set and not 0), or ``None`` when there is no checkpoint yet."""
    if ckpt_step:
        path = os.path.join(load, f"iter_{int(ckpt_step):07d}")
        return path if os.path.isdir(path) else None
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as fh:
        text = fh.read().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        return None
    path = os.path.join(load, name)
    return path if os.path.isdir(path) else None


def common_state_file(iteration_dir: str):
    """The ``torch.save`` zip holding the checkpoint's common state (with the saved ``args``), as
    a path or a file-like object, or ``None``: ``common.pt`` (core_v0.16.1), else the
    ``common_state`` byte object inside rank 0's ``.distcp`` shard (core_v0.19.0), located through
    ``.metadata`` read with the project's restricted unpickler."""
    import io

    path = os.path.join(iteration_dir, "common.pt")
    if os.path.isfile(path):
        return path
    if not os.path.isfile(os.path.join(iteration_dir, ".metadata")):
        return None
    from ..megatron.checkpoint import read_metadata

    try:
        md = read_metadata(os.path.join(iteration_dir, ".metadata"))
        info = next(v for k, v in md.storage_data.items()
                    if getattr(k, "fqn", None) == "common_state/shard_0_1")
        with open(os.path.join(iteration_dir, info.relative_path), "rb") as fh:
            fh.seek(info.offset)
            return io.BytesIO(fh.read(info.length))
    except Exception:  # noqa: BLE001 - unreadable or unexpected: nothing known
        return None


def saved_args(iteration_dir: str) -> Dict[str, object]:
    """Integer/boolean fields of the ``args`` saved in ``iteration_dir``'s common state (those of
    ``_FIELDS`` found; empty if it is not a readable ``torch.save`` zip)."""
    source = common_state_file(iteration_dir)
    if source is None:
        return {}
    try:
        with zipfile.ZipFile(source) as zf:
            name = next((n for n in zf.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return {}
            data = zf.read(name)
    except (OSError, zipfile.BadZipFile):
        return {}
    out: Dict[str, object] = {}
    pending = None
    try:
        for op, arg, _ in pickletools.genops(data):
            if pending is not None and op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT"):
                continue  # the key string being memoised; its value comes next
            if pending is not None:
                if op.name in ("NEWTRUE", "NEWFALSE"):
                    out.setdefault(pending, op.name == "NEWTRUE")
                elif isinstance(arg, int) and op.name.startswith(("BININT", "LONG", "INT")):
                    out.setdefault(pending, arg)
                pending = None
            if isinstance(arg, str) and arg in _FIELDS:
                pending = arg
    except Exception:  # noqa: BLE001 - a damaged pickle: nothing known
        return out
    return out


def check_resume_layout(args) -> None:
    """Refuse (``ValueError``, every problem of :func:`resume_layout_problems` at once) a
    ``--load`` whose optimizer state this run cannot take."""
    problems = resume_layout_problems(args)
    if problems:
        raise ValueError("; ".join(problems))


def resume_layout_problems(args) -> List[str]:
    """What keeps this run from reading the optimizer state of its ``--load`` checkpoint, each
    naming the flag and the fix: saved by a METP run and loaded by a stock one or the reverse;
    saved with ``--use-distributed-optimizer`` and loaded without it or the reverse (the two
    optimizers store different keys: Megatron fails with ``KeyError:
    chained_0.optimizer.state.exp_avg...``). Weights-only loads (``--no-load-optim``,
    ``--finetune``) and first runs (no checkpoint yet) pass."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "no_load_optim", False) or getattr(args, "finetune", False):
        return []
    d = checkpoint_dir(load, getattr(args, "ckpt_step", None))
    if d is None:
        return []
    saved = saved_args(d)
    if not saved:
        return []
    out = []
    was = int(saved.get("metp_parallel_size", 1) or 1)
    now = int(getattr(args, "metp_parallel_size", 1) or 1)
    if (was > 1) != (now > 1):
        what = {True: "a METP run's (its optimizer is a chain of two: the dense weights and the "
                      "METP-sharded ones)",
                False: "a stock run's (one optimizer)"}
        out.append(
            f"--load {load}: {os.path.basename(d)} holds {what[was > 1]} optimizer state, saved "
            f"with --metp-parallel-size {was}; this run (--metp-parallel-size {now}) builds "
            f"{'a chain of two' if now > 1 else 'one optimizer'} and cannot load it. Load the "
            f"weights only with --no-load-optim --no-load-rng (the optimizer restarts; the "
            f"weights move exactly between layouts), or resume with "
            f"{'a METP run' if was > 1 else 'a stock run'}")
    dist_was = saved.get("use_distributed_optimizer")
    dist_now = bool(getattr(args, "use_distributed_optimizer", False))
    if dist_was is not None and bool(dist_was) != dist_now:
        name = {True: "the distributed optimizer's (sharded over data-parallel ranks, saved "
                      "with --use-distributed-optimizer)",
                False: "the plain optimizer's (saved without --use-distributed-optimizer)"}
        fix = ("add --use-distributed-optimizer (DISTRIBUTED_OPTIMIZER=1 in "
               "scripts/pretrain_gpt.sh)" if dist_was else
               "drop --use-distributed-optimizer (DISTRIBUTED_OPTIMIZER=0 in "
               "scripts/pretrain_gpt.sh)")
        out.append(
            f"--load {load}: {os.path.basename(d)} holds {name[bool(dist_was)]} optimizer "
            f"state, which this run ({'with' if dist_now else 'without'} "
            f"--use-distributed-optimizer) cannot read (the two store different keys); "
            f"resume as it was saved: {fix}, or load the weights only with --no-load-optim "
            f"--no-load-rng (the optimizer restarts)")
    return out
