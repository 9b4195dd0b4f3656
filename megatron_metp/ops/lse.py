"""Numerically stable merge of partial attention results by their log-sum-exp.

Two blocks of keys give, for the same query rows, normalised outputs ``o_a, o_b`` and log-sum-exps
``l_a, l_b``. The attention over both is ``o = w_a·o_a + w_b·o_b`` with ``l = log(e^{l_a} + e^{l_b})``
and ``w_x = e^{l_x − l}``. Computing ``l`` with ``logaddexp`` (``max + log1p(exp(−|l_a − l_b|))``)
never exponentiates a large number, so nothing overflows in any dtype; the accumulators are fp32.
(Summing raw ``Σ exp(score)`` per block, as an unstabilised merge does, overflows fp16 once a score
passes ~11 and fp32 past ~88.)
"""

from __future__ import annotations

import torch


def new_accumulators(q_shape, device):
    """``(out_acc, lse_acc)`` for query rows ``q_shape = [b, h, n, d]``: zeros and ``−inf``, fp32."""
    b, h, n, d = q_shape
    return (torch.zeros(b, h, n, d, dtype=torch.float32, device=device),
            torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=device))


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> None:
    """In place: fold block ``(out_b [b,h,n,d], lse_b [b,h,n])`` into the fp32 accumulators."""
    lse_b = lse_b.float()
    new = torch.logaddexp(lse_acc, lse_b)
    shift = new.masked_fill(new == float("-inf"), 0.0)  # rows no key reached yet stay 0, not NaN
    w_acc = torch.exp(lse_acc - shift).unsqueeze(-1)
    w_b = torch.exp(lse_b - shift).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out_b.float() * w_b)
    lse_acc.copy_(new)
