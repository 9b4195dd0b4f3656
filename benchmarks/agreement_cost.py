"""What the default cross-rank agreement check costs: a METP layer step with it on and off.

Two (or ``--metp``) forked gloo ranks run a small METP layer step — ``metp_attention`` then
``metp_mlp``, forward and backward — in alternating blocks of ``--block`` steps: check off, the
default schedule (``METP_CHECK_AGREEMENT=1``: an exchange at the first calls of a group and every
64th, each call's digest added to the window in between), and ``every`` (an exchange at each call),
so the three are measured side by side under the same load. It prints per mode the mean step
time and its ratio to "off", the median ratio of each block to the "off" block of its round, and the cost of one check call on its own (cached
path and exchange). Rank 0's numbers; the ranks run the same schedule.

    python benchmarks/agreement_cost.py                 # METP=2, hidden 64, 64 tokens per rank
    python benchmarks/agreement_cost.py --tokens 256 --hidden 128 --blocks 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp import METPGroup, agree  # noqa: E402
from megatron_metp.ops import metp_attention, metp_mlp  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

MODES = ("off", "default", "every")


def _set_mode(mode: str) -> None:
    """Switch without resetting the call counters (every rank switches at the same call)."""
    agree._enabled = mode != "off"
    agree._mode = {"off": "off", "default": "cached", "every": "every"}[mode]


def _rank(rank, p, tokens, hidden, heads_per_rank, head_dim, block, blocks):
    torch.manual_seed(rank)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="bench")
    agree.enable_agreement_checks(True)
    ffn = 4 * hidden
    x = torch.randn(tokens, 1, hidden, requires_grad=True)
    rows = (heads_per_rank + 2) * head_dim  # one query group per rank: q heads, k, v
    wqkv = (torch.randn(rows, hidden) * 0.05).requires_grad_()
    wo = (torch.randn(hidden, heads_per_rank * head_dim) * 0.05).requires_grad_()
    w1 = (torch.randn(ffn // p, hidden) * 0.05).requires_grad_()
    w2 = (torch.randn(hidden, ffn // p) * 0.05).requires_grad_()

    def step():
        y = metp_attention(x, wqkv, wo, group=grp, num_heads=heads_per_rank * p,
                           num_query_groups=p, kernel="reference", label="layer 1 attention")
        z = metp_mlp(y, w1, w2, group=grp, ffn_hidden_size=ffn, label="layer 1 mlp")
        z.sum().backward()

    for _ in range(agree.FIRST_CALLS + 2):  # warm-up: the scheduled first calls
        step()
    before = agree._window(grp).calls
    step()
    calls_per_step = agree._window(grp).calls - before
    times = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}  # this rank's main-thread CPU time: less sensitive to other jobs
    orders = [MODES[i:] + MODES[:i] for i in range(len(MODES))]
    orders += [o[::-1] for o in orders]
    for b in range(blocks):
        for mode in orders[b % len(orders)]:  # each mode in each position equally often
            _set_mode(mode)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(block):
                step()
            times[mode].append((time.perf_counter() - t0) / block)
            cpu[mode].append((time.thread_time() - c0) / block)
    # one check call on its own: the cached path (between exchanges) and an exchange
    _set_mode("default")
    fields = dict(label="layer 1 mlp", x_hidden_size=hidden, x_dtype=x.dtype, activation="gelu",
                  w1=w1, w2=w2, b1=None, b2=None, needs_grad=True, keep_intermediate=False)
    w = agree._window(grp)
    n = 2000
    while agree._scheduled(w.calls):
        agree.check_group_agrees(grp, "metp_mlp 'layer 1 mlp'", **fields)
    t0 = time.perf_counter()
    cached = 0
    for _ in range(n):
        if agree._scheduled(w.calls):
            break
        agree.check_group_agrees(grp, "metp_mlp 'layer 1 mlp'", **fields)
        cached += 1
    t_cached = (time.perf_counter() - t0) / max(cached, 1)
    _set_mode("every")
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        agree.check_group_agrees(grp, "metp_mlp 'layer 1 mlp'", **fields)
    t_exchange = (time.perf_counter() - t0) / 200
    return {"times": times, "cpu": cpu, "t_cached": t_cached, "t_exchange": t_exchange,
            "calls": calls_per_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads-per-rank", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--block", type=int, default=16, help="steps per block")
    ap.add_argument("--blocks", type=int, default=36, help="rounds of one block per mode")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = run_ranks(_rank, args.metp, args.tokens, args.hidden, args.heads_per_rank,
                    args.head_dim, args.block, args.blocks, timeout=1800)[0]
    times = res["times"]
    mean = {m: statistics.fmean(v) for m, v in times.items()}
    paired = {m: statistics.median(a / b for a, b in zip(times[m], times["off"])) for m in MODES}
    calls = res["calls"]  # checked calls per step
    exch = calls / agree.EVERY  # exchanges per step in the steady state
    model = (calls * res["t_cached"] + exch * res["t_exchange"]) / mean["off"]
    print(f"METP={args.metp}, {args.tokens} tokens per rank, hidden {args.hidden}, "
          f"{args.heads_per_rank * args.metp} heads of {args.head_dim}, FFN {4 * args.hidden}; "
          f"metp_attention + metp_mlp forward and backward ({res['calls']} checked calls per "
          f"step); "
          f"{args.blocks} rounds of one {args.block}-step block per mode, the order rotating; "
          f"rank 0")
    cpu = {m: statistics.fmean(v) for m, v in res["cpu"].items()}
    print("| agreement check | mean step (ms) | mean vs off | median of the blocks' ratio to "
          "the off block next to them | min..max of the blocks (ms) | main-thread CPU per step "
          "(ms) | CPU vs off |")
    print("|---|---|---|---|---|---|---|")
    for m in MODES:
        v = times[m]
        print(f"| {m} | {mean[m] * 1e3:.3f} | {mean[m] / mean['off']:.4f} | {paired[m]:.4f} | "
              f"{min(v) * 1e3:.3f}..{max(v) * 1e3:.3f} | {cpu[m] * 1e3:.3f} | "
              f"{cpu[m] / cpu['off']:.4f} |")
    print(f"one check call: {res['t_cached'] * 1e6:.1f} us between exchanges (memo, window "
          f"append), {res['t_exchange'] * 1e6:.1f} us with an exchange (all-gather over gloo); "
          f"default schedule in steady state = {calls} cached calls + {exch:.4f} exchanges per "
          f"step = {model * 100:.2f} % of the 'off' step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
