"""The attention references agree with stock Megatron SelfAttention, and megatron_metp.megatron.cpu is safe.

(a) reference_self_attention == stock SelfAttention at TP=1 (fp32), MHA and GQA, +/- RoPE, biases;
(b) the same at TP=2 (including ng < p, Megatron's all-gather path);
(c) negative controls: a wrong qkv layout or a missing RoPE is caught;
(d) megatron_metp.megatron.cpu.enable() is idempotent, reversible and refuses when CUDA is claimed.
"""

import pytest
import torch

from megatron_metp.megatron import cpu as mcpu
from tests.harness import run_ranks
from tests.megatron_ref import (RESULT_KEYS, full_attention_params, qkv_layout,
                                reference_self_attention, rel_err, rope_freqs,
                                stock_tp_self_attention)

S, B, H, D = 8, 2, 16, 4

# (num_heads, num_query_groups, qkv_bias, proj_bias, rope)
P1_CASES = [
    (4, 4, True, True, False),    # MHA, all biases
    (4, 4, False, False, True),   # MHA, RoPE, no bias
    (4, 2, True, False, True),    # GQA, RoPE, qkv bias only (add_qkv_bias)
    (4, 2, False, True, False),   # GQA, proj bias only (zero qkv bias in Megatron)
]
P2_CASES = [
    (4, 4, True, True, True),     # MHA, 2 heads per rank
    (4, 2, True, True, True),     # GQA, 1 group per rank
    (4, 1, False, True, True),    # GQA with ng < p: Megatron all-gathers and re-slices qkv
]


def _full(np_, ng, qkv_bias, proj_bias, rope, seed=0, dtype=torch.float32):
    return full_attention_params(S, B, H, np_, ng, D, qkv_bias=qkv_bias, proj_bias=proj_bias,
                                 rope=rope, seed=seed, dtype=dtype)


def _errors(got, ref):
    assert set(got) == set(ref) == set(RESULT_KEYS)
    for k in RESULT_KEYS:
        assert (got[k] is None) == (ref[k] is None), k
    return {k: rel_err(got[k], ref[k]) for k in RESULT_KEYS if ref[k] is not None}


def _expected_keys(qkv_bias, proj_bias):
    return ({"y", "dx", "dqkv_w", "dproj_w"} | ({"dqkv_b"} if qkv_bias else set())
            | ({"dproj_b"} if proj_bias else set()))


_STOCK = {}


def _stock(p, case):
    """Stock results are reused by the negative controls (one fork per case)."""
    if (p, case) not in _STOCK:
        np_, ng = case[:2]
        _STOCK[p, case] = stock_tp_self_attention(p, _full(*case), num_heads=np_,
                                                  num_query_groups=ng)
    return _STOCK[p, case]


@pytest.mark.parametrize("p,case", [(1, c) for c in P1_CASES] + [(2, c) for c in P2_CASES])
def test_reference_matches_stock_megatron_self_attention(p, case):
    np_, ng, qkv_bias, proj_bias, rope = case
    full = _full(*case)
    ref = reference_self_attention(full, num_heads=np_, num_query_groups=ng)
    got = _stock(p, case)
    assert got["y"].shape == (S, B, H) and got["dqkv_w"].shape == full["qkv_weight"].shape
    errs = _errors(got, ref)
    assert set(errs) == _expected_keys(qkv_bias, proj_bias)
    assert max(errs.values()) <= 1e-5, errs


def _swap_k_v(full, np_, ng):
    _, k, v = qkv_layout(np_, ng, D)
    bad = dict(full)
    for key in ("qkv_weight", "qkv_bias"):
        if full[key] is not None:
            t = full[key].clone()
            t[k], t[v] = full[key][v], full[key][k]
            bad[key] = t
    return bad


def _blocked_layout(full, np_, ng):
    """Read the interleaved weight as if it were [all q | all k | all v] (a common mistake)."""
    q, k, v = qkv_layout(np_, ng, D)
    order = torch.cat([q, k, v])
    bad = dict(full)
    bad["qkv_weight"] = full["qkv_weight"][torch.argsort(order)]
    return bad


