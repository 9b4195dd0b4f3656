"""The supported Megatron-LM releases and what differs between them, in one place.

Two releases are supported, each with its patch series ``patches/<tag>/`` (the same hooks, placed
where the release has them; ``scripts/apply_patches.sh`` picks the series by the checkout's
commit) and the megatron-core wheel of the same line:

============  ==========================================  ============  ===========
tag           commit                                      megatron-core  Python
============  ==========================================  ============  ===========
core_v0.16.1  55ac7082517c3878ae653c07c09c534b8aed49f6    0.16.x        >= 3.10
core_v0.19.0  5be9626709af2722333bf54797c954c09edeada3    0.19.x        >= 3.12
============  ==========================================  ============  ===========

What the glue has to know about the difference:

* core_v0.16.1's ``pretrain_gpt.py`` passes ``partial(model_provider, gpt_builder)`` and
  ``extra_args_provider`` to ``pretrain()``, so its patch wraps the builder (``wrap_gpt_builder``).
* core_v0.19.0's ``pretrain_gpt.py`` parses the arguments itself (``parse_and_validate_args``, where
  its patch adds the METP flags) and passes ``pretrain()`` a config container whose
  ``GPTModelConfig`` names Megatron's own ``GPTModelBuilder``; ``pretrain()`` still takes a
  ``model_provider`` and uses it when the container has no model config. Its patch calls
  :func:`route_model_provider`, which hands the METP provider over that way.

megatron-core differences the METP layers meet are in ``megatron_metp/megatron/compat.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.metadata
from typing import Callable, Optional, Tuple

from .yarn_args import has_yarn_flags

__all__ = ["Release", "RELEASES", "by_tag", "by_commit", "for_megatron_core",
           "route_model_provider", "validate_args_owner", "vocab_size_with_padding",
           "disable_gloo_process_groups", "yarn_release_problem"]


@dataclasses.dataclass(frozen=True)
class Release:
    """One supported Megatron-LM release: its tag, the tag's commit, the megatron-core line of
    the same release (``"0.16"``: any 0.16.x) and the oldest Python that line installs on."""

    tag: str
    commit: str
    megatron_core: str
    python: Tuple[int, int]
    #: Megatron's ``NullTokenizer(--vocab-size V)`` (mock data) has V + 1 tokens, an end-of-document
    #: token appended (core_v0.16.1), or V with eod = V - 1 (core_v0.19.0)
    null_tokenizer_adds_eod: bool


RELEASES = (
    Release("core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6", "0.16", (3, 10), True),
    Release("core_v0.19.0", "5be9626709af2722333bf54797c954c09edeada3", "0.19", (3, 12), False),
)


def by_tag(tag: str) -> Release:
    for release in RELEASES:
        if release.tag == tag:
            return release
    raise ValueError(f"Megatron-LM release {tag!r} is not supported (supported: "
                     f"{', '.join(r.tag for r in RELEASES)})")


def by_commit(commit: str) -> Optional[Release]:
    """The supported release whose tag is at ``commit``, or None."""
    for release in RELEASES:
        if release.commit == commit:
            return release
    return None


def for_megatron_core(version: Optional[str] = None) -> Release:
    """The release matching megatron-core ``version`` (default: the installed wheel's, read from
    its metadata without importing it)."""
    if version is None:
        version = importlib.metadata.version("megatron-core")
    line = ".".join(version.split(".")[:2])
    for release in RELEASES:
        if release.megatron_core == line:
            return release
    raise ValueError(f"megatron-core {version} matches no supported Megatron-LM release "
                     f"(supported lines: {', '.join(r.megatron_core for r in RELEASES)})")


def yarn_release_problem(args) -> Optional[str]:
    """The refusal of ``--position-embedding-type yarn`` on a Megatron-LM release without YaRN's
    flags (any run, METP or not), or None."""
    if getattr(args, "position_embedding_type", None) != "yarn" or has_yarn_flags(args):
        return None
    tag = for_megatron_core().tag
    return (f"--position-embedding-type yarn needs Megatron-LM core_v0.19.0: this is {tag}, "
            f"whose pretrain_gpt.py has no --yarn-* flags and never fills megatron-core's YaRN "
            f"settings; use core_v0.19.0 (make venv-019, METP_MEGATRON_LM_RELEASE=core_v0.19.0); "
            f"another position embedding (rope) would train a different model, with positions a "
            f"YaRN checkpoint was not trained on")


def route_model_provider(args, cfg_container, model_provider: Callable, gpt_builder: Callable):
    """core_v0.19.0's hook in ``pretrain_gpt.py``: return ``(cfg_container, provider)`` for
    ``pretrain(cfg_container, ..., model_provider=provider)``.

    With ``--metp-parallel-size > 1`` (or ``--metp-offload-activations``) the model is built by
    ``partial(model_provider, wrap_gpt_builder(gpt_builder))``, as core_v0.16.1's patched script
    builds it, and the container's model config is cleared (``pretrain()`` builds from the config
    when there is one, else from the provider). Otherwise the container comes back unchanged with
    no provider: stock Megatron-LM's ``GPTModelBuilder`` path."""
    from .build import wrap_gpt_builder
    from .flags import metp_enabled

    if not (metp_enabled(args) or getattr(args, "metp_offload_activations", False)):
        return cfg_container, None
    routed = copy.copy(cfg_container)  # not dataclasses.replace: no second __post_init__
    routed.model = None
    return routed, functools.partial(model_provider, wrap_gpt_builder(gpt_builder))


def validate_args_owner():
    """The module whose global ``validate_args`` the Megatron-LM scripts reach (the CPU runner
    wraps it to run its own checks right after): ``megatron.training.initialize`` on core_v0.16.1
    (``initialize_megatron`` parses and validates), ``megatron.training.arguments`` on
    core_v0.19.0 (``parse_and_validate_args``, which ``pretrain_gpt.py`` calls itself; its
    ``initialize`` no longer imports ``validate_args``)."""
    from megatron.training import arguments, initialize

    return initialize if hasattr(initialize, "validate_args") else arguments


def vocab_size_with_padding(vocab_size: int, args) -> int:
    """Megatron-LM's padded vocabulary size for ``vocab_size`` (``--make-vocab-size-divisible-by``
    × TP): ``megatron.training.tokenizer.tokenizer._vocab_size_with_padding`` on core_v0.16.1,
    ``megatron.core.tokenizers.utils.build_tokenizer.vocab_size_with_padding`` on core_v0.19.0."""
    try:
        from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding as pad
    except ImportError:
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding as pad
    return pad(vocab_size, args)


def disable_gloo_process_groups(args) -> None:
    """Turn off Megatron-LM's gloo copies of the process groups (``--disable-gloo-process-groups``):
    ``args.enable_gloo_process_groups`` on core_v0.16.1, ``args.use_gloo_process_groups`` on
    core_v0.19.0."""
    name = "use_gloo_process_groups" if hasattr(args, "use_gloo_process_groups") else \
        "enable_gloo_process_groups"
    setattr(args, name, False)
