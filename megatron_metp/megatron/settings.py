"""``METPSettings``: every choice that makes a model a METP model, in one frozen value.

A METP job is described three ways — Megatron-LM's ``args`` (``megatron_metp.megatron_lm``),
the training ``Layout`` of :mod:`.training`, a planner job (``megatron_metp.tools.plan``) — and
each is turned into one ``METPSettings`` where it is read, once. What the model *is* (sizes,
heads, experts) stays in megatron-core's ``TransformerConfig``; how METP runs it is here:

============================  =============================================================
``mode``                      ``"metp"`` (weight ring + K/V ring), ``"ring"`` (ring
                              self-attention baseline: sequence over the group, weights
                              replicated) or ``"tp"`` (stock Megatron: no METP module)
``metp``, ``context``         the METP size ``p`` and the outer context-parallel factor ``c``
``tp``, ``pp``                Megatron's tensor- and pipeline-parallel sizes
``kernel``                    the K/V ring's block kernel (``None``: chosen by the device,
                              :mod:`megatron_metp.ops.kernel_choice`)
``vocab_parallel``            embedding, output layer and loss sharded over TP × METP
``keep_intermediate``         the MLP keeps ``x·W1_j`` instead of recomputing it
``mlp_token_tile``            token rows per pass of the MLP's weight ring (``0`` whole,
                              ``None`` the override or the auto tile: :mod:`~..ops.tiles`)
``moe_token_tiles``           token tiles of each MoE layer (``None``: override or auto)
``offload_activations``       ``False``, ``True`` (every layer) or the first N layers of a stage
``offload_prefetch``          the offloader fetches the next layer ahead (``None``: its default)
``keep_attention_output``     under full recompute, layers keep their attention output and
                              LSE instead of re-running attention: ``None`` (off), ``True``
                              (every layer) or the first N layers of each pipeline stage
                              (:meth:`METPSettings.kept_attention_layers`)
``rope_recipe``               ``"exact"`` (this rank's angles, int64 positions) or
                              ``"megatron"`` (Megatron's fp32 table); stock TP is always Megatron's
``rope_recipe_source``        what chose Megatron's recipe, named when it is refused past 2^24
``transformer_impl``          ``"local"`` or ``"transformer_engine"`` (the METP layers' norms)
``packed``                    packed documents: boundaries derived from the EOD tokens
``packed_eod``                the EOD token id (``None``: Megatron-LM's tokenizer's)
``packed_layout``             ``"dual_chunk"`` or ``"balanced"`` (:mod:`.packing`)
``init_like_tp``              the sharded weights re-drawn as stock TP of size TP × METP draws
                              them (where the config initialises on the device); ``False`` keeps
                              megatron-core's own per-rank draws
============================  =============================================================

:meth:`METPSettings.problems` holds the rules of these choices once; the preflight, the ranks
(through ``megatron_metp.megatron_lm``) and the planner all ask it. ``names`` maps a field to
the flag a user set it with, so a refusal names what the user typed (Megatron-LM's flags by
default; the training ``Layout`` passes its field names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Union

MODES = ("metp", "ring", "tp")

#: the Megatron-LM flag of each field (what a refusal names by default)
MEGATRON_LM_FLAGS: Dict[str, str] = {
    "metp": "--metp-parallel-size", "context": "--context-parallel-size",
    "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
    "mode": "--metp-disable-weight-ring", "kernel": "--metp-attention-kernel",
    "vocab_parallel": "--metp-vocab-parallel", "keep_intermediate": "--metp-keep-intermediate",
    "mlp_token_tile": "--metp-mlp-token-tile", "moe_token_tiles": "--metp-moe-token-tiles",
    "offload_activations": "--metp-offload-activations",
    "offload_prefetch": "METP_OFFLOAD_PREFETCH", "rope_recipe": "--metp-rope-fp32-recipe",
    "keep_attention_output": "--metp-keep-attention-output",
    "full_recompute": "--recompute-granularity full",
    "transformer_impl": "--transformer-impl", "packed": "--reset-attention-mask",
    "packed_eod": "the tokenizer's EOD id", "packed_layout": "--metp-packed-layout",
}


def _names(names: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """Megatron-LM's flag of each field, with ``names`` (another source's) over them."""
    return {**MEGATRON_LM_FLAGS, **(names or {})}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_kept_attention_layers(n, layers: int, what: str) -> None:
    """``ValueError`` naming ``what`` unless ``n`` (``True`` or a count) layers of a pipeline
    stage of ``layers`` layers can keep their attention output: ``1 <= n <= layers``."""
    if n is True or n is None or n is False:
        return
    if not _is_int(n) or not 1 <= n <= layers:
        raise ValueError(f"{what}: {n!r} layers keep their attention output, but a pipeline "
                         f"stage has {layers} layers; give 1 to {layers} (or no N: every layer)")


@dataclass(frozen=True)
class METPSettings:
    """How METP runs a model (see the module docstring for each field)."""

    mode: str = "metp"
    metp: int = 1
    context: int = 1
    tp: int = 1
    pp: int = 1
    kernel: Optional[str] = None
    vocab_parallel: bool = False
    keep_intermediate: bool = False
    mlp_token_tile: Optional[int] = None
    moe_token_tiles: Optional[int] = None
    offload_activations: Union[bool, int] = False
    offload_prefetch: Optional[bool] = None
    keep_attention_output: Optional[int] = None  # None off, True every layer, N first N
    rope_recipe: str = "exact"
    rope_recipe_source: str = "--metp-rope-fp32-recipe or METP_ROPE_RECIPE=megatron"
    transformer_impl: str = "local"
    packed: bool = False
    packed_eod: Optional[int] = None
    packed_layout: str = "dual_chunk"
    init_like_tp: bool = True

    # ---------------------------------------------------------------- derived facts
    @property
    def weight_ring(self) -> bool:
        """The METP layers' weight ring is on (mode ``"metp"``)."""
        return self.mode == "metp"

    @property
    def sequence_sharded(self) -> bool:
        """The sequence is split over a ring (modes ``"metp"`` and ``"ring"``)."""
        return self.mode in ("metp", "ring")

    @property
    def ring_size(self) -> int:
        """Ranks of the K/V ring: ``p·c`` (Megatron's context-parallel size)."""
        return self.metp * self.context

    def kept_attention_layers(self, layers_per_stage: int) -> int:
        """How many layers of a pipeline stage of ``layers_per_stage`` keep their attention
        output (``keep_attention_output``: ``True`` every layer, ``N`` the first ``N``, at most
        the stage's; ``None`` 0)."""
        n = self.keep_attention_output
        if n is None or n is False:
            return 0
        return layers_per_stage if n is True else min(int(n), layers_per_stage)

    def replace(self, **changes) -> "METPSettings":
        """A copy with ``changes`` (the value itself is frozen)."""
        return dataclasses.replace(self, **changes)

    def spec_kwargs(self) -> Dict:
        """The keyword arguments every METP layer spec takes from the settings (its tiles
        included: :meth:`tile_kwargs`)."""
        return {"weight_ring": self.weight_ring, "kernel": self.kernel,
                "keep_intermediate": self.keep_intermediate, **self.tile_kwargs()}

    def tile_kwargs(self) -> Dict:
        """The token tiles the METP spec hands down to its ops (``None``: the override, else
        the auto tile)."""
        return {"mlp_token_tile": self.mlp_token_tile, "moe_token_tiles": self.moe_token_tiles}

    # ---------------------------------------------------------------------- rules
    def problems(self, *, world_size: Optional[int] = None, seq_length: Optional[int] = None,
                 num_experts: Optional[int] = None, sequence_parallel: bool = False,
                 full_recompute: Optional[bool] = None,
                 names: Optional[Mapping[str, str]] = None) -> List[str]:
        """Every reason these settings cannot run, each naming the flag (``names``: field →
        what the user set it with; Megatron-LM's flags by default) and the fix; ``[]`` when they
        can. ``world_size``, ``seq_length`` and ``sequence_parallel`` are the job's facts the
        layout arithmetic of a sequence-sharded mode needs (:func:`.parallel.metp_config_problems`;
        the experts' own divisibility is :mod:`.moe_checks`'), ``num_experts`` (``0``: a dense
        model) the MoE tiles', ``full_recompute`` (Megatron's ``recompute_granularity`` is
        ``'full'``) the kept attention's; ``None`` skips the rules that need them."""
        flag = _names(names)
        out: List[str] = []
        if self.mode not in MODES:
            return [f"{flag['mode']}: mode must be one of {MODES}, got {self.mode!r}"]
        for field in ("metp", "context", "tp", "pp"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                out.append(f"{flag[field]} must be >= 1, got {value!r}")
        if out:
            return out
        from ..ops.kernel_rates import KERNELS

        if self.kernel is not None and self.kernel not in KERNELS:
            out.append(f"{flag['kernel']} must be one of {('auto',) + tuple(KERNELS)}, got "
                       f"{self.kernel!r}")
        if self.vocab_parallel and self.mode == "tp":
            out.append(f"{flag['vocab_parallel']} needs {flag['metp']} > 1 (with METP off the "
                       f"vocabulary is Megatron's, split over TP only); drop the flag or set "
                       f"{flag['metp']}")
        if self.context > 1 and self.mode == "tp":
            out.append(f"{flag['context']}={self.context} (METP x CP, the outer factor) needs "
                       f"METP with the weight ring (mode='metp'), got {flag['mode']} "
                       f"{self.mode!r}; stock Megatron CP is Megatron's own context parallelism "
                       f"without METP")
        if self.context > 1 and self.mode == "ring":
            out.append(f"{flag['mode']} (ring self-attention) with {flag['context']} "
                       f"{self.context}: the ring baseline runs over the METP group only "
                       f"(METP x CP needs the weight ring, mode='metp'); drop {flag['context']} "
                       f"(or use stock {flag['context']} without METP)")
        out += self.tile_problems(num_experts=num_experts, names=flag)
        out += self._offload_problems(flag)
        out += self.keep_attention_problems(full_recompute=full_recompute, names=flag)
        from ..ops.rope_recipe import RECIPES

        if self.rope_recipe not in RECIPES:
            out.append(f"{flag['rope_recipe']}: the RoPE recipe must be one of {RECIPES}, got "
                       f"{self.rope_recipe!r}")
        from ..ops.layouts import PACKED_LAYOUTS

        if self.packed_layout not in PACKED_LAYOUTS:
            out.append(f"{flag['packed_layout']} must be one of {PACKED_LAYOUTS}, got "
                       f"{self.packed_layout!r}")
        if self.packed_eod is not None and (not _is_int(self.packed_eod) or self.packed_eod < 0):
            out.append(f"{flag['packed_eod']} must be a token id (an int >= 0) or None, got "
                       f"{self.packed_eod!r}")
        if self.sequence_sharded and (world_size is not None or seq_length is not None):
            from .parallel import metp_config_problems

            out += metp_config_problems(
                world_size=world_size if world_size is not None else
                self.tp * self.ring_size * self.pp,
                tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                metp_parallel_size=self.metp, context_parallel_size=self.context,
                seq_length=seq_length, sequence_parallel=sequence_parallel)
        return out

    def tile_problems(self, *, num_experts: Optional[int] = None,
                      names: Optional[Mapping[str, str]] = None) -> List[str]:
        """The token tiles' part of :meth:`problems` (the MLP tile needs the METP weight ring;
        the MoE tiles need experts and METP; their values)."""
        flag = _names(names)
        out = []
        rows = self.mlp_token_tile
        if rows is not None:
            if self.mode == "tp":
                out.append(f"{flag['mlp_token_tile']} tiles the METP MLP; it needs "
                           f"{flag['metp']} > 1 (drop the flag, or set METP)")
            elif self.mode == "ring":
                out.append(f"{flag['mlp_token_tile']} with {flag['mode']}: the ring "
                           f"self-attention baseline runs Megatron's own MLP, which has no "
                           f"token tiles; drop one of the flags")
            elif not _is_int(rows) or rows < 0:
                out.append(f"{flag['mlp_token_tile']} must be >= 0 (token rows per tile, 0 = "
                           f"whole), got {rows}")
        tiles = self.moe_token_tiles
        if tiles is not None:
            if num_experts is not None and not num_experts:
                out.append(f"{flag['moe_token_tiles']} tiles MoE layers; it needs "
                           f"--num-experts (drop the flag)")
            elif self.mode == "tp":
                out.append(f"{flag['moe_token_tiles']} tiles the METP spec's MoE layers; it "
                           f"needs {flag['metp']} > 1 (drop the flag, or set METP)")
            elif not _is_int(tiles) or tiles < 1:
                out.append(f"{flag['moe_token_tiles']} must be >= 1 (token tiles per MoE "
                           f"layer, 1 = whole), got {tiles!r}")
        return out

    def _offload_problems(self, flag) -> List[str]:
        n = self.offload_activations
        if not isinstance(n, (bool, int)) or (not isinstance(n, bool) and n < 1):
            return [f"{flag['offload_activations']} must be True (every layer), False or the "
                    f"layers per pipeline stage to offload (an int >= 1), got {n!r}"]
        p = self.offload_prefetch
        if p is not None and not isinstance(p, bool):
            return [f"{flag['offload_prefetch']} must be on or off, got {p!r}"]
        return []

    def keep_attention_problems(self, *, full_recompute: Optional[bool] = None,
                                names: Optional[Mapping[str, str]] = None) -> List[str]:
        """The kept attention's part of :meth:`problems`: its value, the METP weight ring (the
        METP attention op keeps ``O`` and the LSE) and full recompute (the layers it re-runs
        whole are the ones that keep; ``full_recompute=None``: not known here, not checked)."""
        flag = _names(names)
        n = self.keep_attention_output
        if n is None or n is False:
            return []
        keep = flag["keep_attention_output"]
        if not isinstance(n, (bool, int)) or (not isinstance(n, bool) and n < 1):
            return [f"{keep} must be on for every layer (True), off, or the layers per pipeline "
                    f"stage that keep it (an int >= 1), got {n!r}"]
        out = []
        if self.mode != "metp":
            out.append(f"{keep} keeps the METP attention's output; it needs METP with the weight "
                       f"ring ({flag['metp']} > 1"
                       + (f", without {flag['mode']}" if self.mode == "ring" else "")
                       + f"): drop {keep} or set METP")
        if full_recompute is False:
            out.append(f"{keep} keeps the attention output of a recomputed layer instead of "
                       f"running attention again, for the layers Megatron's full recompute "
                       f"re-runs whole (without it a layer keeps what its backward needs "
                       f"anyway): add {flag['full_recompute']} or drop {keep}")
        return out

    def check(self, **facts) -> "METPSettings":
        """Raise ``ValueError`` with every :meth:`problems` (joined by ``; ``); return self."""
        problems = self.problems(**facts)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def describe(self) -> str:
        """One line for logs: the mode, the sizes and the non-default choices."""
        name = {"metp": "METP (weight ring + K/V ring)", "ring": "ring self-attention",
                "tp": "stock Megatron"}[self.mode]
        parts = [f"{name}: METP size {self.metp}"]
        if self.context > 1:
            parts.append(f"context-parallel (outer) {self.context} (K/V ring over "
                         f"{self.ring_size} ranks)")
        parts.append(f"TP size {self.tp}")
        parts.append(f"attention kernel {self.kernel or 'auto'}")
        parts.append("vocabulary sharded over TP x METP" if self.vocab_parallel
                     else "vocabulary sharded over TP only")
        n = self.keep_attention_output
        if n is not None and n is not False:
            parts.append("attention output kept under full recompute ("
                         + ("every layer" if n is True else f"first {n} layers of a stage")
                         + ")")
        return ", ".join(parts)
