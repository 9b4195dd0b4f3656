"""RoPE angles of METP and ring-baseline GPT models: exact, for this rank's tokens only.

Megatron's ``RotaryEmbedding.forward(s)`` builds the whole sequence's table ``[s, 1, 1, 2r]``
with an fp32 ``arange`` and an fp32 product (positions collide past 2^24; angles round by
~0.12 rad at 4M positions, ``docs/positions.md``), keeps it in an ``lru_cache`` and, under
context parallelism, slices this rank's two dual-chunk pieces out of it.
:class:`ExactRotaryEmbedding` is the same module whose ``forward`` returns only this rank's rows,
``[s/P, 1, 1, 2r]`` for the sequence ring of ``P`` ranks (Megatron's CP group: the METP ring,
or METP × CP), from :func:`megatron_metp.ops.rope.rope_angles` (exact θ = pos·inv_freq mod 2π,
one fp32 rounding). Everything downstream is unchanged: the METP attention (plain, METP × CP,
the streaming layer) takes the ``[s/p]`` rows as they are, Megatron's ``SelfAttention`` of the
ring baseline applies them, and packed documents build their per-document angles through
:func:`angles_of` (:func:`megatron_metp.megatron.packing.document_rope`). The last table is kept
(one entry, this rank's rows only) for the next micro-batch.

:func:`use_exact_angles` switches a built model's plain RoPE module over (its class only: no
parameters or buffers change, checkpoints are unaffected). Default for METP and the ring
baseline; ``--metp-rope-fp32-recipe`` (Megatron-LM), ``Layout.rope_fp32_recipe`` or
``METP_ROPE_RECIPE=megatron`` keep Megatron's recipe (bit-compatible with a stock run). Stock TP
twins keep Megatron's. YaRN (``YarnRotaryEmbedding``) takes exact angles of its scaled
``inv_freq`` (:class:`~.yarn.ExactYarnRotaryEmbedding`). Variants not covered (position
interpolation ``seq_len_interpolation_factor``, interleaved RoPE, mRoPE) keep Megatron's, and any
job whose positions reach 2^24 on Megatron's recipe is refused before work
(:func:`megatron_metp.ops.rope_recipe.fp32_recipe_refusal`).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from .exact_rope import ExactRotaryEmbedding, angles_of  # noqa: F401 (re-exported)
from .rope_checks import rope_reach_problems
from ..ops.rope import rope_angles
from ..ops.rope_recipe import RECIPE_ENV, RECIPES, fp32_recipe_refusal, rope_recipe  # noqa: F401

#: Environment variable choosing the recipe of METP/ring models (``exact`` or ``megatron``).
def uncovered(rotary) -> Optional[str]:
    """Why ``rotary`` cannot take exact angles (a variant they do not cover), or ``None``."""
    from .yarn import exact_class

    if exact_class(rotary) is None:
        return f"{type(rotary).__name__} (only plain RoPE and YaRN have exact angles)"
    if rotary.rotary_interleaved:
        return "interleaved RoPE (--rotary-interleaved)"
    if rotary.seq_len_interpolation_factor is not None:
        return ("position interpolation (--rotary-seq-len-interpolation-factor "
                f"{rotary.seq_len_interpolation_factor})")
    return None


def use_exact_angles(model: torch.nn.Module, recipe: str = "exact") -> str:
    """Give ``model`` (a ``GPTModel``) exact angles when ``recipe == "exact"`` and its RoPE is
    plain; return what its angles are now: ``"exact"``, ``"megatron"`` (asked for, or a variant
    not covered: :func:`uncovered`) or ``"none"`` (no RoPE module)."""
    if recipe not in RECIPES:
        raise ValueError(f"RoPE recipe must be one of {RECIPES}, got {recipe!r}")
    rotary = getattr(model, "rotary_pos_emb", None)
    if not isinstance(rotary, RotaryEmbedding):
        return "none"
    if recipe == "megatron" or uncovered(rotary) is not None:
        return "megatron"
    from .yarn import exact_class

    rotary.__class__ = exact_class(rotary)
    return "exact"


def check_reach(model: torch.nn.Module, state: str, seq_length: int, asked: str) -> None:
    """Refuse (``ValueError``) a model whose angles are Megatron's (``state``, from
    :func:`use_exact_angles`) when its positions reach 2^24; ``asked``: what chose Megatron's
    recipe when the variant is covered (a flag, or stock TP)."""
    if state != "megatron":
        return
    variant = uncovered(model.rotary_pos_emb)
    why = f"{variant} is not covered by exact angles" if variant else f"{asked}"
    fix = ("use plain RoPE (exact angles) with METP or the ring baseline" if variant else
           "run METP or the ring baseline with exact angles (the default: drop "
           "--metp-rope-fp32-recipe / METP_ROPE_RECIPE=megatron)")
    refusal = fp32_recipe_refusal(seq_length, why, fix)
    if refusal:
        raise ValueError(refusal)


# ------------------------------------------------------------------------------ Megatron-LM

def check_args_reach(args) -> None:
    """Refuse (``ValueError``) a job :func:`.rope_checks.rope_reach_problems`
    finds a problem in: positions reaching 2^24 on Megatron's fp32 RoPE recipe."""
    problems = rope_reach_problems(args)
    if problems:
        raise ValueError("; ".join(problems))


def use_angles_of_args(model: torch.nn.Module, args) -> str:
    """:func:`use_exact_angles` on a METP/ring model built from Megatron-LM ``args``
    (``--metp-rope-fp32-recipe``), refused past 2^24 on Megatron's recipe; rank 0 says which."""
    import torch.distributed as dist

    angles = use_exact_angles(model, rope_recipe(bool(getattr(args, "metp_rope_fp32_recipe",
                                                                False))))
    check_reach(model, angles, args.seq_length, "--metp-rope-fp32-recipe or "
                "METP_ROPE_RECIPE=megatron")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"RoPE angles: {angles}" + (" (int64 positions, reduced mod 2 pi, this rank's "
                                          "tokens only)" if angles == "exact" else ""), flush=True)
    return angles
