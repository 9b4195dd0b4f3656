"""Losses over a few optimizer steps of a tiny GPT: single rank, stock TP, and METP compositions.

Every layout starts from the same full weights and sees the same global batches, on forked gloo
CPU ranks with megatron-core's DDP, optimizer and pipeline schedules. Prints a markdown table.

    python benchmarks/compositions.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, train  # noqa: E402
from tests.harness import preload_megatron, run_ranks  # noqa: E402

SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
               vocab_size=64, seq_length=16)

LAYOUTS = [
    ("single rank", 1, Layout()),
    ("stock TP=2", 2, Layout(tp=2, mode="tp")),
    ("stock TP=4", 4, Layout(tp=4, mode="tp")),
    ("ring self-attention=2", 2, Layout(metp=2, mode="ring")),
    ("METP=2", 2, Layout(metp=2)),
    ("METP=4", 4, Layout(metp=4)),
    ("METP=2 × TP=2", 4, Layout(metp=2, tp=2)),
    ("METP=2 × PP=2", 4, Layout(metp=2, pp=2)),
    ("METP=2 × DP=2 (DDP)", 4, Layout(metp=2)),
    ("METP=2 × DP=2 (DDP + distributed optimizer)", 4, Layout(metp=2, distributed_optimizer=True)),
]


def _run(rank, world, layout, steps):
    import warnings

    warnings.simplefilter("ignore")
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(layout, SIZE.seq_length)
    return [(r.lm_loss, r.grad_norm) for r in train(SIZE, layout, steps)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    preload_megatron()
    rows, ref = [], None
    t0 = time.time()
    for name, world, layout in LAYOUTS:
        res = run_ranks(_run, world, layout, args.steps, timeout=600)[0]
        ref = ref or res
        worst = max(abs(a[0] - b[0]) / b[0] for a, b in zip(res, ref))
        rows.append((name, world, res, worst))
    head = " | ".join(f"step {i + 1} lm loss" for i in range(args.steps))
    print(f"| layout | ranks | {head} | grad norm step 1 | max rel. diff vs single |")
    print("|---|---:|" + "---:|" * args.steps + "---:|---:|")
    for name, world, res, worst in rows:
        losses = " | ".join(f"{loss:.7f}" for loss, _ in res)
        print(f"| {name} | {world} | {losses} | {res[0][1]:.6f} | {worst:.1e} |")
    print(f"\n{len(rows)} runs on {os.cpu_count()} CPU cores in {time.time() - t0:.1f} s "
          f"(tiny GPT: {SIZE.num_layers} layers, h={SIZE.hidden_size}, "
          f"{SIZE.num_attention_heads} heads, ffn={SIZE.ffn_hidden_size}, s={SIZE.seq_length}, "
          f"global batch 4, fp32, Adam lr 1e-3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
