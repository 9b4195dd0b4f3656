"""The streaming METP layer with kept attention (``metp_layer(..., keep_attention=True)``): the
forward keeps every head group's attention output and log-sum-exp, the backward never runs the
attention forward again. Its gradients against the same layer's full recompute (fp32, CPU), at
METP 2 and 3, METP 2 × CP 2, packed documents, q/k norm, a YaRN-like softmax scale, the kept
tensors on the host and on the device; the attention forward's K/V ring counted (once per head
group and query tile per layer, not twice); negative controls: a perturbed kept ``O`` or
``lse`` changes the gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import layer_attention, shard_sequence
from megatron_metp.ops.documents import shard_documents
from megatron_metp.ops.layer import metp_layer
from megatron_metp.ops.layer_reads import host_reads
from megatron_metp.runtime import host_stash
from megatron_metp.runtime.context import attach_context_group
from tests.harness import run_ranks
from tests.numerics import rel_err
from tests.test_layer import BASE, _full, _leaf_inputs

H = 12


def _group(rank, world, p):
    """The METP group of ``rank`` (groups of ``p`` consecutive ranks) with, when ``world > p``,
    the context group of every rank attached (METP × CP, as ``tests/test_cp_ops.py``)."""
    if world == p:
        return METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="layer")
    pgs = [dist.new_group(list(range(o * p, (o + 1) * p))) for o in range(world // p)]
    metp = METPGroup.from_process_group(pgs[rank // p], name=f"layer{rank // p}")
    attach_context_group(metp, dist.new_group(list(range(world))))
    return metp


def _run(grp, full, case, r, p, R, P, host, tiles, keep, perturb, rings):
    """One layer forward and backward on this rank; ``perturb``: ``"o"`` / ``"lse"`` changes
    the kept attention output / log-sum-exp of head group 0 between forward and backward.
    Returns the gradients and the K/V ring forwards run in the forward and in all."""
    lay, cu = case["layout"], case.get("cu")

    def shard(t):
        if cu is None:
            return shard_sequence(t, R, P, layout=lay)
        return shard_documents(t, cu, R, P, layout=lay)
    params, n1, n2, qk = _leaf_inputs(full, case, r, p)
    x_leaf = shard(full["x"]).clone().requires_grad_()
    x = x_leaf * 1.0  # not a leaf: the output may be written over it
    del rings[:]
    y = metp_layer(x, group=grp, num_heads=case["A"], num_query_groups=case["G"], causal=True,
                   layout=lay, rotary_pos_emb=full["rotary_pos_emb"], cu_seqlens=cu,
                   softmax_scale=case.get("scale"), qkv_weight=params["qkv_weight"],
                   proj_weight=params["proj_weight"], fc1_weight=params["fc1_weight"],
                   fc2_weight=params["fc2_weight"], activation=case["act"], norm1=n1, norm2=n2,
                   qkv_bias=params["qkv_bias"], proj_bias=params["proj_bias"],
                   fc1_bias=params["fc1_bias"], fc2_bias=params["fc2_bias"], host=host,
                   in_place=True, token_tile=tiles, keep_attention=keep, **qk)
    fwd = len(rings)
    node = y.grad_fn
    q_tiles = len(node.spec.q_tiles)
    kept = node.kept
    assert (kept is not None) == keep
    if keep:  # every group's O and lse, where the layer input went
        o_st, lse_st = kept
        assert len(o_st) == len(lse_st) == p
        assert all(s.host == host for s in o_st + lse_st)
        assert all(s.dtype == torch.float32 and s.rows == x.shape[1] * case["A"] // p
                   for s in lse_st)
    if perturb == "o":
        kept[0][0]._data[: x.shape[1]] += 0.5
    elif perturb == "lse":
        kept[1][0]._data += 0.3
    N = x.shape[0] * x.shape[1]
    reads = []  # rows of the layer input's host stash read by the backward
    read = host_stash.Stash.read

    def counting(self, rows):
        if self.host and self.width == H and self.rows == N:
            reads.append(rows.stop - rows.start)
        return read(self, rows)
    host_stash.Stash.read = counting
    try:
        y.backward(shard(full["gy"]))
    finally:
        host_stash.Stash.read = read
    if keep:  # released after the backward
        assert node.kept is None and all(s._released for s in kept[0] + kept[1])
    out = {"dx": x_leaf.grad, **{"d" + k: v.grad for k, v in params.items() if v is not None},
           **{f"dn1.{k}": v.grad for k, v in n1.named_parameters()},
           **{f"dn2.{k}": v.grad for k, v in n2.named_parameters()},
           **{"d" + k: qk[k].grad for k in ("q_norm_weight", "k_norm_weight") if k in qk}}
    return out, fwd, len(rings), q_tiles, sum(reads) / N


def _keep_rank(rank, world, p, case, host, tiles, controls):
    torch.manual_seed(0)
    grp = _group(rank, world, p)
    full = _full(case)
    rings = []
    ring = layer_attention.ring_attention_forward

    def counting(*a, **kw):
        rings.append(1)
        return ring(*a, **kw)
    layer_attention.ring_attention_forward = counting
    try:
        args = (grp, full, case, rank % p, p, rank, world, host, tiles)
        out = {"recompute": _run(*args, False, None, rings),
               "keep": _run(*args, True, None, rings)}
        for c in controls:
            out[c] = _run(*args, True, c, rings)
    finally:
        layer_attention.ring_attention_forward = ring
    return out


CASES = [  # (METP, world, case overrides, host, tiles, negative controls)
    (2, 2, {}, True, {"rows": 5, "q": 2, "kv": 4, "keys": 3}, ("o", "lse")),
    (2, 2, dict(scale=0.37), False, 2, ("o", "lse")),  # a YaRN-like softmax scale
    (3, 3, dict(A=6, G=3, d=2, bias=True, act="gelu", norm="LayerNorm"), True,
     {"rows": 3, "q": 2, "kv": 3, "keys": 2}, ()),
    (3, 3, dict(A=6, G=3, d=2, qk=True), False, 3, ()),
    (2, 2, dict(cu=(0, 5, 13, 24)), True, {"rows": 4, "q": 3, "kv": 4, "keys": 3}, ()),
    (2, 4, {}, True, {"rows": 2, "q": 2, "kv": 3, "keys": 2}, ("lse",)),  # METP 2 × CP 2
]


@pytest.mark.parametrize("p,world,over,host,tiles,controls", CASES)
def test_kept_attention_gradients_equal_the_recompute(p, world, over, host, tiles, controls):
    case = dict(BASE, **over)
    for r, got in enumerate(run_ranks(_keep_rank, world, p, case, host, tiles, controls)):
        ref, ref_fwd, ref_all, q_tiles, ref_reads = got["recompute"]
        out, fwd, total, _, reads = got["keep"]
        assert len(ref) >= 7 and ref.keys() == out.keys()
        errs = {k: rel_err(out[k], ref[k]) for k in ref}
        assert max(errs.values()) <= 1e-6, (r, errs)
        # on the CPU bit for bit: the forward and the recompute form q, K, V over the same row
        # pieces (Rows.set_kv_cut), so the kept O and lse are the recompute's
        assert all(torch.equal(out[k], ref[k]) for k in ref), r
        # the K/V ring of the attention forward: once per head group and query tile per layer
        # with kept attention; the recompute runs it a second time
        assert fwd == ref_fwd == p * q_tiles and q_tiles >= 2
        assert total == fwd and ref_all == 2 * ref_fwd
        # passes over the host-resident input per backward (ops/layer_reads.host_reads): with
        # kept attention 2p + 2 (q formed from x again, no recompute), else 2p + 3
        assert reads == sum(host_reads(p, host, kept=True).values()) == (2 * p + 2) * host
        assert ref_reads == sum(host_reads(p, host).values()) == (2 * p + 3) * host
        for c in controls:  # negative controls: the backward uses the kept O and lse
            bad = got[c][0]
            assert max(rel_err(bad[k], ref[k]) for k in ref) > 1e-3, (r, c)
