"""The launch/traffic work of issue 14: head-group blocks, the K/V ring's own process group, one
batched exchange per ring step, in-place fp32 GEMMs, the fused LSE merge, cached RoPE tables,
and the launch-counting benchmark (counts asserted, never timings); and issue 21's bounds on
that benchmark (METP's launches ≤ 8× and elementwise bytes ≤ 2× TP+SP's at both block
structures of its 32K and 128K runs), with negative controls."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import metp_attention, ring_attention, shard_sequence
from megatron_metp.ops import lse as lse_ops
from megatron_metp.ops.attention import HEAD_BLOCK_ROWS, head_block_size
from megatron_metp.ops.rope import apply_rope, rope_tables
from tests.harness import run_ranks, unset_env
from tests.numerics import rel_err
from tests.test_attention import _case_params, _errors, _gather, _reference, _shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

S, B, H = 24, 2, 16


# ---------------------------------------------------------------- head-group blocks

def _attn_rank(rank, p, case, head_block, kv_group):
    A, G, d, causal, layout, bias, rope, kernel, seed = case
    full = _case_params(case, torch.float32)
    sh = _shard(full, rank, p, A, G, d)
    params = {k: None if v is None else v.clone().requires_grad_() for k, v in sh.items()}
    x = shard_sequence(full["x"], rank, p, layout=layout).clone().requires_grad_()
    kv = dist.new_group(list(range(p))) if kv_group else None
    grp = METPGroup.from_process_group(dist.group.WORLD, name="blk", kv_group=kv)
    y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=grp, num_heads=A,
                       num_query_groups=G, causal=causal, layout=layout,
                       rotary_pos_emb=full["rotary_pos_emb"], qkv_bias=params["qkv_bias"],
                       proj_bias=params["proj_bias"], kernel=kernel, head_block=head_block)
    fwd = grp.stats.snapshot()
    y.backward(shard_sequence(full["gy"], rank, p, layout=layout))
    return [{"y": y.detach(), "dx": x.grad, "fwd": fwd, "total": grp.stats.snapshot(),
             "kv_separate": grp.kv is not None,
             **{"d" + k: None if v is None else v.grad for k, v in params.items()}}]


@pytest.mark.parametrize("p,head_block", [(2, 2), (4, 2), (4, 4)])
def test_head_blocks_fp32_parity_and_traffic(p, head_block):
    """kb head groups per block (one all-gather per weight piece when kb = p, per-piece
    broadcasts otherwise, a K/V ring of kb·A/p heads): the same result as the reference, the
    same bytes as one group at a time, p/kb K/V rings."""
    case = (2 * p, p, 2, True, "dual_chunk", True, True, "torch_flash", 5)
    got = run_ranks(_attn_rank, p, case, head_block, True)
    errs = _errors(_gather(got, 0, "dual_chunk"), _reference(case))
    assert max(errs.values()) <= 1e-5, errs
    one = run_ranks(_attn_rank, p, case, 1, True)
    nb = p // head_block
    for a, b in zip(got, one):
        assert a[0]["kv_separate"]
        assert a[0]["fwd"]["bytes_received"] == b[0]["fwd"]["bytes_received"]
        # forward: nb K/V rings of p-1 exchanges; the weights' 3 pieces (W_qkv, b_qkv, W_oᵀ)
        # in one all-gather each (kb = p), or broadcast per group (counted where received)
        w_fwd = 3 if head_block == p else 3 * (p - 1)
        assert a[0]["fwd"]["steps"] == nb * (p - 1) + w_fwd, a[0]["fwd"]


def test_head_block_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert head_block_size(8, 4, 4096, cpu) == 1  # CPU: one group at a time (least memory)
    assert head_block_size(8, 4, 4096, cuda) == 8  # 7B at 32K: 32 heads x 4096 rows = 2^17
    assert head_block_size(8, 4, 16384, cuda) == 2  # 128K: 4 heads x 16K rows per group
    assert head_block_size(8, 4, HEAD_BLOCK_ROWS, cuda) == 1
    assert head_block_size(6, 1, 100, cuda) == 6 and head_block_size(8, 4, 4096, cpu, 4) == 4
    for bad in (3, 0, "x"):
        with pytest.raises(ValueError, match="divisor of the METP group size 8"):
            head_block_size(8, 4, 4096, cpu, bad)


# ---------------------------------------------------------------- K/V ring on its own group

def _ring_rank(rank, p, kv_group):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(S, B, 4, 8, generator=g) for _ in range(3))
    kv = dist.new_group(list(range(p))) if kv_group else None
    grp = METPGroup.from_process_group(dist.group.WORLD, name="kv", kv_group=kv)
    ql, kl, vl = (shard_sequence(t, rank, p).clone().requires_grad_() for t in (q, k, v))
    o = ring_attention(ql, kl, vl, group=grp, kernel="torch_flash")
    o.backward(torch.ones_like(o))
    return o.detach(), ql.grad, kl.grad, vl.grad, grp.stats.snapshot()


@pytest.mark.parametrize("p", [2, 3])
def test_kv_ring_on_its_own_group_is_bit_identical(p):
    a = run_ranks(_ring_rank, p, True)
    b = run_ranks(_ring_rank, p, False)
    for ra, rb in zip(a, b):
        for x, y in zip(ra[:4], rb[:4]):
            assert torch.equal(x, y)
        assert ra[4] == rb[4]  # counted on the METP group's shared stats


def _kv_bad(rank, p):
    singles = [dist.new_group([i]) for i in range(p)]
    other = singles[rank]
    grp = METPGroup.from_process_group(dist.group.WORLD, name="kv")
    try:
        grp.with_kv_group(other)
    except ValueError as exc:
        return str(exc)
    return None


def test_kv_group_with_other_ranks_is_refused():
    for msg in run_ranks(_kv_bad, 2):
        assert msg and "not the METP ring's [0, 1] in that order" in msg


def _megatron_groups(rank, p):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.parallel import initialize_model_parallel

    cpu.enable()
    groups = initialize_model_parallel(1, 1, p, seq_length=8)
    m = groups.metp
    return m.kv is not None, m.kv_ring.ranks == m.ranks, m.kv_ring.group is not m.group


def test_megatron_groups_give_the_kv_ring_its_own_communicator():
    for got in run_ranks(_megatron_groups, 2):
        assert got == (True, True, True)


# ---------------------------------------------------------------- numerics of the pieces

def test_fused_merge_and_combine_equal_the_masked_merge():
    g = torch.Generator().manual_seed(0)
    n = 6
    blocks = [(slice(0, n), torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, generator=g)),
              (slice(3, n), torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, generator=g)),
              (slice(0, n), torch.randn(1, 2, n, 4, generator=g), 5 * torch.randn(1, 2, n, generator=g))]
    ref_o, ref_l = lse_ops.new_accumulators((1, 2, n, 4), "cpu")
    for rows, o, lb in blocks:
        lse_ops.merge_masked_(ref_o[:, :, rows], ref_l[:, :, rows], o, lb)
    out, lse = lse_ops.start(blocks[0][1].clone(), blocks[0][2].clone())
    for rows, o, lb in blocks[1:]:
        lse_ops.merge_(out[:, :, rows], lse[:, :, rows], o, lb)
    assert rel_err(out, ref_o) < 1e-6 and rel_err(lse, ref_l) < 1e-6
    c_out, c_lse = lse_ops.combine(blocks)
    assert rel_err(c_out, ref_o) < 1e-6 and rel_err(c_lse, ref_l) < 1e-6
    dest = torch.empty(1, 2, n, 4, dtype=torch.bfloat16)
    got, _ = lse_ops.combine(blocks, out=dest)
    assert got is dest and rel_err(dest, ref_o) < 1e-2


def test_rope_with_shared_tables_equals_the_rotation():
    theta = torch.randn(8, 1, 1, 2)
    freqs = torch.cat([theta, theta], -1)  # Megatron's [θ | θ]
    t = torch.randn(8, 2, 3, 6)
    tables = rope_tables(freqs, t.dtype)
    rot = apply_rope(t, freqs, tables=tables)
    x1, x2 = t[..., :2], t[..., 2:4]
    c, s = torch.cos(freqs), torch.sin(freqs)
    want = torch.cat([x1 * c[..., :2] - x2 * s[..., :2], x2 * c[..., 2:] + x1 * s[..., 2:],
                      t[..., 4:]], -1)
    assert torch.allclose(rot, want, atol=1e-6)
    assert torch.allclose(apply_rope(rot, freqs, transpose=True), t, atol=1e-5)
    out = torch.empty(8, 2, 3, 6, dtype=torch.bfloat16)  # written into a narrower dtype
    assert apply_rope(t, freqs, out=out, tables=tables) is out
    assert rel_err(out, want) < 1e-2
    # any number of head dims: [n, b, groups, heads per group, d]
    t5 = torch.randn(8, 2, 3, 2, 6)
    assert torch.allclose(apply_rope(t5, freqs).flatten(2, 3),
                          apply_rope(t5.flatten(2, 3), freqs), atol=1e-6)


def test_mm_acc_cuda_branch_is_in_place_and_an_error_is_not_taken_for_a_missing_kernel(
        monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_metp.ops import _accum
    from megatron_metp.ops.cuda_emulation import emulate_cuda

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((str(func), kwargs.get("out") is not None if kwargs else False))
            return func(*args, **(kwargs or {}))

    undo = emulate_cuda(kernels=False)
    try:
        with FakeTensorMode():
            acc = torch.zeros(8, 4)
            a, b = torch.empty(8, 3, dtype=torch.bfloat16), torch.empty(3, 4, dtype=torch.bfloat16)
            ops = Ops()
            with ops:
                _accum.mm_acc(acc, a, b)
            assert ops.seen == [("aten.addmm.dtype_out", True)]  # one GEMM, into acc
            monkeypatch.setattr(torch, "addmm", lambda *a_, **k_: (_ for _ in ()).throw(
                RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")))
            with pytest.raises(RuntimeError, match="out of memory"):
                _accum.mm_acc(acc, a, b)  # an error of the real call is raised, not fallen back
    finally:
        undo()
        monkeypatch.undo()
    # the capability probe runs once per (device, dtypes) on tiny tensors and is cached
    calls = []
    real = torch.addmm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", counted)
    monkeypatch.setattr(_accum, "_cuda_out_dtype_ok", {})
    x = torch.zeros(1, 1, dtype=torch.bfloat16)
    first = _accum._out_dtype_supported(x, torch.float32)
    assert _accum._out_dtype_supported(x, torch.float32) is first
    assert calls == [torch.Size([2, 2])]


# ---------------------------------------------------------------- the launch benchmark

def _tiny_counts():
    import launches

    out = {}
    for mode in ("tp-sp", "metp"):
        out[mode] = launches.per_layer(mode, 256, 4, hidden=64, heads=8, ffn=128)
    return out


def test_launch_benchmark_counts_one_batch_per_ring_step():
    """The benchmark's counter on tiny shapes, GPU paths selected (all 4 head groups in one
    block at p = 4): the K/V ring posts one batched exchange per step (backward: K/V with
    dK/dV), so do the MLP's weight/gradient rings, and the counts are what the schedule says."""
    c = _tiny_counts()
    m, t = c["metp"], c["tp-sp"]
    p = 4
    # attention: forward p-1 K/V steps; backward 1 + (p-1) + 1 (first block, then one per
    # step carrying K/V ahead and dK/dV back). MLP: forward p-1; backward likewise 1+(p-1)+1.
    assert m["p2p_batches"] == (p - 1) + (p + 1) + (p - 1) + (p + 1), m
    assert m["p2p_unbatched"] == 0
    # all-gathers of the attention weights (W_qkv, W_oᵀ) fwd and bwd, reduce-scatters of their
    # grads: 4 + 2 collectives; the Megatron TP+SP layer: all-gathers and reduce-scatters
    assert m["collectives"] == 6 and t["messages"] == 10, (m["by_op"], t["by_op"])
    assert m["attention_calls"] == 2 * p  # one block: p kernel calls each way
    assert m["launches"] <= 8 * t["launches"], (m["launches"], t["launches"])
    assert m["flops"] <= 1.3 * t["flops"]
    assert "mm" in m["by_op"] and not any(k.startswith("zeros") for k in m["by_op"]
                                           if m["by_op"][k] > 2)


