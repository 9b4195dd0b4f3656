"""The block-kernel registry (:mod:`megatron_metp.ops.kernel_choice`) and the GPU adapters
(:mod:`megatron_metp.ops.gpu_kernels`), on CPU by emulation.

Choice: fake platforms (H100 with FlashAttention-3, A100, an older torch, a B200, an sm75) give
the order cudnn > flash_attn_3 > flash_attn > torch_flash > reference with each kernel's own
conditions; ``METP_ATTENTION_KERNEL`` and ``kernel=`` override; unknown or unavailable names are
refused naming the variable and what is available; the choice is logged once and recorded.

Adapters: each GPU library is replaced by a CPU emulation with its signature and its output
layout (cuDNN: ``[b, h, n, d]`` and ``lse [b, h, n, 1]``; FlashAttention-2/3: ``[b, n, h, d]``
and ``lse [b, h, n]``), computed by the fp32 reference. Blocks (one full, one causal piece) go
through the adapter and the ring's log-sum-exp merge (:mod:`megatron_metp.ops.lse`), the
backward through the adapter with the merged output and log-sum-exp; all is checked against a
float64 autograd reference (rel. error ≤ 1e-5), MHA and GQA. Negative control: an emulation that
returns a base-2 log-sum-exp is caught.
"""

import math

import pytest
import torch

from megatron_metp import METPGroup
from megatron_metp.ops import gpu_kernels, kernel_choice, lse as lse_ops
from megatron_metp.ops.attention_kernels import ReferenceKernel, _BY_NAME, select_kernel
from megatron_metp.ops.kernel_choice import KERNELS, Platform, available_kernels, chosen_kernel
from tests.harness import run_ranks, unset_env
from tests.numerics import rel_err

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
BOTH = {"flash_attn_interface": "", "flash_attn": ""}
H100 = Platform((2, 13), (9, 0), 90100, dict(BOTH))


def _on(monkeypatch, pf):
    monkeypatch.setattr(kernel_choice, "platform", lambda: pf)
    unset_env(monkeypatch, "METP_ATTENTION_KERNEL")


# ------------------------------------------------------------------------------ the choice

@pytest.mark.parametrize("pf, dtype, head_dim, expect", [
    (H100, BF16, 128, KERNELS),                                           # everything, in order
    (Platform((2, 4), (9, 0), 90100, dict(BOTH)), BF16, 128,              # torch without cuDNN
     ("flash_attn_3", "flash_attn", "torch_flash", "reference")),         # SDPA ops
    (Platform((2, 13), (9, 0), 8900, dict(BOTH)), BF16, 128,              # cuDNN 8
     ("flash_attn_3", "flash_attn", "torch_flash", "reference")),
    (Platform((2, 13), (8, 0), 90100, dict(BOTH)), BF16, 128,             # A100: no FA3
     ("cudnn", "flash_attn", "torch_flash", "reference")),
    (Platform((2, 4), (8, 0), 90100, {"flash_attn": ""}), torch.float16, 64,
     ("flash_attn", "torch_flash", "reference")),
    (Platform((2, 13), (10, 0), 90800, dict(BOTH)), BF16, 128,            # B200: FA3 is sm90 only
     ("cudnn", "flash_attn", "torch_flash", "reference")),
    (Platform((2, 13), (9, 0), 90100, {"flash_attn": "flash-attn 2.6.3: METP needs >= 2.7"}),
     BF16, 128, ("cudnn", "torch_flash", "reference")),
    (H100, BF16, 192, ("flash_attn_3", "flash_attn", "torch_flash", "reference")),  # cuDNN ≤ 128
    (H100, torch.float32, 128, ("reference",)),                            # 16-bit kernels only
    (Platform((2, 13), (7, 5), 90100, dict(BOTH)), torch.float16, 128, ("reference",)),  # sm75
])
def test_order_and_per_platform_fallback(monkeypatch, pf, dtype, head_dim, expect):
    _on(monkeypatch, pf)
    assert available_kernels(CUDA, dtype, head_dim) == expect
    assert select_kernel(CUDA, dtype, head_dim=head_dim).name == expect[0]
    assert chosen_kernel() == expect[0] and chosen_kernel(CUDA, dtype) == expect[0]


