"""A Hugging Face ``rope_scaling`` of type ``yarn`` as Megatron's YaRN settings.

transformers (``_compute_yarn_parameters``) and megatron-core (``YarnRotaryEmbedding``, both
0.16.1 and 0.19) compute the same YaRN: with ``f`` the factor, ``L`` the original context and
``inv_freq_j = base^(-2j/d)``, the scaled frequencies are ::

    inv_freq'_j = inv_freq_j / f · ramp_j + inv_freq_j · (1 − ramp_j)
    ramp_j = clamp((j − low) / (high − low), 0, 1),
    low, high = correction dims of beta_fast, beta_slow at L (floor/ceil when rounded)

and both multiply cos and sin (so queries and keys, hence every score by ``A²``) by the
attention factor ``A``. They name the settings differently; this module maps one onto the other:

=====================================  ========================================  ===================
transformers ``rope_scaling``          Megatron ``TransformerConfig`` attribute  Megatron-LM flag
=====================================  ========================================  ===================
``factor``                             ``yarn_rotary_scaling_factor``            ``--rotary-scaling-factor``
``original_max_position_embeddings``   ``yarn_original_max_position_embeddings`` ``--yarn-original-max-position-embeddings``
  (default ``max_position_embeddings``)
``beta_fast`` (default 32)             ``yarn_beta_fast``                        ``--yarn-beta-fast``
``beta_slow`` (default 1)              ``yarn_beta_slow``                        ``--yarn-beta-slow``
``truncate`` (default true)            ``yarn_correction_range_round_to_int``    ``--no-yarn-correction-range-round-to-int``
``mscale``, ``mscale_all_dim``         ``yarn_mscale``, ``yarn_mscale_all_dim``  ``--mscale``, ``--mscale-all-dim``
``attention_factor``                   (as ``yarn_mscale``, see below)
=====================================  ========================================  ===================

The attention factor. transformers: ``attention_factor`` if set; else, when ``mscale`` and
``mscale_all_dim`` are both set and non-zero, ``g(f, mscale) / g(f, mscale_all_dim)``; else
``g(f, 1)``, with ``g(f, m) = 0.1·m·ln f + 1`` (1 for ``f ≤ 1``). Megatron always computes
``g(f, yarn_mscale) / g(f, yarn_mscale_all_dim)`` (defaults 1 and 0, i.e. ``g(f, 1)``). So the
last two cases map directly, and an explicit ``attention_factor`` ``A`` maps to
``yarn_mscale = (A − 1) / (0.1·ln f)``, ``yarn_mscale_all_dim = 0`` (exact to fp64 rounding;
with ``f ≤ 1`` only ``A = 1`` is expressible and anything else is refused). Megatron has no
attention-factor field of its own: this is how transformers' value reaches it.

Megatron-LM takes ``--position-embedding-type yarn`` and the ``--yarn-*`` flags from
core_v0.19.0 on; core_v0.16.1's ``pretrain_gpt.py`` has no ``yarn`` choice (megatron-core 0.16.1's
``GPTModel`` does: the converter's own model build and the METP tests use it on both).
"""

from __future__ import annotations

import math
from typing import List, Optional

from .errors import HFConfigError

#: the Megatron-LM release whose pretrain_gpt.py first takes --position-embedding-type yarn
YARN_RELEASE = "core_v0.19.0"

YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
         "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def _err(msg: str):
    return HFConfigError(msg)


def rope_number(rs: dict, key: str, *, positive: bool = False,
               where: str = "rope_scaling") -> Optional[float]:
    v = rs.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            (positive and not v > 0):
        raise _err(f"config.json: {where}.{key} = {v!r} must be a "
                   f"{'positive ' if positive else ''}finite number")
    return float(v)


def mscale_factor(factor: float, mscale: float) -> float:
    """YaRN's ``g(f, m) = 0.1·m·ln f + 1`` (1 for ``f ≤ 1``), as both libraries write it."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(y: dict) -> float:
    """The attention factor ``A`` Megatron computes from the ``yarn_*`` settings ``y``."""
    f = y["yarn_rotary_scaling_factor"]
    return float(mscale_factor(f, y["yarn_mscale"]) / mscale_factor(f, y["yarn_mscale_all_dim"]))


def yarn_from_hf(rs: dict, max_position_embeddings: int, *, where: str = "rope_scaling") -> dict:
    """Megatron's ``yarn_*`` ``TransformerConfig`` attributes of a ``rope_scaling`` of type
    ``yarn`` (:class:`~.config.HFConfigError` naming the key for anything else); ``where``
    names the dict in messages (transformers 5.x: ``rope_parameters``)."""
    import functools

    _num = functools.partial(rope_number, where=where)
    unknown = sorted(set(rs) - YARN_KEYS)
    if unknown:
        raise _err(f"config.json: {where} has {unknown} besides YaRN's keys "
                   f"{sorted(YARN_KEYS)}: it cannot be reproduced; remove them")
    factor = _num(rs, "factor", positive=True)
    if factor is None:
        raise _err(f"config.json: {where} type 'yarn' needs a 'factor'")
    orig = rs.get("original_max_position_embeddings") or max_position_embeddings
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise _err(f"config.json: {where}.original_max_position_embeddings = {orig!r} "
                   f"must be an integer >= 1")
    beta_fast = _num(rs, "beta_fast") or 32.0  # transformers' `or`: 0 and null mean default
    beta_slow = _num(rs, "beta_slow") or 1.0
    truncate = rs.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _err(f"config.json: {where}.truncate = {truncate!r} must be true or false")
    mscale, mscale_all = _num(rs, "mscale"), _num(rs, "mscale_all_dim")
    a = _num(rs, "attention_factor", positive=True)
    y = dict(yarn_rotary_scaling_factor=factor, yarn_original_max_position_embeddings=orig,
             yarn_beta_fast=beta_fast, yarn_beta_slow=beta_slow,
             yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
             yarn_correction_range_round_to_int=truncate)
    if a is not None:
        if factor <= 1:
            if a != 1.0:
                raise _err(f"config.json: {where}.attention_factor = {a!r} with factor "
                           f"{factor!r} <= 1: Megatron's YaRN fixes the factor at 1 there "
                           f"(mscale does not apply), so it cannot be reproduced")
        else:
            y["yarn_mscale"] = (a - 1.0) / (0.1 * math.log(factor))
            if abs(attention_factor(y) - a) > 1e-12 * a:
                raise _err(f"config.json: {where}.attention_factor = {a!r} is not "
                           f"reproduced by Megatron's mscale formula within 1e-12")
    elif mscale and mscale_all:  # transformers' truthiness: both set and non-zero
        y["yarn_mscale"], y["yarn_mscale_all_dim"] = mscale, mscale_all
    return y


def yarn_flags(y: dict) -> List[str]:
    """Megatron-LM (core_v0.19.0) flags of the ``yarn_*`` settings (with
    ``--position-embedding-type yarn`` and ``--rotary-base``, written by the caller)."""
    out = ["--rotary-scaling-factor", repr(y["yarn_rotary_scaling_factor"]),
           "--yarn-original-max-position-embeddings",
           str(y["yarn_original_max_position_embeddings"]),
           "--yarn-beta-fast", repr(y["yarn_beta_fast"]),
           "--yarn-beta-slow", repr(y["yarn_beta_slow"]),
           "--mscale", repr(y["yarn_mscale"]), "--mscale-all-dim", repr(y["yarn_mscale_all_dim"])]
    if not y["yarn_correction_range_round_to_int"]:
        out.append("--no-yarn-correction-range-round-to-int")
    return out
