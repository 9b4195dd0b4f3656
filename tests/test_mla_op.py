"""METP multi-latent attention (``metp_mla_attention``) against a single-device reference MLA
from the same full weights (``tests/mla_cases.py``, fp64 from the equations): output, the input's
and every weight's gradient within 1e-5 (fp32) at METP 2 and 3, with negative controls, and the
ring counters: the K/V ring moves ``kv_lora_rank + qk_pos_emb_head_dim`` values per token per
step, not the heads' K/V."""

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import metp_mla_attention, shard_sequence, unshard_sequence
from megatron_metp.ops import documents, mla_ring
from megatron_metp.ops.documents import shard_documents, unshard_documents
from megatron_metp.runtime.context import attach_context_group
from tests.harness import run_ranks
from tests.mla_cases import (REPLICATED, SHARDED, MLACase, full_params, reference_mla,
                             shard_weights)
from tests.mla_stock import stock_mla
from tests.numerics import rel_err

#: DeepSeek-V3's latent width (kv_lora_rank 512 + rope 64) and head dims, 2 heads per rank
V3_LATENT = MLACase(heads=4, kvr=512, dn=128, dr=64, dv=128, ql=None, s=4, b=1, h=16,
                    kernel="reference", bias=False, seed=3)
#: the same with one latent ring for every head (head_block = p = 2)
V3_ONE_RING = dataclasses.replace(V3_LATENT, kb=2)
CASES = {
    2: [(MLACase(heads=4, kvr=8, dn=6, dr=4, dv=4, ql=12), None),  # flash kernel, v padded
        (MLACase(heads=2, kvr=6, dn=4, dr=2, dv=6, ql=None, layout="contiguous",
                 kernel="reference", mscale=1.25, scale=0.3, bias=False, seed=1), None),  # YaRN
        (V3_LATENT, None), (V3_ONE_RING, None),
        (MLACase(heads=4, kvr=8, dn=6, dr=4, dv=4, ql=12, s=16, cu=(0, 3, 9, 16), seed=10),
         None),  # packed documents, masked pieces
        (MLACase(heads=2, kvr=6, dn=4, dr=2, dv=6, ql=None, s=16, layout="balanced",
                 kernel="reference", cu=(0, 9, 16), seed=11), None)],
    3: [(MLACase(heads=6, kvr=8, dn=4, dr=4, dv=2, ql=10, seed=2), None),
        (MLACase(heads=3, kvr=5, dn=6, dr=2, dv=6, ql=None, kernel="reference", mscale=1.1,
                 seed=4), None),
        (MLACase(heads=6, kvr=8, dn=4, dr=4, dv=2, ql=10, seed=2), "stale"),
        (MLACase(heads=6, kvr=8, dn=4, dr=4, dv=2, ql=10, seed=9, kb=3), None),  # one ring
        (MLACase(heads=3, kvr=8, dn=4, dr=4, dv=2, ql=None, s=18, layout="contiguous",
                 cu=(0, 2, 7, 18), seed=12), None)],  # packed: the forward ring stops early
    (2, 4): [(MLACase(heads=4, kvr=8, dn=6, dr=4, dv=4, ql=12, s=16, seed=5), None),
             (MLACase(heads=2, kvr=6, dn=4, dr=2, dv=6, ql=None, s=16, kernel="reference",
                      seed=6), None),
             (MLACase(heads=4, kvr=8, dn=6, dr=4, dv=4, ql=12, s=16, seed=5), "no_context")],
}


class _StaleRing(mla_ring.RingExchanger):
    """Negative control: from step 2 on, the forward hands out the previous step's latent
    block again (a block at the wrong ring step)."""

    def circulate(self, payload, **kw):
        prev = None
        for t, buf in super().circulate(payload, **kw):
            yield t, (prev if t >= 2 else buf)
            prev = buf.clone()


@contextlib.contextmanager
def _chunks(case):
    """``balanced`` with own chunks from 1 token at these tiny lengths (every document of at
    least ``2p`` tokens dual-chunked on its own), on the ranks and where the parts are joined."""
    before = documents.set_balanced_min_chunk(1) if case.layout == "balanced" else None
    try:
        yield
    finally:
        if before is not None:
            documents.set_balanced_min_chunk(before)