def test_cpu_choice_unchanged(monkeypatch):
    _on(monkeypatch, Platform((2, 13), None, None, {}))
    cpu = torch.device("cpu")
    assert available_kernels(cpu, BF16) == ("torch_flash", "reference")
    assert select_kernel(cpu).name == "torch_flash"


def test_override_and_refusals(monkeypatch):
    _on(monkeypatch, H100)
    monkeypatch.setenv("METP_ATTENTION_KERNEL", "flash_attn")
    assert select_kernel(CUDA, BF16, head_dim=128).name == "flash_attn"
    assert select_kernel(CUDA, BF16, "torch_flash").name == "torch_flash"  # kernel= wins
    monkeypatch.setenv("METP_ATTENTION_KERNEL", "auto")
    assert select_kernel(CUDA, BF16, head_dim=128).name == "cudnn"
    monkeypatch.setenv("METP_ATTENTION_KERNEL", "flashattention")
    with pytest.raises(ValueError, match=r"must be one of .*METP_ATTENTION_KERNEL.*got "
                                         r"'flashattention'; available here: \('cudnn'"):
        select_kernel(CUDA, BF16)
    monkeypatch.setenv("METP_ATTENTION_KERNEL", "flash_attn_3")
    with pytest.raises(ValueError, match=r"'flash_attn_3' \(METP_ATTENTION_KERNEL=flash_attn_3\)"
                                         r" is not available for bfloat16 on cuda: Hopper .*9\.0"
                                         r".* 8\.0; available: \('cudnn', 'flash_attn'"):
        _on(monkeypatch, Platform((2, 13), (8, 0), 90100, dict(BOTH)))
        monkeypatch.setenv("METP_ATTENTION_KERNEL", "flash_attn_3")
        select_kernel(CUDA, BF16)
    with pytest.raises(ValueError, match="flash_attn not installed .*pip install flash-attn"):
        _on(monkeypatch, Platform((2, 13), (9, 0), 90100, {}))
        select_kernel(CUDA, BF16, "flash_attn")


def test_choice_logged_once_per_process_and_recorded(monkeypatch, caplog, capsys):
    _on(monkeypatch, Platform((2, 13), (9, 0), 90100, {"flash_attn": ""}))
    monkeypatch.setattr(kernel_choice, "_logged", set())
    with caplog.at_level("INFO", logger="megatron_metp.attention_kernel"):
        for _ in range(3):
            select_kernel(CUDA, BF16, head_dim=128)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[METP] attention kernel: cudnn (auto: best available for cuda "
                               "bfloat16, head dim 128; order cudnn > flash_attn_3 > ")
    assert "not here" not in lines[0]
    assert capsys.readouterr().out.count("[METP] attention kernel: cudnn") == 1  # rank 0 prints
    from megatron_metp.ops import chosen_kernel as exported, kernel_names
    assert exported() == "cudnn" and kernel_names() == KERNELS
    with caplog.at_level("INFO", logger="megatron_metp.attention_kernel"):
        select_kernel(CUDA, BF16, "flash_attn", head_dim=128)
    assert "flash_attn (kernel= argument" in caplog.records[-1].getMessage()
    assert "not here: flash_attn_3 (flash_attn_interface not installed" in \
        caplog.records[-1].getMessage()
    assert chosen_kernel() == "flash_attn"


def _disagree(rank, p):
    import os

    import torch.distributed as dist

    from megatron_metp.ops import ring_attention

    os.environ["METP_ATTENTION_KERNEL"] = "reference" if rank == 0 else "torch_flash"
    q = torch.randn(4, 1, 2, 8)
    try:
        grp = METPGroup.from_process_group(dist.group.WORLD, name="kernel-test", timeout_s=10.0)
        ring_attention(q, q, q, group=grp)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_choose_differently_are_refused():
    for msg in run_ranks(_disagree, 2, timeout=60):
        assert "kernel differs: reference on rank 0" in msg and "torch_flash on rank 1" in msg


# ------------------------------------------------------------------------------ the adapters

def _ref_fwd(q, k, v, causal, scale):
    """The fp32 reference in heads-first layout (what every emulation computes)."""
    return ReferenceKernel.forward(q, k, v, causal, scale)


def _ref_bwd(dout, q, k, v, out, lse, causal, scale):
    return ReferenceKernel.backward(dout, q, k, v, out, lse, causal, scale)


