"""Token tiles of the METP layers: how many of a rank's token rows one pass of a weight ring takes.

A METP layer op (today :func:`~megatron_metp.ops.metp_mlp`) normally runs its weight ring once
over all ``N = s/p·b`` token rows of the rank, so every transient of a ring step (the fp32 output
or ``dx`` accumulator ``[N, h]``, one shard's ``z``, ``f(z)``, ``dz`` ``[N, k·F/p]``) grows with
``s/p``. With token tiles the op runs the whole ring once per tile of ``R`` rows (*tile-outer*):
the accumulators and the shard's intermediates are ``[R, ·]``, the weight shards (and, in
backward, the travelling gradient sums) go round once per tile, so the ring bytes of the op are
multiplied by the tile count ``T = ceil(N/R)``. Each step of a tile still computes on ``R`` rows,
so the transfers stay hidden while ``R`` is above the overlap threshold (``metp plan``: ~2.2K
tokens per rank on H100); the auto tile is far above it (~24K rows for Llama-3-8B at METP 8).

Why tile-outer and not tile-inner (the ring once, each step over the tiles, full-size fp32
accumulators): measured with ``benchmarks/mlp_memory.py --methods metp-outer-gpumm
metp-inner-gpumm --token-tile 23831`` (CUDA-faithful fake tensors, Llama-3-8B MLP, METP 8,
512K tokens per rank: tile-outer 17,742 MiB, tile-inner 24,702, whole 35,110;
``docs/tiles.md``), tile-inner keeps the
``[N, h]`` fp32 accumulator of the forward and of ``dx`` (8 GiB at 512K rows, 12 GiB at 768K),
which alone is more than the 15 % of a 76 GiB rank the 6M-token job allows a layer's transient.

Tile size, first that applies:

* the op's ``token_tile`` argument (rows per tile, a positive integer; ``0`` = whole), e.g.
  from Megatron-LM's ``--metp-mlp-token-tile`` through the spec's ``mlp_token_tile`` and
  :class:`~megatron_metp.megatron.modules.METPMLP`;
* the override ``METP_MLP_TOKEN_TILE`` (same meaning; :mod:`megatron_metp.runtime.overrides`);
* auto: the most rows whose token-proportional transient stays within
  ``METP_TILE_BUDGET_MIB`` (default 1024 MiB); a rank with fewer rows runs whole (one tile:
  exactly the untiled kernels and launches).

Tiles are balanced (``T`` tiles of ``ceil(N/T)`` rows, the last shorter). Every rank of a group
must run the same number of tiles (each tile is one pass of the ring): the agreement check
compares it (``token_tiles``), and a rank whose tile count differs is refused before any transfer.
"""

from __future__ import annotations

from typing import List, Optional

from ..runtime import overrides
from .slices import tile_slices  # noqa: F401  (the tiles cut here; also ops.tiles.tile_slices)

#: rows per MLP tile (0 = whole); overridden by the op's ``token_tile`` argument
MLP_TOKEN_TILE_ENV = "METP_MLP_TOKEN_TILE"
#: the byte budget of one tile's token-proportional transient, MiB
TILE_BUDGET_ENV = "METP_TILE_BUDGET_MIB"
DEFAULT_TILE_BUDGET_MIB = 1024
_ROWS = overrides.OVERRIDES[MLP_TOKEN_TILE_ENV].unit  # "token rows per tile, 0 = whole"


def tile_budget_bytes() -> int:
    """The auto tile's budget: ``METP_TILE_BUDGET_MIB`` (a positive integer) or 1024 MiB."""
    mib = overrides.integer(TILE_BUDGET_ENV)
    return (DEFAULT_TILE_BUDGET_MIB if mib is None else mib) << 20


def mlp_row_bytes(h: int, ffn_shard: int, k: int, elem: int, acc_elem: int = 4,
                  keep_intermediate: bool = False) -> int:
    """Token-proportional bytes of one MLP ring step per token row (its largest, the backward):
    the ``dx`` accumulator (``acc_elem·h``), one shard's ``z`` (unless kept), ``f(z)``,
    ``g·W2_j``, ``dz`` and, for SwiGLU, its two halves (``elem`` bytes each)."""
    f = ffn_shard
    z = 0 if keep_intermediate else k * f
    halves = 2 * f if k == 2 else 0
    return acc_elem * h + elem * (z + f + f + halves + k * f)


