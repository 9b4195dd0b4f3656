"""Megatron-LM's YaRN flags with METP, and the release that has them.

Megatron-LM core_v0.19.0 takes ``--position-embedding-type yarn`` with ``--rotary-scaling-factor``,
``--yarn-original-max-position-embeddings``, ``--yarn-beta-fast``, ``--yarn-beta-slow``,
``--[no-]yarn-correction-range-round-to-int``, ``--mscale`` and ``--mscale-all-dim``, and puts them
on the ``TransformerConfig`` as ``yarn_*`` attributes (its ``argument_utils``). METP honours every
one: its YaRN angles come from megatron-core's own ``YarnRotaryEmbedding`` settings and its
attention folds the config's attention factor into the softmax scale
(:mod:`megatron_metp.megatron.yarn`).

core_v0.16.1's ``pretrain_gpt.py`` has no ``yarn`` choice and no ``--yarn-*`` flags (megatron-core
0.16.1's ``GPTModel`` does have YaRN, but nothing fills its settings). :func:`offer_yarn_choice`
lets a parser that takes METP's flags accept ``yarn`` so that
:func:`.releases.yarn_release_problem` refuses it naming the release (the dry run parses that way)
instead of argparse's bare "invalid choice". core_v0.16.1's ``pretrain_gpt.py`` itself parses
once without METP's flags first (for its in-process restart), so ``scripts/pretrain_gpt.sh``
refuses ``POSITION_EMBEDDING_TYPE=yarn`` with a core_v0.16.1 checkout before launching it.

With ``--multi-latent-attention`` YaRN is MLA's own (``--rope-type yarn``, MLA's default): it
reads ``--rotary-scaling-factor``, ``--mscale`` and ``--mscale-all-dim``; the ``--yarn-*`` flags,
and every YaRN flag with ``--rope-type rope``, are refused naming them.

Refused with METP (:func:`yarn_problems`), naming the flag: YaRN's flags without
``--position-embedding-type yarn`` (Megatron ignores them there), and with it
``--rotary-percent`` below 1, ``--use-rope-scaling`` and ``--rotary-seq-len-interpolation-factor``
(megatron-core's YaRN rotates the whole head with its own frequencies and ignores them).
"""

from __future__ import annotations

import argparse
from typing import List

#: (args attribute, flag, Megatron-LM's default) of YaRN's settings
YARN_FLAGS = (
    ("rotary_scaling_factor", "--rotary-scaling-factor", 1.0),
    ("yarn_original_max_position_embeddings", "--yarn-original-max-position-embeddings", None),
    ("yarn_beta_fast", "--yarn-beta-fast", None),
    ("yarn_beta_slow", "--yarn-beta-slow", None),
    ("yarn_correction_range_round_to_int", "--[no-]yarn-correction-range-round-to-int", None),
    ("mscale", "--mscale", 1.0),
    ("mscale_all_dim", "--mscale-all-dim", 0.0),
)


def has_yarn_flags(args_or_parser) -> bool:
    """Whether ``args`` (or a parser) come from a Megatron-LM release with YaRN's flags."""
    if isinstance(args_or_parser, argparse.ArgumentParser):
        return "--yarn-beta-fast" in args_or_parser._option_string_actions
    return hasattr(args_or_parser, "yarn_beta_fast")


def offer_yarn_choice(parser: argparse.ArgumentParser) -> None:
    """On a Megatron-LM without YaRN flags (core_v0.16.1), add ``yarn`` to
    ``--position-embedding-type``'s choices; :func:`.releases.yarn_release_problem` then
    refuses it."""
    action = parser._option_string_actions.get("--position-embedding-type")
    if action is None or has_yarn_flags(parser) or action.choices is None or \
            "yarn" in action.choices:
        return
    action.choices = list(action.choices) + ["yarn"]


#: the YaRN flags megatron-core's multi-latent attention reads (``MLATransformerConfig``
#: fields, with ``--rope-type yarn``, MLA's default); its original context and betas are the
#: config's defaults (4096, 32, 1), which the ``--yarn-*`` flags do not reach
MLA_YARN_FLAGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")


def _mla_yarn_problems(args) -> List[str]:
    """:func:`yarn_problems` of a ``--multi-latent-attention`` run."""
    yarn = getattr(args, "rope_type", None) in (None, "yarn")
    out = []
    for name, flag, default in YARN_FLAGS:
        value = getattr(args, name, default)
        if value == default or (yarn and name in MLA_YARN_FLAGS):
            continue
        out.append(f"{flag} {value} with --multi-latent-attention (MLA's YaRN takes "
                   f"--rope-type yarn with --rotary-scaling-factor, --mscale and "
                   f"--mscale-all-dim only{'' if yarn else '; this run has --rope-type rope'}"
                   f"): drop it")
    return out


def yarn_problems(args) -> List[str]:
    """YaRN flags a METP run cannot honour, each naming the flag and the fix."""
    out = []
    if getattr(args, "multi_latent_attention", False):
        return _mla_yarn_problems(args)
    if getattr(args, "position_embedding_type", None) != "yarn":
        for name, flag, default in YARN_FLAGS:
            value = getattr(args, name, default)
            if value != default:
                out.append(f"{flag} {value} (YaRN's setting: it applies with "
                           f"--position-embedding-type yarn only; drop it)")
        return out
    percent = getattr(args, "rotary_percent", 1.0)
    if percent != 1.0:
        out.append(f"--rotary-percent {percent} with --position-embedding-type yarn "
                   f"(megatron-core's YaRN rotates the whole head and ignores it; drop it)")
    if getattr(args, "use_rope_scaling", False):
        out.append("--use-rope-scaling with --position-embedding-type yarn (Llama 3.1's "
                   "scaling; YaRN has its own: drop it)")
    if getattr(args, "rotary_seq_len_interpolation_factor", None) is not None:
        out.append("--rotary-seq-len-interpolation-factor with --position-embedding-type yarn "
                   "(megatron-core's YaRN ignores it; drop it)")
    return out
