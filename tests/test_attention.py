"""METP self-attention against a single-device reference and stock Megatron TP SelfAttention."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import metp_attention, shard_sequence, unshard_sequence
from tests.harness import assert_messages, run_ranks, value_errors
from tests.megatron_ref import (full_attention_params, reference_self_attention,
                                stock_tp_self_attention)
from tests.numerics import rel_err

S, B, H = 24, 2, 16  # S divisible by 2p for p = 1..4


def _shard(full, rank, p, A, G, d):
    rows = (G // p) * (A // G + 2) * d
    cols = (A // p) * d
    sl = slice(rank * rows, (rank + 1) * rows)
    return {"qkv_weight": full["qkv_weight"][sl], "proj_weight": full["proj_weight"][:, rank * cols:(rank + 1) * cols],
            "qkv_bias": None if full["qkv_bias"] is None else full["qkv_bias"][sl],
            "proj_bias": full["proj_bias"]}


def _case_params(case, dtype):
    A, G, d, causal, layout, bias, rope, kernel, seed = case
    return full_attention_params(S, B, H, A, G, d, qkv_bias=bias, proj_bias=bias, rope=rope,
                                 seed=seed, dtype=dtype)


def _metp_rank(rank, p, cases, dtype=torch.float32, wrong_shard=False, local_rope=False):
    results = []
    for case in cases:
        A, G, d, causal, layout, bias, rope, kernel, seed = case
        full = _case_params(case, dtype)
        sh = _shard(full, (rank + 1) % p if wrong_shard else rank, p, A, G, d)
        sh["proj_weight"] = _shard(full, rank, p, A, G, d)["proj_weight"]
        params = {k: None if v is None else v.clone().requires_grad_() for k, v in sh.items()}
        x = shard_sequence(full["x"], rank, p, layout=layout).clone().requires_grad_()
        freqs = full["rotary_pos_emb"]
        if freqs is not None and local_rope:  # Megatron's CP-sliced form
            freqs = shard_sequence(freqs, rank, p, layout=layout)
        grp = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="attn")
        y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=grp,
                           num_heads=A, num_query_groups=G, causal=causal, layout=layout,
                           rotary_pos_emb=freqs, qkv_bias=params["qkv_bias"],
                           proj_bias=params["proj_bias"], kernel=kernel)
        fwd = grp.stats.snapshot()
        y.backward(shard_sequence(full["gy"], rank, p, layout=layout))
        results.append({"y": y.detach(), "dx": x.grad, "fwd": fwd, "total": grp.stats.snapshot(),
                        "kernels": dict(grp.stats.kernels),
                        **{"d" + k: None if v is None else v.grad for k, v in params.items()}})
    return results


def _gather(out, i, layout):
    rs = [o[i] for o in out]
    return {"y": unshard_sequence([r["y"] for r in rs], layout=layout),
            "dx": unshard_sequence([r["dx"] for r in rs], layout=layout),
            "dqkv_w": torch.cat([r["dqkv_weight"] for r in rs]),
            "dqkv_b": None if rs[0]["dqkv_bias"] is None else torch.cat([r["dqkv_bias"] for r in rs]),
            "dproj_w": torch.cat([r["dproj_weight"] for r in rs], dim=1),
            "dproj_b": None if rs[0]["dproj_bias"] is None else sum(r["dproj_bias"].double() for r in rs)}


def _errors(got, ref):
    return {k: rel_err(got[k], ref[k]) for k in ref if ref[k] is not None}


def _reference(case, dtype=torch.float32, ref_dtype=torch.float32):
    A, G, d, causal, layout, bias, rope, kernel, seed = case
    return reference_self_attention(_case_params(case, dtype), num_heads=A, num_query_groups=G,
                                    causal=causal, dtype=ref_dtype)


# (A heads, G query groups, head dim, causal, layout, bias, rope, kernel, seed)
CASES = {
    1: [(4, 4, 4, True, "dual_chunk", True, True, "torch_flash", 0),
        (8, 2, 2, True, "contiguous", False, False, "reference", 1),
        (4, 1, 4, True, "dual_chunk", True, True, "torch_flash", 2),     # MQA
        (4, 2, 4, False, "dual_chunk", True, False, "reference", 3)],
    2: [(4, 4, 4, True, "dual_chunk", True, True, "torch_flash", 0),
        (8, 2, 2, True, "contiguous", False, True, "reference", 1),      # GQA
        (4, 2, 4, False, "dual_chunk", True, False, "torch_flash", 3)],
    3: [(6, 3, 2, True, "dual_chunk", True, True, "torch_flash", 0),     # GQA, odd p
        (6, 6, 2, True, "contiguous", False, True, "reference", 1),
        (12, 3, 2, False, "contiguous", True, False, "torch_flash", 2)],
    4: [(8, 4, 2, True, "dual_chunk", True, True, "torch_flash", 0),
        (4, 4, 4, True, "contiguous", False, False, "reference", 1)],
}


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_metp_attention_fp32_parity(p):
    cases = CASES[p]
    out = run_ranks(_metp_rank, p, cases)
    for i, case in enumerate(cases):
        errs = _errors(_gather(out, i, case[4]), _reference(case))
        assert len(errs) == (6 if case[5] else 4)
        assert max(errs.values()) <= 1e-5, (case, errs)
        assert set(out[0][i]["kernels"]) == {case[7]}


def test_rope_given_as_megatron_cp_slice_equals_full_table():
    cases = [CASES[2][0]]
    a = run_ranks(_metp_rank, 2, cases)
    b = run_ranks(_metp_rank, 2, cases, torch.float32, False, True)
    for ra, rb in zip(a, b):
        assert torch.equal(ra[0]["y"], rb[0]["y"]) and torch.equal(ra[0]["dx"], rb[0]["dx"])


def test_negative_control_wrong_head_group_shard_is_caught():
    case = CASES[3][0]
    out = run_ranks(_metp_rank, 3, [case], torch.float32, True)
    errs = _errors(_gather(out, 0, case[4]), _reference(case))
    assert errs["y"] > 1e-2 and errs["dqkv_w"] > 1e-2, errs


@pytest.mark.parametrize("p", [2, 3])
def test_metp_attention_traffic_matches_closed_form(p):
    case = (2 * p, p, 2, True, "dual_chunk", True, False, "reference", 0)  # A=2p, G=p, d=2
    A, G, d = case[:3]
    res = run_ranks(_metp_rank, p, [case])
    w = ((G // p) * (A // G + 2) * d * H + (G // p) * (A // G + 2) * d + H * (A // p) * d) * 4
    kv = 2 * (S // p) * B * (G // p) * d * 4  # K and V of one head group, fp32
    for r in res:
        f, t = r[0]["fwd"], r[0]["total"]
        assert f == {"steps": (p - 1) + p * (p - 1), "bytes_sent": p * (p - 1) * kv,
                     "bytes_received": (p - 1) * w + p * (p - 1) * kv}
        assert t["steps"] == 3 * (p - 1) + 3 * p * (p - 1)
        assert t["bytes_sent"] == (p - 1) * w + 3 * p * (p - 1) * kv
        assert t["bytes_received"] == 2 * (p - 1) * w + 3 * p * (p - 1) * kv


# ---------------------------------------------------------------- bf16 against stock Megatron TP

def _mean_errors(runs):
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


@pytest.mark.parametrize("kernel", ["reference", "torch_flash"])
@pytest.mark.parametrize("p", [2, 3])
def test_bf16_no_worse_than_stock_megatron_tp_self_attention(p, kernel):
    """bf16 errors against the fp32 reference from the same bf16 weights, averaged over 3 seeds.

    Stock TP runs Megatron's unfused DotProductAttention (local spec). One bf16 rounding is noise
    on these sizes, so "no worse" means: the summed error is at most stock TP's and no quantity
    is more than 10 % above stock TP's (the unfused ``reference`` kernel, the same math as stock).
    PyTorch's fused kernel returns each block's gradients rounded to bf16, so with ``torch_flash``
    the p block partials of dQ/dK/dV carry p roundings; there the per-quantity margin is 25 %
    (measured: at most 17 %, on the qkv bias), and the summed error must still beat stock TP.
    The replicated proj bias is METP's per-rank partial (as in test_mlp), bounded by one bf16
    ulp instead.
    """
    A, G, d = 2 * p, p, 4
    metp_runs, stock_runs = [], []
    for seed in (7, 8, 9):
        case = (A, G, d, True, "dual_chunk", True, True, kernel, seed)
        full = _case_params(case, torch.bfloat16)
        ref = reference_self_attention(full, num_heads=A, num_query_groups=G, causal=True,
                                       dtype=torch.float32)
        out = run_ranks(_metp_rank, p, [case], torch.bfloat16)
        metp_runs.append(_errors(_gather(out, 0, case[4]), ref))
        stock_runs.append(_errors(stock_tp_self_attention(p, full, num_heads=A, num_query_groups=G,
                                                          causal=True, dtype=torch.bfloat16), ref))
    metp, stock = _mean_errors(metp_runs), _mean_errors(stock_runs)
    print(f"\nbf16 attention p={p} kernel={kernel}: METP {metp}\n  stock TP {stock}")
    assert sum(metp.values()) <= sum(stock.values()), (metp, stock)
    for k in stock:
        margin = 1.1 if kernel == "reference" else 1.25
        bound = 2 ** -8 if k == "dproj_b" else margin * stock[k]
        assert metp[k] <= bound, (k, metp[k], stock[k])


# ---------------------------------------------------------------- bad input

def _bad(rank, p):
    grp = METPGroup.from_process_group(dist.group.WORLD, name="bad-attn")
    x = torch.zeros(4, 1, 8)
    wq, wo = torch.zeros(2 * 3 * 2, 8), torch.zeros(8, 2 * 2)  # A=4, G=4 -> per rank 2 groups, d=2
    kw = dict(group=grp, num_heads=4, num_query_groups=4)
    cases = {
        "groups_not_divisible": lambda: metp_attention(x, torch.zeros(3 * 2, 8), torch.zeros(8, 2),
                                                       group=grp, num_heads=2, num_query_groups=1),
        "heads_vs_groups": lambda: metp_attention(x, wq, wo, group=grp, num_heads=6,
                                                  num_query_groups=4),
        "head_dim_mismatch": lambda: metp_attention(x, wq, torch.zeros(8, 6), **kw),
        "qkv_rows": lambda: metp_attention(x, torch.zeros(13, 8), wo, **kw),
        "hidden": lambda: metp_attention(torch.zeros(4, 1, 9), wq, wo, **kw),
        "odd_tokens": lambda: metp_attention(torch.zeros(3, 1, 8), wq, wo, **kw),
        "rope_shape": lambda: metp_attention(x, wq, wo, rotary_pos_emb=torch.zeros(5, 1, 1, 2), **kw),
        "dtype": lambda: metp_attention(x, wq.double(), wo, **kw),
        "proj_bias": lambda: metp_attention(x, wq, wo, proj_bias=torch.zeros(7), **kw),
    }
    return value_errors(cases), grp.stats.steps


def test_metp_attention_bad_input_is_refused_before_any_transfer():
    expect = {"groups_not_divisible": "not divisible by the METP group size 2",
              "heads_vs_groups": "multiple of num_query_groups", "head_dim_mismatch": "proj_weight",
              "qkv_rows": "qkv_weight", "hidden": "qkv_weight", "odd_tokens": "divisible by 4",
              "rope_shape": "rotary_pos_emb", "dtype": "dtype", "proj_bias": "proj_bias"}
    for msgs, steps in run_ranks(_bad, 2):
        assert steps == 0
        assert_messages(msgs, expect)
