"""Soak, short: 40 training steps of a 2-rank METP=2 tiny GPT (vocabulary sharded too) keep memory
and handles flat.

``benchmarks/soak.py`` runs the long version (300+ steps) and prints the trace; this test runs its
``soak_rank`` for 40 steps (global batch 2, a sample every 10 steps) and checks on every rank, from
step 10 on, what ``benchmarks.soak.growth_problems`` calls flat: live tensor bytes and storages
exactly equal at every sample, no storage of an earlier step still alive, open file descriptors and
threads not growing, no METP ring receive buffer alive after a step and the same number of ring
exchanges and buffer allocations in every step, GC-tracked objects +1 per step at most (the loop's
own step records) plus +2 per sample (the trace) plus 16, and RSS within 8 MiB. A negative control
leaks one ring buffer per step and must be caught.
"""

from benchmarks.soak import SIZE, growth_problems, soak_rank
from megatron_metp.megatron.training import GPTSize, Layout
from tests.harness import run_ranks

STEPS, EVERY = 40, 10
WARMUP = 5  # the first sample after the warm-up is step 10
LAYOUT = Layout(metp=2, global_batch_size=2, vocab_parallel=True)  # every METP ring


def test_forty_metp_steps_keep_memory_and_handles_flat():
    traces = run_ranks(soak_rank, 2, STEPS, SIZE, LAYOUT, EVERY, WARMUP, timeout=240)
    for rank, trace in enumerate(traces):
        assert [s["step"] for s in trace] == [1] + list(range(EVERY, STEPS + 1, EVERY))
        assert trace[-1]["ring_exchanges"] > 0
        assert growth_problems(trace, WARMUP) == [], (rank, trace)


_LEAKED = []


def _leaky_soak_rank(rank, world, steps):
    """Negative control: keep every ring receive buffer of one kind alive forever."""
    from megatron_metp.runtime import ring

    start = ring.RingExchanger.start

    def leaking_start(self, send, recv, *, step):
        _LEAKED.append(recv)
        return start(self, send, recv, step=step)

    ring.RingExchanger.start = leaking_start
    one_layer = GPTSize(**{**SIZE.__dict__, "num_layers": 1})
    return soak_rank(rank, world, steps, one_layer, LAYOUT, 1, 1)


def test_negative_control_a_retained_ring_buffer_is_caught():
    trace = run_ranks(_leaky_soak_rank, 2, 4, timeout=120)[0]
    problems = " | ".join(growth_problems(trace, 1))
    for needle in ("live_tensor_bytes not constant", "ring receive buffers still alive",
                   "holds storages of earlier steps"):
        assert needle in problems, problems
