"""Property-based parity of the vocabulary ops: random geometries against the single-device
embedding → mixing → output layer → cross-entropy reference of ``tests/vocab_cases.py``.

Drawn per geometry: group size 1–4, vocabulary 2–40 padded Megatron's way (to a multiple of
``divisible_by·p``, ``divisible_by`` 1, 2 or 4, so padding rows exist or not), tokens per rank 1–4,
batch 1–3, hidden 1–12, tied or untied tables, label smoothing 0 or 0.1, a random loss mask (all
masked allowed), and (non-)contiguous hidden states. Loss, per-token loss, dX and every weight
gradient must be within ``1e-5`` of the reference (fp32). Budget and ``METP_FULL_PROPERTIES=1`` as
in ``tests/test_properties.py``: one Hypothesis example is a batch of geometries, one fork per group
size evaluates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from megatron_metp.ops import metp_embedding, metp_output_cross_entropy, padded_vocab_size
from tests.harness import run_ranks
from tests.numerics import rel_err
from tests.test_properties import FP32_TOL, _by_size, _group, _settings
from tests.vocab_cases import smoothed_ce


@dataclass(frozen=True)
class VocabCase:
    p: int
    vocab: int
    divisible_by: int
    n: int          # tokens per rank
    b: int
    h: int
    tied: bool
    smoothing: float
    noncontig: bool
    seed: int

    @property
    def V(self) -> int:
        return padded_vocab_size(self.vocab, self.divisible_by, 1, self.p)


def _full(c: VocabCase):
    gen = torch.Generator().manual_seed(c.seed)
    s = c.n * c.p
    emb = torch.randn(c.V, c.h, generator=gen)
    return {
        "tokens": torch.randint(0, c.vocab, (c.b, s), generator=gen),
        "labels": torch.randint(0, c.vocab, (c.b, s), generator=gen),
        "mask": (torch.rand(c.b, s, generator=gen) > 0.3).float(),
        "emb": emb, "mix": torch.randn(c.h, c.h, generator=gen) * c.h ** -0.5,
        "out": emb if c.tied else torch.randn(c.V, c.h, generator=gen) * c.h ** -0.5,
    }


def _reference(c: VocabCase):
    f = _full(c)
    emb = f["emb"].clone().requires_grad_()
    out = emb if c.tied else f["out"].clone().requires_grad_()
    mix = f["mix"].clone().requires_grad_()
    hidden = emb[f["tokens"]].transpose(0, 1) @ mix
    hidden.retain_grad()
    loss = smoothed_ce(hidden @ out.t(), f["labels"].t(), c.smoothing).t()
    ((loss * f["mask"]).sum() / f["mask"].sum().clamp_min(1)).backward()
    return {"per_token": loss.detach(), "dhidden": hidden.grad, "demb": emb.grad,
            "dout": None if c.tied else out.grad, "dmix": mix.grad}


def _metp_cases(rank, world, cases):
    g = _group(world, "vocab-properties")
    res = []
    for c in cases:
        f = _full(c)
        sl = slice(rank * c.n, (rank + 1) * c.n)
        v = c.V // c.p
        emb = f["emb"][rank * v:(rank + 1) * v].clone().requires_grad_()
        out = emb if c.tied else f["out"][rank * v:(rank + 1) * v].clone().requires_grad_()
        mix = f["mix"].clone().requires_grad_()
        x = metp_embedding(f["tokens"][:, sl], emb, group=g)
        hidden = x.transpose(0, 1) if c.noncontig else x.transpose(0, 1).contiguous()
        hidden = hidden @ mix
        hidden.retain_grad()
        loss = metp_output_cross_entropy(hidden, out, f["labels"][:, sl], group=g,
                                         label_smoothing=c.smoothing)
        ((loss * f["mask"][:, sl]).sum() / f["mask"].sum().clamp_min(1)).backward()
        res.append({"per_token": loss.detach(), "dhidden": hidden.grad, "demb": emb.grad,
                    "dout": None if c.tied else out.grad, "dmix": mix.grad})
    return res


@st.composite
def vocab_cases(draw):
    return [VocabCase(p=p, vocab=draw(st.integers(2, 40)), divisible_by=draw(st.sampled_from([1, 2, 4])),
                      n=draw(st.integers(1, 4)), b=draw(st.integers(1, 3)),
                      h=draw(st.integers(1, 12)), tied=draw(st.booleans()),
                      smoothing=draw(st.sampled_from([0.0, 0.1])), noncontig=draw(st.booleans()),
                      seed=draw(st.integers(0, 2 ** 16)))
            for p in (1, 2, 3, 4) for _ in range(2)]


@_settings(default=3, full=40)
@given(vocab_cases())
def test_vocab_ops_match_the_single_device_reference(cases):
    for p, batch in _by_size(cases).items():
        out = run_ranks(_metp_cases, p, batch, timeout=120)
        for i, c in enumerate(batch):
            ref = _reference(c)
            got = {"per_token": torch.cat([o[i]["per_token"] for o in out], dim=1),
                   "dhidden": torch.cat([o[i]["dhidden"] for o in out], dim=0),
                   "demb": torch.cat([o[i]["demb"] for o in out], dim=0),
                   "dmix": sum(o[i]["dmix"] for o in out)}
            if not c.tied:
                got["dout"] = torch.cat([o[i]["dout"] for o in out], dim=0)
            errs = {k: (rel_err(got[k], ref[k]) if ref[k].norm() > 0 else got[k].norm().item())
                    for k in got}
            assert max(errs.values()) <= FP32_TOL, (c, errs)
