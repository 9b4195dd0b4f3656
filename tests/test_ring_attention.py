"""Token layouts and the K/V ring against single-device attention."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import (local_positions, ring_attention, select_kernel, shard_sequence,
                               unshard_sequence)
from tests.harness import assert_messages, run_ranks, value_errors
from tests.numerics import rel_err

S, B, D = 24, 2, 4  # S divisible by 2p for p = 1..4


# ---------------------------------------------------------------- layouts

@pytest.mark.parametrize("layout", ["dual_chunk", "contiguous"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_shard_unshard_roundtrip_and_positions(layout, p):
    x = torch.arange(S * 3).view(S, 3)
    parts = [shard_sequence(x, r, p, layout=layout) for r in range(p)]
    assert torch.equal(unshard_sequence(parts, layout=layout), x)
    for r, part in enumerate(parts):
        assert torch.equal(part[:, 0] // 3, local_positions(r, p, S // p, layout=layout))
    if layout == "dual_chunk":  # rank r holds chunks r and 2p-1-r of 2p
        c = S // (2 * p)
        assert parts[0][0, 0] == 0 and parts[0][-1, 0] // 3 == S - 1 and parts[0].shape[0] == 2 * c


def _megatron_cp_split(rank, p):
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank
    tokens = torch.arange(S).view(1, S)
    got = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=dist.group.WORLD)
    return got["tokens"], shard_sequence(tokens, rank, p, seq_dim=1)


@pytest.mark.parametrize("p", [2, 3])
def test_dual_chunk_is_megatrons_context_parallel_split(p):
    for megatron_split, ours in run_ranks(_megatron_cp_split, p):
        assert torch.equal(megatron_split, ours)


def test_sequence_not_divisible_by_2p_is_refused():
    with pytest.raises(ValueError, match="not divisible by 6"):
        shard_sequence(torch.zeros(10, 1), 0, 3)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(torch.zeros(12, 1), 0, 3, layout="zigzag")


# ---------------------------------------------------------------- ring attention parity

def reference_attention(q, k, v, causal, scale=None, dtype=torch.float64):
    """Single-device attention on the full sequence, ``[s, b, h, d]``, by autograd."""
    s, b, hq, d = q.shape
    rep = hq // k.shape[2]
    qh = q.to(dtype).permute(1, 2, 0, 3)
    kh = k.to(dtype).permute(1, 2, 0, 3).repeat_interleave(rep, 1)
    vh = v.to(dtype).permute(1, 2, 0, 3).repeat_interleave(rep, 1)
    sc = qh @ kh.transpose(-1, -2) * (scale or 1 / math.sqrt(d))
    if causal:
        sc = sc.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return (sc.softmax(-1) @ vh).permute(2, 0, 1, 3)


def _qkv(hq, hkv, seed, scale=1.0, s=S, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, B, h, D, generator=g) * sc).to(dtype)
            for h, sc in ((hq, scale), (hkv, scale), (hkv, 1.0), (hq, 1.0))]


# (causal, layout, hq, hkv, kernel)
CASES = [
    (True, "dual_chunk", 4, 4, "torch_flash"),
    (True, "dual_chunk", 8, 2, "reference"),     # GQA
    (True, "contiguous", 4, 1, "torch_flash"),   # MQA
    (True, "contiguous", 8, 2, "reference"),
    (False, "dual_chunk", 4, 2, "torch_flash"),
    (False, "contiguous", 4, 4, "reference"),
]


def _ring_cases(rank, p, cases, seed=0, wrong_layout=False):
    results = []
    for i, (causal, layout, hq, hkv, kernel) in enumerate(cases):
        q, k, v, go = _qkv(hq, hkv, seed + i)
        shard_layout = ("contiguous" if layout == "dual_chunk" else "dual_chunk") \
            if wrong_layout else layout
        ql, kl, vl = (shard_sequence(t, rank, p, layout=shard_layout).clone().requires_grad_()
                      for t in (q, k, v))
        grp = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="ra")
        o = ring_attention(ql, kl, vl, group=grp, causal=causal, layout=layout, kernel=kernel)
        fwd = grp.stats.snapshot()
        o.backward(shard_sequence(go, rank, p, layout=shard_layout))
        results.append({"o": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "fwd": fwd,
                        "total": grp.stats.snapshot(), "kernels": dict(grp.stats.kernels)})
    return results


def _ring_errors(out, p, cases, seed=0, layouts=None):
    errs = []
    for i, (causal, layout, hq, hkv, kernel) in enumerate(cases):
        q, k, v, go = (t.clone().double().requires_grad_() for t in _qkv(hq, hkv, seed + i))
        ref = reference_attention(q, k, v, causal)
        ref.backward(go)
        lay = layouts[i] if layouts else layout
        got = {name: unshard_sequence([o[i][name] for o in out], layout=lay)
               for name in ("o", "dq", "dk", "dv")}
        errs.append({"o": rel_err(got["o"], ref), "dq": rel_err(got["dq"], q.grad),
                     "dk": rel_err(got["dk"], k.grad), "dv": rel_err(got["dv"], v.grad)})
    return errs


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_ring_attention_fp32_parity(p):
    out = run_ranks(_ring_cases, p, CASES)
    for case, errs, res in zip(CASES, _ring_errors(out, p, CASES), out[0]):
        assert max(errs.values()) <= 1e-5, (case, errs)
        assert res["kernels"] == {case[4]: 1}  # the kernel that ran is reported


@pytest.mark.parametrize("p", [2, 3])
def test_ring_attention_traffic_matches_closed_form(p):
    cases = [(True, "dual_chunk", 8, 2, "reference")]
    res = run_ranks(_ring_cases, p, cases)
    kv_bytes = 2 * (S // p) * B * 2 * D * 4  # K and V blocks of 2 heads, fp32
    for r in res:
        assert r[0]["fwd"] == {"steps": p - 1, "bytes_sent": (p - 1) * kv_bytes,
                               "bytes_received": (p - 1) * kv_bytes}
        tot = 3 * (p - 1) * kv_bytes  # + (p-1) K/V and (p-1) fp32 dK/dV blocks in backward
        assert r[0]["total"] == {"steps": 3 * (p - 1), "bytes_sent": tot, "bytes_received": tot}


def test_negative_control_wrong_token_layout_is_caught():
    p, cases = 3, [(True, "dual_chunk", 4, 2, "reference")]
    out = run_ranks(_ring_cases, p, cases, 0, True)  # sharded contiguous, told dual_chunk
    errs = _ring_errors(out, p, cases, layouts=["contiguous"])[0]
    assert errs["o"] > 1e-2 and errs["dk"] > 1e-2, errs


def test_kernel_selection_and_override(monkeypatch):
    cpu = torch.device("cpu")
    assert select_kernel(cpu).name == "torch_flash"
    assert select_kernel(cpu, torch.float32, "reference").name == "reference"
    monkeypatch.setenv("METP_ATTENTION_KERNEL", "reference")
    assert select_kernel(cpu).name == "reference"
    with pytest.raises(ValueError, match="not available"):
        select_kernel(cpu, torch.float32, "flash_attn")
    with pytest.raises(ValueError, match="must be one of"):
        select_kernel(cpu, torch.float32, "triton")


# ---------------------------------------------------------------- stability at long sequences

def _unstabilised_merge(q, k, v, p, dtype):
    """What an unstabilised ring does: Σ exp(score) per block without subtracting a max."""
    s, b, h, d = q.shape
    n = s // p
    num, den = 0, 0
    for j in range(p):
        kj, vj = k[j * n:(j + 1) * n].to(dtype), v[j * n:(j + 1) * n].to(dtype)
        sc = torch.einsum("sbhd,tbhd->bhst", q.to(dtype), kj) / math.sqrt(d)
        e = torch.exp(sc)
        num = num + torch.einsum("bhst,tbhd->bhsd", e, vj)
        den = den + e.sum(-1, keepdim=True)
    return num / den


def _long_rank(rank, p, q, k, v, dtype):
    grp = METPGroup.from_process_group(dist.group.WORLD, name="long")
    ql, kl, vl = (shard_sequence(t, rank, p, layout="contiguous").to(dtype) for t in (q, k, v))
    return ring_attention(ql, kl, vl, group=grp, causal=False, layout="contiguous")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_scores_overflow_an_unstabilised_merge_but_not_ours(dtype):
    p, s = 4, 512
    g = torch.Generator().manual_seed(3)
    q = torch.randn(s, 1, 2, 8, generator=g) * 6  # scores up to ~100: exp() overflows bf16/fp16
    k = torch.randn(s, 1, 2, 8, generator=g) * 6
    v = torch.randn(s, 1, 2, 8, generator=g)
    naive = _unstabilised_merge(q, k, v, p, dtype)
    assert not torch.isfinite(naive).all()  # the failure mode exists on this input
    out = unshard_sequence(run_ranks(_long_rank, p, q, k, v, dtype), layout="contiguous")
    ref = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=False)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 2e-2  # 16-bit inputs and output


# ---------------------------------------------------------------- bad input

def _ring_bad(rank, p):
    grp = METPGroup.from_process_group(dist.group.WORLD, name="bad")
    ok = torch.zeros(6, 1, 4, 8)
    cases = {
        "odd_dual_chunk": lambda: ring_attention(torch.zeros(5, 1, 4, 8), torch.zeros(5, 1, 4, 8),
                                                 torch.zeros(5, 1, 4, 8), group=grp),
        "gqa_heads": lambda: ring_attention(ok, torch.zeros(6, 1, 3, 8), torch.zeros(6, 1, 3, 8),
                                            group=grp),
        "head_dim": lambda: ring_attention(ok, torch.zeros(6, 1, 4, 4), torch.zeros(6, 1, 4, 4),
                                           group=grp),
        "kv_shape": lambda: ring_attention(ok, ok, torch.zeros(6, 1, 2, 8), group=grp),
        "rank3": lambda: ring_attention(torch.zeros(6, 4, 8), ok, ok, group=grp),
        "dtype": lambda: ring_attention(ok, ok.double(), ok.double(), group=grp),
        "layout": lambda: ring_attention(ok, ok, ok, group=grp, layout="zigzag"),
        "kernel": lambda: ring_attention(ok, ok, ok, group=grp, kernel="flash_attn"),
    }
    return value_errors(cases), grp.stats.steps


def test_ring_attention_bad_input_is_refused_before_any_transfer():
    expect = {"odd_dual_chunk": "divisible by 4", "gqa_heads": "multiple of k/v heads",
              "head_dim": "head dims differ", "kv_shape": "same shape", "rank3": "q must be",
              "dtype": "dtype", "layout": "layout must be one of", "kernel": "not available"}
    for msgs, steps in run_ranks(_ring_bad, 2):
        assert steps == 0
        assert_messages(msgs, expect)


def test_cuda_code_paths_type_check_on_fake_cuda_tensors():
    """No GPU here: run the CUDA branches (fused flash kernel wrappers, fp32-output matmul) on
    fake CUDA tensors, which checks call signatures, shapes and dtypes without a device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.ops._accum import mm_acc
    from megatron_metp.ops.attention_kernels import TorchFlashKernel, select_kernel

    with FakeTensorMode():
        q = torch.empty(1, 4, 16, 8, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 2, 16, 8, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(1, 2, 16, 8, dtype=torch.bfloat16, device="cuda")
        assert select_kernel(q.device, q.dtype, "torch_flash") is TorchFlashKernel
        assert select_kernel(q.device, torch.float32).name == "reference"  # fp32 on CUDA
        out, lse = TorchFlashKernel.forward(q, k, v, True, 0.3)
        assert out.shape == q.shape and lse.shape == (1, 4, 16) and lse.dtype == torch.float32
        dq, dk, dv = TorchFlashKernel.backward(out.float(), q, k, v, out, lse, True, 0.3)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        acc = torch.zeros(16, 8, dtype=torch.float32, device="cuda")
        mm_acc(acc, torch.empty(16, 4, dtype=torch.bfloat16, device="cuda"),
               torch.empty(4, 8, dtype=torch.bfloat16, device="cuda"))
        assert acc.dtype == torch.float32 and acc.device.type == "cuda"
