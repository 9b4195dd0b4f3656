"""Host memory as a planned constraint: pinned host bytes per node against the node's RAM.

With ``--offload-activations`` every rank pins what its layers keep for backward in host memory
(``Activations.host``: with full recompute, ``L`` layer inputs of ``[s/p, b, h]``, 16-bit), and all
ranks of a node pin theirs in the same RAM. A job fits only if the device total fits each GPU
*and* ``gpus_per_node × host`` fits the node's host memory; the longest sequence honours both.

Host RAM per node of each hardware preset (``--host-memory-gib`` overrides it, per node):

* A100-80GB: NVIDIA DGX A100 (640 GB) datasheet — 2 TB system memory.
* H100-80GB: NVIDIA DGX H100 datasheet — 2 TB system memory.
* H200-141GB: NVIDIA DGX H200 datasheet — 2 TB system memory.

"2 TB" is taken as 2·10¹² bytes = 1,862.6 GiB, all of it available to pinned buffers (the
operating system, the data loader and the CUDA context's host allocations come out of
``--host-memory-gib`` if the user lowers it).
"""

from __future__ import annotations

from typing import Dict, Optional

from .model import GiB, Job

#: GPUs per node (one HGX/DGX node), for the host memory a node must hold
GPUS_PER_NODE = 8

#: host RAM per node of each preset, GiB, and its source
HOST_MEMORY_GIB: Dict[str, float] = {
    "A100-80GB": 2e12 / GiB,
    "H100-80GB": 2e12 / GiB,
    "H200-141GB": 2e12 / GiB,
}
HOST_MEMORY_SOURCES: Dict[str, str] = {
    "A100-80GB": "NVIDIA DGX A100 datasheet: 2 TB system memory",
    "H100-80GB": "NVIDIA DGX H100 datasheet: 2 TB system memory",
    "H200-141GB": "NVIDIA DGX H200 datasheet: 2 TB system memory",
}


def host_capacity_bytes(job: Job) -> Optional[float]:
    """Host RAM of one node in bytes: ``job.host_memory_gib`` if set, else the preset's
    (``None``: unknown preset, no host constraint)."""
    gib = job.host_memory_gib if job.host_memory_gib is not None else \
        HOST_MEMORY_GIB.get(job.hardware)
    return None if gib is None else gib * GiB


def host_per_node(host_per_rank: float) -> float:
    """Pinned host bytes of one node: every GPU of the node pins its rank's share."""
    return GPUS_PER_NODE * host_per_rank


def host_fits(job: Job, host_per_rank: float) -> bool:
    cap = host_capacity_bytes(job)
    return cap is None or host_per_node(host_per_rank) <= cap


def host_report(job: Job, measured_per_rank: Optional[float], planned_per_rank: float) -> str:
    """One line for ``metp measure`` / the dry run: pinned host bytes per rank and per node,
    measured next to planned, against the node's host memory."""
    cap = host_capacity_bytes(job)
    used = planned_per_rank if measured_per_rank is None else measured_per_rank
    parts = []
    if measured_per_rank is not None:
        parts.append(f"measured {measured_per_rank / GiB:,.2f} GiB per rank, "
                     f"{host_per_node(measured_per_rank) / GiB:,.0f} GiB per node of "
                     f"{GPUS_PER_NODE}")
    parts.append(f"planned {planned_per_rank / GiB:,.2f} GiB per rank, "
                 f"{host_per_node(planned_per_rank) / GiB:,.0f} GiB per node")
    if cap is not None:
        parts.append(f"host memory {cap / GiB:,.0f} GiB per node: "
                     f"{'fits' if host_per_node(used) <= cap else 'DOES NOT FIT'}")
    return "pinned host memory: " + "; ".join(parts)
