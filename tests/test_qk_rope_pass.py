"""One RoPE pass for q and k (``ops/attention_prep.project_block``, issue 41's layer traffic and
launches): with one query head per group and no q/k norm, q, k and v share one buffer and q and k
are rotated together: the same values bit for bit as rotating each on its own (fp32 and bf16,
a partial rotary width), half the RoPE kernels. Negative control: GQA (two query heads per
group) keeps the two passes."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_metp.ops import attention_prep as AP
from megatron_metp.ops.rope import apply_rope, rope_tables


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _geo(qpg, groups):
    return type("Geo", (), dict(q_per_group=qpg, d=8, groups_local=groups))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qpg", [1, 2])
def test_one_rope_pass_for_q_and_k(dtype, qpg):
    g = torch.Generator().manual_seed(qpg)
    n, b, G, d, h = 16, 2, 3, 8, 12
    x2 = torch.randn(n * b, h, generator=g).to(dtype)
    w = torch.randn(G * (qpg + 2) * d, h, generator=g).to(dtype)
    freqs = torch.randn(n, 1, 1, 6, generator=g)  # rotary width 6 < d: the rest copied
    tables = rope_tables(freqs, dtype)
    with _Ops() as ops:
        q, k, v, kv = AP.project_block(x2, w, None, _geo(qpg, G), n, b, 1, (freqs, tables))
    t = AP.project(x2, w, None).view(n, b, G, qpg + 2, d)
    want_q = apply_rope(t[:, :, :, :qpg], freqs, tables=tables).flatten(2, 3).permute(1, 2, 0, 3)
    want_k = apply_rope(t[:, :, :, qpg], freqs, tables=tables).permute(1, 2, 0, 3)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, t[:, :, :, qpg + 1].permute(1, 2, 0, 3))
    assert q.is_contiguous() and kv.is_contiguous() and kv.numel() == 2 * b * G * n * d
    assert torch.equal(kv, torch.cat([k.flatten(), v.flatten()]))
    rope_kernels = sum(ops.names.count(o) for o in ("mul", "addcmul_"))
    assert rope_kernels == (3 if qpg == 1 else 6), ops.names
