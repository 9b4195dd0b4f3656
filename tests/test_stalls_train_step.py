"""A rank stopped inside Megatron-LM's ``train_step`` is named within the one METP timeout.

Two forked gloo ranks build the tiny METP=2 GPT with megatron-core (DDP, the optimizer, the
METP rings) as the patched Megatron-LM does: Megatron's own groups wait
``--distributed-timeout-minutes`` (here ``PG_S`` = 30 s), the METP rings and the default group
the shorter METP timeout ``TIMEOUT_S`` (``--metp-ring-timeout``). A step shaped as Megatron-LM's
``train_step`` (its arguments; the schedule, which ends in ``config.finalize_model_grads_func``;
``optimizer.step``) runs under :func:`megatron_metp.megatron_lm.last_seen._train_step`, what
``install`` puts in Megatron-LM's place. At iteration 2 rank 1 stops (sleeps ``STALL_S``) in a
layer's forward (rank 0 waits in a METP ring exchange), in the gradient reduce (rank 0 waits in
DDP's all-reduce over DP × CP) or just before the distributed optimizer's parameter gather.
Rank 0 must end within the METP timeout plus the grace, naming rank 1, its last label and its
age — not after the 30 s of Megatron's groups. The negative control runs the same stall under
the wrapper as it was before (a labelled region only, the groups' own timeouts): rank 0 does
not end within the bound. ``-s`` prints the times.
"""

import re
import time

import pytest

from megatron_metp.megatron.training import Layout
from megatron_metp.runtime.watchdog import StalledRankError, grace_s
from tests.harness import run_ranks
from tests.test_checkpoint import SIZE

TIMEOUT_S = 1.0  # the METP timeout (--metp-ring-timeout)
PG_S = 30.0  # Megatron's groups (--distributed-timeout-minutes)
STALL_S = TIMEOUT_S + grace_s(TIMEOUT_S) + 1.5  # rank 1 comes back after rank 0 has reported
BOUND_S = TIMEOUT_S + grace_s(TIMEOUT_S) + 1.0  # + the part of the step before the stall


def _init(layout):
    """The groups as the patched Megatron-LM leaves them (module docstring)."""
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.parallel import initialize_model_parallel

    cpu.enable()
    initialize_model_parallel(1, 1, layout.metp, seq_length=SIZE.seq_length,
                              ring_timeout_s=TIMEOUT_S, distributed_timeout_minutes=PG_S / 60,
                              create_gloo_process_groups=False)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=PG_S))  # default group
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def _megatron_lm_step(layout):
    """A step with Megatron-LM's ``train_step`` arguments and its three phases."""
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import _null

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        n_mb = layout.global_batch_size // layout.micro_batch_size
        forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator,
                              model=model, num_microbatches=n_mb, seq_length=SIZE.seq_length,
                              micro_batch_size=layout.micro_batch_size, forward_only=False)
        with cpu.cuda_to_cpu() if cpu.is_enabled() else _null():
            return optimizer.step()

    return train_step


def _run(rank, world, where, wrapper):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_metp.megatron import training as T
    from megatron_metp.megatron_lm import last_seen
    from megatron_metp.runtime import watchdog

    layout = Layout(metp=2, global_batch_size=2, distributed_optimizer=where == "gather")
    _init(layout)
    watchdog.set_job_timeout(TIMEOUT_S)
    state = T.setup(SIZE, layout)
    ddp, opt = state["model"], state["optimizer"]
    step = _megatron_lm_step(layout)
    if wrapper == "train_step":
        step = last_seen._train_step(step, TIMEOUT_S)
    else:  # the negative control: a labelled region only, as before
        step = last_seen._marked(step, last_seen._iteration_label)

    def run(iteration):
        return step(T._forward_step, T._microbatches(SIZE, layout, iteration - 1), [ddp], opt,
                    None, ddp.config, get_forward_backward_func(), iteration=iteration - 1)

    run(1)

    def halt(*_a, **_k):
        time.sleep(STALL_S)

    if rank == 1 and where == "ring":  # inside layer 2's forward: rank 0 waits in a ring step
        ddp.module.decoder.layers[-1].register_forward_pre_hook(halt)
    elif rank == 1 and where == "grad-reduce":  # rank 0 waits in DDP's all-reduce
        finalize = ddp.config.finalize_model_grads_func

        def stalling_finalize(*a, **k):
            halt()
            return finalize(*a, **k)

        ddp.config.finalize_model_grads_func = stalling_finalize
    elif rank == 1 and where == "gather":  # rank 0 waits in the parameter all-gather
        sync = ddp.start_param_sync

        def stalling_sync(*a, **k):
            halt()
            return sync(*a, **k)

        ddp.start_param_sync = stalling_sync
    t0 = time.monotonic()
    try:
        run(2)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return type(exc).__name__, str(exc), time.monotonic() - t0, getattr(exc, "stalled", None)
    return "ok", "", time.monotonic() - t0, None


