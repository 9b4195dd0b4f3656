"""Transformer Engine and flash-attn where present, PyTorch where not: what METP's layers use.

METP's attention and MLP are its own fused ring ops whatever ``--transformer-impl`` says; what
the flag changes inside a METP layer is the two norms and the ring's block kernel:

======================  ===========================================  ==============================
``--transformer-impl``  norms (``input_layernorm``, ``pre_mlp_``)     K/V ring block kernel
======================  ===========================================  ==============================
``local``               Megatron's local norm (apex or torch)        best available (below)
``transformer_engine``  TE's fused LayerNorm/RMSNorm (``TENorm``)    best available (below)
                        when ``transformer_engine`` imports; else
                        Megatron's local norm, and a printed note
======================  ===========================================  ==============================

Block kernel, best available first (:func:`megatron_metp.ops.attention_kernels.available_kernels`):
cuDNN (torch's SDPA cuDNN ops), FlashAttention-3 (Hopper, installed), FlashAttention-2 (installed),
PyTorch's fused flash kernel (``torch_flash``), the plain PyTorch reference
(:mod:`megatron_metp.ops.kernel_choice`). ``--use-flash-attn`` asks for
the first and is refused where flash-attn is not installed. The final norm and the embedding and
output layers are Megatron's own and follow the flag as for stock models.

Nothing here imports Transformer Engine unless it is installed; on machines without it (CPU CI)
the same code selects the PyTorch path and :func:`select_norm` says so in its note.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

__all__ = ["NormChoice", "TRANSFORMER_IMPLS", "have_transformer_engine", "select_norm"]

#: ``--transformer-impl`` values a METP model can be built with
TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass(frozen=True)
class NormChoice:
    """The norm a METP layer gets: ``module`` replaces the local spec's norm (``None``: keep
    it); ``impl`` is what is used; ``note`` says so for the log ("" when nothing to say)."""

    impl: str
    module: Optional[type]
    note: str


def have_transformer_engine() -> bool:
    """Whether Transformer Engine's PyTorch package is installed (found, not imported)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None and \
            importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


def _te_norm_class(normalization: str) -> type:
    """Megatron's TE norm for METP's layers (``TENorm``: TE's LayerNorm or RMSNorm by
    ``config.normalization``), as Megatron's TE spec provider hands it out."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider().layer_norm(rms_norm=normalization == "RMSNorm", for_qk=False)


def select_norm(transformer_impl: str, normalization: str = "LayerNorm") -> NormChoice:
    """The norm for ``--transformer-impl transformer_impl`` (``--normalization``
    ``normalization``). Raises ``ValueError`` naming the flag for other values."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl {transformer_impl!r}: METP layers are built with "
                         f"one of {TRANSFORMER_IMPLS}")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization {normalization!r}: METP layers support LayerNorm "
                         f"and RMSNorm")
    if transformer_impl == "local":
        return NormChoice("local", None, "")
    if not have_transformer_engine():
        return NormChoice("local", None,
                          "--transformer-impl transformer_engine: transformer-engine is not "
                          "installed here, so the METP layers' norms are Megatron's local "
                          f"{normalization} (the PyTorch path); the attention and MLP are METP's "
                          "ring ops either way")
    return NormChoice("transformer_engine", _te_norm_class(normalization),
                      f"--transformer-impl transformer_engine: the METP layers' norms are "
                      f"Transformer Engine's fused {normalization} (TENorm); the attention and "
                      f"MLP are METP's ring ops, not TE modules")
