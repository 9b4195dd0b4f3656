"""The MoE token tiles' arithmetic (no torch, no megatron-core: the planner uses it).

One MoE layer's routed tokens kept for backward, per rank (stock megatron-core, CUDA, ``e``-byte
activations, ``m = 2`` for a gated activation such as SwiGLU, else 1), for ``n`` local tokens
(``s/(p·c)·b``), top-``k`` routing, hidden size ``h`` and expert FFN size ``f′`` ::

    whole (stock):  n · k · e · (2h + (2m + 2)·f′)       bf16 SwiGLU: n·k·(4h + 12f′)
    T tiles:        ceil(n/T) · k · e · (2h + (2m + 2)·f′)   (one tile's, during its backward)

and the tile count ``T`` the MoE layers run (:mod:`megatron_metp.megatron.moe_tiles`).
"""

from __future__ import annotations

import math

from ..runtime import overrides
from .tiles import tile_budget_bytes

__all__ = ["MOE_TOKEN_TILES_ENV", "gated_activation", "routed_row_bytes",
           "routed_transient_bytes", "resolve_moe_tiles"]

#: number of token tiles of every MoE layer's routed part (``1`` = whole); unset: auto
MOE_TOKEN_TILES_ENV = "METP_MOE_TOKEN_TILES"


def gated_activation(config) -> bool:
    """Whether ``config`` (a ``TransformerConfig``) has a gated expert activation (SwiGLU)."""
    return bool(getattr(config, "gated_linear_unit", False))


def routed_row_bytes(hidden: int, moe_ffn: int, topk: int, *, elem: int = 2,
                     gated: bool = True) -> int:
    """Bytes one local token's routed tensors hold for backward in stock megatron-core (CUDA,
    ``elem``-byte activations): ``k·elem·(2h + (2m + 2)·f′)``, ``m = 2`` gated (SwiGLU) else 1.

    Per chosen expert: the dispatched (permuted) input ``[h]`` (``fc1``'s input), the expert
    output ``[h]`` (the combine's weighted unpermute), ``fc1``'s output ``[m·f′]``, the
    activation's saved input ``[m·f′]`` (its own copy on the fused CUDA path), its output
    ``[f′]`` and the probability-weighted intermediate ``[f′]`` (``fc2``'s input). bf16 SwiGLU:
    ``k·(4h + 12f′)``."""
    m = 2 if gated else 1
    return int(topk) * int(elem) * (2 * int(hidden) + (2 * m + 2) * int(moe_ffn))


def routed_transient_bytes(tokens: int, hidden: int, moe_ffn: int, topk: int, *,
                           tiles: int = 1, elem: int = 2, gated: bool = True) -> int:
    """One MoE layer's routed-token transient per rank, in bytes, for ``tokens`` local tokens
    (``s/(p·c)·b``) run in ``tiles`` token tiles: ``ceil(tokens/tiles)·`` :func:`routed_row_bytes`.

    ``tiles=1``: stock megatron-core's ``n·k·(4h + 12f′)`` (bf16, SwiGLU), kept from a layer's
    forward to its backward; ``tiles=T``: the largest tile's, live only while that tile's
    backward runs (:class:`~megatron_metp.megatron.moe_tiles.TiledMoELayer`). Not counted: the
    ``[tokens, E]`` routing the tiled layer keeps (the router's fp32 logits, scores, probs, the
    bool map and the aux / z losses' terms: 24 bytes per token and expert measured on CPU,
    ``tests/test_moe_tiles.py``; stock keeps them too) and the dispatchers' communication
    buffers of one tile."""
    tiles = max(1, int(tiles))
    rows = math.ceil(int(tokens) / tiles) if tokens > 0 else 0
    return rows * routed_row_bytes(hidden, moe_ffn, topk, elem=elem, gated=gated)


def resolve_moe_tiles(tokens: int, row_bytes: int, tiles=None) -> int:
    """Token tiles of one MoE layer for ``tokens`` local tokens: ``tiles`` if given (the spec's
    ``moe_token_tiles``), else ``METP_MOE_TOKEN_TILES``, else the fewest whose
    :func:`routed_transient_bytes` (``row_bytes`` per token) fits ``METP_TILE_BUDGET_MIB``
    (:func:`~megatron_metp.runtime.overrides.integer_setting`); never more than ``tokens``
    (at least 1)."""
    tokens = int(tokens)
    count = overrides.integer_setting(tiles, MOE_TOKEN_TILES_ENV, "moe_token_tiles")
    if count is None:
        rows = max(1, tile_budget_bytes() // max(1, int(row_bytes)))
        count = max(1, math.ceil(tokens / rows))
    return max(1, min(count, tokens))
