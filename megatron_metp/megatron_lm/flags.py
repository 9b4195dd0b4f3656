"""The ``--metp-*`` flags of Megatron-LM's ``pretrain_gpt.py`` and the names METP sets on ``args``.

The patched ``pretrain_gpt.py`` registers the flags through
``extra_args_provider=compose_extra_args_providers(<modelopt's provider or None>, add_metp_args)``.
This module only parses: the rules a command line must keep are in :mod:`.checks`, the mapping of
METP onto Megatron's context-parallel dimension in :mod:`.validate`. It imports neither
``megatron.training`` nor megatron-core.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ..ops.kernel_rates import KERNELS

__all__ = ["ATTENTION_KERNELS", "MAPPED", "CP_OUTER", "VOCAB_BASE", "metp_enabled",
           "add_metp_args", "compose_extra_args_providers"]

#: choices of ``--metp-attention-kernel``; ``auto`` picks the fastest available at run time
ATTENTION_KERNELS = ("auto",) + KERNELS

#: set on ``args`` once :func:`.validate.validate_metp_args` has moved METP onto the
#: context-parallel dimension
MAPPED = "metp_context_parallel_mapped"
#: set on ``args``: ``--context-parallel-size`` as given with METP (the outer factor ``c`` of
#: METP × CP; Megatron's context-parallel size becomes ``p·c``)
CP_OUTER = "metp_context_parallel_outer"
#: set on ``args``: ``--make-vocab-size-divisible-by`` as given, before METP's factor
VOCAB_BASE = "metp_vocab_divisible_by_base"


def metp_enabled(args) -> bool:
    """Whether ``args`` ask for METP (``--metp-parallel-size`` > 1)."""
    return (getattr(args, "metp_parallel_size", 1) or 1) > 1


def add_metp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--metp-*`` argument group to Megatron's parser and return the parser."""
    group = parser.add_argument_group(
        title="METP (memory-efficient tensor parallelism)",
        description="Weights and sequence of every transformer layer sharded over one ring of "
                    "GPUs (megatron-metp). METP uses Megatron's context-parallel dimension.")
    group.add_argument(
        "--metp-parallel-size", type=int, default=1,
        help="Number of GPUs in a METP ring (p). Each rank holds 1/p of every linear weight of "
             "the transformer layers (on top of TP) and 1/p of the sequence; weight shards and "
             "K/V blocks travel around the ring. World size must be divisible by "
             "TP x METP x PP, --seq-length by 2 x METP. --context-parallel-size c is the outer "
             "factor (the sequence over p x c ranks). With --num-experts E the experts are "
             "sharded over the ring (expert-model-parallel size p, E divisible by p). Cannot be "
             "combined with --sequence-parallel (with TP > 1). 1 (default) disables METP.")
    group.add_argument(
        "--metp-disable-weight-ring", action="store_true",
        help="Ring self-attention baseline: keep the linear weights replicated over the METP "
             "group (sharded by TP only) and ring only K/V blocks in attention.")
    group.add_argument(
        "--metp-attention-kernel", choices=ATTENTION_KERNELS, default="auto",
        help="Block attention kernel of the K/V ring: cudnn (torch's SDPA cuDNN ops, GPU), "
             "flash_attn_3 (FlashAttention-3, Hopper, installed), flash_attn (FlashAttention-2, "
             "installed), torch_flash (PyTorch's fused flash kernel), reference (plain PyTorch, "
             "stores one score block). auto (default) picks the fastest available by the "
             "published rates (megatron_metp/ops/kernel_rates.py; $METP_KERNEL_RATES: a "
             "measured file), else the first available in that order, or "
             "$METP_ATTENTION_KERNEL; the choice is logged once ([METP] attention kernel: ...).")
    group.add_argument(
        "--metp-keep-intermediate", action="store_true",
        help="Keep each MLP weight shard's intermediate f(x W1_j) for backward instead of "
             "recomputing it (faster, more activation memory).")
    group.add_argument(
        "--metp-vocab-parallel", action="store_true",
        help="Shard the word embedding and the output layer by vocabulary over TP x METP too, "
             "and compute the loss with the output-layer shards on the ring (online "
             "log-sum-exp): no rank holds a whole table or full-vocabulary logits. Megatron "
             "pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP x METP.")
    group.add_argument(
        "--metp-offload-activations", nargs="?", const=True, default=False, metavar="N",
        type=_offload_layers_arg,
        help="Copy what the transformer layers keep for backward to pinned host memory as each "
             "layer finishes its forward (side CUDA stream) and bring layer l-1's back while "
             "layer l runs its backward: the GPU holds two layers' saved tensors (with "
             "--recompute-granularity full: two layer inputs), the host the rest. N: offload "
             "only the first N layers of each pipeline stage and keep the last ones on the GPU "
             "(when the node's host memory cannot hold every layer; metp plan says how many it "
             "holds); no N: every layer. Works with and without METP; replaces Megatron's "
             "--cpu-offloading, which cannot be combined with recompute.")
    group.add_argument(
        "--metp-keep-attention-output", nargs="?", const=True, default=None, metavar="N",
        type=_keep_layers_arg,
        help="With --recompute-granularity full: each METP layer keeps its attention output O "
             "(activation dtype, the size of the layer input) and its fp32 log-sum-exp for the "
             "backward, on the host where --metp-offload-activations sends the layer's input, "
             "else on the GPU; the backward re-forms Q, K, V from the layer input and runs the "
             "attention backward from them without running the attention forward (the K/V "
             "ring) again. N: only the first N layers of each pipeline stage keep it; no N: "
             "every layer.")
    group.add_argument(
        "--metp-packed-layout", choices=("dual_chunk", "balanced"), default="dual_chunk",
        help="With --reset-attention-mask: how the packed documents' tokens are spread over the "
             "METP ring. dual_chunk (default): Megatron's CP split of the whole sequence. "
             "balanced: documents of at least 2 x METP x 128 tokens are dual-chunked over the "
             "ring on their own, the rest together, so every rank gets the same attention work "
             "(the model's token inputs move there with one all-gather per micro-batch, the "
             "per-token loss comes back).")
    group.add_argument(
        "--metp-mock-max-document-length", type=int, default=None, metavar="N",
        help="With --mock-data: Megatron's mock dataset draws its document lengths (each "
             "document ends with an EOD token) uniformly from [1, N) instead of [1, 4096), so "
             "that short sequences hold several documents (tests and demos of "
             "--reset-attention-mask / --eod-mask-loss). Works with METP on or off.")
    group.add_argument(
        "--metp-ring-timeout", type=float, default=None, metavar="SECONDS",
        help="Seconds a ring step (and each of Megatron-LM's barriers) waits for its peer "
             "before failing with a message naming the group, step and peer (the stalled rank "
             "and where it was last seen) (default: $METP_RING_TIMEOUT_S, else "
             "--distributed-timeout-minutes x 60, the one timeout of every process group; a "
             "longer value is refused).")
    group.add_argument(
        "--metp-rope-fp32-recipe", action="store_true",
        help="METP and the ring baseline keep Megatron's fp32 RoPE angles (fp32 positions times "
             "fp32 inv_freq: bit-compatible with a stock run) instead of exact ones (positions "
             "as int64, the angle reduced mod 2 pi before one fp32 rounding, for this rank's "
             "tokens only). Also $METP_ROPE_RECIPE=megatron. Refused when positions reach 2^24 "
             "(--seq-length > 16,777,216), where fp32 positions collide.")
    add_tile_args(group)
    from .yarn_args import offer_yarn_choice

    offer_yarn_choice(parser)  # core_v0.16.1: refused naming the release (yarn_args)
    return parser


