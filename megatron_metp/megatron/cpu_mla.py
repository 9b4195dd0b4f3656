"""Shim (m) of :mod:`megatron_metp.megatron.cpu`: stock multi-latent attention on CPU ranks.

megatron-core's ``MLASelfAttention`` builds its core attention with ``k_channels`` (the query and
key head width, ``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (``v_head_dim``);
Transformer Engine's core attention takes them, the local ``DotProductAttention`` (the only one
on a CPU, core_v0.16.1 and core_v0.19.0) does not, so stock MLA cannot be built on CPU ranks.
The local attention computes every head at one width, ``kv_channels``: the shim lets it accept
the two arguments when both equal ``kv_channels`` (a model with ``--v-head-dim`` equal to
``--qk-head-dim + --qk-pos-emb-head-dim`` and ``--kv-channels`` set to it, as the tiny MLA twin
configs are), where it computes exactly stock MLA's attention, and refuses other widths by
name. Where megatron-core's ``HAVE_TE`` is set while its ``TELinear`` is no class (a CPU install
without Transformer Engine), ``MultiLatentAttention.__init__`` would test ``isinstance(linear_proj,
TELinear)`` for an fp8 setting and fail; the shim sets that module's ``HAVE_TE`` to False (no TE
module is built on a CPU rank). This is what lets a METP MLA run have a stock twin on CPU ranks
(``configs/tiny-cpu-ep2-mla-moe.sh``).
"""

from __future__ import annotations

import functools

__all__ = ["patch_mla_core_attention", "te_linear_is_stand_in"]


def te_linear_is_stand_in(module) -> bool:
    """Whether megatron-core ``module`` (``multi_latent_attention``) has ``HAVE_TE`` set while its
    ``TELinear`` is no class (a CPU install without Transformer Engine): an
    ``isinstance(..., TELinear)`` there raises."""
    return bool(getattr(module, "HAVE_TE", False)) and \
        not isinstance(getattr(module, "TELinear", None), type)


def _with_mla_channels(init):
    @functools.wraps(init)
    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        width = config.kv_channels
        if (k_channels, v_channels) != (None, None) and (k_channels, v_channels) != (width, width):
            raise ValueError(
                f"stock multi-latent attention on CPU ranks (megatron-core's local "
                f"DotProductAttention computes every head at --kv-channels {width}): the query/key "
                f"head width {k_channels} (--qk-head-dim + --qk-pos-emb-head-dim) and "
                f"--v-head-dim {v_channels} must both equal --kv-channels; pass --kv-channels "
                f"{k_channels} and --v-head-dim {k_channels}, or run on GPUs with "
                f"--transformer-impl transformer_engine")
        init(self, config, *args, **kwargs)

    return __init__


def patch_mla_core_attention(patch) -> None:
    """Apply shim (m) with ``patch(owner, name, value)`` (recorded, undone by ``disable()``)."""
    from megatron.core.transformer import multi_latent_attention as stock
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    patch(DotProductAttention, "__init__", _with_mla_channels(DotProductAttention.__init__))
    if te_linear_is_stand_in(stock):
        patch(stock, "HAVE_TE", False)