def _tiny_p8(mode, **env):
    """``benchmarks/launches.py``'s per-layer counts at its ``--tiny`` widths (h=64, 8 heads, ffn
    128, s=256) on p = 8 ranks, with the head-block / tile environment exactly ``env`` (the
    forked children inherit it)."""
    import launches

    from megatron_metp.ops.tiles import MLP_TOKEN_TILE_ENV, TILE_BUDGET_ENV

    with pytest.MonkeyPatch.context() as mp:
        for name in ("METP_HEAD_BLOCK", MLP_TOKEN_TILE_ENV, TILE_BUDGET_ENV):
            unset_env(mp, name)
        for name, value in env.items():
            mp.setenv(name, value)
        return launches.per_layer(mode, 256, 8, hidden=64, heads=8, ffn=128)


@pytest.fixture(scope="module")
def tp_sp_p8():
    return _tiny_p8("tp-sp")


@pytest.mark.parametrize("head_block,blocks", [("8", 1), ("2", 4)])
def test_launches_and_bytes_within_issue_21_bounds(tp_sp_p8, head_block, blocks):
    """``benchmarks/launches.py --seq 32768 131072`` (p = 8) runs the attention as one head-group
    block (kb = 8) at 32K and as four blocks of kb = 2 at 128K (:func:`head_block_size`). Launch
    counts depend on p, the blocks and the layer's options, not on the widths or the length, so
    the ``--tiny`` widths with ``METP_HEAD_BLOCK`` = 8 / 2 count the benchmark's launches
    (192 / 462 against TP+SP's 63). Bounds of issue 21: launches ≤ 8×, elementwise bytes
    ≤ 2× TP+SP's. Each block's forward weighs its p outputs with one softmax
    (:func:`lse.combine`), no ``logaddexp`` per ring step."""
    m, t = _tiny_p8("metp", METP_HEAD_BLOCK=head_block), tp_sp_p8
    assert m["attention_calls"] == 2 * 8 * blocks  # p kernel calls per block, each way
    assert m["by_op"].get("_softmax") == blocks and "logaddexp" not in m["by_op"], m["by_op"]
    assert m["launches"] <= 8 * t["launches"], (m["launches"], t["launches"])
    assert m["elementwise_bytes"] <= 2 * t["elementwise_bytes"], (
        m["elementwise_bytes"], t["elementwise_bytes"])


