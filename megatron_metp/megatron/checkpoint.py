"""Save and resume METP (and stock) Megatron training state with ``dist_checkpointing``.

A checkpoint holds the model's sharded state (METP shards on Megatron's TP axis, so stock TP
layouts read it too), the optimizer state sharded against the same keys, every rank's RNG state
and the iteration. Loading never unpickles arbitrary objects from the checkpoint directory: the
RNG states are stored as tensors, the ``.metadata`` pickle is checked against an allow-list of
``torch.distributed.checkpoint`` classes before torch reads it, and ``common.pt`` and every byte
object in the ``.distcp`` shard files (Megatron's ``_extra_state``) are read with
``torch.load(weights_only=True)`` instead of the full unpickler ``dist_checkpointing`` uses. A
directory that is missing, incomplete, written for another model or holding anything else raises
:class:`CheckpointError` naming what is wrong.

Crash safety and integrity live in three small modules: :mod:`.checkpoint_layout` (one directory
per iteration, published by an atomic rename and Megatron-LM's tracker file written last),
:mod:`.checkpoint_integrity` (CRC-32 of every stored item, recorded per saving rank and checked
before loading) and :mod:`.checkpoint_agreement` (every rank of a save or load succeeds or
raises together).
"""

from __future__ import annotations

import os
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ..runtime.agree import check_pending
from . import compat
from .checkpoint_agreement import agree, checkpoint_timeout_s
from .checkpoint_errors import CheckpointError
from .checkpoint_integrity import ALGORITHM, manifest_name, verify_share, write_manifest
from .checkpoint_layout import (META_FORMAT, METP_META, TRACKER, incomplete_reason,
                                iteration_dirname, prepare_staging, publish, read_meta, resolve,
                                staging_path)

__all__ = ["CheckpointError", "METP_META", "TRACKER", "load_checkpoint", "save_checkpoint"]


# What torch.distributed.checkpoint's ``.metadata`` pickle may reference. torch reads that file
# with a plain ``pickle.load``; it is checked against this list first, so a planted object never
# reaches the unpickler that would run it. Besides these, the dataclasses and enums defined in
# ``_METADATA_MODULES`` themselves are allowed (never a function, or a name reached through a
# dotted path such as ``torch.distributed.checkpoint.filesystem`` + ``os.system``).
_METADATA_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "slice"), ("builtins", "set"), ("builtins", "frozenset"),
}
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                     "torch.distributed.checkpoint.filesystem")


