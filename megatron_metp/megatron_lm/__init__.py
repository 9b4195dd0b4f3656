"""The Megatron-LM side of METP: the hooks the patches in ``patches/`` call (:mod:`.flags`,
:mod:`.validate`, :mod:`.parallel_state`, :mod:`.build`; the rules they check: :mod:`.checks`), the
runner that trains Megatron-LM's own scripts on CPU ranks (:mod:`.cpu`), the checks of a
checkpoint before ``--load`` (:mod:`.resume`, :mod:`.ckpt_manifest`: the per-file checksums
written at ``--save``) and what differs between the supported Megatron-LM
releases (:mod:`.releases`).

The names below are the ones the patches call (``from megatron_metp.megatron_lm import ...`` and
``from megatron_metp import megatron_lm as metp``); they stay here as long as a patched checkout
may call them. Importing this package imports neither ``megatron.training`` nor megatron-core.
"""

from .ckpt_manifest import publish_checkpoint_manifest
from .build import wire_wide_expert_parallel, wrap_gpt_builder
from .flags import add_metp_args, compose_extra_args_providers
from .parallel_state import install_stall_watch, metp_expert_model_parallel_size
from .releases import route_model_provider
from .validate import validate_metp_args

__all__ = ["add_metp_args", "compose_extra_args_providers", "install_stall_watch",
           "metp_expert_model_parallel_size", "validate_metp_args", "wrap_gpt_builder",
           "route_model_provider", "publish_checkpoint_manifest", "wire_wide_expert_parallel"]