def test_issue_21_bounds_catch_per_step_merges_and_forced_tiles(tp_sp_p8, monkeypatch):
    """Negative controls of the bounds above, at the 128K block structure (kb = 2): (a) each
    block's ring folding its outputs in as they arrive (:func:`lse.merge_`, five kernels per
    ring step, as kb = 1 does) instead of :func:`lse.combine` exceeds 8× TP+SP's launches;
    (b) MLP token tiles forced where the auto tile is whole (``METP_MLP_TOKEN_TILE=4``, 8 tiles
    of 4 rows: the weight ring and its per-tile reads and writes 8 times) exceed 2× its
    elementwise bytes (docs/tiles.md's forced-tile row)."""
    from megatron_metp.ops import attention

    t = tp_sp_p8
    ring_forward = attention.ring_attention_forward

    def fold_on_arrival(*args, **kwargs):
        return ring_forward(*args, **dict(kwargs, defer_merge=False))

    monkeypatch.setattr(attention, "ring_attention_forward", fold_on_arrival)
    merged = _tiny_p8("metp", METP_HEAD_BLOCK="2")
    assert "logaddexp" in merged["by_op"]  # the control ran the per-step merge
    assert merged["launches"] > 8 * t["launches"], (merged["launches"], t["launches"])
    monkeypatch.undo()
    tiled = _tiny_p8("metp", METP_HEAD_BLOCK="2", METP_MLP_TOKEN_TILE="4")
    assert tiled["elementwise_bytes"] > 2 * t["elementwise_bytes"], (
        tiled["elementwise_bytes"], t["elementwise_bytes"])


