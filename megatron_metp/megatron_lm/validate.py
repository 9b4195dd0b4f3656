"""``validate_metp_args``: refuse a command line METP cannot run, then map METP onto Megatron's
context-parallel dimension.

The patched ``megatron/training/arguments.py`` calls :func:`validate_metp_args` at the top of the
world-size arithmetic of ``validate_args``: every problem of :func:`.checks.metp_arg_problems` is
refused first (one ``ValueError``, ``args`` unchanged), then ``args`` is rewritten (context-parallel
size ``p·c``, the expert-parallel fold, the vocabulary padding, the flags METP honours by mapping
them onto its own), each change with a ``> METP:`` note printed on rank 0. With
``--metp-parallel-size 1`` Megatron's behaviour is unchanged.
"""

from __future__ import annotations

from .checks import metp_arg_problems
from .flags import CP_OUTER, MAPPED, VOCAB_BASE

__all__ = ["validate_metp_args"]


def validate_metp_args(args):
    """Map ``--metp-parallel-size p`` onto Megatron's context-parallel size; return ``args``.

    Called by the patched ``validate_args`` before Megatron computes the data-parallel size.
    Every problem of :func:`.checks.metp_arg_problems` is refused first, all in one ``ValueError``
    naming each flag to change (nothing in ``args`` changed). With ``p == 1`` (or no METP flags
    at all, e.g. another entry point) ``args`` is then returned untouched; with ``p > 1``
    ``args.context_parallel_size = p``. Calling it again on the same ``args`` is harmless.
    """
    from .releases import yarn_release_problem

    # YaRN's release check reads the installed Megatron-LM's parser output (inside the ranks only)
    from .ckpt_manifest import rank_checkpoint_problems  # the --load shards against their manifest

    problems = [x for x in (yarn_release_problem(args),) if x] + metp_arg_problems(args) + \
        rank_checkpoint_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    p = getattr(args, "metp_parallel_size", 1)
    from ..megatron.packing import apply_mock_document_length

    mock_note = apply_mock_document_length(args)
    if mock_note and getattr(args, "rank", 0) == 0:
        print(f"> METP: {mock_note}", flush=True)
    if p is None or p == 1:
        return args
    cp = args.context_parallel_size
    if getattr(args, MAPPED, False):
        cp = getattr(args, CP_OUTER, 1)  # mapped by an earlier call: Megatron's CP is p·c
    _map_kernel_flags(args)
    args.context_parallel_size = p * cp
    setattr(args, CP_OUTER, cp)
    setattr(args, MAPPED, True)
    from .moe_args import fold_expert_parallel

    moe_note = fold_expert_parallel(args, p)  # the TransformerConfig's EP must be p too
    if getattr(args, "rank", 0) == 0:
        cp_note = (f" x --context-parallel-size {cp} (the outer factor: the sequence over all "
                   f"{p * cp} ranks, weights over the {p} of each METP ring)") if cp > 1 else ""
        print(f"> METP: --metp-parallel-size {p}{cp_note} runs on Megatron's context-parallel "
              f"dimension (context-parallel size {p * cp}); expert groups are folded onto the "
              f"METP rings (whole METP rings with a wider --expert-model-parallel-size) in "
              f"parallel_state", flush=True)
        if moe_note:
            print(f"> METP: {moe_note}", flush=True)
    _fold_vocab_padding(args, p)
    return args


def _fold_vocab_padding(args, p: int) -> None:
    """Make Megatron pad the vocabulary to a multiple of ``divisible_by × TP × METP``.

    Megatron pads to ``--make-vocab-size-divisible-by × TP``; multiplying the first factor by
    ``p`` (once, however often this runs) pads as stock TP of size ``TP × METP`` does, so a METP
    run and its TP twin have the same embedding and output-layer shapes (and checkpoints), and
    with ``--metp-vocab-parallel`` every TP×METP rank the same number of rows.
    """
    base = getattr(args, VOCAB_BASE, None)
    if base is None:
        base = getattr(args, "make_vocab_size_divisible_by", 128) or 1
        setattr(args, VOCAB_BASE, base)
    args.make_vocab_size_divisible_by = base * p
    if getattr(args, "rank", 0) == 0:
        split = ("word embedding and output layer sharded over TP x METP"
                 if getattr(args, "metp_vocab_parallel", False) else
                 "as stock TP of size TP x METP pads it")
        print(f"> METP: vocabulary padded to a multiple of {base} x "
              f"{args.tensor_model_parallel_size} x {p} ({split})", flush=True)


def _map_kernel_flags(args) -> None:
    """Flags METP honours by mapping them onto its own, each with a printed note."""
    from ..megatron.packing import map_packing_flags

    notes = map_packing_flags(args)
    if getattr(args, "use_flash_attn", False) and \
            getattr(args, "metp_attention_kernel", "auto") == "auto":
        args.metp_attention_kernel = "flash_attn"
        notes.append("--use-flash-attn: the METP K/V ring's block kernel is flash-attn "
                     "(--metp-attention-kernel flash_attn)")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        from ..megatron.gpu_stack import select_norm

        notes.append(select_norm("transformer_engine",
                                 getattr(args, "normalization", "LayerNorm")).note
                     + "; the embedding, output layer and final norm are Megatron's and follow "
                       "the flag")
    if getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size == 1:
        notes.append("--sequence-parallel with TP 1: Megatron turns it off itself (METP shards "
                     "the sequence over the METP ring anyway)")
    if getattr(args, "rank", 0) == 0:
        for note in notes:
            print(f"> METP: {note}", flush=True)
