"""Time of one Adam step of a rank (:func:`optimizer_s`): on the GPU, memory-bound, or on the
host (CPU Adam); :mod:`.step_time` and :mod:`.alst_time` add it once per iteration.
"""

from __future__ import annotations

from .host_link import HOST_MEMORY_EFFICIENCY, host_link
from .model import BF16, FP32, Job

#: HBM bandwidth (TB/s, datasheets: A100 80GB SXM 2.039, H100 SXM 3.35, H200 4.8), for the GPU
#: Adam step (memory-bound), at 80 % sustained
HBM_TBS = {"A100-80GB": 2.039, "H100-80GB": 3.35, "H200-141GB": 4.8}
#: bytes an Adam step moves per parameter: fp32 gradient read, fp32 master / two moments read and
#: written, bf16 parameter written (4 + 3·8 + 2)
ADAM_BYTES = 30


def optimizer_s(n_params: float, job: Job, ranks_per_node: int, cpu: bool,
                hardware: str) -> float:
    """One Adam step over ``n_params`` parameters of a rank: on the GPU at 80 % of its HBM
    bandwidth, or on the host (CPU Adam) at the rank's share of the node's host memory bandwidth
    (:mod:`.host_link`) plus the fp32 gradients down and bf16 parameters up the host link."""
    if not cpu:
        return n_params * ADAM_BYTES / (0.8 * HBM_TBS[hardware] * 1e12)
    link = host_link(hardware)
    share = HOST_MEMORY_EFFICIENCY * link["host_memory_node_gbs"] / max(1, ranks_per_node)
    return n_params * ADAM_BYTES / (share * 1e9) + n_params * (FP32 + BF16) / (link["gbs"] * 1e9)