def test_gpu_check_dry_runs_its_code_paths_on_cpu(tmp_path):
    """``benchmarks/gpu_check.py --dry``: the GPU check's kernels part, stacks, CPU-instrument
    figure and launch counts on tiny CPU shapes; writes its JSON and table."""
    import json

    import gpu_check

    assert gpu_check.main(["--dry", "--out", str(tmp_path), "--modes", "metp", "tp-sp"]) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("rates (cpu (--dry), kernel torch_flash") and "\n| kernel |" in md
    kernels = {r["kernel"] for r in res["kernels"]}
    assert kernels == {"torch_flash", "reference"}
    for r in res["kernels"]:  # bf16 kernels within bf16 rounding of the fp32 reference
        assert max(r[k] for k in ("err_out", "err_lse", "err_dq", "err_dk", "err_dv")) < 3e-2
    rows = {r["mode"]: r for r in res["stacks"]}
    assert set(rows) == {"metp", "tp-sp"} and not any("error" in r for r in res["stacks"])
    for r in rows.values():
        assert r["cpu_instrument_peak"] > 0 and r["fwd_bwd_s"] > 0
        assert r["launches_from"].startswith("dispatch counter")
    assert rows["metp"]["launches_per_layer"] <= 8 * rows["tp-sp"]["launches_per_layer"]


