"""METP operators: autograd functions over explicit METP process groups."""

from ._grads import wire_dtype
from .attention import metp_attention
from .attention_kernels import available_kernels, chosen_kernel, kernel_names, select_kernel
from .cross_entropy import metp_output_cross_entropy, metp_output_logits
from .embedding import metp_embedding
from .mla import metp_mla_attention
from .mlp import metp_mlp
from .ring_attention import ring_attention
from .sequence import local_positions, shard_sequence, unshard_sequence
from .vocab import padded_vocab_size

__all__ = ["metp_mlp", "metp_attention", "metp_mla_attention", "ring_attention", "metp_embedding",
           "metp_output_cross_entropy", "metp_output_logits", "padded_vocab_size",
           "shard_sequence", "unshard_sequence", "local_positions", "available_kernels",
           "select_kernel", "chosen_kernel", "kernel_names", "wire_dtype"]
