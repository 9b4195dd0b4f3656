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
from typing import Optional

import torch
from torch.nn import Parameter

from .groups import METPGroups

#: attribute set on every METP-sharded parameter
METP_SHARDED = "metp_sharded"


def _divide(n: int, parts: int, what: str, flag: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by TP×METP = {parts}; change {flag}")
    return n // parts


def _init_shard(weight: torch.Tensor, init_method, groups: METPGroups, name: str) -> None:
    """Initialise this rank's shard from a stream distinct per (TP rank, METP rank).

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
            shape = (_divide(output_size, n, f"{self.name} output size", flag), input_size)
        else:
            shape = (output_size, _divide(input_size, n, f"{self.name} input size", flag))
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            _init_shard(self.weight.data, init_method, groups, self.name)
        _mark_sharded(self.weight, partition_dim=0 if mode == "column" else 1, stride=stride)
        if bias:
            bshape = (shape[0],) if mode == "column" else (output_size,)
            self.bias = Parameter(torch.zeros(bshape, dtype=config.params_dtype, device=device))
            if mode == "column":
                _mark_sharded(self.bias, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"METP {self.mode}-parallel {self.name!r} weights are applied by "
                           f"METPSelfAttention / METPMLP through the fused METP ops; they cannot "
                           f"be called as a standalone linear layer")

    def extra_repr(self) -> str:
        return (f"{self.mode}, in={self.input_size}, out={self.output_size}, "
                f"shard {self.groups.shard_index} of {self.groups.shards}, "
                f"bias={self.bias is not None}")


def _mark_sharded(param: Parameter, *, partition_dim: int, stride: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.allreduce = False  # reduce over pure DP only: the METP op already summed the group
    setattr(param, METP_SHARDED, True)


def is_metp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, METP_SHARDED, False))
