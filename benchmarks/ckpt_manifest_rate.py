"""What the Megatron-LM checkpoint manifest costs: hash rates on this CPU, and the time to hash
(at save) and verify (at load) a Llama-3-8B-sized checkpoint with its optimizer state.

It measures, best of ``--repeat`` runs each: SHA-256 (the manifest's hash) and BLAKE2b (the other
candidate) on a buffer in memory (one core); and ``ckpt_manifest.write_manifest`` over
``--files`` files of ``--mib`` MiB each, read back from the page cache with its thread pool (as
rank 0 does at ``--save``). From the rates it prints the seconds for a checkpoint of
``--params`` parameters at 14 bytes each (bf16 weights, fp32 main parameters, Adam's two fp32
moments, as Megatron-LM's torch_dist format stores them with mixed precision): one core, the
thread pool measured here, and the ranks' shares at load (each rank hashes 1/world of the
bytes). A file system slower than the rates measured here bounds the times instead.

    python benchmarks/ckpt_manifest_rate.py
    python benchmarks/ckpt_manifest_rate.py --files 8 --mib 256 --world 64
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_metp.megatron_lm import ckpt_manifest  # noqa: E402


def _rate(algo: str, buf: bytes, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        h = hashlib.new(algo)
        t = time.perf_counter()
        h.update(buf)
        best = min(best, time.perf_counter() - t)
    return len(buf) / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per file and of the buffer")
    ap.add_argument("--files", type=int, default=4, help="files of the folder hashed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--params", type=float, default=8.03e9, help="parameters (Llama-3-8B)")
    ap.add_argument("--world", type=int, default=64, help="ranks sharing the load check")
    opts = ap.parse_args(argv)
    buf = os.urandom(opts.mib << 20)
    rates = {algo: _rate(algo, buf, opts.repeat) for algo in ("sha256", "blake2b")}
    for algo, r in rates.items():
        print(f"{algo:8s} in memory, one core: {r:.2f} GB/s")
    with tempfile.TemporaryDirectory() as d:
        for i in range(opts.files):
            with open(os.path.join(d, f"__{i}_0.distcp"), "wb") as fh:
                fh.write(buf)
        best = float("inf")
        for _ in range(opts.repeat):
            _, n, size, took = ckpt_manifest.write_manifest(d)
            best = min(best, took)
        pool = size / best / 1e9
        workers = ckpt_manifest._workers(n)
        print(f"write_manifest, {n} files x {opts.mib} MiB from the page cache, {workers} "
              f"thread{'s' if workers > 1 else ''}: {pool:.2f} GB/s")
    total = opts.params * 14
    one = rates[ckpt_manifest.HASH]
    print(f"checkpoint of {opts.params / 1e9:.2f}B parameters with optimizer state: "
          f"{total / 1e9:.1f} GB")
    print(f"  save (rank 0) or preflight: {total / one / 1e9:.0f} s on one core, "
          f"{total / pool / 1e9:.0f} s with the {workers}-thread pool measured here")
    print(f"  load in the ranks ({opts.world} ranks, each its share): "
          f"{total / opts.world / one / 1e9:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
