"""Embedding → mixing → output layer → cross-entropy cases: full weights and the single-device
reference the METP vocabulary ops are checked against.

The model of a case: ``x = E[tokens]`` (``[b, s, h]``), ``hidden = xᵀ·A`` (``[s, b, h]``, ``A``
replicated, so that gradients reach the embedding through something other than the identity),
``loss_i = CE(hidden_i·Wᵀ, label_i)`` over the padded vocabulary (Megatron's semantics: padding rows
take part in the softmax), and ``L = Σ_i mask_i·loss_i / Σ mask``. ``W = E`` when tied.
"""

from __future__ import annotations

import torch

from megatron_metp.ops import padded_vocab_size

VOCAB = 50  # not divisible by 3 or 4: exercises Megatron's padding


def full_vocab_case(s, b, h, p, *, tied=False, tp=1, vocab=VOCAB, divisible_by=2, seed=0,
                    dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    V = padded_vocab_size(vocab, divisible_by, tp, p)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    emb = rnd(V, h)
    case = {
        "V": V, "vocab": vocab,
        "tokens": torch.randint(0, vocab, (b, s), generator=gen),
        "labels": torch.randint(0, vocab, (b, s), generator=gen),
        "mask": (torch.rand(b, s, generator=gen) > 0.25).float(),
        "emb": emb,
        "mix": rnd(h, h, scale=h ** -0.5),
        "out": None if tied else rnd(V, h, scale=h ** -0.5),
    }
    return case


def smoothed_ce(logits, labels, smoothing):
    """Megatron's cross-entropy with label smoothing (``vocab_parallel_cross_entropy``'s form)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, labels[..., None]).squeeze(-1)
    if not smoothing:
        return nll
    V = logits.shape[-1]
    eps = smoothing * V / (V - 1)
    return (1 - eps) * nll - eps * logp.mean(-1)


def reference(case, smoothing=0.0, dtype=torch.float32):
    """Loss and gradients on one device from the full weights (computed in ``dtype``)."""
    emb = case["emb"].to(dtype).clone().requires_grad_()
    mix = case["mix"].to(dtype).clone().requires_grad_()
    out = emb if case["out"] is None else case["out"].to(dtype).clone().requires_grad_()
    x = emb[case["tokens"]]  # [b, s, h]
    hidden = (x.transpose(0, 1) @ mix)  # [s, b, h]
    hidden.retain_grad()
    logits = hidden @ out.t()  # [s, b, V]
    loss = smoothed_ce(logits, case["labels"].t(), smoothing).t()  # [b, s]
    total = (loss * case["mask"]).sum() / case["mask"].sum()
    total.backward()
    return {"loss": total.detach(), "per_token": loss.detach(), "demb": emb.grad,
            "dmix": mix.grad, "dout": None if case["out"] is None else out.grad,
            "dhidden": hidden.grad}
