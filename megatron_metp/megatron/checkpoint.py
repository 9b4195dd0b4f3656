"""Save and resume METP (and stock) Megatron training state with ``dist_checkpointing``.

A checkpoint holds the model's sharded state (METP shards on Megatron's TP axis, so stock TP
layouts read it too), the optimizer state sharded against the same keys, every rank's RNG state
and the iteration. Loading never unpickles arbitrary objects from the checkpoint directory's
``common.pt`` beyond what ``dist_checkpointing`` itself reads, and a directory that is missing,
incomplete or written for another model raises :class:`CheckpointError` naming what is wrong.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist

METP_META = "metp_checkpoint.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded into this model; the message says why."""


# What torch.distributed.checkpoint's ``.metadata`` pickle may reference. torch reads that file
# with a plain ``pickle.load``; it is checked against this list first, so a planted object never
# reaches the unpickler that would run it.
_METADATA_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "slice"), ("builtins", "set"), ("builtins", "frozenset"),
}
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                     "torch.distributed.checkpoint.filesystem")


def _check_metadata_pickle(path: str) -> None:
    import io
    import pickle

    class _Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _METADATA_ALLOWED or module in _METADATA_MODULES or \
                    (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise CheckpointError(f"checkpoint metadata {path!r} references {module}.{name}, which "
                                  f"a checkpoint never needs: refusing to load it (untrusted or "
                                  f"corrupt file)")

    try:
        with open(path, "rb") as f:
            _Restricted(io.BytesIO(f.read())).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CheckpointError(f"checkpoint metadata {path!r} is unreadable: {exc}") from exc


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


def _rng_state():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded(state, iteration: int, is_loading: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = state["model"].module
    model_sd = model.sharded_state_dict()
    sd = {"model": model_sd}
    if state.get("optimizer") is not None:
        sd["optimizer"] = _optimizer_sharded(state["optimizer"], model_sd, is_loading)
    rank, world = dist.get_rank(), dist.get_world_size()
    sd["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    sd["iteration"] = iteration
    sd["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    return sd


def save_checkpoint(directory: str, state, iteration: int, layout_description: str = "") -> None:
    """Write ``state`` (from :func:`megatron_metp.megatron.training.setup`) at ``iteration``."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(state, iteration, is_loading=False), directory)
    if dist.get_rank() == 0:
        with open(os.path.join(directory, METP_META), "w") as f:
            json.dump({"iteration": iteration, "layout": layout_description,
                       "world_size": dist.get_world_size()}, f)
    dist.barrier()


def load_checkpoint(directory: str, state, *, load_optimizer: bool = True,
                    load_rng: bool = True) -> int:
    """Load ``directory`` into ``state`` (any METP/TP layout of the same model); returns the
    iteration it was saved at. Raises :class:`CheckpointError` with the reason on failure."""
    from megatron.core import dist_checkpointing

    meta_path = os.path.join(directory, METP_META)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
    if not os.path.exists(meta_path) or not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise CheckpointError(f"{directory!r} is not a complete METP/Megatron distributed checkpoint "
                              f"(missing {METP_META} or Megatron's metadata); was the save "
                              f"interrupted?")
    with open(meta_path) as f:
        meta = json.load(f)
    _check_metadata_pickle(os.path.join(directory, ".metadata"))
    template = _sharded(state, 0, is_loading=True) if load_optimizer else \
        _sharded(dict(state, optimizer=None), 0, is_loading=True)
    if not load_rng:
        template.pop("rng_state")
    try:
        loaded = dist_checkpointing.load(template, directory)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        raise CheckpointError(f"cannot load {directory!r} (saved as {meta.get('layout') or '?'} at "
                              f"iteration {meta.get('iteration')}) into this model: "
                              f"{str(exc).splitlines()[0][:400]}. Check that the model geometry "
                              f"(layers, hidden size, heads, FFN, vocabulary) matches") from exc
    model = state["model"].module
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {directory!r} does not match the model: missing "
                              f"{missing[:5]}, unexpected {list(unexpected)[:5]}")
    if load_optimizer and "optimizer" in loaded:
        _load_optimizer(state["optimizer"], loaded["optimizer"])
    if load_rng and "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    return int(loaded["iteration"])