def _shard(t, case, rank, world):
    if case.cu is None:
        return shard_sequence(t, rank, world, layout=case.layout)
    return shard_documents(t, case.cu, rank, world, layout=case.layout)


def _rank(rank, world, p, cases):
    """METP groups of ``p`` ranks; with ``world = p·c > p`` inside one context group of all
    ranks (METP × CP: the sequence split over all ``world`` ranks, the weights over ``p``)."""
    if p == world:
        grp = METPGroup.from_process_group(dist.group.WORLD, name="mla")
    else:
        metp = [dist.new_group(list(range(o, o + p))) for o in range(0, world, p)]
        grp = METPGroup.from_process_group(metp[rank // p], name=f"mla{rank // p}")
        attach_context_group(grp, dist.new_group(list(range(world))))
    out = []
    for case, variant, *angles in cases:
        with _chunks(case):
            out.append(_one(rank, world, p, grp, case, variant, angles))
    return out


def _one(rank, world, p, grp, case, variant, angles):
    """One case on this rank: the op's output, the gradients and the ring counters."""
    full = full_params(case)
    if angles:  # stock's RoPE (YaRN's scaled inv_freq) as the project's exact angles
        full["rotary_pos_emb"] = angles[0]
    w = {k: v.clone().requires_grad_() for k, v in shard_weights(full, case, rank % p, p).items()}
    x = _shard(full["x"], case, rank, world).clone().requires_grad_()
    freqs, seq = full["rotary_pos_emb"], None
    if variant == "no_context":  # the latent ring inside the METP group only
        freqs, seq = shard_sequence(freqs, rank, world, layout=case.layout), grp
    ring = mla_ring.RingExchanger
    mla_ring.RingExchanger = _StaleRing if variant == "stale" else ring
    grp.stats.reset()
    try:
        y = metp_mla_attention(x, **w, group=grp, num_heads=case.heads, kv_lora_rank=case.kvr,
                               qk_head_dim=case.dn, qk_pos_emb_head_dim=case.dr,
                               v_head_dim=case.dv, q_lora_rank=case.ql,
                               rotary_pos_emb=freqs, layout=case.layout, context_group=seq,
                               kernel=case.kernel, softmax_scale=case.scale,
                               rope_mscale=case.mscale, head_block=case.kb, cu_seqlens=case.cu)
        fwd = grp.stats.snapshot()
        y.backward(_shard(full["gy"], case, rank, world))
    finally:
        mla_ring.RingExchanger = ring
    return {"y": y.detach(), "dx": x.grad, "fwd": fwd, "total": grp.stats.snapshot(),
            **{"d" + k: v.grad for k, v in w.items()}}


@functools.lru_cache(maxsize=None)
def _run(p, world=None):
    return run_ranks(_rank, world or p, p, CASES[(p, world) if world else p])


def _errors(out, i, case, ref, p=None):
    rs = [o[i] for o in out]
    p = p or len(rs)
    with _chunks(case):
        got = {k: unshard_documents([r[k] for r in rs], case.cu, layout=case.layout)
               if case.cu else unshard_sequence([r[k] for r in rs], layout=case.layout)
               for k in ("y", "dx")}
    for name, dim in SHARDED.items():  # a shard's gradient: summed over the c METP groups
        got["d" + name] = torch.cat([sum(r["d" + name] for r in rs[g::p]) for g in range(p)],
                                    dim=dim)
    for name in REPLICATED:  # token partials: the caller's DDP sums them over the group
        if "d" + name in rs[0]:
            got["d" + name] = sum(r["d" + name] for r in rs)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    return {k: rel_err(got[k], ref[k]) for k in got}


def _check_parity(p, world=None):
    out = _run(p, world)
    for i, (case, variant) in enumerate(CASES[(p, world) if world else p]):
        errs = _errors(out, i, case, reference_mla(full_params(case), case), p)
        if variant is None:
            assert max(errs.values()) <= 1e-5, (p, case, errs)
        else:  # the negative control: the same check sees it
            assert errs["y"] > 1e-2, (p, case, variant, errs)


def test_mla_matches_reference_p2():
    _check_parity(2)


def test_mla_matches_reference_p3_and_stale_block_is_caught():
    _check_parity(3)
    # packed (0, 2, 7, 18) over 3 contiguous blocks: no rank needs the block two steps back, so
    # the forward latent ring stops after 2 steps: 1 exchange per head group
    case = CASES[3][-1][0]
    assert case.cu == (0, 2, 7, 18) and documents.forward_steps(case.cu, 6, 3, case.layout) == 2
    for rank in _run(3):
        assert rank[-1]["fwd"]["bytes_sent"] == 3 * 1 * 6 * case.b * (case.kvr + case.dr) * 4


def test_mla_metp2_x_cp2_matches_reference_and_needs_the_context_ring():
    """METP 2 × CP 2: the latent ring over all 4 ranks, weights over 2; negative control: the
    same sharding with the ring inside each METP group (its tokens taken for the whole
    sequence)."""
    _check_parity(2, 4)


def test_reference_check_catches_an_unrotated_rope_key():
    """Negative control of the check itself: MLA whose shared RoPE key is not rotated differs
    from the op's result by far more than the bound."""
    case = CASES[2][0][0]
    out = _run(2)
    errs = _errors(out, 0, case, reference_mla(full_params(case), case, rotate_key=False))
    assert errs["y"] > 1e-2 and errs["dkv_down_weight"] > 1e-2, errs


def test_reference_check_catches_attention_across_documents():
    """Negative control for the packed cases: the same output against MLA over the whole
    sequence (document boundaries ignored) is far outside the bound."""
    out = _run(2)
    for i, (case, _) in enumerate(CASES[2]):
        if case.cu is not None:
            whole = dataclasses.replace(case, cu=None)
            errs = _errors(out, i, case, reference_mla(full_params(case), whole))
            assert errs["y"] > 1e-2, (case, errs)


def test_latent_ring_moves_the_latent_not_the_heads_kv():
    """Counters (bytes sent per rank) of the V3-width case at p = 2: forward = p head groups ×
    (p−1) ring steps × tokens × (kv_lora_rank + rope) fp32 values, nothing else sent (weight
    broadcasts count as received); backward adds the same latent steps, as many fp32 dL
    steps and the fp32 weight-gradient reduces to the owners."""
    p, case = 2, V3_LATENT
    i = [c for c, _ in CASES[p]].index(case)
    out = _run(p)
    tokens = case.s // p * case.b
    C = case.kvr + case.dr
    H = case.heads // p
    heads_kv = H * (case.dn + case.dr + case.dv)  # one head group's K and V per token
    flat = (H * (case.dn + case.dr) * case.h + H * (case.dn + case.dv) * case.kvr
            + case.h * H * case.dv)
    for o in (rank[i] for rank in out):
        fwd = o["fwd"]["bytes_sent"]
        per_token_step = fwd / (p * (p - 1) * tokens * 4)
        assert per_token_step == C == 576, per_token_step
        assert per_token_step < heads_kv  # 576 vs 2 heads × 320 here; V3: 128 × 320 = 40,960
        bwd = o["total"]["bytes_sent"] - fwd
        assert bwd == p * (p - 1) * tokens * C * 4 * 2 + (p - 1) * flat * 4, bwd


#: (case, YaRN fields of MLATransformerConfig): heads divisible by 2 and 3
STOCK_CASES = [(MLACase(heads=6, kvr=8, dn=4, dr=4, dv=2, ql=10, seed=7), {}),
               (MLACase(heads=6, kvr=6, dn=4, dr=4, dv=6, ql=None, kernel="reference",
                        bias=False, seed=8),
                dict(rotary_scaling_factor=4.0, original_max_position_embeddings=4, mscale=1.0,
                     mscale_all_dim=0.8))]


def test_mla_matches_stock_megatron_core_mla_at_metp_2_and_3():
    """Single-rank stock megatron-core ``MLASelfAttention`` (local spec; q/kv down- and
    up-projections, both RMSNorms, DeepSeek RoPE and YaRN with mscale as stock builds them;
    tests/mla_stock.py) against METP 2 and 3 with the same full weights: output, input and every
    weight's gradient within 1e-5, plain RoPE and YaRN (cos/sin factor ≠ 1, softmax scale with
    mscale²). The fp64 reference of the other tests agrees with stock too."""
    stock = stock_mla([(case, full_params(case), yarn) for case, yarn in STOCK_CASES])
    cases = [(dataclasses.replace(case, scale=st["softmax_scale"], mscale=st["rope_mscale"]),
              None, st["exact_angles"]) for (case, _), st in zip(STOCK_CASES, stock)]
    assert stock[1]["rope_mscale"] > 1.01 and cases[1][0].scale > 1.2 / (8 ** 0.5)  # YaRN is on
    for i, (case, _, angles) in enumerate(cases):
        full = dict(full_params(case), rotary_pos_emb=angles)
        ref = {k: stock[i][k] for k in reference_mla(full, case)}
        errs = {k: rel_err(reference_mla(full, case)[k], ref[k]) for k in ref}
        assert max(errs.values()) <= 1e-5, ("reference vs stock", case, errs)
    for p in (2, 3):
        out = run_ranks(_rank, p, p, cases)
        for i, (case, _, _) in enumerate(cases):
            ref = {k: v for k, v in stock[i].items() if k == "y" or k.startswith("d")}
            errs = _errors(out, i, case, ref, p)
            assert max(errs.values()) <= 1e-5, (p, case, errs)


def test_one_latent_ring_for_every_head_with_head_block_p():
    """``head_block = p``: the up-/output-projection shards are all-gathered once and one latent
    ring serves every head: forward sends (p−1) latent steps of 576 values per token in all
    (against p·(p−1) with one ring per head group) plus the all-gather's (p−1) shards; the
    result equals the reference (test_mla_matches_reference_p2) and the per-group run's."""
    p, case = 2, V3_ONE_RING
    i = [c for c, _ in CASES[p]].index(case)
    tokens = case.s // p * case.b
    H = case.heads // p
    shards = (H * (case.dn + case.dr) * case.h + H * (case.dn + case.dv) * case.kvr
              + case.h * H * case.dv)
    per_group = _run(p)[0][[c for c, _ in CASES[p]].index(V3_LATENT)]
    for o in (rank[i] for rank in _run(p)):
        latent = o["fwd"]["bytes_sent"] - (p - 1) * shards * 4
        assert latent == (p - 1) * tokens * (case.kvr + case.dr) * 4, o["fwd"]
        assert latent * p == per_group["fwd"]["bytes_sent"]  # the per-group rings send p times more


def test_bad_arguments_are_refused_by_name():
    """p = 1 in this process: each wrong argument gives a ValueError naming it and the fix."""
    case = MLACase(heads=2, kvr=4, dn=2, dr=2, dv=2, ql=6, s=4, b=1, h=8, bias=False)
    full = full_params(case)
    w = shard_weights(full, case, 0, 1)
    good = dict(w, group=None, num_heads=2, kv_lora_rank=4, qk_head_dim=2,
                qk_pos_emb_head_dim=2, v_head_dim=2, q_lora_rank=6,
                rotary_pos_emb=full["rotary_pos_emb"])
    assert metp_mla_attention(full["x"], **good).shape == full["x"].shape
    bad = {"kv_up_weight": dict(good, kv_up_weight=w["kv_up_weight"][:-1]),
           "head_block": dict(good, head_block=2),
           "rotary_pos_emb is required": dict(good, rotary_pos_emb=None),
           "q_lora_rank": dict(good, q_lora_rank=None),
           "qk_pos_emb_head_dim must be even": dict(good, qk_pos_emb_head_dim=3)}
    for name, kwargs in bad.items():
        try:
            metp_mla_attention(full["x"], **kwargs)
        except ValueError as exc:
            assert name in str(exc), (name, str(exc))
        else:
            raise AssertionError(f"{name}: not refused")
