"""Partial host offload (``ActivationOffloader(layers=N)``, ``Layout(offload_activations=N)``,
``--metp-offload-activations N``): only the first ``N`` layers of a stage go to the host.

* The policy, on the stand-in block: layer groups are counted from 0 in each forward (two
  forwards before one backward, as a pipeline stage runs them), the first ``N`` go to the host and
  come back exactly, the last ones never leave, and the backward of the lowest kept layer
  prefetches the last offloaded one (negative control: without prefetch nothing comes early).
* Inside Megatron (forked gloo ranks, 3 steps of Megatron's DDP + Adam, full recompute): partial
  offload is bit-identical to no offload and to the full offload at METP 2 and 3, and what goes
  to the host is exactly the ``N`` offloaded layers' inputs (with the RoPE table, which the first
  chunk saves); a policy that offloads everything is caught by the same check.
* The counts are validated before any work, naming the flag.
"""

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from megatron_metp.runtime import offload as O
from tests.gpt_cases import SIZE
from tests.grads import differences
from tests.harness import run_ranks
from tests.test_offload import Block, _run
from tests.test_recompute import RECOMPUTE, _variants


# ---------------------------------------------------------------- the policy on the stand-in block

def test_first_layers_go_to_the_host_the_last_stay_and_counts_restart_per_forward():
    torch.manual_seed(0)
    block = Block(4, 16)
    x = torch.randn(32, 16)
    ref = _run(block, x)
    off = O.ActivationOffloader(min_bytes=0, layers=2, prefetch=True).attach(block)
    seen = []
    for layer in block.layers:
        layer.register_forward_pre_hook(
            lambda *_: seen.append((off.current_group, off.offloads_current_group())))
    got = _run(block, x, off)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert seen == [(0, True), (1, True), (2, False), (3, False)]
    st = off.stats
    # internal keys: 0 before the first layer, 1..4 the layers; only layers 0 and 1 went out
    assert set(st.by_group) == {1, 2} and st.offloaded_bytes == st.fetched_bytes > 0
    assert st.host_bytes == 0 and off.pending() == 0
    assert st.prefetched_groups == 2  # layer 1 at layer 2's backward, layer 0 at layer 1's
    assert not off.offloads_current_group()  # outside a forward

    # two forwards before one backward (a pipeline stage's 1F1B warm-up): counted from 0 each
    seen.clear()
    y1, y2 = block(x.requires_grad_()), block(x * 2)
    assert [g for g, _ in seen] == [0, 1, 2, 3, 0, 1, 2, 3]
    (y1.sum() + y2.sum()).backward()
    assert off.pending() == 0 and off.stats.host_bytes == 0

    # negative controls: the full offload sends every layer, and without prefetch nothing
    # comes back before its own backward asks for it
    full = O.ActivationOffloader(min_bytes=0)
    _run(_attached(full, Block(4, 16)), x, full)
    assert set(full.stats.by_group) == {1, 2, 3, 4}
    lazy = O.ActivationOffloader(min_bytes=0, layers=2, prefetch=False)
    _run(_attached(lazy, Block(4, 16)), x, lazy)
    assert lazy.stats.prefetched_groups == 0 and set(lazy.stats.by_group) == {1, 2}


def _attached(off, block):
    off.attach(block)
    return block


