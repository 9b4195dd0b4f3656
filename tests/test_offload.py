"""Host offload of saved activations (``megatron_metp.runtime.offload.ActivationOffloader``).

* Exact: loss and gradients with the offload equal those without (bit-identical), and a corrupted
  host copy is caught by the same comparison (negative control).
* Bookkeeping: every offloaded tensor comes back, the host holds nothing after backward.
* Memory under fake tensors: the device keeps only what is not offloaded; the host peak is the
  offloaded bytes; the backward re-forms at most two layer groups at a time.
"""

import pytest
import torch

from megatron_metp.runtime.offload import ActivationOffloader


class Block(torch.nn.Module):
    """A stand-in for Megatron's TransformerBlock: ``layers`` run in turn."""

    def __init__(self, n, h, dtype=torch.float32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(h, dtype=dtype), torch.nn.Linear(h, 4 * h, dtype=dtype),
            torch.nn.GELU(), torch.nn.Linear(4 * h, h, dtype=dtype)) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _run(block, x, offloader=None, corrupt=False):
    for p in block.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    y = block(x)
    if corrupt:
        entry = next(e for g in offloader._groups.values() for e in g)
        entry.host.add_(1.0)
    (y * y).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]


def test_offload_is_exact_and_returns_everything():
    torch.manual_seed(0)
    block = Block(3, 16)
    x = torch.randn(64, 16)
    ref = _run(block, x)
    off = ActivationOffloader(min_bytes=0).attach(block)
    got = _run(block, x, off)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    st = off.stats
    assert st.offloaded > 0 and st.offloaded_bytes == st.fetched_bytes
    assert st.host_bytes == 0 and off.pending() == 0
    assert set(st.by_group) >= {1, 2, 3}          # one group per layer (0: before the first)
    assert st.prefetched_groups >= 2              # groups 2 and 1 brought back ahead of time
    # negative control: a corrupted host copy changes the gradients
    bad = _run(block, x, off, corrupt=True)
    assert not all(torch.equal(a, b) for a, b in zip(bad, ref))


def test_small_tensors_and_parameters_stay():
    block = Block(2, 8)
    off = ActivationOffloader(min_bytes=1 << 30).attach(block)
    _run(block, torch.randn(4, 8), off)
    assert off.stats.offloaded == 0
    with pytest.raises(ValueError, match="min_bytes"):
        ActivationOffloader(min_bytes=-1)
    with pytest.raises(ValueError, match="already has"):
        off.attach(block)


def test_fake_memory_device_and_host():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.tools import fakerank as FR

    n_layers, rows, h = 6, 4096, 256

    def measure(offload):
        with FakeTensorMode():
            block = Block(n_layers, h, dtype=torch.bfloat16)
            off = ActivationOffloader().attach(block) if offload else None
            x = torch.empty(rows, h, dtype=torch.bfloat16, requires_grad=True)
            trk = FR.tracker()
            with FR.measuring(trk):
                y = block(x)
                after_fwd = FR.snap(trk, "current")["cat"].get("ACT", 0)
                y.float().sum().backward()
            peak = FR.snap(trk, "peak")["total"]
        return after_fwd, peak, off

    kept, peak, _ = measure(False)
    kept_off, peak_off, off = measure(True)
    per_layer = off.stats.offloaded_bytes / n_layers
    # the offloaded bytes left the device, and the host held all of them at its peak
    assert kept - kept_off == pytest.approx(off.stats.offloaded_bytes, rel=0.01)
    assert off.stats.host_peak == off.stats.offloaded_bytes and off.stats.host_bytes == 0
    # the backward re-forms at most two groups at a time: peak well below the no-offload one
    assert peak_off <= peak - (n_layers - 3) * per_layer


# ---------------------------------------------------------------- inside Megatron (forked ranks)

from megatron_metp.megatron.training import GPTSize, Layout  # noqa: E402
from tests.gpt_cases import SIZE  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.test_recompute import RECOMPUTE, _assert_same, _variants  # noqa: E402

SWIGLU = GPTSize(**{**SIZE.__dict__, "swiglu": True})
OFF = {"offload_activations": True}


def _offload_variants(rank, world, size, base, variants):
    """``_variants`` with every saved tensor offloaded (the tiny model's are < 1 MiB), and the
    offloaders' statistics: what went to the host came back."""
    from megatron_metp.runtime import offload

    offload.DEFAULT_MIN_BYTES = 0
    attached = []
    attach = offload.ActivationOffloader.attach

    def recording(self, block):
        attached.append(self)
        return attach(self, block)

    offload.ActivationOffloader.attach = recording
    out = _variants(rank, world, size, base, variants)
    out["stats"] = [(o.stats.offloaded, o.stats.offloaded_bytes, o.stats.fetched_bytes,
                     o.stats.host_bytes, o.pending(), o.stats.host_peak) for o in attached]
    return out


def _check_stats(per_rank):
    for res in per_rank:
        assert res["stats"], "no offloader was attached"
        for n, sent, back, held, pending, peak in res["stats"]:
            # the streaming layer op (full recompute, megatron/streaming.py) keeps its layer
            # inputs on the host itself: counted in host_peak, not as offloaded saved tensors
            assert (n > 0 or peak > 0) and sent == back and held == 0 and pending == 0, \
                res["stats"]


@pytest.fixture(scope="module")
def metp2_offload():
    variants = [("plain", {}), ("offload", {"layout": OFF}),
                ("offload-uniform1", {"layout": {**OFF, **RECOMPUTE["uniform1"]}}),
                ("offload-block1", {"layout": {**OFF, **RECOMPUTE["block1"]}}),
                ("perturbed", {"layout": OFF, "seed": 1235}),
                ("vocab", {"layout": {"vocab_parallel": True}}),
                ("vocab-offload-uniform2", {"layout": {"vocab_parallel": True, **OFF,
                                                       **RECOMPUTE["uniform2"]}})]
    return run_ranks(_offload_variants, 2, SWIGLU, Layout(metp=2), variants, timeout=300)


def test_metp2_offload_is_exact(metp2_offload):
    _assert_same(metp2_offload, "plain", ["offload", "offload-uniform1", "offload-block1"])
    _assert_same(metp2_offload, "vocab", ["vocab-offload-uniform2"])
    _check_stats(metp2_offload)
    assert "+offload" in metp2_offload[0]["offload"]["describe"]


def test_offload_comparison_catches_a_perturbed_run(metp2_offload):
    with pytest.raises(AssertionError):
        _assert_same(metp2_offload, "plain", ["perturbed"])


@pytest.mark.parametrize("world,base", [
    (3, Layout(metp=3)),
    (4, Layout(tp=2, metp=2)),
    (4, Layout(pp=2, metp=2)),
    (2, Layout(tp=2, mode="tp")),
])
def test_offload_is_exact_across_layouts(world, base):
    size = GPTSize(**{**SIZE.__dict__, "num_layers": 4}) if base.pp > 1 else SIZE
    variants = [("plain", {}), ("offload", {"layout": OFF}),
                ("offload-uniform1", {"layout": {**OFF, **RECOMPUTE["uniform1"]}})]
    res = run_ranks(_offload_variants, world, size, base, variants, timeout=300)
    _assert_same(res, "plain", ["offload", "offload-uniform1"])
    _check_stats(res)
