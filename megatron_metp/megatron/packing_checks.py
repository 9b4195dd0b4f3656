"""The Megatron-LM packing flags METP refuses, checked on a plain argument namespace.

Kept apart from :mod:`megatron_metp.megatron.packing` (which imports megatron-core) so that the
launcher's preflight (:mod:`megatron_metp.megatron_lm.preflight`) can run them in a second.
"""

from __future__ import annotations

from typing import List

__all__ = ["packing_problems", "mock_document_length_problems"]


def packing_problems(args) -> List[str]:
    """Megatron-LM packing flags METP refuses, each naming the flag and the fix (METP on)."""
    out = []

    def flag(name, default=None):
        return getattr(args, name, default)

    if flag("sft"):
        out.append("--sft (Megatron's SFT batches are packed THD sequences, split over the ring "
                   "by Transformer Engine's per-sequence CP partition, not METP's dual-chunk "
                   "layout; METP packs pre-training documents: drop --sft and use "
                   "--reset-attention-mask on EOD-separated data)")
    layout = flag("metp_packed_layout", "dual_chunk") or "dual_chunk"
    if layout != "dual_chunk" and not flag("reset_attention_mask"):
        out.append(f"--metp-packed-layout {layout} without --reset-attention-mask (it spreads "
                   f"the packed documents over the ring: add --reset-attention-mask or drop it)")
    if layout != "dual_chunk" and flag("metp_disable_weight_ring"):
        out.append(f"--metp-packed-layout {layout} with --metp-disable-weight-ring (the ring "
                   f"self-attention baseline applies RoPE in Megatron's dual-chunk order: drop "
                   f"one of them)")
    if (flag("eod_mask_loss") or flag("reset_attention_mask")) and \
            (flag("metp_parallel_size", 1) or 1) > 1 and not flag("calculate_per_token_loss"):
        given = "--eod-mask-loss" if flag("eod_mask_loss") else "--reset-attention-mask"
        out.append(f"{given} without --calculate-per-token-loss (the loss mask leaves EOD tokens "
                   f"out, so the METP ranks hold different token counts, and Megatron would "
                   f"average each rank's own mean over the ring: not the global mean stock TP "
                   f"computes; add --calculate-per-token-loss)")
    if flag("reset_attention_mask"):
        mbs = flag("micro_batch_size", 1) or 1
        if mbs > 1:
            out.append(f"--reset-attention-mask with --micro-batch-size {mbs} (METP's attention "
                       f"takes one set of document boundaries per micro-batch, and the samples "
                       f"of a micro-batch have different ones: pass --micro-batch-size 1 and "
                       f"raise --global-batch-size for more samples per step)")
        pp = flag("pipeline_model_parallel_size", 1) or 1
        if pp > 1:
            out.append(f"--reset-attention-mask with --pipeline-model-parallel-size {pp} (METP "
                       f"derives the document boundaries from the token ids, which Megatron "
                       f"gives only to the first pipeline stage: use "
                       f"--pipeline-model-parallel-size 1)")
    return out


def mock_document_length_problems(args) -> List[str]:
    """``--metp-mock-max-document-length N`` given where it cannot work (METP on or off)."""
    n = getattr(args, "metp_mock_max_document_length", None)
    if n is None:
        return []
    if n < 2:
        return [f"--metp-mock-max-document-length {n}: must be at least 2 (documents are drawn "
                f"with lengths in [1, N))"]
    if not getattr(args, "mock_data", False):
        return ["--metp-mock-max-document-length shapes Megatron's mock data only: add "
                "--mock-data or drop the flag"]
    return []
