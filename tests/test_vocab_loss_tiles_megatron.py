"""The ring loss's backward in token tiles inside Megatron (``METP_LOSS_TOKEN_TILE``), with its
gradient written into the final hidden states (``METPGPTModel`` passes ``grad_into_hidden``;
``METP_LOSS_GRAD_INTO_HIDDEN=0`` switches that off): 3 steps of Megatron's DDP + Adam equal the
untiled run that writes a new gradient tensor — losses, grad norms and every gradient after step
1 within 1e-6 (fp32) — at METP 2 with the vocabulary ring, full recompute and host offload; the
loss's ring went round once more per extra tile; a perturbed initial weight is caught by the same
comparison. When the model lets the loss overwrite the hidden states, and when not, is checked
on its own (``_loss_grad_into_hidden``)."""

import types

import pytest
import torch

from megatron_metp.megatron.training import Layout
from megatron_metp.ops import vocab as V
from tests.grads import worst_difference
from tests.harness import run_ranks, unset_env
from tests.test_tiles_megatron import FULL, SWIGLU, _runs

SAME = 1e-6
OFF = {V.LOSS_TOKEN_TILE_ENV: "0", V.LOSS_GRAD_INTO_HIDDEN_ENV: "0"}  # today's loss backward
TILED = {V.LOSS_TOKEN_TILE_ENV: "5", V.LOSS_GRAD_INTO_HIDDEN_ENV: "1"}


def _recorded_runs(rank, world, size, base, variants):
    """:func:`tests.test_tiles_megatron._runs`, recording what the model passes to the loss as
    ``grad_into_hidden`` next to ``METP_LOSS_GRAD_INTO_HIDDEN`` at the time of the call."""
    import os

    from megatron_metp.megatron import vocab as mv

    real, calls = mv.metp_output_cross_entropy, set()

    def recording(hidden, *args, **kwargs):
        calls.add((os.environ.get(V.LOSS_GRAD_INTO_HIDDEN_ENV), kwargs.get("grad_into_hidden")))
        return real(hidden, *args, **kwargs)

    mv.metp_output_cross_entropy = recording
    return _runs(rank, world, size, base, variants), calls


def test_tiled_loss_training_equals_untiled():
    layout = dict(FULL, vocab_parallel=True, offload_activations=True)
    variants = [("untiled", {"layout": layout, "env": OFF}),
                ("tiled-into", {"layout": layout, "env": TILED}),
                ("untiled-into", {"layout": layout, "env": dict(OFF, **{
                    V.LOSS_GRAD_INTO_HIDDEN_ENV: "1"})}),
                ("perturbed-tiled-into", {"layout": layout, "env": TILED, "seed": 1235})]
    for res, calls in run_ranks(_recorded_runs, 2, SWIGLU, Layout(metp=2), variants,
                                timeout=300):
        for name in ("tiled-into", "untiled-into"):
            assert worst_difference(res["untiled"], res[name]) <= SAME, name
        # the model wrote dX into hidden unless METP_LOSS_GRAD_INTO_HIDDEN=0
        assert calls == {("0", False), ("1", True)}, calls
        # 12 tokens per rank and micro-batch in tiles of 5: 3 passes of the loss's backward
        # ring instead of 1 (the MLP is whole in all three runs)
        assert res["tiled-into"]["ring"]["bytes_sent"] > res["untiled"]["ring"]["bytes_sent"]
        assert res["untiled-into"]["ring"] == res["untiled"]["ring"]
        assert worst_difference(res["untiled"], res["perturbed-tiled-into"]) > 1e-3


def _model(memory_efficient=False, final_norm=True):
    """A stand-in ``self`` for ``METPGPTModel._loss_grad_into_hidden``."""
    return types.SimpleNamespace(
        config=types.SimpleNamespace(memory_efficient_layer_norm=memory_efficient),
        decoder=types.SimpleNamespace(final_layernorm=object() if final_norm else None))


def test_when_the_model_lets_the_loss_overwrite_hidden(monkeypatch):
    from megatron_metp.megatron.vocab import METPGPTModel

    decide = METPGPTModel._loss_grad_into_hidden
    leaf = torch.randn(4, 1, 8, requires_grad=True)
    hidden = leaf * 2.0  # the final norm's output: an intermediate of its own
    unset_env(monkeypatch, V.LOSS_GRAD_INTO_HIDDEN_ENV)
    assert decide(_model(), hidden) is True
    # apex's memory-efficient norm saves its output; no final norm; leaves, views, strides,
    # no gradient wanted: not overwritten
    assert decide(_model(memory_efficient=True), hidden) is False
    assert decide(_model(final_norm=False), hidden) is False
    assert decide(_model(), leaf) is False
    assert decide(_model(), torch.cat([hidden, hidden])[:4]) is False
    assert decide(_model(), hidden.detach()) is False
    assert decide(_model(), torch.randn(8, 1, 4, requires_grad=True).permute(2, 1, 0) * 1.0) \
        is False
    monkeypatch.setenv(V.LOSS_GRAD_INTO_HIDDEN_ENV, "0")
    assert decide(_model(), hidden) is False
    monkeypatch.setenv(V.LOSS_GRAD_INTO_HIDDEN_ENV, "yes")
    with pytest.raises(ValueError, match="METP_LOSS_GRAD_INTO_HIDDEN must be 0 or 1"):
        decide(_model(), hidden)
