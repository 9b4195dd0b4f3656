"""YaRN (``position_embedding_type='yarn'``) in METP's attention.

Megatron's ``YarnRotaryEmbedding`` (megatron-core 0.16.1 and 0.19) hands the layers the angles
``θ = pos · inv_freq'`` of YaRN's scaled frequencies ``inv_freq'`` and drops its attention
factor ``A`` (the concentration factor, "mscale") there; its ``Attention`` multiplies the cos and
sin tables of both queries and keys by ``A`` instead (``apply_rotary_pos_emb(..., mscale=A)``,
``A`` from ``_yarn_get_concentration_factor_from_config``, 1 without ``yarn_*`` settings).
transformers does the same (``attention_scaling`` times cos and sin). Every channel rotates
(YaRN's table spans the whole head), so the scores become ::

    (A·R q) · (A·R k) · s  =  (R q) · (R k) · (A²·s)      s = softmax_scale or 1/sqrt(d)

METP's attention takes angles, not cos/sin tables, and folds ``A²`` into its softmax scale
(:func:`metp_softmax_scale`): the same scores up to fp32 rounding. METP's ring baseline
(``METPRingCoreAttention``) runs inside Megatron's own ``SelfAttention``, which has already
applied ``A`` to q and k: nothing is folded there.

:func:`yarn_inv_freq` is ``inv_freq'`` exactly as ``YarnRotaryEmbedding.get_emb`` forms it (the
same megatron-core helpers on the module's own settings); :class:`ExactYarnRotaryEmbedding`
(what :func:`~.rope.use_exact_angles` makes of a ``YarnRotaryEmbedding``, the default for METP
and the ring baseline) forms this rank's angles from it with
:func:`megatron_metp.ops.rope.rope_angles`: exact past 2^24 positions like plain RoPE's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding, _yarn_get_concentration_factor)

from .exact_rope import ExactRotaryEmbedding


def yarn_attention_factor(config) -> float:
    """YaRN's attention factor ``A`` as megatron-core's attention computes it from ``config``
    (1.0 when ``config`` has no ``yarn_*`` settings)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
        _yarn_get_concentration_factor_from_config as factor

    return float(factor(config))


def metp_softmax_scale(config) -> Optional[float]:
    """The softmax scale of METP's attention: ``config.softmax_scale`` (None: the op's
    ``1/sqrt(d)``) times ``A²`` (:func:`yarn_attention_factor`) when YaRN's ``A != 1``."""
    a = yarn_attention_factor(config)
    if a == 1.0:
        return config.softmax_scale
    s = config.softmax_scale
    if s is None:
        s = 1.0 / math.sqrt(config.kv_channels)
    return s * a * a


def yarn_inv_freq(rotary) -> torch.Tensor:
    """YaRN's scaled ``inv_freq' [d/2]`` (fp32) of a ``YarnRotaryEmbedding``, bit-identical to
    the one its ``get_emb`` multiplies the positions by::

        inv_freq' = inv_freq_inter · ramp + inv_freq_extra · (1 − ramp)
        ramp = clamp((j − low) / (high − low), 0, 1),  (low, high) = correction range
    """
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as Y

    low, high = Y._yarn_find_correction_range(
        rotary.beta_fast, rotary.beta_slow, rotary.dim, rotary.rotary_base,
        rotary.original_max_position_embeddings, rotary.correction_range_round_to_int)
    if torch.cuda.is_available() and rotary.inv_freq_extra.device.type == "cpu":
        # as get_emb: built on the CPU, moved once to the current device
        dev = torch.cuda.current_device()
        rotary.inv_freq_extra = rotary.inv_freq_extra.to(device=dev)
        rotary.inv_freq_inter = rotary.inv_freq_inter.to(device=dev)
    extra, inter = rotary.inv_freq_extra, rotary.inv_freq_inter
    mask = 1.0 - Y._yarn_linear_ramp_mask(low, high, rotary.dim // 2,
                                          device=extra.device).to(dtype=torch.float32)
    return inter * (1 - mask) + extra * mask


class ExactYarnRotaryEmbedding(ExactRotaryEmbedding, YarnRotaryEmbedding):
    """megatron-core's ``YarnRotaryEmbedding`` with exact angles for this rank's tokens only
    (:class:`~.rope.ExactRotaryEmbedding`'s ``forward``) of YaRN's scaled ``inv_freq'``
    (:func:`yarn_inv_freq`). Like Megatron's, ``forward`` returns ``(angles, A)``; ``GPTModel``
    drops ``A`` and the attention applies it from the config (module docstring). Built by
    :func:`~.rope.use_exact_angles` from a constructed ``YarnRotaryEmbedding``."""

    def exact_inv_freq(self) -> torch.Tensor:
        return yarn_inv_freq(self)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None):
        emb = ExactRotaryEmbedding.forward(self, max_seq_len, offset, packed_seq, cp_group)
        return emb, _yarn_get_concentration_factor(self.scaling_factor, self.mscale,
                                                   self.mscale_all_dim)


def exact_class(rotary):
    """The exact-angle class for a model's RoPE module ``rotary`` (plain RoPE or YaRN, either
    already switched or not), or None for a kind exact angles do not cover."""
    kind = type(rotary)
    if kind in (RotaryEmbedding, ExactRotaryEmbedding):
        return ExactRotaryEmbedding
    if kind in (YarnRotaryEmbedding, ExactYarnRotaryEmbedding):
        return ExactYarnRotaryEmbedding
    return None