CASES = [  # where rank 1 stops; the label rank 1 was last seen entering
    ("ring", "forward-backward of iteration 2"),
    ("grad-reduce", "gradient reduce of iteration 2"),
    ("gather", "optimizer step of iteration 2"),
]


@pytest.mark.parametrize("where,label", CASES, ids=[w for w, _ in CASES])
def test_a_rank_stopped_inside_train_step_is_named_within_the_metp_timeout(where, label):
    out = run_ranks(_run, 2, where, "train_step", timeout=60, allow_errors=True)
    kind, msg, seconds, stalled = out[0]
    assert kind == "StalledRankError" and stalled == [1], out
    assert msg.startswith(f"METP: rank 1 stalled or died during {label!r}"), msg
    # rank 1's last label and how long ago it entered it
    seen = re.search(r"rank 1 stalled or died: it is inside it \(entered ([0-9.]+) s ago\)", msg)
    assert seen, msg
    assert TIMEOUT_S <= float(seen.group(1)) < BOUND_S, msg
    assert f"the job timeout, {TIMEOUT_S:g} s" in msg, msg
    assert TIMEOUT_S <= seconds < BOUND_S, (seconds, msg)  # the METP timeout, not Megatron's
    assert out[1] is not None and out[1][0] != "ok", out  # rank 1, back, fails too: no hang
    print(f"\n[train_step stall] rank 1 stops in {where}: rank 0 {kind} after {seconds:.2f} s "
          f"(METP timeout {TIMEOUT_S:g} s, groups {PG_S:g} s): {msg[:300]}")


def test_without_the_train_step_timeout_the_gradient_reduce_waits_megatrons_groups():
    """The negative control: the same stall in the gradient reduce under a labelled region only
    (each group keeps ``--distributed-timeout-minutes``): rank 0 does not end within the METP
    timeout — it waits until rank 1 comes back, and then the step simply completes."""
    out = run_ranks(_run, 2, "grad-reduce", "label-only", timeout=60, allow_errors=True)
    kind, msg, seconds, _ = out[0]
    assert kind == "ok" and seconds >= STALL_S > BOUND_S, out
    assert out[1][0] == "ok", out


def test_the_step_wrapper_restores_the_groups_and_the_optimizer(monkeypatch):
    """After (and after a failed) ``train_step`` every group has its own timeout again, and the
    optimizer's ``step`` and the config's ``finalize_model_grads_func`` are the originals."""
    out = run_ranks(_restores, 2, timeout=60)
    for before, during, after, same in out:
        assert during == {name: TIMEOUT_S for name in before}, (before, during)
        assert after == before and before["dp-cp"] == PG_S, (before, after)
        assert same, out


def _restores(rank, world):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_metp.megatron_lm import last_seen
    from megatron_metp.runtime import watchdog

    _init(Layout(metp=2))
    watchdog.set_job_timeout(TIMEOUT_S)

    def timeouts():
        groups = {"default": dist.distributed_c10d._get_default_group(),
                  "dp-cp": ps.get_data_parallel_group(with_context_parallel=True),
                  "tp": ps.get_tensor_model_parallel_group()}
        return {k: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for k, g in groups.items()}

    class Opt:
        def step(self):
            return "stepped"

    opt, finalize = Opt(), (lambda *a: None)
    config = SimpleNamespace(finalize_model_grads_func=finalize)
    seen = {}

    def step(fsf, di, model, optimizer, sched, cfg, fbf, iteration=None):
        seen["during"] = timeouts()
        assert optimizer.step() == "stepped"
        raise ValueError("a bug in the step")

    before = timeouts()
    with pytest.raises(ValueError, match="a bug in the step"):
        last_seen._train_step(step, TIMEOUT_S)(None, None, [], opt, None, config, None,
                                               iteration=0)
    same = "step" not in vars(opt) and config.finalize_model_grads_func is finalize
    return before, seen["during"], timeouts(), same