class _Emulations:
    """CPU stand-ins for the libraries, with their signatures and output layouts. ``log2``:
    return a base-2 log-sum-exp (the negative control)."""

    def __init__(self, log2=False):
        self.k = 1 / math.log(2) if log2 else 1.0
        self.calls = []

    # torch.ops.aten._scaled_dot_product_cudnn_attention{,_backward} (torch 2.13 schema)
    def cudnn_ops(self):
        def fwd(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
            assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
            assert query.shape[1] == key.shape[1]  # the adapter hands cuDNN equal head counts
            self.calls.append(("cudnn", tuple(query.shape), tuple(key.shape), is_causal))
            out, lse = _ref_fwd(query, key, value, is_causal, scale)
            z = torch.zeros((), dtype=torch.int64)
            return (out.to(query.dtype), (lse * self.k).unsqueeze(-1), None, None,
                    query.shape[2], key.shape[2], z, z, None)

        def bwd(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                scale=None):
            assert tuple(logsumexp.shape) == (*query.shape[:3], 1)
            assert (max_q, max_k) == (query.shape[2], key.shape[2]) and attn_bias is None
            return _ref_bwd(grad_out, query, key, value, out, logsumexp.squeeze(-1), is_causal,
                            scale)
        return fwd, bwd

    # flash_attn.flash_attn_interface (2.7+): tokens first, lse [b, h, n]
    def fa2_ops(self):
        def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                softcap, alibi_slopes, return_softmax):
            assert (window_size_left, window_size_right, dropout_p) == (-1, -1, 0.0)
            self.calls.append(("flash_attn", tuple(q.shape), tuple(k.shape), causal))
            out, lse = _ref_fwd(*(t.transpose(1, 2) for t in (q, k, v)), causal, softmax_scale)
            return (out.transpose(1, 2).to(q.dtype).contiguous(), lse * self.k,
                    torch.empty(0), torch.empty(2, dtype=torch.int64))

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                rng_state=None):
            assert tuple(softmax_lse.shape) == (q.shape[0], q.shape[2], q.shape[1])
            g = _ref_bwd(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), softmax_lse, causal,
                         softmax_scale)
            for dst, src in zip((dq, dk, dv), g):
                dst.copy_(src.transpose(1, 2))
            return torch.empty(0)
        return fwd, bwd

    # flash_attn_interface (FlashAttention-3): keywords, tokens first, lse [b, h, n]
    def fa3_ops(self):
        def fwd(q, k, v, k_new=None, v_new=None, qv=None, out_=None, *, softmax_scale=None,
                causal=False, **rest):
            assert not rest and k_new is None and out_ is None
            self.calls.append(("flash_attn_3", tuple(q.shape), tuple(k.shape), causal))
            out, lse = _ref_fwd(*(t.transpose(1, 2) for t in (q, k, v)), causal, softmax_scale)
            return out.transpose(1, 2).to(q.dtype), lse * self.k, torch.empty(0), torch.empty(0)

        def bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, *,
                dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False, **rest):
            assert not rest and tuple(softmax_lse.shape) == (q.shape[0], q.shape[2], q.shape[1])
            g = _ref_bwd(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), softmax_lse,
                         is_causal, softmax_scale)
            for dst, src in zip((dq, dk, dv), g):
                dst.copy_(src.transpose(1, 2))
            return torch.empty(0)
        return fwd, bwd


def _emulate(monkeypatch, log2=False):
    em = _Emulations(log2)
    for name in ("cudnn_ops", "fa2_ops", "fa3_ops"):
        monkeypatch.setattr(gpu_kernels, name, getattr(em, name))
    return em