class _Shared(torch.nn.Module):
    """Two layers that both save one tensor made before them (as every chunk saves the RoPE
    table): the first save goes to the host, the second keeps the device tensor."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, table):
        for layer in self.layers:
            x = layer(x) * table
        return x


def test_a_tensor_still_on_the_device_comes_back_without_a_copy(monkeypatch):
    torch.manual_seed(0)
    x, table = torch.randn(4, 8), torch.randn(4, 8)
    block = _Shared()
    ref = torch.autograd.grad(block(x, table).sum(), list(block.parameters()))
    off = O.ActivationOffloader(min_bytes=0).attach(block)
    got = torch.autograd.grad(block(x, table).sum(), list(block.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # alive and unchanged, no second copy: the table, and x (the caller holds it; the first
    # layer saves it)
    assert off.stats.reused == 2

    def written_after_saving(stamp):  # x changed in place between forward and backward
        monkeypatch.setattr(O, "_stamp", stamp)
        x0 = x.clone()
        y = block(x0, table)
        x0.add_(1.0)
        return torch.autograd.grad(y.sum(), list(block.parameters()))

    # the changed x comes back from its host copy (the value autograd saved) ...
    assert all(torch.equal(a, b) for a, b in zip(written_after_saving(O._stamp), ref))
    # ... negative control: a stamp blind to in-place writes would hand back the changed x
    blind = lambda t, stamp=O._stamp: stamp(t)[:-1]  # noqa: E731
    assert not all(torch.equal(a, b) for a, b in zip(written_after_saving(blind), ref))


def test_counts_are_validated_naming_the_setting():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="layers .*must be an int >= 1 or None"):
            O.ActivationOffloader(layers=bad)
    with pytest.raises(ValueError, match=r"ActivationOffloader\(layers=...\): 5 layers offloaded, "
                                         r"but a pipeline stage has 4 layers; offload 1 to 4"):
        O.ActivationOffloader(layers=5).attach(Block(4, 8))
    chunked = Block(4, 8)
    chunked.config = type("Cfg", (), dict(recompute_granularity="full", recompute_method="uniform",
                                          recompute_num_layers=2))()
    with pytest.raises(ValueError, match=r"3 layers offloaded with full recompute in chunks of 2 "
                                         r".*offload a multiple of 2 \(2, 4\)"):
        O.ActivationOffloader(layers=3).attach(chunked)
    O.ActivationOffloader(layers=2).attach(chunked)  # whole chunks: accepted
    with pytest.raises(ValueError, match="Layout.offload_activations must be True"):
        Layout(metp=2, offload_activations=0)
    with pytest.raises(ValueError, match="Layout.offload_activations: 3 layers offloaded, but a "
                                         "pipeline stage has 2 layers"):
        Layout(metp=2, pp=2, offload_activations=3).offload_layers(4)


# ---------------------------------------------------------------- inside Megatron (forked ranks)

SWIGLU4 = GPTSize(**{**SIZE.__dict__, "swiglu": True, "num_layers": 4})
FULL1 = RECOMPUTE["uniform1"]


def _partial_variants(rank, world, size, base, variants, everything=(), streaming=False):
    """``_variants`` (3 steps each) recording, per variant that offloads, the tensors its
    offloader sent to the host in the first forward: ``(layer, shape, bytes)``. The variants
    named in ``everything`` get a policy that offloads every layer whatever it was asked.
    ``streaming``: full recompute of one layer per chunk runs as the streaming layer op
    (megatron/streaming.py), which keeps its input on the host itself; then the host bytes
    each layer's forward counted (``stashed``: ``(layer, bytes)``) are recorded too. Without
    it (``METP_STREAMING_LAYER=0``) Megatron's checkpoint saves the layer inputs."""
    import os

    os.environ["METP_STREAMING_LAYER"] = "1" if streaming else "0"
    O.DEFAULT_MIN_BYTES = 0  # the tiny model's tensors are far below 1 MiB
    names = [n for n, opts in variants if opts.get("layout", {}).get("offload_activations")]
    attached = []
    attach, pack = O.ActivationOffloader.attach, O.ActivationOffloader._pack

    def recording_attach(self, block):  # setup() builds one model per variant, in order
        name = names[len(attached)]
        attached.append((name, self))
        self.sent, self.stashed = [], []
        count = self.count_host

        def counting(nbytes, self=self):
            if self._active:  # a forward: the layer running now
                self.stashed.append((self.current_group, nbytes))
            count(nbytes)
        self.count_host = counting
        if name in everything:
            self.offloads_group = lambda group: True
        return attach(self, block)

    def recording_pack(self, t):
        out = pack(self, t)
        if isinstance(out, O._Entry):
            self.sent.append((self._group - self._layer, self._layer, tuple(out.shape),
                              out.nbytes))
        return out

    O.ActivationOffloader.attach, O.ActivationOffloader._pack = recording_attach, recording_pack
    out = _variants(rank, world, size, base, variants)
    for name, off in attached:
        first = min((f for f, *_ in off.sent), default=None)
        out[name]["sent"] = [rec[1:] for rec in off.sent if rec[0] == first]
        out[name]["stashed"] = off.stashed
        out[name]["host_peak"] = off.stats.host_peak
        out[name]["left"] = (off.stats.host_bytes, off.pending())
    return out


def _assert_identical(per_rank, ref, names):
    for res in per_rank:
        for name in names:
            loss, norm, worst, identical = differences(res[ref], res[name])
            assert identical and loss == 0 and norm == 0, (name, loss, norm, worst)


