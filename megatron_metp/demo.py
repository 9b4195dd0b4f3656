"""``make demo``: METP on CPU ranks, checked against a single-device reference.

Run without arguments, it starts itself under ``torchrun`` with ``--nproc-per-node`` gloo ranks
(default 2). Each rank holds its shard of the MLP weights and its slice of the tokens; the METP
MLP runs forward and backward over the weight ring, and rank 0 compares the reassembled outputs and
gradients with the same MLP computed on one device from the full weights.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="METP group size p (CPU ranks)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length s (divisible by p)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=128, help="FFN size (divisible by p)")
    ap.add_argument("--activation", choices=["gelu", "swiglu"], default="swiglu")
    return ap.parse_args(argv)


def _launch(args) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "megatron_metp.demo",
           f"--seq={args.seq}", f"--hidden={args.hidden}",
           f"--ffn={args.ffn}", f"--activation={args.activation}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("launching:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, env=env)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _worker(args) -> int:
    from .groups import METPGroup
    from .ops import metp_mlp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    s, b, h, ffn, actv = args.seq, 2, args.hidden, args.ffn, args.activation
    if s % p or ffn % p:
        raise SystemExit(f"--seq ({s}) and --ffn ({ffn}) must be divisible by --nproc ({p})")
    k = 2 if actv == "swiglu" else 1
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(s, b, h, generator=gen)
    gy = torch.randn(s, b, h, generator=gen)
    w1 = torch.randn(k * ffn, h, generator=gen) * h ** -0.5
    w2 = torch.randn(h, ffn, generator=gen) * ffn ** -0.5
    f, n = ffn // p, s // p
    rows = torch.arange(rank * f, (rank + 1) * f)
    rows = torch.cat([rows, rows + ffn]) if k == 2 else rows
    w1_r = w1[rows].clone().requires_grad_()
    w2_r = w2[:, rank * f:(rank + 1) * f].clone().requires_grad_()
    x_r = x[rank * n:(rank + 1) * n].clone().requires_grad_()

    group = METPGroup.from_process_group(dist.group.WORLD, name="demo")
    y_r = metp_mlp(x_r, w1_r, w2_r, group=group, activation=actv, ffn_hidden_size=ffn)
    y_r.backward(gy[rank * n:(rank + 1) * n])
    parts = [None] * p
    dist.all_gather_object(parts, (y_r.detach(), x_r.grad, w1_r.grad, w2_r.grad))
    if rank == 0:
        xf, w1f, w2f = (t.clone().requires_grad_() for t in (x, w1, w2))
        z = xf.reshape(-1, h) @ w1f.t()
        if k == 2:
            zg, zu = z.chunk(2, dim=-1)
            a = torch.nn.functional.silu(zg) * zu
        else:
            a = torch.nn.functional.gelu(z)
        y = (a @ w2f.t()).view(s, b, h)
        y.backward(gy)
        y_m = torch.cat([q[0] for q in parts])
        dx_m = torch.cat([q[1] for q in parts])
        dw1_m = torch.empty_like(w1)
        dw2_m = torch.empty_like(w2)
        for r, q in enumerate(parts):
            rr = torch.arange(r * f, (r + 1) * f)
            rr = torch.cat([rr, rr + ffn]) if k == 2 else rr
            dw1_m[rr] = q[2]
            dw2_m[:, r * f:(r + 1) * f] = q[3]
        checks = [("output y", _rel(y_m, y)), ("grad x", _rel(dx_m, xf.grad)),
                  ("grad fc1 weight", _rel(dw1_m, w1f.grad)), ("grad fc2 weight", _rel(dw2_m, w2f.grad))]
        st = group.stats
        print(f"METP MLP ({actv}) on {p} CPU ranks: s={s} b={b} h={h} ffn={ffn}, fp32")
        print(f"  rank 0 holds x {tuple(x_r.shape)}, fc1 {tuple(w1_r.shape)}, fc2 {tuple(w2_r.shape)}")
        print(f"  ring traffic rank 0: {st.steps} exchanges, {st.bytes_sent} bytes sent")
        ok = True
        for name, err in checks:
            good = err <= 1e-5
            ok &= good
            print(f"  {name:16s} rel. error vs single device {err:.2e}  {'ok' if good else 'FAIL'}")
        print("demo:", "all checks passed" if ok else "CHECK FAILED")
        code = 0 if ok else 1
    else:
        code = 0
    dist.destroy_process_group()
    return code


def main(argv=None) -> int:
    args = _parse(argv)
    if "RANK" not in os.environ:
        return _launch(args)
    return _worker(args)


if __name__ == "__main__":
    sys.exit(main())
