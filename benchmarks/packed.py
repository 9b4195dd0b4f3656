#!/usr/bin/env python
"""Packed sequences (``cu_seqlens``): per-rank attention balance, FLOPs, bytes and block-kernel
launches of one METP attention layer, packed document mixes against full causal attention.

Everything is arithmetic from the block plan of :mod:`megatron_metp.ops.documents` (the same
plan the ops run; ``tests/test_packed_attention.py`` checks these counts against what forked
gloo ranks really launch and send); nothing is timed and no 128K attention runs here.

Mixes: document lengths drawn log-uniformly in ``[256, 65536]`` tokens until the context is
full (the last document cut to fit), one mix per seed, the same for every layout.

Layouts: ``dual_chunk`` (Megatron's CP order over the whole packed sequence), ``contiguous``,
and ``balanced`` (:mod:`megatron_metp.ops.documents`: documents of at least ``2p·128`` tokens
dual-chunked over the ranks on their own, the rest dual-chunked together: the balanced split).

Tables:

* **balance**: per-rank attention work (visible score pairs, :func:`documents.attention_work`)
  max/mean over the ``p`` ranks, per layout (target ≤ 1.15).
* **layer**: per rank and layer, for the Llama-8B-like geometry below (bf16):
  ``attn TFLOP`` the block kernels' FLOPs (forward ``4·d`` per evaluated score pair and head,
  backward 2.5× the forward; a causal piece evaluates its triangle, a masked piece its whole
  box), max over ranks; ``useful`` the same for the visible pairs only; ``linear TFLOP`` the
  QKV and output-projection GEMMs (forward + backward, the same for every mix); ``K/V GB sent``
  forward (the ring stops after the last step any rank needs) and backward (K/V and fp32
  ``dK/dV`` blocks, every step); ``launches`` block-kernel calls per rank in one forward of
  one K/V ring (the backward makes as many; a layer runs ``p/kb`` rings of ``kb`` head groups),
  max over ranks, for a kernel that takes a mask (one masked piece per cut block) and for one
  that does not (flash-attn, CUDA torch_flash: one full/causal piece per document rectangle).

Usage::

    python benchmarks/packed.py            # 32K and 128K context, p = 8, 5 seeds
    python benchmarks/packed.py --quick    # 2K context, p = 4, 2 seeds (what the tests run)
    python benchmarks/packed.py --json out/packed.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp.ops import documents  # noqa: E402

#: Llama-3-8B-like attention geometry: hidden, heads, query groups, head dim; batch 1, bf16.
GEOMETRY = {"hidden": 4096, "heads": 32, "groups": 8, "head_dim": 128, "batch": 1, "elem": 2}
LAYOUTS = ("dual_chunk", "contiguous", "balanced")


def draw_mix(s: int, seed: int, lo: int = 256, hi: int = 65536, unit: int = 1):
    """``cu_seqlens`` of one mix: log-uniform lengths in ``[lo, hi]`` (rounded to a multiple
    of ``unit``) until ``s`` is full (the last one cut to fit)."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < s:
        length = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        length = max(unit, unit * round(length / unit))
        cu.append(min(s, cu[-1] + length))
    return tuple(cu)


def kv_bytes(cu, p: int, layout: str, batch: int, kv_heads: int, head_dim: int,
             elem: int) -> dict:
    """``{"fwd", "bwd"}``: K/V bytes one rank sends in one ring over ``kv_heads`` K/V heads."""
    cu = tuple(cu)
    n = cu[-1] // p
    if p == 1:
        return {"fwd": 0, "bwd": 0}
    block = 2 * n * batch * kv_heads * head_dim
    steps = documents.forward_steps(cu, n, p, layout)
    return {"fwd": (steps - 1) * block * elem, "bwd": (p - 1) * block * (elem + 4)}


