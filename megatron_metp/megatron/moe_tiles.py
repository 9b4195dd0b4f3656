"""MoE token tiles: the routed part of Megatron's ``MoELayer`` over a rank's tokens in tiles.

Stock megatron-core's ``MoELayer`` routes, dispatches, runs the experts on and combines all
``N = s/(p·c)·b`` local tokens at once, and autograd keeps one layer's routed tokens for backward:
per token and per chosen expert (``k`` of them) the dispatched input and the expert output
(``[h]`` each), the expert's ``fc1`` output, the activation's input and output and the
probability-weighted intermediate (``[f′]``-sized, ``2f′`` for SwiGLU's gate and up), so
:func:`routed_transient_bytes` ``= N·k·e·(2h + (2m + 2)·f′)`` bytes (``e`` the element size,
``m = 2`` for a gated activation): ``N·k·(4h + 12f′)`` in bf16 with SwiGLU (Qwen3-30B-A3B,
``h = 2048``, ``f′ = 768``, ``k = 8``: 17 GiB per 131,072 tokens per rank). It grows with
``s/(p·c)`` whatever else is tiled.

:class:`TiledMoELayer` (Megatron's ``MoELayer``, same submodules, parameters, state dict and
checkpoints) runs it in ``T`` token tiles ``t`` of ``R = ceil(N/T)`` rows ::

    P, M   = router(X)                     X [N, h] -> probs P [N, E] (fp32), map M [N, E] bool
                                           once over all N tokens: the aux / sequence-aux / z
                                           losses see the whole sequence as stock
    Y[t]   = combine(experts(dispatch(X[t], P[t], M[t])))          for each tile t, [R, h]
    Y      = Y[t_1] ‖ … ‖ Y[t_T]                                   [N, h]

Forward runs the tiles without autograd and keeps only ``X`` (the ``pre_mlp_layernorm`` output
the router's gating keeps anyway), ``P`` and ``M`` (with the router's own saved tensors about
24 bytes per token and expert, which stock keeps too). Backward, given
``dY`` ``[N, h]``, re-runs one tile at a time with autograd (its dispatch, experts and combine:
the same collectives in the same order on every rank of the expert-parallel group) and takes ::

    dX[t], dP[t], dW_t = ∂(Y[t]·dY[t]) / ∂(X[t], P[t], W)          W: this rank's experts
    dW = Σ_t dW_t                                                   returned once, so Megatron's
                                                                    gradient hooks fire once
    dX += routerᵀ(dP)                                               (autograd, outside the tiles)

so only one tile's routed tensors, ``R·k·e·(2h + (2m+2)f′)`` bytes, are live at a time (plus the
dispatcher's buffers of one tile). One tile (``T = 1``) is exactly stock ``MoELayer.forward``.
Tiled equals untiled to the order of fp32 sums: the router, the per-token expert math and the
combine are row-wise, and every dropless dispatcher only permutes rows.

Tile count, first that applies: the ``moe_token_tiles`` of the layer (the spec's
:func:`tiled_moe_spec` argument, from Megatron-LM's ``--metp-moe-token-tiles``; tests set the
attribute); the override ``METP_MOE_TOKEN_TILES`` (``≥ 1``);
else auto, the fewest tiles whose routed transient stays within ``METP_TILE_BUDGET_MIB`` (1 GiB
by default, the dense tiles' budget, :mod:`megatron_metp.ops.tiles`): ``T = ceil(N / ⌊budget /
row⌋)``, one tile when the rank's tokens fit. ``T`` depends only on ``N`` (equal on every rank of a
METP / CP group) and the environment, so every rank of the expert-parallel group runs the same
number of dispatches; the agreement check (when on) compares it.

Under full recompute (:mod:`.streaming`: the dense layers run the streaming layer op, each MoE
layer Megatron's checkpoint of that one layer) the checkpoint re-runs this forward in the layer's
backward: the tiles keep only ``X, P, M`` there too, and the backward re-runs one tile at a time,
so no MoE transient of a recomputed layer grows with ``s/(p·c)`` beyond the ``[N, E]`` routing.
Measured (``tests/test_moe_tiles.py``, CPU fp32, 240 tokens, 3 tiles): stock keeps 197,800 bytes
for backward, the tiled forward 23,080 (the routing), one tile's re-run at most 59,840.

The fake-rank instruments (``metp measure``, the Megatron-LM dry run) run the tile loop
(:func:`routed_tiles`, forward and recompute, and the backward's re-run) through
:mod:`megatron_metp.runtime.loop_sample`: under ``--measure-tiles sampled`` only tiles ``1, 2``
and ``T`` run (every tile allocates the same shapes, the last one shorter), and the dispatch
and combine all-to-alls of tile 2 count ``T − 2`` times, so peak, stored bytes and traffic are the
full loop's (``tests/test_fast_dry.py``, 8 tiles); training never opens that sampling.

Not tiled (one tile, stock, whatever the count): inference with a captured CUDA graph
(``intermediate_tensors``). Refused with more than one tile (:func:`tile_problems`): padding the
expert input to capacity (per-tile capacities would differ from the whole's), MoE latent
projections, overlapping the dispatch backward with expert weight gradients (0.19).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..ops.moe_tile_count import (MOE_TOKEN_TILES_ENV, gated_activation, resolve_moe_tiles,
                                   routed_row_bytes, routed_transient_bytes)
from ..ops.tiles import tile_slices
from ..runtime import loop_sample
from ..runtime.overrides import parse_int

__all__ = ["MOE_TOKEN_TILES_ENV", "TiledMoELayer", "routed_row_bytes", "routed_transient_bytes",
           "resolve_moe_tiles", "tile_problems", "routed_tile", "routed_tiles", "tiled_moe_spec",
           "drop_dispatch_state"]


def tile_problems(config) -> List[str]:
    """What more than one MoE token tile cannot run with (each naming the option and the
    alternative; empty: tiles work)."""
    out = []
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        out.append("--moe-pad-expert-input-to-capacity pads each expert's input to a capacity "
                   "computed from the dispatched tokens, which differs per token tile; run "
                   "dropless or with one tile (METP_MOE_TOKEN_TILES=1)")
    if getattr(config, "moe_latent_size", None):
        out.append("--moe-latent-size: MoE latent projections are not tiled; use one tile "
                   "(METP_MOE_TOKEN_TILES=1)")
    if getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):
        out.append("overlap_dispatch_backward_with_experts_wgrad: the delayed expert weight "
                   "gradients assume one dispatch per layer; use one tile "
                   "(METP_MOE_TOKEN_TILES=1)")
    return out


def routed_tile(layer: MoELayer, hidden: torch.Tensor, probs: torch.Tensor,
                routing_map: torch.Tensor) -> torch.Tensor:
    """Dispatch → experts → combine of one tile through ``layer``'s own pieces.

    ``hidden`` ``[R, h]``, ``probs`` ``[R, E]``, ``routing_map`` ``[R, E]`` (bool) → ``[R, h]``
    (the routed output without shared experts). The token dispatcher keeps per-call state
    (shapes, splits, the tile's routing map) from ``preprocess`` to ``postprocess``: tiles run
    one after another, never interleaved."""
    x, p = layer.preprocess(hidden, probs, routing_map)
    x, p = layer.dispatch(x, p)
    out, bias = layer.routed_experts_compute(x, p)
    if bias is not None:
        raise ValueError("MoE token tiles: the experts returned a bias (not supported by "
                         "Megatron's dispatchers either)")
    out = layer.postprocess(layer.combine(out), None)
    drop_dispatch_state(layer.token_dispatcher)
    return out


def routed_tiles(layer: MoELayer, slices: Sequence[slice], hidden: torch.Tensor,
                 probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """``Y = ‖_t routed_tile(X[t], P[t], M[t])`` ``[N, h]``, each tile's ``[R, h]`` written into
    ``Y`` as it comes (one tile's output alive besides ``Y``, not all ``T`` before a concatenation).

    The tile loop goes through :func:`megatron_metp.runtime.loop_sample.tiles`: in training every
    tile runs; inside the fake instruments' ``loop_sample.sampling()`` only the first two and the
    last tile do (the rows of the skipped ones stay unwritten: fake tensors have no values), and
    the dispatch / combine collectives of a kept tile count for the tiles it stands for."""
    out = None
    for _, t in loop_sample.tiles(slices):
        y = routed_tile(layer, hidden[t], probs[t], routing_map[t])
        if out is None:
            out = y.new_empty((hidden.shape[0],) + tuple(y.shape[1:]))
        out[t].copy_(y)
        del y
    return out


#: the token dispatchers' per-call tensors that outlive the call (megatron-core 0.16.1 and
#: 0.19: alltoall ``probs`` [R, E], ``routing_map`` [R, E] bool, the permutation's indices
#: [R·k] int64; allgather ``local_map`` / ``local_probs``); autograd keeps what the backward needs
DISPATCH_STATE = ("probs", "routing_map", "reversed_local_input_permutation_mapping",
                  "local_map", "local_probs", "global_local_map")


def drop_dispatch_state(dispatcher) -> None:
    """Forget ``dispatcher``'s per-call routing tensors once its combine has run.

    Megatron's dispatchers keep them as attributes until the layer's next call. Under full
    recompute the next call is the layer's recompute in the backward, so every MoE layer would
    hold its routing — ``N·E·(e + 1) + 8·N·k`` bytes (``e`` the probabilities' element size;
    a tile's slice of ``P``/``M`` keeps the whole ``[N, E]`` storage alive) — for the whole
    forward and backward, 48 MiB per layer for Qwen3-30B-A3B at 131,072 tokens per rank."""
    for name in DISPATCH_STATE:
        if isinstance(getattr(dispatcher, name, None), torch.Tensor):
            setattr(dispatcher, name, None)


class _RoutedTiles(torch.autograd.Function):
    """``Y = ‖_t routed_tile(X[t], P[t], M[t])``; keeps ``X, P, M``; backward re-runs a tile at
    a time (module docstring). Inputs after ``M``: this rank's expert parameters."""

    @staticmethod
    def forward(ctx, layer, slices, hidden, probs, routing_map, *params):
        with torch.no_grad():
            out = routed_tiles(layer, slices, hidden, probs, routing_map)
        ctx.layer, ctx.slices = layer, slices
        ctx.save_for_backward(hidden, probs, routing_map, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, probs, routing_map, *params = ctx.saved_tensors
        layer, slices = ctx.layer, ctx.slices
        need_x, need_p = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[5 + i]]
        dx = torch.zeros_like(hidden) if need_x else None
        dp = torch.zeros_like(probs) if need_p else None
        dw: List[Optional[torch.Tensor]] = [None] * len(params)
        for _, t in loop_sample.tiles(slices):  # (the fake instruments: some)
            with torch.enable_grad():
                x = hidden[t].detach().requires_grad_(need_x)
                p = probs[t].detach().requires_grad_(need_p)
                y = routed_tile(layer, x, p, routing_map[t])
            inputs = ([x] if need_x else []) + ([p] if need_p else []) + [params[i] for i in want]
            if not inputs or not y.requires_grad:
                continue
            grads = list(torch.autograd.grad(y, inputs, grad_out[t], allow_unused=True))
            del y
            if need_x:
                g = grads.pop(0)
                if g is not None:
                    dx[t].copy_(g)
            if need_p:
                g = grads.pop(0)
                if g is not None:
                    dp[t].copy_(g)
            for i, g in zip(want, grads):
                if g is not None:
                    dw[i] = g if dw[i] is None else dw[i].add_(g)
            del grads
        for i in want:  # an expert no tile reached: a zero gradient, as stock's empty GEMM
            if dw[i] is None:
                dw[i] = torch.zeros_like(params[i])
        return (None, None, dx, dp, None, *dw)


def _expert_params(layer: MoELayer) -> Sequence[torch.nn.Parameter]:
    return [p for p in layer.experts.parameters() if p.requires_grad]


class TiledMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with its routed part in token tiles (module docstring).

    ``moe_token_tiles``: the tile count (keyword argument, from the spec's ``moe_token_tiles``;
    ``None``: ``METP_MOE_TOKEN_TILES`` or auto). After each forward ``last_tiles`` holds the
    count that ran."""

    moe_token_tiles: Optional[int] = None
    last_tiles: int = 0

    def __init__(self, *args, moe_token_tiles: Optional[int] = None, **kwargs):
        if moe_token_tiles is not None:  # refused before the layer is built
            parse_int(moe_token_tiles, "moe_token_tiles", minimum=1,
                      unit="token tiles per MoE layer, 1 = whole")
        super().__init__(*args, **kwargs)
        self.moe_token_tiles = moe_token_tiles

    def token_tiles(self, tokens: int, elem: int) -> int:
        """This layer's tile count for ``tokens`` local tokens of ``elem``-byte activations."""
        cfg = self.config
        row = routed_row_bytes(cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                               cfg.moe_router_topk, elem=elem,
                               gated=gated_activation(cfg))
        return resolve_moe_tiles(tokens, row, self.moe_token_tiles)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        h = hidden_states.shape[-1]
        tokens = hidden_states.numel() // h
        count = 1 if intermediate_tensors is not None else \
            self.token_tiles(tokens, hidden_states.element_size())
        self.last_tiles = count
        if count <= 1:
            out = super().forward(hidden_states, intermediate_tensors, padding_mask)
            if intermediate_tensors is None:  # (a captured CUDA graph reads its routing map)
                drop_dispatch_state(self.token_dispatcher)
            return out
        problems = tile_problems(self.config)
        if problems:
            raise ValueError(f"MoE token tiles ({count}): {problems[0]}")
        self._check_agreement(count)
        if padding_mask is not None:  # [b, s] -> [s, b] as stock does
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        x = hidden_states.reshape(tokens, h)
        slices = tile_slices(tokens, math.ceil(tokens / count))
        params = _expert_params(self)
        if torch.is_grad_enabled():
            out = _RoutedTiles.apply(self, slices, x, probs, routing_map, *params)
        else:
            out = routed_tiles(self, slices, x, probs, routing_map)
        out = out.view(hidden_states.shape[:-1] + out.shape[-1:])
        if shared is not None:
            out = out + shared
        return out, None

    def _check_agreement(self, count: int) -> None:
        from ..runtime.agree import agreement_checks_enabled, check_group_agrees
        from ..runtime.groups import as_metp_group

        group = getattr(self.token_dispatcher, "tp_ep_group", None)
        if group is None or not agreement_checks_enabled():
            return
        check_group_agrees(as_metp_group(group), f"MoE token tiles, layer {self.layer_number}",
                           moe_token_tiles=int(count))


def tiled_moe_spec(mlp_spec, moe_token_tiles: Optional[int] = None):
    """``mlp_spec`` (a MoE layer's ``TransformerLayerSubmodules.mlp``: a ``ModuleSpec`` in
    megatron-core 0.16, a ``functools.partial`` in 0.19) with :class:`TiledMoELayer` for
    ``MoELayer``, built with ``moe_token_tiles`` (``None``: the override, else auto); anything
    else is returned unchanged."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(mlp_spec, functools.partial):
        if isinstance(mlp_spec.func, type) and issubclass(mlp_spec.func, MoELayer):
            return functools.partial(TiledMoELayer, *mlp_spec.args, **mlp_spec.keywords,
                                     moe_token_tiles=moe_token_tiles)
        return mlp_spec
    if isinstance(mlp_spec, ModuleSpec) and isinstance(mlp_spec.module, type) and \
            issubclass(mlp_spec.module, MoELayer):
        return ModuleSpec(module=TiledMoELayer,
                          params={**(mlp_spec.params or {}), "moe_token_tiles": moe_token_tiles},
                          submodules=mlp_spec.submodules, metainfo=dict(mlp_spec.metainfo or {}))
    return mlp_spec
