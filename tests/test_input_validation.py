"""Bad input is refused before any work, with a message naming the argument or variable and the
fix (issue "crash-safe ... bounded failures", item 5: the parts fixed so far)."""

import math
import subprocess
import sys

import pytest

from megatron_metp import METPGroup
from megatron_metp import megatron_lm
from megatron_metp.runtime.groups import DEFAULT_RING_TIMEOUT_S, ring_timeout_from_env
from megatron_metp.tools import plan as P
from megatron_metp.tools.demo import _parse as demo_args
from tests.test_megatron_lm import _args


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-1", "0", "1e999"])
def test_ring_timeout_variable_refused(monkeypatch, raw):
    monkeypatch.setenv("METP_RING_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match=r"METP_RING_TIMEOUT_S=.*positive, finite"):
        METPGroup.from_process_group(None)


def test_ring_timeout_variable_accepted(monkeypatch):
    monkeypatch.setenv("METP_RING_TIMEOUT_S", " 12.5 ")
    assert METPGroup.from_process_group(None).timeout_s == 12.5
    monkeypatch.setenv("METP_RING_TIMEOUT_S", "")
    assert ring_timeout_from_env() == DEFAULT_RING_TIMEOUT_S
    for bad in (math.nan, math.inf, 0, -3, "7"):
        with pytest.raises(ValueError, match="timeout_s must be a positive, finite number"):
            METPGroup.from_process_group(None, timeout_s=bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_megatron_ring_timeout_flag_refused(value):
    with pytest.raises(ValueError, match=r"--metp-ring-timeout .* positive, finite"):
        megatron_lm.validate_metp_args(_args(metp_parallel_size=2, metp_ring_timeout=value))


def test_plan_reserve_refused():
    model = P.PRESETS["gpt-7b"]
    for bad in (-100, -0.5, 80, 1e9):
        with pytest.raises(ValueError, match="--reserve-gib must be >= 0 and below"):
            P.validate(model, P.Job(reserve_gib=bad), ["metp"])
    P.validate(model, P.Job(reserve_gib=0), ["metp"])
    proc = subprocess.run([sys.executable, "-m", "megatron_metp.cli", "plan", "--reserve-gib",
                           "-100"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--reserve-gib" in proc.stderr


def test_demo_refuses_before_any_run(tmp_path, capsys):
    for argv, needle in ((["--hidden", "0"], "--hidden must be >= 1"),
                         (["--hidden", "-8"], "--hidden must be >= 1"),
                         (["--out-dir", "/proc/not-here"], "--out-dir '/proc/not-here' cannot")):
        with pytest.raises(SystemExit):
            demo_args(argv)
        assert needle in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(SystemExit):
        demo_args(["--out-dir", str(blocked / "sub")])
    ok = demo_args(["--out-dir", str(tmp_path / "new" / "dir")])
    assert (tmp_path / "new" / "dir").is_dir() and ok.out_dir.endswith("dir")


@pytest.mark.parametrize("shape", [(0, 1, 2, 4), (2, 0, 2, 4), (2, 1, 0, 4)])
def test_ring_attention_refuses_empty_input_before_any_transfer(shape):
    """0 tokens used to kill the process with SIGFPE inside the CPU flash kernel."""
    import torch

    from megatron_metp.ops import ring_attention

    group = METPGroup.from_process_group(None)
    q = torch.zeros(shape)
    with pytest.raises(ValueError, match="must not be empty"):
        ring_attention(q, q, q, group=group)
    assert group.stats.steps == 0


def test_unknown_config_keys_refused(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("hidden: 512\nlayers: 2\nnum_heads: 8\nsequence_lenght: 4096\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) sequence_lenght; known: .*seq_length"):
        P.from_config(str(cfg))
    cfg.write_text("hidden: 512\nlayers: 2\nnum_heads: 8\nseq_length: 4096\n")
    model, _ = P.from_config(str(cfg))
    assert model["seq"] == 4096


def _first_order_cases():
    import torch

    from megatron_metp.ops import metp_attention, metp_mlp, ring_attention

    group = METPGroup.from_process_group(None)
    torch.manual_seed(0)
    s, h = 4, 8
    x = torch.randn(s, 1, h, requires_grad=True)
    q = torch.randn(2, 1, s, 4, requires_grad=True)
    return group, {
        "metp_mlp": (x, lambda: metp_mlp(x, torch.randn(16, h), torch.randn(h, 16), group=group)),
        "metp_attention": (x, lambda: metp_attention(
            x, torch.randn(3 * h, h), torch.randn(h, h), group=group, num_heads=2,
            num_query_groups=2)),
        "ring_attention": (q, lambda: ring_attention(q, q, q, group=group)),
    }


@pytest.mark.parametrize("op", ["metp_mlp", "metp_attention", "ring_attention"])
def test_double_backward_is_refused_by_name_before_any_transfer(op):
    """create_graph=True used to fail inside the flat-buffer packing with an in-place leaf error."""
    import torch

    from megatron_metp.ops._first_order import DoubleBackwardError

    group, cases = _first_order_cases()
    inp, fn = cases[op]
    first, = torch.autograd.grad(fn().square().sum(), inp)  # first order: fine
    assert torch.isfinite(first).all() and first.abs().sum() > 0
    with pytest.raises(DoubleBackwardError, match=f"METP {op}: double backward.*create_graph=True"):
        torch.autograd.grad(fn().square().sum(), inp, create_graph=True)


def _double_backward_on_a_ring(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_metp.ops import metp_mlp
    from megatron_metp.ops._first_order import DoubleBackwardError

    group = METPGroup.from_process_group(dist.group.WORLD)
    torch.manual_seed(rank)
    x = torch.randn(4, 1, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)  # this rank's shards of a 16-wide FFN
    y = metp_mlp(x, w1, w2, group=group)
    after_forward = group.stats.steps
    try:
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    except DoubleBackwardError as exc:
        return {"error": str(exc), "forward_steps": after_forward,
                "steps": group.stats.steps}
    return {"error": None}


def test_double_backward_is_refused_on_every_rank_of_a_ring_before_its_backward_sends():
    from tests.harness import run_ranks

    for r in run_ranks(_double_backward_on_a_ring, 2, timeout=60):
        assert r["error"] and "metp_mlp: double backward" in r["error"]
        assert r["forward_steps"] > 0 and r["steps"] == r["forward_steps"]