@pytest.mark.parametrize("mistake", ["swap_k_v", "blocked_layout", "no_rope"])
def test_negative_controls_are_caught(mistake):
    case = (4, 2, False, True, True)  # GQA with RoPE (a P1 case: stock result reused)
    np_, ng = case[:2]
    full = _full(*case)
    if mistake == "swap_k_v":
        bad, rope = _swap_k_v(full, np_, ng), None
    elif mistake == "blocked_layout":
        bad, rope = _blocked_layout(full, np_, ng), None
    else:
        bad, rope = full, torch.zeros_like(full["rotary_pos_emb"])  # cos 1, sin 0: no rotation
    ref = reference_self_attention(bad, num_heads=np_, num_query_groups=ng, rotary_pos_emb=rope)
    errs = _errors(_stock(1, case), ref)
    assert errs["y"] > 1e-2 and errs["dqkv_w"] > 1e-2, errs


def test_bf16_stock_close_to_fp32_reference():
    case = (4, 2, True, True, True)
    np_, ng = case[:2]
    full = _full(*case, dtype=torch.bfloat16)
    got = stock_tp_self_attention(2, full, num_heads=np_, num_query_groups=ng,
                                  dtype=torch.bfloat16)
    assert got["y"].dtype == torch.bfloat16 and got["dqkv_w"].dtype == torch.bfloat16
    exact = reference_self_attention(full, num_heads=np_, num_query_groups=ng)  # fp32 math
    same_rounding = reference_self_attention(full, num_heads=np_, num_query_groups=ng,
                                             dtype=torch.bfloat16)
    errs = _errors(got, exact)
    assert max(errs.values()) <= 3e-2, errs  # a few bf16 ulps (2^-8 = 3.9e-3 each)
    assert max(_errors(same_rounding, exact).values()) <= 3e-2


def test_rope_freqs_match_megatron_rotary_embedding():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    emb = RotaryEmbedding(D, 1.0, use_cpu_initialization=True)
    emb.inv_freq = emb.inv_freq.cpu()
    ours = rope_freqs(S, D)
    theirs = torch.cat([emb.get_freqs_non_repeated(S)] * 2, dim=-1)[:, None, None, :]
    assert ours.shape == (S, 1, 1, D) and torch.equal(ours, theirs)


# ---------------------------------------------------------------- megatron_metp.megatron.cpu

def test_enable_refuses_when_cuda_is_claimed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    with pytest.raises(RuntimeError, match="force=True"):
        mcpu.enable()
    with pytest.raises(RuntimeError, match="force=True"):
        mcpu.cuda_to_cpu()
    assert not mcpu.is_enabled() and torch.cuda.current_device is current_device


