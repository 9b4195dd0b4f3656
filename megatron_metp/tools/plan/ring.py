"""The K/V ring's buffers (``ops.ring_attention``), shared by the modes that run it: ``ring`` and
``cp`` (the ring core of stock Megatron layers) and ``metp`` (one head group at a time)."""

from __future__ import annotations

from typing import Dict

from .model import BF16, FP32


def ring_forward_buffers(n, hq, hk, A, p, job) -> Dict[str, float]:
    """Buffers of ``ops.ring_attention.ring_attention_forward`` at its largest step (rank 0's
    diagonal block): fp32 output and log-sum-exp accumulators, the K/V ring's packed and
    received blocks, and the block kernel's output with the merge's fp32 temporaries (flash), or
    the reference kernel's three fp32 score blocks (scores, minus lse, exp)."""
    b = job.micro_batch
    out = {"output accumulator (fp32)": FP32 * n * hq,
           "log-sum-exp accumulator (fp32)": FP32 * n * A}
    if p > 1:
        out["K/V ring: own packed + received block (bf16)"] = 2 * BF16 * 2 * n * hk
    if hk < hq:
        out["K/V expanded to the query heads (bf16)"] = 2 * BF16 * n * hq
    if job.kernel == "flash":
        out["block output (bf16) + lse (fp32)"] = BF16 * n * hq + FP32 * n * A
        out["merge: fp32 copy of the block output and its weighted copy"] = 2 * FP32 * n * hq
    else:
        out["reference kernel: scores, scores − lse, exp blocks (fp32)"] = \
            3 * FP32 * b * A * (n // b) ** 2
    return out


def ring_backward_buffers(n, hq, hk, A, p, job, off_diagonal_sums: int = 0) -> Dict[str, float]:
    """Buffers of ``ops.ring_attention.ring_attention_backward`` for ``n`` local tokens (``b``
    folded in) of ``hq``/``hk`` query/key widths and ``A`` heads, at its largest step on rank 0.

    Alive throughout: the fp32 ``dq`` accumulator; with ``p > 1`` this rank's packed K/V block
    and the block held (bf16), and the travelling dK/dV sum's buffers (fp32; the second one from
    the first hand-on). Rank 0's steps: first the block of rank ``p−1`` (dual-chunk: the second
    half of the queries against all keys, so the kernel gets contiguous copies of the query,
    output and output-gradient halves), then ``p−2`` … 1 (the same shape, both sum buffers
    alive), then its own diagonal block (all × all, causal, both buffers). GQA: the block kernel
    expands K/V to the query heads and folds dK/dV back. ``off_diagonal_sums``: the sum buffers
    alive at an off-diagonal step when the caller knows them (the METP attention op: both, at
    any ring size, as ``metp measure`` finds at METP 2: tests/test_partial_plan.py); by default
    the second one only past a ring of 2.
    """
    b = job.micro_batch
    gqa = hk < hq
    kv = 2 * n * hk
    ts = FP32 * kv
    base = {"dq accumulator (fp32)": FP32 * n * hq}
    if p > 1:
        base["K/V ring: own packed + held block (bf16)"] = 2 * BF16 * kv
    flash = job.kernel == "flash"

    def kernel(nq, nk, copies_q):
        if flash:
            d = {"block kernel dq, dk, dv (bf16)": BF16 * (nq * hq + 2 * nk * hq)}
            if copies_q:
                d["contiguous q, out, dout halves (bf16) + lse (fp32)"] = \
                    3 * BF16 * nq * hq + FP32 * nq * A
        else:
            blk = b * A * (nq // b) * (nk // b)
            d = {"reference kernel: scores, P, dP, dS blocks (fp32)": 4 * FP32 * blk,
                 "reference kernel: fp32 q, k, v, dout copies": FP32 * (2 * nq * hq + 2 * nk * hq),
                 "reference kernel: dv (fp32)": FP32 * nk * hq}
        if gqa:
            d["K/V expanded to the query heads, dK/dV folded (bf16)"] = \
                BF16 * (2 * nk * hq + 2 * nk * hk)
        return d

    steps = []
    diag = dict(base, **kernel(n, n, False))
    diag["dK/dV travelling sum (fp32)"] = (2 if p > 1 else 1) * ts
    steps.append(diag)
    if p > 1:
        off = dict(base, **kernel(n // 2, n, True))
        off["dK/dV travelling sum (fp32)"] = (off_diagonal_sums or (2 if p > 2 else 1)) * ts
        steps.append(off)
    return max(steps, key=lambda d_: sum(d_.values()))
