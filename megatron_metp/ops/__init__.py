"""METP operators: autograd functions over explicit METP process groups."""

from .attention import metp_attention
from .attention_kernels import available_kernels, select_kernel
from .mlp import metp_mlp
from .ring_attention import ring_attention
from .sequence import local_positions, shard_sequence, unshard_sequence

__all__ = ["metp_mlp", "metp_attention", "ring_attention", "shard_sequence", "unshard_sequence",
           "local_positions", "available_kernels", "select_kernel"]