def _enable_in_child(rank, world):
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import tensor_parallel

    originals = (torch.cuda.current_device, mrandom.initialize_rng_tracker, schedules.torch,
                 fused_softmax.get_default_causal_mask)
    res = {}
    # force=True applies the shims even where CUDA is (claimed) available.
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    mcpu.enable(force=True)
    res["forced"] = mcpu.is_enabled()
    mcpu.disable()
    torch.cuda.is_available = real

    mcpu.enable()
    patched = (torch.cuda.current_device, mrandom.initialize_rng_tracker, schedules.torch,
               fused_softmax.get_default_causal_mask)
    n_saved = len(mcpu._SAVED)
    mcpu.enable()  # idempotent: nothing patched twice
    res["idempotent"] = (len(mcpu._SAVED) == n_saved and all(
        a is b for a, b in zip(patched, (torch.cuda.current_device,
                                         mrandom.initialize_rng_tracker, schedules.torch,
                                         fused_softmax.get_default_causal_mask))))
    res["device"] = torch.cuda.current_device()
    res["zeros"] = schedules.torch.zeros([], dtype=torch.int, device="cuda").device
    res["mask"] = fused_softmax.get_default_causal_mask(3)

    # (b): seeded, per-name CPU streams; fork leaves the default stream untouched.
    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=1, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    res["tracker"] = type(tracker).__name__
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    res["default_untouched"] = torch.equal(before, torch.get_rng_state())
    g = torch.Generator().manual_seed(1234 + 2718 + 1)  # Megatron's TP seed for tp_rank=1
    res["stream"] = torch.equal(a, torch.rand(4, generator=g)) and torch.equal(
        b, torch.rand(4, generator=g))

    # Activation recompute restores the forked stream: same dropout mask, same gradient.
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(8, requires_grad=True)

    def f(x, w):
        with tracker.fork():
            return torch.nn.functional.dropout(x * w, 0.5, training=True)

    state = tracker.get_states().copy()
    f(x, w).sum().backward()
    g_plain = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    tracker.set_states(state)
    tensor_parallel.checkpoint(f, False, x, w).sum().backward()
    mask_used = bool((g_plain[1] == 0).any() and (g_plain[1] != 0).any())
    res["recompute"] = mask_used and torch.equal(g_plain[0], x.grad) and torch.equal(
        g_plain[1], w.grad)

    mcpu.disable()
    mcpu.disable()
    res["restored"] = (not mcpu.is_enabled()) and all(
        a is b for a, b in zip(originals, (torch.cuda.current_device,
                                           mrandom.initialize_rng_tracker, schedules.torch,
                                           fused_softmax.get_default_causal_mask)))
    res["tracker_dropped"] = mrandom._CUDA_RNG_STATE_TRACKER is None
    return res


def test_enable_is_idempotent_and_reversible():
    (res,) = run_ranks(_enable_in_child, 1)  # a forked child: the test process stays unpatched
    assert res["forced"] and res["idempotent"] and res["restored"] and res["tracker_dropped"]
    assert res["device"] == torch.device("cpu") and res["zeros"] == torch.device("cpu")
    assert torch.equal(res["mask"], torch.ones(3, 3, dtype=torch.bool).triu(1))
    assert res["tracker"] == "CpuRNGStatesTracker"
    assert res["default_untouched"] and res["stream"] and res["recompute"]
    assert not mcpu.is_enabled()


def test_cuda_to_cpu_mode():
    with mcpu.cuda_to_cpu():
        a = torch.tensor([1.0], device="cuda")
        z = torch.zeros(2, dtype=torch.int, device="cuda", pin_memory=True)
        assert a.device.type == "cpu" and z.device.type == "cpu"
        assert a.cuda() is a and a.to("cuda").device.type == "cpu"
        assert a.type() == "torch.cuda.FloatTensor"
        assert a.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert a.type(torch.float64).dtype == torch.float64
    assert a.type() == "torch.FloatTensor"


def test_pos_emb_on_this_cp_rank_takes_dual_chunks():
    class Group:
        def __init__(self, r, n):
            self.r, self.n = r, n

        def rank(self):
            return self.r

        def size(self):
            return self.n

    emb = torch.arange(8.0).view(8, 1, 1, 1)
    got = [mcpu._pos_emb_on_this_cp_rank(emb, 0, Group(r, 2)).flatten().tolist() for r in (0, 1)]
    assert got == [[0, 1, 6, 7], [2, 3, 4, 5]]
    mask = mcpu._sliding_window_causal_mask(4, 6, (1, 0))
    expected = ~torch.ones(4, 6, dtype=torch.bool).triu(2 - 1).tril(2 + 0)  # Megatron's formula
    assert torch.equal(mask, expected)


def test_non_causal_matches_too():
    case = (4, 2, True, True, True)
    np_, ng = case[:2]
    full = _full(*case)
    got = stock_tp_self_attention(2, full, num_heads=np_, num_query_groups=ng, causal=False)
    errs = _errors(got, reference_self_attention(full, num_heads=np_, num_query_groups=ng,
                                                 causal=False))
    assert max(errs.values()) <= 1e-5, errs
    causal_ref = reference_self_attention(full, num_heads=np_, num_query_groups=ng)
    assert _errors(got, causal_ref)["y"] > 1e-2  # the mask matters at this size