def _assert_sends_layer_inputs(per_rank, name, n, size, p):
    """The first forward sent layer ``i``'s input ``[s/p, b, h]`` for each ``i < n`` and nothing
    of the other layers; layer 0 also the RoPE table (a checkpoint argument, saved once); with
    every layer offloaded the last layer's group also holds the final norm's input and
    statistics (it runs there)."""
    x = (size.seq_length // p, 1, size.hidden_size)
    x_bytes = 4 * x[0] * x[1] * x[2]  # fp32
    last = size.num_layers - 1
    for res in per_rank:
        sent = res[name]["sent"]
        inputs = sorted(layer for layer, shape, _ in sent if shape == x)
        assert inputs == list(range(n)) + ([last] if n == size.num_layers else []), (name, sent)
        rope = [(layer, shape) for layer, shape, _ in sent if len(shape) == 4]
        assert len(rope) == 1 and rope[0][0] == 0, (name, sent)
        stats = [(layer, nb) for layer, shape, nb in sent if shape != x and len(shape) != 4]
        assert all(layer == last == n - 1 and nb < x_bytes // 2 for layer, nb in stats), \
            (name, sent)
        assert res[name]["host_peak"] == sum(b for *_, b in sent)  # one micro-batch at a time
        assert res[name]["left"] == (0, 0)


@pytest.mark.parametrize("p", [2, 3])
def test_partial_offload_trains_as_no_offload_and_sends_only_its_layers(p):
    variants = [("recompute", {"layout": FULL1}),
                ("full", {"layout": dict(FULL1, offload_activations=True)}),
                ("partial", {"layout": dict(FULL1, offload_activations=2)}),
                ("everything", {"layout": dict(FULL1, offload_activations=2)}),
                ("perturbed", {"layout": dict(FULL1, offload_activations=2), "seed": 1235})]
    if p == 2:  # without recompute: every saved tensor of layers 0 and 1
        variants += [("plain", {}), ("partial-plain", {"layout": {"offload_activations": 2}})]
    per_rank = run_ranks(_partial_variants, p, SWIGLU4, Layout(metp=p), variants,
                         everything=("everything",), timeout=300)
    _assert_identical(per_rank, "recompute", ["full", "partial"])
    _assert_identical(per_rank, "full", ["partial"])
    _assert_sends_layer_inputs(per_rank, "partial", 2, SWIGLU4, p)
    _assert_sends_layer_inputs(per_rank, "full", 4, SWIGLU4, p)
    assert "+offload=2" in per_rank[0]["partial"]["describe"]
    # negative controls: a policy that offloads every layer, and other initial weights
    with pytest.raises(AssertionError):
        _assert_sends_layer_inputs(per_rank, "everything", 2, SWIGLU4, p)
    with pytest.raises(AssertionError):
        _assert_identical(per_rank, "recompute", ["perturbed"])
    if p == 2:
        _assert_identical(per_rank, "plain", ["partial-plain"])
        for res in per_rank:
            layers = {layer for layer, *_ in res["partial-plain"]["sent"]}
            assert layers == {0, 1}, res["partial-plain"]["sent"]


def test_partial_offload_with_pipeline_stages_counts_layers_per_stage():
    """METP 2 × PP 2, 2 layers per stage, one offloaded: each stage sends its own first layer
    (layer groups count from 0 in each stage's block and in each micro-batch's forward, two
    micro-batches in flight on the first stage under 1F1B), and training is bit-identical."""
    variants = [("recompute", {"layout": FULL1}),
                ("partial", {"layout": dict(FULL1, offload_activations=1)}),
                ("everything", {"layout": dict(FULL1, offload_activations=1)})]
    per_rank = run_ranks(_partial_variants, 4, SWIGLU4, Layout(metp=2, pp=2), variants,
                         everything=("everything",), timeout=300)
    _assert_identical(per_rank, "recompute", ["partial", "everything"])
    for res in per_rank:
        assert {layer for layer, *_ in res["partial"]["sent"]} == {0}, res["partial"]["sent"]
        assert {layer for layer, *_ in res["everything"]["sent"]} == {0, 1}  # negative control
        assert res["partial"]["left"] == (0, 0)


def test_partial_offload_through_the_streaming_layer():
    """With the streaming layer op (full recompute, one layer per chunk) the offloaded layers
    keep their inputs on the host themselves: the first N layers of the forward stash an input
    ``[s/p, b, h]`` (plus their attention outputs, released after the forward), the others
    none; training is bit-identical to no offload and to the full offload; a policy that
    offloads every layer is caught."""
    p = 2
    variants = [("recompute", {"layout": FULL1}),
                ("full", {"layout": dict(FULL1, offload_activations=True)}),
                ("partial", {"layout": dict(FULL1, offload_activations=2)}),
                ("everything", {"layout": dict(FULL1, offload_activations=2)})]
    per_rank = run_ranks(_partial_variants, p, SWIGLU4, Layout(metp=p), variants,
                         everything=("everything",), streaming=True, timeout=300)
    _assert_identical(per_rank, "recompute", ["full", "partial", "everything"])
    x_bytes = 4 * (SWIGLU4.seq_length // p) * SWIGLU4.hidden_size  # fp32, micro-batch 1
    for res in per_rank:
        for name, layers in (("partial", {0, 1}), ("full", {0, 1, 2, 3}),
                             ("everything", {0, 1, 2, 3})):
            inputs = {layer for layer, nb in res[name]["stashed"] if nb == x_bytes}
            assert inputs == layers, (name, res[name]["stashed"])
            assert res[name]["left"] == (0, 0)
        assert {layer for layer, _ in res["partial"]["stashed"]} == {0, 1}
