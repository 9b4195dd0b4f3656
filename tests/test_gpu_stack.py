"""--transformer-impl for METP layers: Transformer Engine's norms where installed, the local ones
(and a note saying so) where not — the selection and its CPU fallback."""

import pytest
import torch

from megatron_metp.megatron import gpu_stack
from megatron_metp.megatron.training import GPTSize, Layout
from tests.gpt_cases import one_step_grads
from tests.harness import run_ranks

SIZE = GPTSize(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
               vocab_size=64, seq_length=16)


class _StandInTENorm(torch.nn.LayerNorm):
    """Stands in for TE's ``TENorm`` (same constructor, same LayerNorm); counts its calls."""

    calls = 0
    gain = 1.0

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x) * self.gain


def test_without_transformer_engine_the_local_norm_is_used_and_said(monkeypatch):
    monkeypatch.setattr(gpu_stack, "have_transformer_engine", lambda: False)
    choice = gpu_stack.select_norm("transformer_engine", "RMSNorm")
    assert choice.impl == "local" and choice.module is None
    assert "transformer-engine is not installed here" in choice.note and "RMSNorm" in choice.note
    local = gpu_stack.select_norm("local")
    assert local == gpu_stack.NormChoice("local", None, "")


def test_with_transformer_engine_its_norm_is_chosen(monkeypatch):
    monkeypatch.setattr(gpu_stack, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(gpu_stack, "_te_norm_class", lambda normalization: _StandInTENorm)
    choice = gpu_stack.select_norm("transformer_engine")
    assert choice.impl == "transformer_engine" and choice.module is _StandInTENorm
    assert "Transformer Engine's fused LayerNorm (TENorm)" in choice.note


@pytest.mark.parametrize("impl,normalization", [("inference_optimized", "LayerNorm"),
                                                ("local", "L2Norm")])
def test_other_values_are_refused_naming_the_flag(impl, normalization):
    with pytest.raises(ValueError, match="--transformer-impl" if impl != "local" else
                       "--normalization"):
        gpu_stack.select_norm(impl, normalization)


def test_this_machine_detects_transformer_engine_as_importlib_does():
    import importlib.util

    assert gpu_stack.have_transformer_engine() == \
        (importlib.util.find_spec("transformer_engine") is not None)


def _step_with_te_norm(rank, world, gain):
    gpu_stack.have_transformer_engine = lambda: True
    gpu_stack._te_norm_class = lambda normalization: _StandInTENorm
    _StandInTENorm.gain = gain
    out = one_step_grads(rank, world, SIZE, Layout(metp=2, transformer_impl="transformer_engine"))
    return {"loss": out["loss"], "calls": _StandInTENorm.calls}


def test_metp_gpt_built_with_the_te_norm_runs_it_and_matches_the_local_one():
    local = run_ranks(one_step_grads, 2, SIZE, Layout(metp=2))
    te = run_ranks(_step_with_te_norm, 2, 1.0)
    # two norms per layer, each run once in the forward
    assert [r["calls"] for r in te] == [2 * SIZE.num_layers] * 2
    assert abs(te[0]["loss"] - local[0]["loss"]) <= 1e-6 * abs(local[0]["loss"])
    # negative control: a norm that computes something else changes the loss
    off = run_ranks(_step_with_te_norm, 2, 1.5)
    assert abs(off[0]["loss"] - local[0]["loss"]) > 1e-3