# ---------------------------------------------------------------- weight gradients and main_grad

def _grads_rank(rank, p, use_main_grad, wire):
    from megatron_metp.ops import metp_mlp

    g = torch.Generator().manual_seed(3)
    h, F, A = 16, 32, 4
    x = (torch.randn(S // p, B, h, generator=g) * (rank + 1)).bfloat16().requires_grad_()
    w1 = torch.randn(2 * F // p, h, generator=g).bfloat16().requires_grad_()
    w2 = torch.randn(h, F // p, generator=g).bfloat16().requires_grad_()
    wq = torch.randn(3 * h // p, h, generator=g).bfloat16().requires_grad_()
    wo = torch.randn(h, h // p, generator=g).bfloat16().requires_grad_()
    params = (w1, w2, wq, wo)
    if use_main_grad:  # what Megatron's DDP gives each parameter
        for w in params:
            w.main_grad = torch.zeros(w.shape, dtype=wire)
            w.grad_added_to_main_grad = False
    grp = METPGroup.from_process_group(dist.group.WORLD, name="grads")
    y = metp_attention(x, wq, wo, group=grp, num_heads=A, num_query_groups=A, causal=True,
                       kernel="torch_flash", grad_reduce_dtype=wire)
    y = metp_mlp(y, w1, w2, group=grp, activation="swiglu", grad_reduce_dtype=wire)
    before = grp.stats.bytes_sent
    y.float().square().sum().backward()
    return ([w.main_grad.clone() if use_main_grad else w.grad for w in params],
            [getattr(w, "grad_added_to_main_grad", None) for w in params],
            grp.stats.bytes_sent - before)


def test_owner_gradient_goes_into_main_grad_unrounded_and_wire_follows_its_dtype():
    p = 2
    plain = run_ranks(_grads_rank, p, False, torch.float32)
    fused = run_ranks(_grads_rank, p, True, torch.float32)
    for (g_plain, _, sent32), (g_main, added, _) in zip(plain, fused):
        assert added == [True] * 4
        for a, b in zip(g_plain, g_main):
            assert b.dtype == torch.float32
            assert torch.equal(b.bfloat16(), a)  # the same fp32 sum, not rounded first
        assert any(not torch.equal(b, b.bfloat16().float()) for b in g_main)
    # bf16 main_grad (Megatron's --grad-reduce-in-bf16): bf16 on the wire
    bf = run_ranks(_grads_rank, p, True, torch.bfloat16)
    for (_, _, sent32), (g_bf, _, sent16) in zip(plain, bf):
        assert all(g.dtype == torch.bfloat16 for g in g_bf)
        assert sent16 < sent32