def layer_row(cu, p: int, layout: str, geo=GEOMETRY) -> dict:
    """One table row: per-rank figures of one METP attention layer for ``cu``."""
    cu = tuple(cu)
    s = cu[-1]
    n = s // p
    h, A, G, d, b, e = (geo[k] for k in ("hidden", "heads", "groups", "head_dim", "batch", "elem"))
    masked = documents.plan_counts(cu, p, layout, masks=True)
    split = documents.plan_counts(cu, p, layout, masks=False)
    per_pair = A * b * 4 * d * 3.5  # forward 4·d per pair and head, backward 2.5×
    linear = 3 * 2 * n * b * h * ((A + 2 * G) * d + A * d)
    kv = kv_bytes(cu, p, layout, b, G, d, e)
    return {"docs": len(cu) - 1, "layout": layout,
            "attn_tflop_masked": max(masked["pairs"]) * per_pair / 1e12,
            "attn_tflop_split": max(split["pairs"]) * per_pair / 1e12,
            "useful_tflop": max(masked["useful"]) * per_pair / 1e12,
            "linear_tflop": linear / 1e12,
            "kv_gb_fwd": kv["fwd"] / 1e9, "kv_gb_bwd": kv["bwd"] / 1e9,
            "fwd_steps": masked["steps"],
            "launches_masked": max(masked["launches"]), "launches_split": max(split["launches"]),
            "balance": max(masked["useful"]) * p / sum(masked["useful"])}


def balance_table(contexts, p, seeds, layouts=LAYOUTS):
    rows = []
    for s in contexts:
        for seed in seeds:
            cu = draw_mix(s, seed)
            rows.append({"context": s, "seed": seed, "docs": len(cu) - 1,
                         **{lay: documents.work_balance(cu, p, lay) for lay in layouts}})
    return rows


def layer_table(contexts, p, seeds, layouts=LAYOUTS):
    rows = []
    for s in contexts:
        for layout in layouts:
            rows.append({"context": s, "mix": "full causal", **layer_row((0, s), p, layout)})
            for seed in seeds:
                rows.append({"context": s, "mix": f"seed {seed}",
                             **layer_row(draw_mix(s, seed), p, layout)})
    return rows


def _md(rows, cols):
    head = "| " + " | ".join(c for c, _ in cols) + " |"
    sep = "|" + "|".join("---:" for _ in cols) + "|"
    body = []
    for r in rows:
        cells = []
        for _, key in cols:
            v = r[key] if not callable(key) else key(r)
            cells.append(f"{v:,.3f}" if isinstance(v, float) else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep] + body)


def render(balance, layer, p, layouts=LAYOUTS) -> str:
    out = [f"## Attention work balance, p = {p} (max/mean visible score pairs per rank)", "",
           _md(balance, [("context", "context"), ("seed", "seed"), ("docs", "docs")]
               + [(lay, lay) for lay in layouts]), ""]
    for lay in layouts:
        for s in sorted({r["context"] for r in balance}):
            vals = [r[lay] for r in balance if r["context"] == s]
            out.append(f"* {lay}, {s} tokens: max/mean worst {max(vals):.3f}, "
                       f"mean {sum(vals) / len(vals):.3f} over {len(vals)} mixes")
    out += ["", f"## One METP attention layer per rank, p = {p} "
            f"(h={GEOMETRY['hidden']}, A={GEOMETRY['heads']}, G={GEOMETRY['groups']}, "
            f"d={GEOMETRY['head_dim']}, bf16)", "",
            _md(layer, [("context", "context"), ("layout", "layout"), ("mix", "mix"),
                        ("docs", "docs"), ("attn TFLOP (mask)", "attn_tflop_masked"),
                        ("attn TFLOP (split)", "attn_tflop_split"),
                        ("useful TFLOP", "useful_tflop"), ("linear TFLOP", "linear_tflop"),
                        ("K/V GB fwd", "kv_gb_fwd"), ("K/V GB bwd", "kv_gb_bwd"),
                        ("fwd steps", "fwd_steps"), ("launches (mask)", "launches_masked"),
                        ("launches (split)", "launches_split"), ("max/mean", "balance")])]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2K context, p = 4, 2 seeds")
    ap.add_argument("--p", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        contexts, p, seeds = (2048,), args.p or 4, range(args.seeds or 2)
    else:
        contexts, p, seeds = (32768, 131072), args.p or 8, range(args.seeds or 5)
    balance = balance_table(contexts, p, seeds)
    layer = layer_table(contexts, p, seeds)
    print(render(balance, layer, p))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"p": p, "balance": balance, "layer": layer}, fh, indent=1)
    return balance, layer


if __name__ == "__main__":
    main()
