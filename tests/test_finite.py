"""NaN/Inf entering a METP op is reported with the layer and iteration when checks are on."""

import math

import torch

from megatron_metp.runtime import finite
from megatron_metp.ops import metp_mlp
from tests.harness import run_ranks


def test_checks_are_off_by_default_and_nan_passes_silently():
    assert not finite.finite_checks_enabled()
    x = torch.full((2, 1, 4), math.nan)
    y = metp_mlp(x, torch.randn(4, 4), torch.randn(4, 4), group=None)
    assert torch.isnan(y).all()


def test_forward_and_backward_report_where(monkeypatch):
    monkeypatch.setattr(finite, "_enabled", True)
    finite.set_iteration(17)
    try:
        x = torch.randn(2, 1, 4)
        x[0, 0, 1] = math.inf
        try:
            metp_mlp(x, torch.randn(4, 4), torch.randn(4, 4), group=None, label="layer 3 mlp")
            raise AssertionError("no error")
        except finite.NonFiniteError as exc:
            msg = str(exc)
        assert "layer 3 mlp (forward)" in msg and "(x)" in msg and "iteration 17" in msg
        assert "0 NaN, 1 Inf" in msg
        x = torch.randn(2, 1, 4, requires_grad=True)
        y = metp_mlp(x, torch.randn(4, 4), torch.randn(4, 4), group=None, label="layer 5 mlp")
        try:
            y.backward(torch.full_like(y, math.nan))
            raise AssertionError("no error")
        except finite.NonFiniteError as exc:
            assert "layer 5 mlp (backward)" in str(exc) and "grad_output" in str(exc)
    finally:
        finite.set_iteration(None)


def _gpt_with_nan(rank, world):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, setup, train

    cpu.enable()
    finite.enable_finite_checks(True)
    size = GPTSize(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                   vocab_size=32, seq_length=8)
    layout = Layout(metp=2)
    init_parallel(layout, size.seq_length)
    state = setup(size, layout)
    train(size, layout, 1, state=state)
    with torch.no_grad():  # poison layer 2's input: its attention must report it
        state["model"].module.decoder.layers[0].mlp.linear_fc2.weight.fill_(math.nan)
    try:
        train(size, layout, 1, state=state, start_step=1)
    except finite.NonFiniteError as exc:
        return str(exc)
    return None


def test_nan_inside_a_gpt_is_reported_with_layer_and_iteration():
    msgs = run_ranks(_gpt_with_nan, 2)
    for m in msgs:
        assert m is not None and "layer 1 mlp (forward)" in m and "fc2_weight" in m and \
            "iteration 2" in m, m


def _nan_on_one_rank(rank, world):
    import time

    import torch.distributed as dist

    from megatron_metp import METPGroup
    from megatron_metp.ops import metp_mlp

    finite.enable_finite_checks(True)
    group = METPGroup.from_process_group(dist.group.WORLD, timeout_s=60.0)
    torch.manual_seed(rank)
    x = torch.randn(4, 1, 8)
    if rank == 1:
        x[2, 0, 3] = math.nan  # only rank 1's tokens are bad
    t0 = time.monotonic()
    try:
        metp_mlp(x, torch.randn(8, 8), torch.randn(8, 8), group=group, label="layer 3 mlp")
    except finite.NonFiniteError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0,
                "steps": group.stats.steps}
    return {"error": None}


def test_a_nan_on_one_rank_ends_every_rank_at_once_naming_it():
    """It used to raise on the bad rank only; its peers waited the whole ring timeout."""
    for rank, r in enumerate(run_ranks(_nan_on_one_rank, 2, timeout=60)):
        assert r["error"] is not None, rank
        assert "layer 3 mlp (forward)" in r["error"] and "rank 1 (global 1): x has 1 NaN" in r["error"]
        assert "rank 0 (global 0)" not in r["error"]  # rank 0's values are finite
        assert r["seconds"] < 30 and r["steps"] == 0  # at once (timeout 60 s), nothing sent
        print(f"\n[fault] NaN in rank 1's MLP input: rank {rank} NonFiniteError after "
              f"{r['seconds']:.2f} s: {r['error'][:160]}")
