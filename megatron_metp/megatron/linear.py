"""Parameter holders for METP-sharded linear weights, in Megatron's TP layouts.

A METP layer's ``linear_qkv``/``linear_fc1`` (column-parallel) and ``linear_proj``/``linear_fc2``
(row-parallel) keep Megatron's names and shapes: with TP size ``t`` and METP size ``p`` the weight
is split into ``t·p`` shards along the TP partition dimension and this rank holds shard
``tp_rank·p + metp_rank`` — the rows (columns) stock TP of size ``t·p`` gives its rank of that
index. So state dicts map one to one onto stock TP checkpoints.

These modules only hold parameters: :class:`~megatron_metp.megatron.modules.METPSelfAttention`
and :class:`~megatron_metp.megatron.modules.METPMLP` apply them through the fused METP ops (the
ring schedule needs the whole block, not one linear at a time).

Gradient reduction: the METP ops already sum a shard's gradient over the METP group's tokens, so
sharded weights must reduce over pure data parallelism only. They are marked ``allreduce=False``
(Megatron's expert-parameter route, whose data-parallel group :func:`initialize_model_parallel`
makes equal to pure DP) and ``tensor_model_parallel=True`` (one shard per rank in grad norms).
Replicated biases (row-parallel layers) are ordinary parameters: reduced over DP×CP like every
parameter under Megatron's context parallelism.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.nn import Parameter

from .groups import METPGroups

#: attribute set on every METP-sharded parameter
METP_SHARDED = "metp_sharded"


def divide(n: int, parts: int, what: str, flag: str) -> int:
    """``n // parts``; ``ValueError`` naming ``what`` and the ``flag`` to change when it is not
    exact."""
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by TP×METP = {parts}; change {flag}")
    return n // parts


def init_cpu_shard(weight: torch.Tensor, init_method: Callable, *, output_size: int,
                   input_size: int, partition_dim: int, stride: int, rank: int,
                   world_size: int) -> None:
    """``use_cpu_initialization``: the full ``[output_size, input_size]`` matrix drawn from the
    default CPU generator (as Megatron's CPU initialisation draws it on every rank), and
    ``weight`` set to stock TP rank ``rank``'s piece of it for TP size ``world_size``."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    per_partition = weight.shape[partition_dim]
    _initialize_affine_weight_cpu(weight, output_size, input_size, per_partition, partition_dim,
                                  init_method, stride=stride, params_dtype=weight.dtype,
                                  rank=rank, world_size=world_size,
                                  skip_set_tensor_parallel_attributes=True)


def init_shard(weight: torch.Tensor, init_method, groups: METPGroups, name: str) -> None:
    """Initialise this rank's shard from a stream distinct per (TP rank, METP rank).

    Used at construction; a model built for training is then re-drawn as stock TP of size
    ``t·p`` draws it (:func:`~.init.initialize_like_tp`).

    A seed is drawn from Megatron's model-parallel RNG tracker (distinct per TP rank, equal over
    the METP group), offset by the METP rank, and the shard is initialised under it, leaving every
    other generator as it was.
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        base = int(torch.randint(0, 2 ** 31 - 1, (1,), device=weight.device).item())
    devices = [weight.device] if weight.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((base + 7919 * groups.metp.rank + zlib.crc32(name.encode())) % (2 ** 63))
        init_method(weight)


class METPLinear(torch.nn.Module):
    """This rank's shard of a column- or row-parallel weight split over TP×METP.

    Accepts the keyword arguments Megatron's attention/MLP pass to their linear builders.
    Column mode: ``weight [output_size/(t·p), input_size]``, bias sharded likewise.
    Row mode: ``weight [output_size, input_size/(t·p)]``, bias ``[output_size]`` replicated.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool = True, groups: METPGroups, mode: str, stride: int = 1,
                 is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 **_unused):
        super().__init__()
        if mode not in ("column", "row"):
            raise ValueError(f"mode must be 'column' or 'row', got {mode!r}")
        if is_expert:
            raise ValueError("METP layers do not support MoE experts yet; run MoE models without "
                             "--metp-parallel-size")
        self.mode, self.groups, self.config = mode, groups, config
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.name = tp_comm_buffer_name or mode
        n = groups.shards
        flag = "--num-attention-heads/--num-query-groups" if self.name in ("qkv", "proj") \
            else "--ffn-hidden-size"
        if mode == "column":
            shape = (divide(output_size, n, f"{self.name} output size", flag), input_size)
        else:
            shape = (output_size, divide(input_size, n, f"{self.name} input size", flag))
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        self.init_method = init_method
        if config.perform_initialization:
            if config.use_cpu_initialization:  # the full matrix, as stock TP draws it
                init_cpu_shard(self.weight.data, init_method, output_size=output_size,
                               input_size=input_size, partition_dim=0 if mode == "column" else 1,
                               stride=stride, rank=groups.shard_index, world_size=n)
            else:  # re-drawn as stock TP of size t·p draws it by init.initialize_like_tp
                init_shard(self.weight.data, init_method, groups, self.name)
        mark_sharded(self.weight, partition_dim=0 if mode == "column" else 1, stride=stride)
        if bias:
            bshape = (shape[0],) if mode == "column" else (output_size,)
            self.bias = Parameter(torch.zeros(bshape, dtype=config.params_dtype, device=device))
            if mode == "column":
                mark_sharded(self.bias, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron ``dist_checkpointing`` view: the global tensor split ``t·p`` ways, TP-major.

        A shard is unique within its DP replica group: ``replica_id = (0, 0, pure-DP rank)``.
        Row-parallel biases are replicated over TP×METP×DP: ``(0, tp rank, DP×CP rank)`` as
        Megatron's replicated tensors. Because the shard index equals stock TP's rank index for
        TP size ``t·p``, a checkpoint moves between METP p, METP p′ and stock TP (SwiGLU's fc1 is
        split into gate and up by ``MLP.sharded_state_dict`` from these offsets, as for TP).
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        g = self.groups
        dp_rank = dist.get_rank(g.dp) if g.dp is not None else 0
        dp_cp_rank = dp_rank * g.metp.size + g.metp.rank
        axis = len(sharded_offsets) + (0 if self.mode == "column" else 1)
        out = {}
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if param is None:
                continue
            key = f"{prefix}{name}"
            if is_metp_sharded(param):
                out[key] = ShardedTensor.from_rank_offsets(
                    key, param, *sharded_offsets, (axis if name == "weight" else len(sharded_offsets),
                                                   g.shard_index, g.shards),
                    replica_id=(0, 0, dp_rank), prepend_axis_num=len(sharded_offsets))
            else:
                out[key] = ShardedTensor.from_rank_offsets(
                    key, param, *sharded_offsets, replica_id=(0, g.tp_rank, dp_cp_rank),
                    prepend_axis_num=len(sharded_offsets))
        key = f"{prefix}_extra_state"  # as Megatron's TP linears, so checkpoints interoperate
        out[key] = make_sharded_object_for_checkpoint(self.get_extra_state(), key, sharded_offsets,
                                                      (0, g.tp_rank, dp_cp_rank))
        return out

    def get_extra_state(self) -> None:
        """Nothing extra; present so state dicts match Megatron's TP linear layers."""
        return None

    def set_extra_state(self, state) -> None:
        """Extra state is ignored (as in Megatron's TP linear layers)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"METP {self.mode}-parallel {self.name!r} weights are applied by "
                           f"METPSelfAttention / METPMLP through the fused METP ops; they cannot "
                           f"be called as a standalone linear layer")

    def extra_repr(self) -> str:
        return (f"{self.mode}, in={self.input_size}, out={self.output_size}, "
                f"shard {self.groups.shard_index} of {self.groups.shards}, "
                f"bias={self.bias is not None}")


def mark_sharded(param: Parameter, *, partition_dim: int, stride: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.allreduce = False  # reduce over pure DP only: the METP op already summed the group
    setattr(param, METP_SHARDED, True)


def is_metp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, METP_SHARDED, False))