def resolve_rows(token_tile, n_rows: int, row_bytes: int, env: str = MLP_TOKEN_TILE_ENV,
                 arg: str = "token_tile") -> int:
    """Rows per tile for ``n_rows`` token rows (``n_rows`` itself = whole, one tile): the
    argument ``token_tile``, else the override ``env``, else the budget
    (:func:`~megatron_metp.runtime.overrides.integer_setting`; ``0`` = whole)."""
    n_rows = int(n_rows)
    rows = overrides.integer_setting(token_tile, env, arg)
    if rows is None:
        rows = max(1, tile_budget_bytes() // max(1, int(row_bytes)))
    if rows == 0 or rows >= n_rows:
        return max(n_rows, 1)
    return rows


#: ``outer`` (default) or ``inner``: see the module docstring
TILE_ORDER_ENV = "METP_MLP_TILE_ORDER"
TILE_ORDERS = ("outer", "inner")


def tile_order() -> str:
    """``METP_MLP_TILE_ORDER`` (``outer``, the default, or ``inner``)."""
    return overrides.choice(TILE_ORDER_ENV)


def agreement_fields(count: int, order: str) -> dict:
    """What the agreement check compares about tiling: nothing for one tile (the untiled op's
    record is unchanged), else the tile count and order (each tile is one pass of the ring)."""
    return {} if count <= 1 else {"token_tiles": int(count), "tile_order": order}


# ---------------------------------------------------------------- the streaming layer's tiles

#: ``METP_LAYER_TOKEN_TILE``: tokens per tile of the streaming layer's row passes and query
#: tiles (``0`` = whole; else auto from the budget)
LAYER_TOKEN_TILE_ENV = "METP_LAYER_TOKEN_TILE"


class LayerTiles:
    """The tile sizes of one streaming METP layer (:mod:`.layer`) for ``n`` local tokens:

    * ``rows``: tokens per tile of the row passes (projection + residual + MLP, ``dx``);
    * ``q``: tokens per query tile of the attention (one K/V ring per tile);
    * ``kv``: key rows of every rank's K/V block on the ring at once in backward (the
      travelling K/V and fp32 ``dK/dV`` buffers' size; ``n`` = whole blocks);
    * ``keys``: keys per kernel call (whole by default: a full block takes GQA by folding the
      query heads into rows, :mod:`.attention_kernels`, so no call expands K/V; the causal
      pieces of a query tile are that tile's square).

    Auto (first that applies: the op's ``token_tile``, ``METP_LAYER_TOKEN_TILE``, else the
    budget ``METP_TILE_BUDGET_MIB``, 1 GiB): the row passes take the whole budget, the query
    tile and the K/V ring half of it each, from the bytes per token below (``e`` the element
    size, ``b`` the micro-batch, ``H·d`` one head group's query width, ``G·d`` its key width;
    the MLP's from :func:`mlp_row_bytes`; a query tile forms ``x`` and ``norm1(x)`` a row tile at
    a time)::

        row pass     b·(6·h·e + mlp_row_bytes)       x, O, h1, norm2(h1), d norm2, its input grad
        query tile   b·(7·H·d·e + 8·H·d)             q, O, dO, pre-norm q, d(qkv), the kernel's
                                                     q/O/dO copies; dq and a sub-block's (fp32)
        K/V ring     b·(4·G·d·e + 16·G·d)            own copy + held; two fp32 dK/dV sums

    ``mlp_token_tile`` (the spec's, from ``--metp-mlp-token-tile``; else
    ``METP_MLP_TOKEN_TILE``; rows = tokens × micro-batch) sets the row passes' tile, as it sets
    the separate MLP op's. A forced ``token_tile`` (or
    ``METP_LAYER_TOKEN_TILE``) sets ``rows`` and ``q`` (and leaves ``kv``/``keys`` whole), so the
    tests can cut tiny sequences; a dict sets each of the four."""

    def __init__(self, n: int, b: int, h: int, heads_dim: int, kv_dim: int, elem: int,
                 mlp_bytes: int, token_tile=None, mlp_token_tile: Optional[int] = None):
        if isinstance(token_tile, dict):  # every size given (tests): rows, q, kv, keys
            unknown = set(token_tile) - {"rows", "q", "kv", "keys"}
            if unknown:
                raise ValueError(f"token_tile as a dict takes rows, q, kv, keys; got {unknown}")
            for name in ("rows", "q", "kv", "keys"):
                v = overrides.parse_int(token_tile.get(name, 0), f"token_tile[{name!r}]",
                                        unit=_ROWS)
                setattr(self, name, n if v == 0 or v >= n else v)
            return
        forced = overrides.integer_setting(token_tile, LAYER_TOKEN_TILE_ENV, "token_tile")
        if forced is not None:
            whole = forced == 0 or forced >= n
            self.rows = self.q = n if whole else forced
            self.kv = self.keys = n
            return
        budget = tile_budget_bytes()
        per = lambda nbytes: max(1, int(nbytes))  # noqa: E731
        # --metp-mlp-token-tile (the spec's mlp_token_tile): rows of tokens × batch
        mlp_rows = overrides.integer_setting(mlp_token_tile, MLP_TOKEN_TILE_ENV, "mlp_token_tile")
        if mlp_rows is not None:
            self.rows = n if mlp_rows == 0 else min(n, max(1, -(-mlp_rows // b)))
        else:
            self.rows = min(n, max(1, budget // per(b * (6 * h * elem + mlp_bytes))))
        self.q = min(n, max(1, (budget // 2) // per(b * (7 * heads_dim * elem
                                                        + 8 * heads_dim))))
        self.kv = min(n, max(1, (budget // 2) // per(b * (4 * kv_dim * elem + 16 * kv_dim))))
        self.keys = n

    def row_tiles(self, n: int) -> List[slice]:
        return tile_slices(n, self.rows)

    def q_tiles(self, n: int, layout: str = "dual_chunk", causal: bool = True,
                packed: bool = False):
        """The op's query tiles (:func:`~megatron_metp.ops.balance.query_tiles`: each a tuple
        of row ranges; causal ``dual_chunk`` tiles take mirrored ranges of both chunks)."""
        from .balance import query_tiles

        return query_tiles(n, self.q, layout, causal, packed)

    def kv_blocks(self, n: int, layout: str = "dual_chunk", causal: bool = True,
                  packed: bool = False):
        """The backward's key sub-blocks (:func:`~megatron_metp.ops.balance.kv_blocks`)."""
        from .balance import kv_blocks

        return kv_blocks(n, self.kv, layout, causal, packed)

    def fields(self) -> dict:
        """What the agreement check compares (every rank must run the same passes)."""
        return {"layer_tiles": (int(self.rows), int(self.q), int(self.kv), int(self.keys))}