def _exact(q, ks, vs, masks, dout, scale):
    """float64 autograd over all keys at once: ``(out, lse, dq, dk, dv)``."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, torch.cat(ks, 2), torch.cat(vs, 2)))
    g = q.shape[1] // k64.shape[1]
    s = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) * scale
    s = s.masked_fill(~torch.cat(masks, 1), float("-inf"))
    out = torch.softmax(s, -1) @ v64.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), q64.grad, k64.grad, v64.grad


def _run_blocks(kern, hq, hkv, seed=0):
    """A full block (6 earlier keys) and a causal square piece (8 keys) for 8 query rows, merged
    as the ring merges them; backward per block from the merged output and log-sum-exp."""
    g = torch.Generator().manual_seed(seed)
    b, n, m, d = 2, 8, 6, 16
    scale = d ** -0.5
    q = torch.randn(b, hq, n, d, generator=g)
    ka, va = (torch.randn(b, hkv, m, d, generator=g) for _ in range(2))
    kc, vc = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    dout = torch.randn(b, hq, n, d, generator=g)
    oc, lc = kern.forward(q, kc, vc, True, scale)    # the diagonal piece covers every row
    out, lse = lse_ops.start(oc, lc)
    oa, la = kern.forward(q, ka, va, False, scale)
    lse_ops.merge_(out, lse, oa, la)
    ga = kern.backward(dout, q, ka, va, out, lse, False, scale)
    gc = kern.backward(dout, q, kc, vc, out, lse, True, scale, workspace={})
    got = (out, lse, ga[0] + gc[0], torch.cat([ga[1], gc[1]], 2), torch.cat([ga[2], gc[2]], 2))
    want = _exact(q, [ka, kc], [va, vc],
                  [torch.ones(n, m, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()],
                  dout, scale)
    return {w: rel_err(x, y) for w, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want)}


@pytest.mark.parametrize("name", ["cudnn", "flash_attn_3", "flash_attn"])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
def test_adapter_and_merge_match_the_reference(monkeypatch, name, hq, hkv):
    em = _emulate(monkeypatch)
    errs = _run_blocks(_BY_NAME[name], hq, hkv)
    assert max(errs.values()) <= 1e-5, errs
    native_gqa = kernel_choice.kernel_support(name)["gqa_native"]
    for kname, qs, ks, causal in em.calls:
        assert kname == name
        heads_k = ks[2] if native_gqa else ks[1]
        # FA2/3 get the hkv K/V heads (native GQA); cuDNN gets K/V unexpanded for the full block
        # (query heads folded into rows) and expanded only for the causal piece
        assert heads_k == (hkv if native_gqa or not causal else hq), (qs, ks, causal)


@pytest.mark.parametrize("name", ["cudnn", "flash_attn_3", "flash_attn"])
def test_negative_control_base2_lse_is_caught(monkeypatch, name):
    _emulate(monkeypatch, log2=True)
    errs = _run_blocks(_BY_NAME[name], 4, 2)
    assert errs["out"] > 1e-3 and errs["lse"] > 1e-2, errs


def test_support_table_matches_the_kernels():
    assert tuple(kernel_choice.SUPPORTS) == KERNELS
    q = torch.empty(1, 2, 4, 8)
    for name in KERNELS:
        sup = kernel_choice.kernel_support(name)
        assert sup["causal"] and bool(sup["masks"]) == _BY_NAME[name].takes_mask(q), name
    assert [n for n in KERNELS if kernel_choice.kernel_support(n)["gqa_native"]] == \
        ["flash_attn_3", "flash_attn"]
    with pytest.raises(ValueError, match="unknown attention kernel 'xformers'"):
        kernel_choice.kernel_support("xformers")


def test_cudnn_adapter_matches_torch_schema_on_meta_tensors():
    """The real torch ops (this torch's schema and meta shapes), no emulation: the adapter's
    call is accepted and ``lse [b, h, n, 1]`` comes out as ``[b, h, n]``."""
    K = _BY_NAME["cudnn"]
    q = torch.empty(2, 4, 16, 8, dtype=BF16, device="meta")
    k = torch.empty(2, 2, 16, 8, dtype=BF16, device="meta")
    for causal in (True, False):
        out, lse = K.forward(q, k, k, causal, 0.3)
        assert out.shape == q.shape and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
        dq, dk, dv = K.backward(out, q, k, k, out, lse, causal, 0.3)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_unexpected_lse_layout_is_refused(monkeypatch):
    em = _Emulations()
    fwd, bwd = em.fa2_ops()
    monkeypatch.setattr(gpu_kernels, "fa2_ops",
                        lambda: (lambda *a, **kw: (fwd(*a, **kw)[0], torch.zeros(3)), bwd))
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="'flash_attn' returned a log-sum-exp of shape"):
        _BY_NAME["flash_attn"].forward(q, q, q, True, 0.3)
