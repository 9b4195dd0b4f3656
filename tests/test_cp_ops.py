"""METP × context parallelism at op level: METP groups of p ranks inside a sequence ring of p·c
ranks (``runtime.context.attach_context_group``); the sequence split over all p·c ranks, the
weights over p only, each head group's K/V ring over the p·c ranks. Output and every gradient
against a single-device reference from the same full weights (fp32), with a negative control."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import metp_attention, shard_sequence, unshard_sequence
from megatron_metp.ops.documents import shard_documents, unshard_documents
from megatron_metp.runtime.context import attach_context_group, context_size
from tests.harness import run_ranks
from tests.megatron_ref import full_attention_params, reference_self_attention
from tests.numerics import rel_err
from tests.test_attention import _shard
from tests.test_packed_attention import reference_packed_self_attention

S, B, H = 24, 2, 8  # S divisible by 2·p·c for p·c = 4 and 6


def _groups(rank, p, c, with_context=True):
    """METP groups [0..p-1], [p..2p-1], … (Megatron's expert groups inside the CP group) and the
    CP group of all p·c ranks; every rank creates every group, in the same order."""
    world = p * c
    metp_pgs = [dist.new_group(list(range(o * p, (o + 1) * p))) for o in range(c)] if p > 1 \
        else [None] * c
    metp = METPGroup.from_process_group(metp_pgs[rank // p], name=f"metp{rank // p}")
    if with_context:
        attach_context_group(metp, dist.new_group(list(range(world))))
    return metp


def _shard_x(t, cu, R, P, layout):
    if cu is None:
        return shard_sequence(t, R, P, layout=layout)
    return shard_documents(t, cu, R, P, layout=layout)


def _cp_rank(rank, world, p, cases, with_context=True):
    c = world // p
    metp = _groups(rank, p, c, with_context)
    R, P, r = rank, world, rank % p
    out = []
    for A, G, d, layout, rope, kernel, cu, seed in cases:
        full = full_attention_params(S, B, H, A, G, d, rope=rope, seed=seed)
        params = {k: None if v is None else v.clone().requires_grad_()
                  for k, v in _shard(full, r, p, A, G, d).items()}
        x = _shard_x(full["x"], cu, R, P, layout).clone().requires_grad_()
        metp.stats.reset()
        y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=metp,
                           num_heads=A, num_query_groups=G, layout=layout,
                           rotary_pos_emb=full["rotary_pos_emb"], qkv_bias=params["qkv_bias"],
                           proj_bias=params["proj_bias"], kernel=kernel, cu_seqlens=cu)
        fwd = metp.stats.snapshot()
        y.backward(_shard_x(full["gy"], cu, R, P, layout))
        out.append({"y": y.detach(), "dx": x.grad, "c": context_size(metp), "fwd": fwd,
                    "total": metp.stats.snapshot(),
                    **{"d" + k: None if v is None else v.grad for k, v in params.items()}})
    return out


def _unshard(parts, cu, layout):
    if cu is None:
        return unshard_sequence(parts, layout=layout)
    return unshard_documents(parts, cu, layout=layout)


def _errors(out, i, case, p):
    A, G, d, layout, rope, kernel, cu, seed = case
    full = full_attention_params(S, B, H, A, G, d, rope=rope, seed=seed)
    if cu is None:
        ref = reference_self_attention(full, num_heads=A, num_query_groups=G, causal=True)
        ref = {"y": ref["y"], "dx": ref["dx"], "dqkv_weight": ref["dqkv_w"],
               "dqkv_bias": ref["dqkv_b"], "dproj_weight": ref["dproj_w"],
               "dproj_bias": ref["dproj_b"]}
    else:
        ref = reference_packed_self_attention(full, cu, A, G)
    rs = [o[i] for o in out]
    c = len(rs) // p
    # a METP shard's gradient: the sum over the c METP groups (Megatron's expert-DP reduction)
    shard = [[rs[o * p + r] for o in range(c)] for r in range(p)]
    got = {"y": _unshard([q["y"] for q in rs], cu, layout),
           "dx": _unshard([q["dx"] for q in rs], cu, layout),
           "dqkv_weight": torch.cat([sum(q["dqkv_weight"] for q in s) for s in shard]),
           "dqkv_bias": torch.cat([sum(q["dqkv_bias"] for q in s) for s in shard]),
           "dproj_weight": torch.cat([sum(q["dproj_weight"] for q in s) for s in shard], dim=1),
           "dproj_bias": sum(q["dproj_bias"] for q in rs)}
    return {k: rel_err(got[k], ref[k]) for k in got}


# (A heads, G query groups, head dim, layout, rope, kernel, cu_seqlens, seed)
CASES = [
    (4, 2, 4, "dual_chunk", True, "torch_flash", None, 0),              # GQA, dual chunk over 2pc
    (4, 4, 2, "contiguous", True, "reference", None, 1),
    (4, 2, 4, "dual_chunk", True, "torch_flash", (0, 5, 13, 24), 2),    # packed documents
    (4, 2, 2, "balanced", True, "reference", (0, 16, 24), 3),          # packed, balanced layout
]


@pytest.mark.parametrize("p,world", [(2, 4), (1, 4), (3, 6)])
def test_metp_cp_attention_fp32_parity(p, world):
    cases = CASES if p != 3 else [(6, 3, 2) + CASES[0][3:], (6, 3, 2) + CASES[2][3:]]
    out = run_ranks(_cp_rank, world, p, cases)
    assert all(o[0]["c"] == world // p for o in out)
    for i, case in enumerate(cases):
        errs = _errors(out, i, case, p)
        assert len(errs) == 6 and max(errs.values()) <= 1e-5, (p, world, case, errs)


def test_negative_control_kv_ring_inside_the_metp_group_only_is_wrong():
    """The same sharding without the context group: each METP group's K/V ring sees only its
    own ranks' tokens (and takes them for the whole sequence), so the result is wrong. (Without
    RoPE: with it, the whole-sequence angle table no longer matches and the call is refused.)"""
    case = (4, 2, 4, "dual_chunk", False, "torch_flash", None, 0)
    out = run_ranks(_cp_rank, 4, 2, [case], False)
    errs = _errors(out, 0, case, 2)
    assert errs["y"] > 1e-2 and errs["dqkv_weight"] > 1e-2, errs


def _bad_context(rank, world):
    pg = dist.new_group([0, 1])
    metp = METPGroup.from_process_group(pg, name="m") if rank < 2 else None
    odd = dist.new_group([0, 1, 2])
    other = dist.new_group([1, 2])
    if rank >= 2:
        return None
    msgs = []
    for pg in (odd, other):
        try:
            attach_context_group(metp, pg) if rank in dist.get_process_group_ranks(pg) else None
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_bad_context_group_is_refused_naming_the_rule():
    out = run_ranks(_bad_context, 3)
    assert any("not a multiple of the METP group size 2" in m for m in out[0]), out[0]
    assert any("does not contain" in m for m in out[1]), out[1]


def test_traffic_weights_inside_the_metp_group_kv_over_the_cp_group():
    """Per rank and call, METP 2 × CP 2: the head-group weights arrive only from the p−1 other
    ranks of the METP group, each head group's K/V block travels p·c−1 steps of the CP ring:
    forward (p−1) weight receipts + p·(pc−1) K/V steps; backward the weights again, (p−1)
    gradient reduces, and each head group's K/V block and fp32 dK/dV sum sent pc−1 times
    (bytes: the closed form of tests/test_attention.py with p·c in the K/V ring)."""
    p, c, A, G, d = 2, 2, 4, 2, 2
    case = (A, G, d, "dual_chunk", False, "reference", None, 0)
    res = run_ranks(_cp_rank, p * c, p, [case])
    pc = p * c
    w = ((G // p) * (A // G + 2) * d * H + (G // p) * (A // G + 2) * d + H * (A // p) * d) * 4
    kv = 2 * (S // pc) * B * (G // p) * d * 4  # K and V of one head group, fp32
    for r in res:
        f, t = r[0]["fwd"], r[0]["total"]
        assert f == {"steps": (p - 1) + p * (pc - 1), "bytes_sent": p * (pc - 1) * kv,
                     "bytes_received": (p - 1) * w + p * (pc - 1) * kv}, f
        # backward K/V ring: one batched exchange per step (K/V ahead + the dK/dV sum) and the
        # first one posted early: pc + 1 exchanges per head group for pc >= 3
        assert t["steps"] == 3 * (p - 1) + p * (pc - 1) + p * (pc + (pc >= 3)), t
        assert t["bytes_sent"] == (p - 1) * w + 3 * p * (pc - 1) * kv, t
        assert t["bytes_received"] == 2 * (p - 1) * w + 3 * p * (pc - 1) * kv, t
