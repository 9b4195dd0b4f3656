"""METP operators: autograd functions over explicit METP process groups.

The names below are imported on first use (``megatron_metp.ops.metp_mlp`` and ``from
megatron_metp.ops import metp_mlp`` work as usual), so that importing a torch-free submodule such
as :mod:`.kernel_rates` (the launcher's preflight) does not import torch.
"""

import sys
import types

from ..runtime.lazy import lazy_names

#: public name -> the submodule that defines it
_WHERE = {"wire_dtype": "_grads", "metp_attention": "attention",
          "available_kernels": "attention_kernels", "chosen_kernel": "attention_kernels",
          "kernel_names": "attention_kernels", "select_kernel": "attention_kernels",
          "metp_output_cross_entropy": "cross_entropy", "metp_output_logits": "cross_entropy",
          "metp_embedding": "embedding", "metp_mla_attention": "mla", "metp_mlp": "mlp",
          "ring_attention": "ring_attention", "local_positions": "sequence",
          "shard_sequence": "sequence", "unshard_sequence": "sequence",
          "padded_vocab_size": "vocab"}

__all__ = ["metp_mlp", "metp_attention", "metp_mla_attention", "ring_attention", "metp_embedding",
           "metp_output_cross_entropy", "metp_output_logits", "padded_vocab_size",
           "shard_sequence", "unshard_sequence", "local_positions", "available_kernels",
           "select_kernel", "chosen_kernel", "kernel_names", "wire_dtype"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``ring_attention`` (which defines the
    function of that name) does not replace the package's ``ring_attention``, the function (the
    eager ``from .ring_attention import ring_attention`` this replaces kept it so too)."""

    def __setattr__(self, name, value):
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
