"""The Megatron-LM side of METP: the hooks the patches in ``patches/`` call (:mod:`.hooks`), the
runner that trains Megatron-LM's own scripts on CPU ranks (:mod:`.cpu`), the checks of a
checkpoint before ``--load`` (:mod:`.resume`, :mod:`.ckpt_manifest`: the per-file checksums
written at ``--save``) and what differs between the supported Megatron-LM
releases (:mod:`.releases`).

The names below are the ones the patches call (``from megatron_metp.megatron_lm import ...`` and
``from megatron_metp import megatron_lm as metp``); they stay here as long as a patched checkout
may call them. Importing this package imports neither ``megatron.training`` nor megatron-core.
"""

from .ckpt_manifest import publish_checkpoint_manifest
from .hooks import (add_metp_args, compose_extra_args_providers, metp_expert_model_parallel_size,
                    validate_metp_args, wrap_gpt_builder)
from .releases import route_model_provider

__all__ = ["add_metp_args", "compose_extra_args_providers", "metp_expert_model_parallel_size",
           "validate_metp_args", "wrap_gpt_builder", "route_model_provider",
           "publish_checkpoint_manifest"]
