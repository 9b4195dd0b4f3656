"""The Megatron-LM side of METP: the hooks the patches in ``patches/`` call (:mod:`.flags`,
:mod:`.validate`, :mod:`.parallel_state`, :mod:`.build`; the rules they check: :mod:`.checks`), the
runner that trains Megatron-LM's own scripts on CPU ranks (:mod:`.cpu`), the checks of a
checkpoint before ``--load`` (:mod:`.resume`, :mod:`.ckpt_manifest`: the per-file checksums
written at ``--save``) and what differs between the supported Megatron-LM
releases (:mod:`.releases`).

The names below are the ones the patches call (``from megatron_metp.megatron_lm import ...`` and
``from megatron_metp import megatron_lm as metp``); they stay here as long as a patched checkout
may call them. Importing this package imports neither ``megatron.training`` nor megatron-core,
nor torch: the names are imported on first use, so that the launcher's preflight
(:mod:`.preflight`) starts without torch.
"""

from ..runtime.lazy import lazy_names

#: public name -> the submodule that defines it
_WHERE = {"publish_checkpoint_manifest": "ckpt_manifest",
          "wire_ddp": "build", "wire_wide_expert_parallel": "build",
          "wrap_gpt_builder": "build",
          "add_metp_args": "flags", "compose_extra_args_providers": "flags",
          "install_stall_watch": "parallel_state",
          "metp_expert_model_parallel_size": "parallel_state",
          "route_model_provider": "releases", "validate_metp_args": "validate"}

__all__ = ["add_metp_args", "compose_extra_args_providers", "install_stall_watch",
           "metp_expert_model_parallel_size", "validate_metp_args", "wrap_gpt_builder",
           "route_model_provider", "publish_checkpoint_manifest", "wire_ddp",
           "wire_wide_expert_parallel"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)