def _metadata_global_allowed(module: str, name: str) -> bool:
    import dataclasses
    import enum
    import importlib

    if "." in name:  # pickle protocol 4 resolves dotted names attribute by attribute
        return False
    if (module, name) in _METADATA_ALLOWED:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module in _METADATA_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and obj.__module__ == module and \
            (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    return False


def read_metadata(path: str):
    """torch's ``Metadata`` of a ``.metadata`` file, unpickled with only the allowed globals
    (``CheckpointError`` otherwise)."""
    return check_metadata_pickle(path)


def check_metadata_pickle(path: str):
    """Unpickle ``.metadata`` with only the allowed globals; returns torch's ``Metadata``."""
    import io
    import pickle

    class _Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if _metadata_global_allowed(module, name):
                return super().find_class(module, name)
            raise CheckpointError(f"checkpoint metadata {path!r} references {module}.{name}, which "
                                  f"a checkpoint never needs: refusing to load it (untrusted or "
                                  f"corrupt file)")

    try:
        with open(path, "rb") as f:
            return _Restricted(io.BytesIO(f.read())).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CheckpointError(f"checkpoint metadata {path!r} is unreadable: {exc}") from exc


def _refuse_pickle(what: str, exc: BaseException) -> CheckpointError:
    first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    return CheckpointError(f"{what} is not plain data (tensors, numbers, strings, None and "
                           f"containers of them): refusing to load it (untrusted or corrupt "
                           f"file): {first}")


def _safe_torch_load(source, what: str, **kwargs):
    """``torch.load`` that only rebuilds tensors, primitive containers and the classes registered
    with ``torch.serialization.add_safe_globals``. ``weights_only=True`` is passed explicitly, so
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn it off."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, or a corrupt zip
        raise _refuse_pickle(what, exc) from exc


def _safe_load_strategies():
    """``dist_checkpointing`` load strategies for the ``torch_dist``/``torch`` backends whose
    readers never run the full unpickler on checkpoint contents.

    Megatron's ``TorchDistLoadShardedStrategy`` loads through ``MCoreLoadPlanner``, whose
    ``load_bytes`` (from torch's ``DefaultLoadPlanner``) reads every byte object of a ``.distcp``
    file with ``torch.load(weights_only=False)``; here the planner is a subclass that reads them
    with ``weights_only=True``, swapped in for the duration of the load only. ``common.pt`` is read
    the same way (Megatron calls ``torch.load`` without ``weights_only``, which the environment
    variable ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns into a full unpickle)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
    from torch.distributed.checkpoint._traverse import set_element

    if not hasattr(mcore_torch, "MCoreLoadPlanner"):
        raise CheckpointError("this megatron-core has no dist_checkpointing MCoreLoadPlanner; "
                              "megatron_metp cannot load its checkpoints safely")

    class _SafeLoadPlanner(mcore_torch.MCoreLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            obj = _safe_torch_load(value, f"byte object {fqn!r} in a .distcp shard file")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    class _SafeShardedStrategy(mcore_torch.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):  # 0.19: more args
            original = mcore_torch.MCoreLoadPlanner
            mcore_torch.MCoreLoadPlanner = _SafeLoadPlanner
            try:
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            finally:
                mcore_torch.MCoreLoadPlanner = original

    class _SafeCommonStrategy(compat.common_load_strategy_base()):
        def load_common(self, checkpoint_dir):
            path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
            try:
                return _safe_torch_load(path, f"{path!r}", map_location="cpu")
            except FileNotFoundError as exc:
                raise CheckpointError(f"{path!r} is missing") from exc

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointError("checkpoints with ShardedObjects saved as separate .pt files are "
                                  "not supported")

    return _SafeShardedStrategy(), _SafeCommonStrategy()


def _checkpoint_error_in(exc: BaseException) -> Optional[CheckpointError]:
    """The :class:`CheckpointError` a rank raised inside ``dist_checkpointing`` (torch wraps each
    rank's exception in a ``CheckpointException`` and hands it to every rank), if any."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return e
        for wrapped in (getattr(e, "failures", None) or {}).values():
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        todo += [e.__cause__, e.__context__]
    return None


def _param_pairs(opt):
    """``(model_param, torch_optimizer, optimizer_param)`` for every parameter an optimizer (or a
    chain of them: METP's weights go to Megatron's expert-path optimizer) steps."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        if hasattr(o, "fp32_from_float16_groups"):  # 16-bit params with fp32 main copies
            for model_group, main_group in zip(o.float16_groups, o.fp32_from_float16_groups):
                for model_p, main_p in zip(model_group, main_group):
                    yield model_p, o.optimizer, main_p
            for group in getattr(o, "fp32_from_fp32_groups", []):
                for p in group:
                    yield p, o.optimizer, p
        else:
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    yield p, o.optimizer, p


def _optimizer_sharded(opt, model_sd, is_loading: bool):
    """Adam state as ShardedTensors keyed by each parameter's *global* checkpoint key.

    Megatron's own optimizer checkpoint is laid out per optimizer instance, which differs
    between METP (a second, expert-path optimizer) and stock TP. Keyed by parameter instead, the
    same state loads into any TP/METP layout of the model.
    """
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if any(isinstance(o, DistributedOptimizer) for o in getattr(opt, "chained_optimizers", [opt])):
        raise CheckpointError("checkpointing the distributed optimizer's state is not supported "
                              "by megatron_metp.megatron.checkpoint yet; save without "
                              "--use-distributed-optimizer or with load_optimizer=False")
    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    # local names (with layer indices) for the dict; each ShardedTensor carries its global key
    by_id = {id(t.data): (name, t) for name, t in tensors.items()}
    out, step = {}, 0
    for model_p, topt, opt_p in _param_pairs(opt):
        if id(model_p) not in by_id:
            continue
        local, sh = by_id[id(model_p)]
        st = topt.state.get(opt_p)
        if st is None or "exp_avg" not in st:
            if not is_loading:
                raise CheckpointError("save after at least one optimizer step (Adam state is empty)")
            st = topt.state[opt_p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(opt_p),
                                      "exp_avg_sq": torch.zeros_like(opt_p)}
        for name in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{local}"] = make_sharded_optimizer_tensor(sh, st[name], f"optimizer.{name}")
        if opt_p is not model_p:
            out[f"main.{local}"] = make_sharded_optimizer_tensor(sh, opt_p.data, "optimizer.main")
        step = max(step, int(st["step"]))
    out["step"] = step
    return out


def _load_optimizer(opt, loaded: dict) -> None:
    """Adam state (and fp32 main params) already loaded in place; set every param's step."""
    step = loaded["step"]
    for _, topt, opt_p in _param_pairs(opt):
        st = topt.state.get(opt_p)
        if st is not None:
            st["step"] = torch.tensor(float(step)) if torch.is_tensor(st.get("step")) else step


def _rng_tensors() -> dict:
    """This rank's RNG states as uint8 tensors: torch's CPU generator, the current CUDA device's
    (if any) and every state of Megatron's RNG tracker (``tracker.<name>``)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    for name, st in get_cuda_rng_tracker().get_states().items():
        if not torch.is_tensor(st):
            raise CheckpointError(f"RNG tracker state {name!r} is a {type(st).__name__}, not a "
                                  f"tensor (CUDA-graph-safe RNG?); it cannot be checkpointed")
        out[f"tracker.{name}"] = st
    return out


def _set_rng_tensors(loaded: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(loaded["torch"])
    if "cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded["cuda"])
    tracker = get_cuda_rng_tracker()
    states = dict(tracker.get_states())
    states.update({k[len("tracker."):]: v for k, v in loaded.items() if k.startswith("tracker.")})
    tracker.set_states(states)


def _rng_sharded(saved_keys=None) -> dict:
    """The RNG states as ShardedTensors of global shape ``(world, n)``, row = rank: tensors, not a
    pickled object. Loading asks only for the states both this process and the checkpoint have
    (``saved_keys``; e.g. no CUDA state from a CPU run)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, t in _rng_tensors().items():
        if saved_keys is not None and name not in saved_keys:
            continue
        # a copy: loading writes into it, and the tracker's own state tensors must stay intact
        out[name] = ShardedTensor.from_rank_offsets(f"rng_state.{name}", t.detach().clone(),
                                                    (0, rank, world), replica_id=0,
                                                    prepend_axis_num=1)
    return out


def _sharded(state, iteration: int, is_loading: bool, rng_keys=None):
    from megatron.core import parallel_state as ps

    model = state["model"].module
    model_sd = model.sharded_state_dict()
    sd = {"model": model_sd}
    if state.get("optimizer") is not None:
        sd["optimizer"] = _optimizer_sharded(state["optimizer"], model_sd, is_loading)
    if not is_loading or rng_keys is not None:
        sd["rng_state"] = _rng_sharded(rng_keys)
    sd["iteration"] = iteration
    sd["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    return sd


def _check_iteration(iteration) -> int:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"save_checkpoint: iteration must be an int >= 0, got {iteration!r}")
    return iteration


def save_checkpoint(directory: str, state, iteration: int, layout_description: str = "") -> None:
    """Write ``state`` (from :func:`megatron_metp.megatron.training.setup`) at ``iteration`` into
    ``directory/iter_<iteration>`` (Megatron-LM's ``--save`` layout, see
    :mod:`~megatron_metp.megatron.checkpoint_layout`) and point
    ``directory/latest_checkpointed_iteration.txt`` at it.

    The checkpoint is written into a hidden staging directory, checksummed by every rank
    (:mod:`~megatron_metp.megatron.checkpoint_integrity`) and published by rank 0 with a rename
    and the tracker, only after all ranks have reported success. A rank that fails or dies makes
    every surviving rank raise :class:`CheckpointError`; what was published before (the tracker's
    iteration) stays intact. Saving an iteration that exists replaces it.
    """
    from megatron.core import dist_checkpointing

    _check_iteration(iteration)
    checkpoint_timeout_s()  # a bad METP_CHECKPOINT_TIMEOUT_S is refused before any work
    rank, world = dist.get_rank(), dist.get_world_size()
    what = f"saving iteration {iteration} to {directory!r}"
    staging = staging_path(directory, iteration)
    kept = (f"Nothing was published: {os.path.join(directory, TRACKER)!r} still names the last "
            f"complete save, if any.")

    def prepare():
        sd = _sharded(state, iteration, is_loading=False)
        if rank == 0:
            prepare_staging(directory, iteration)
        return sd

    sd, error = _attempt(prepare)
    its = agree(f"{what} (preparing {staging!r})", error, [iteration], outcome=kept)
    if len({i[0] for i in its}) > 1:
        raise CheckpointError(f"{what}: the ranks were asked to save different iterations "
                              f"({sorted({i[0] for i in its})}); every rank must pass the same one")
    # every rank is here (the bounded agreement above names any that is not): the METP op calls
    # since the last agreement exchange are checked now, so a disagreement between scheduled
    # exchanges is refused before its result is published
    groups = state.get("groups") if isinstance(state, dict) else None
    check_pending(getattr(groups, "metp", None), f"before {what}")
    _, error = _attempt(dist_checkpointing.save, sd, staging)
    agree(f"{what} (writing shards into {staging!r})", error, outcome=kept)
    _, error = _attempt(lambda: write_manifest(
        staging, check_metadata_pickle(os.path.join(staging, ".metadata")), rank))
    agree(f"{what} (checksumming the shards in {staging!r})", error, outcome=kept)
    meta = {"format": META_FORMAT, "iteration": iteration, "layout": layout_description,
            "world_size": world, "rng": sorted(sd["rng_state"]),
            "integrity": {"algorithm": ALGORITHM,
                          "manifests": [manifest_name(r) for r in range(world)]}}
    _, error = _attempt(publish, directory, iteration, meta) if rank == 0 else (None, None)
    agree(f"{what} (publishing {iteration_dirname(iteration)} and {TRACKER})", error,
          outcome=f"Rank 0 may or may not have published it: load_checkpoint({directory!r}) "
                  f"loads the iteration {TRACKER} names.")


def _attempt(fn, *args):
    """``(fn(*args), None)``, or ``(None, the exception)`` for any failure (torch's
    ``CheckpointException`` is a ``BaseException``); interrupts propagate."""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported to every rank by agree()
        return None, exc


def _prepare_load(directory: str, load_rng: bool):
    """This rank's view of what ``load_checkpoint(directory)`` loads: the iteration directory,
    its ``metp_checkpoint.json``, its checked ``.metadata`` and the RNG keys to load."""
    path = resolve(directory)
    why = incomplete_reason(path)
    if why is not None:
        raise CheckpointError(f"{path!r} {why}")
    meta = read_meta(path)
    metadata = check_metadata_pickle(os.path.join(path, ".metadata"))
    rng_keys = None
    if load_rng:
        rng_keys = meta.get("rng")
        if not isinstance(rng_keys, list) or "torch" not in rng_keys:
            raise CheckpointError(f"{path!r} holds no RNG states as tensors (saved by an "
                                  f"older megatron_metp?); load it with load_rng=False")
        if meta.get("world_size") != dist.get_world_size():
            raise CheckpointError(f"{path!r} holds the RNG states of {meta.get('world_size')} "
                                  f"ranks, this job has {dist.get_world_size()}; load it with "
                                  f"load_rng=False")
    return path, meta, metadata, rng_keys


def load_checkpoint(directory: str, state, *, load_optimizer: bool = True,
                    load_rng: bool = True) -> int:
    """Load a checkpoint into ``state`` (any METP/TP layout of the same model); returns the
    iteration it was saved at.

    ``directory`` is a save directory (the iteration its ``latest_checkpointed_iteration.txt``
    names is loaded) or one ``iter_<n>`` directory. Every byte that is loaded is checked against
    the checksums recorded at save before the model is touched. Raises :class:`CheckpointError`
    with the reason, naming the file, on every rank if it fails on any.
    """
    checkpoint_timeout_s()  # a bad METP_CHECKPOINT_TIMEOUT_S is refused before any work
    rank, world = dist.get_rank(), dist.get_world_size()
    what = f"loading {directory!r}"
    prepared, error = _attempt(_prepare_load, directory, load_rng)
    path, meta, metadata, rng_keys = prepared or (None, None, None, None)
    its = agree(what, error, [int(meta["iteration"]) if meta else -1,
                              zlib.crc32(os.path.abspath(path or directory).encode())])
    if len({tuple(i) for i in its}) > 1:
        raise CheckpointError(f"{what}: the ranks resolved different checkpoints "
                              f"(iterations {sorted({i[0] for i in its})}); was a save into "
                              f"{directory!r} running at the same time? Load an iter_<n> "
                              f"directory directly")
    what = f"loading {path!r}"
    skip = tuple(p for p, used in (("optimizer.", load_optimizer), ("rng_state.", load_rng))
                 if not used)
    count, error = _attempt(verify_share, path, meta["integrity"]["manifests"], metadata, rank,
                            world, skip)
    counts = agree(f"{what} (verifying checksums)", error, [count or 0])
    listed, stored = sum(c[0] for c in counts), len(metadata.storage_data)
    if listed != stored:
        raise CheckpointError(f"{what}: the integrity manifests list {listed} stored items, "
                              f"{path}/.metadata has {stored}; the files of this checkpoint do "
                              f"not belong together")
    iteration, error = _attempt(_load_verified, path, meta, state, load_optimizer, load_rng,
                                rng_keys)
    agree(what, error)
    return iteration


def _load_verified(path: str, meta: dict, state, load_optimizer: bool, load_rng: bool,
                   rng_keys) -> int:
    template = _sharded(state if load_optimizer else dict(state, optimizer=None), 0,
                        is_loading=True, rng_keys=rng_keys)
    sharded_strategy, common_strategy = _safe_load_strategies()
    try:
        loaded = compat.dist_checkpointing_load(
            template, path, sharded_strategy, common_strategy,
            lambda value: _safe_torch_load(value, "the common state in a .distcp shard file"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        refused = _checkpoint_error_in(exc)
        if refused is not None:
            raise CheckpointError(f"cannot load {path!r}: {refused}") from exc
        raise CheckpointError(f"cannot load {path!r} (saved as {meta.get('layout') or '?'} at "
                              f"iteration {meta.get('iteration')}) into this model: "
                              f"{str(exc).splitlines()[0][:400]}. Check that the model geometry "
                              f"(layers, hidden size, heads, FFN, vocabulary) matches") from exc
    model = state["model"].module
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: missing "
                              f"{missing[:5]}, unexpected {list(unexpected)[:5]}")
    if load_optimizer and "optimizer" in loaded:
        _load_optimizer(state["optimizer"], loaded["optimizer"])
    if load_rng:
        _set_rng_tensors(loaded["rng_state"])
    return int(loaded["iteration"])