def _offload_layers_arg(raw: str) -> int:
    """``--metp-offload-activations N``: a positive count (checked against the layers of a
    pipeline stage by :func:`.checks.check_offload_layers_args`)."""
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(
            f"N must be a positive number of layers per pipeline stage, got {raw!r}; give no N "
            f"to offload every layer")
    return int(raw)


def _keep_layers_arg(raw: str) -> int:
    """``--metp-keep-attention-output N``: a positive count (checked against the layers of a
    pipeline stage by :func:`.checks.check_keep_layers_args`)."""
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(
            f"N must be a positive number of layers per pipeline stage, got {raw!r}; give no N "
            f"to keep the attention output of every layer")
    return int(raw)


def compose_extra_args_providers(*providers: Optional[Callable]) -> Callable:
    """One ``extra_args_provider`` that runs each given provider in order (``None`` skipped).

    Megatron's ``parse_args`` accepts a single provider; ``pretrain_gpt.py`` already passes
    modelopt's ``add_modelopt_args`` when nvidia-modelopt is installed. Each provider receives
    the parser and must return it.
    """
    active = [p for p in providers if p is not None]
    for p in active:
        if not callable(p):
            raise TypeError(f"extra_args_provider {p!r} is not callable")

    def extra_args_provider(parser):
        for p in active:
            returned = p(parser)
            if returned is None:
                raise TypeError(f"extra_args_provider {getattr(p, '__name__', p)!r} returned "
                                f"None; a provider must return the parser it was given")
            parser = returned
        return parser

    extra_args_provider.providers = tuple(active)
    return extra_args_provider


def add_tile_args(group) -> None:
    group.add_argument(
        "--metp-mlp-token-tile", type=int, default=None, metavar="ROWS",
        help="Token rows (of this rank's s/p x micro-batch) per pass of the METP MLP's weight "
             "ring: the MLP's fp32 accumulators and one shard's intermediates are [ROWS, .] "
             "instead of [s/p, .], the weight ring goes round once per tile. 0: whole. "
             "Default: $METP_MLP_TOKEN_TILE, else auto (the most rows within "
             "$METP_TILE_BUDGET_MIB, 1024 MiB, of token-proportional transient; whole when "
             "the rank's tokens fit).")
    group.add_argument(
        "--metp-moe-token-tiles", type=int, default=None, metavar="TILES",
        help="Token tiles of every MoE layer's routed part (dispatch, experts, combine; the "
             "router runs once over all local tokens): only one tile's routed tokens are kept "
             "for backward. 1: whole. Default: $METP_MOE_TOKEN_TILES, else auto (the fewest "
             "tiles whose routed tokens fit $METP_TILE_BUDGET_MIB, 1024 MiB; one when they "
             "fit).")
