"""Start-up check that no METP group spans two nodes.

A METP group's weight ring and head-group broadcasts move whole weight shards every layer; they
are sized for the intra-node link (NVLink). Under METP × context parallelism only the K/V ring of
the CP group may cross nodes. :func:`check_metp_groups_on_one_node` all-gathers every rank's
node (:func:`node_name`: Slurm's node name, else the host name) and METP group over the world (one small collective, bounded by the job timeout) and
raises :class:`METPPlacementError` on *every* rank, naming the group, its hosts and the fix,
when a METP group has ranks on two hosts.

``METP_ALLOW_CROSS_NODE_RING=1`` accepts such a layout on purpose (e.g. METP 16 over two nodes
of 8, ``configs/gpt-13b-256k-metp16.sh``, which predates METP × CP): rank 0 then prints the
same text as a warning line and the job goes on. The launcher's preflight refuses the same
layouts before any rank starts, from the layout alone (:mod:`.ring_nodes`).
"""

from __future__ import annotations

import datetime
import socket
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import overrides
from .groups import METPGroup
from .ring_nodes import fix_text

#: bytes of a host name carried by the check (longer names are compared by this prefix)
HOST_BYTES = 64


class METPPlacementError(RuntimeError):
    """A METP group has ranks on more than one node."""


def node_name() -> str:
    """This rank's node: Slurm's node name (``$SLURMD_NODENAME``, set in every task of a job
    step; distinct per node also where several ``slurmd`` share a host), else the host name."""
    return overrides.slurm_node_name() or socket.gethostname()


def _encode(host: str, ranks: Sequence[int], width: int) -> torch.Tensor:
    raw = host.encode()[:HOST_BYTES]
    row = torch.full((1 + HOST_BYTES + 1 + width,), -1, dtype=torch.int64)
    row[0] = len(raw)
    row[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    row[1 + HOST_BYTES] = len(ranks)
    row[2 + HOST_BYTES:2 + HOST_BYTES + len(ranks)] = torch.tensor(list(ranks), dtype=torch.int64)
    return row


def _decode(row: torch.Tensor):
    n = int(row[0])
    host = bytes(int(b) for b in row[1:1 + n]).decode(errors="replace")
    k = int(row[1 + HOST_BYTES])
    return host, tuple(int(r) for r in row[2 + HOST_BYTES:2 + HOST_BYTES + k])


def check_metp_groups_on_one_node(metp: METPGroup, *, hostname: Optional[str] = None,
                                  gpus_per_node: Optional[int] = None) -> dict:
    """Raise :class:`METPPlacementError` on every rank if any METP group of the job has ranks on
    two hosts; return ``{host: [global ranks]}`` otherwise. A collective over the world group:
    call it on every rank at the same point (start-up). ``hostname``: this rank's node (default
    :func:`node_name`; tests pass fake ones). ``gpus_per_node`` only improves the message."""
    if not dist.is_initialized() or (dist.get_backend() or "") == "fake":
        # the fake process group of the instruments moves nothing: one process, one host
        return {hostname or node_name(): list(range(dist.get_world_size()
                                                             if dist.is_initialized() else 1))}
    world = dist.get_world_size()
    host = hostname if hostname is not None else node_name()
    mine = _encode(host, metp.ranks, world)
    device = torch.device("cpu")
    if "nccl" in (dist.get_backend() or ""):
        device = torch.device("cuda", torch.cuda.current_device())
    mine = mine.to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(rows, mine, async_op=True)
    if device.type == "cpu":
        work.wait(timeout=datetime.timedelta(seconds=metp.timeout_s))
    else:
        work.wait()
    info = [_decode(r.cpu()) for r in rows]
    hosts = {}
    for rank, (h, _) in enumerate(info):
        hosts.setdefault(h, []).append(rank)
    bad = []
    for ranks in sorted({g for _, g in info}):
        on = {}
        for r in ranks:
            on.setdefault(info[r][0], []).append(r)
        if len(on) > 1:
            bad.append((ranks, on))
    if bad:
        text = _message(bad, hosts, host, gpus_per_node)
        if overrides.flag("METP_ALLOW_CROSS_NODE_RING"):  # 1: accept; 0/unset: refuse
            if dist.get_rank() == 0:
                print(f"> {text.split(' This is rank')[0]} Accepted: "
                      f"METP_ALLOW_CROSS_NODE_RING=1.", flush=True)
            return hosts
        raise METPPlacementError(text + " (METP_ALLOW_CROSS_NODE_RING=1 accepts the layout "
                                 "on purpose.)")
    return hosts


def _message(bad, hosts, host, gpus_per_node) -> str:
    ranks, on = bad[0]
    where = ", ".join(f"{h} (ranks {', '.join(map(str, rs))})" for h, rs in on.items())
    per_node = gpus_per_node or max(len(v) for v in hosts.values())
    more = f" (and {len(bad) - 1} more group(s))" if len(bad) > 1 else ""
    return (f"METP: the METP group of global ranks {list(ranks)} spans {len(on)} nodes: "
            f"{where}{more}. Its weight ring and head-group broadcasts would cross the "
            f"inter-node link every layer. {fix_text(per_node)} "
            f"This is rank {dist.get_rank()} on {host}.")
