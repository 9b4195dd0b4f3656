"""Hardware presets of ``metp plan``: device memory, dense bf16 rate and NVLink bandwidth per
direction, each with its source (the public datasheet; the H200's measured matmul rate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float     # device memory, the datasheet's figure
    bf16_tflops: float    # dense bf16 tensor-core peak, TFLOP/s
    link_gbps: float      # NVLink bandwidth per direction, GB/s (10^9 B/s)
    measured_tflops: Optional[float] = None  # a matmul rate measured by this project
    source: str = ""
    host_gbps: float = 64.0  # host link (PCIe) per direction, GB/s, nominal
    internode_gbps: float = 50.0  # inter-node link per GPU per direction, GB/s (see below)
    hbm_gbps: float = 3350.0  # device memory bandwidth, GB/s (datasheet; MoE expert GEMMs)
    sms: int = 132            # streaming multiprocessors (datasheet; MoE expert GEMMs' waves)


#: Sources (public datasheets):
#: * A100-80GB (SXM): NVIDIA A100 Tensor Core GPU datasheet — BF16 tensor core 312 TFLOP/s dense
#:   (624 with sparsity), 80 GB HBM2e, NVLink 3 600 GB/s total = 300 GB/s per direction.
#: * H100-80GB (SXM5): NVIDIA H100 Tensor Core GPU datasheet — BF16 tensor core 1,979 TFLOP/s
#:   *with sparsity*, i.e. 989 TFLOP/s dense; 80 GB HBM3; NVLink 4 900 GB/s total = 450 GB/s per
#:   direction.
#: * H200-141GB (SXM): NVIDIA H200 Tensor Core GPU datasheet — same compute as H100 SXM
#:   (989 TFLOP/s dense bf16), 141 GB HBM3e, NVLink 900 GB/s total = 450 GB/s per direction.
#:   Measured here (DESIGN.md §4, one H200, 2026-11-30): bf16 matmul 708 TFLOP/s.
#: * Host link (activation offload): PCIe 4.0 x16 (A100) 32 GB/s per direction, PCIe 5.0 x16
#:   (H100/H200 SXM) 64 GB/s per direction, nominal (PCI-SIG; NVIDIA's HGX system specs list
#:   one PCIe 5.0 x16 link per GPU). Not measured here.
#: * Inter-node link (a ring that crosses nodes: METP × CP's K/V ring): one InfiniBand adapter
#:   per GPU in NVIDIA's reference systems. DGX H100 / H200 user guide (hardware overview): eight
#:   single-port ConnectX-7 for the compute fabric, 400 Gb/s NDR each = 50 GB/s per direction per
#:   GPU. DGX A100 user guide: eight single-port ConnectX-6, 200 Gb/s HDR each = 25 GB/s per
#:   direction per GPU. Nominal line rates, not measured here.
#: * Device memory bandwidth and SM count (the MoE expert GEMMs' shape rate, :mod:`.moe_time`):
#:   A100 80GB SXM 2,039 GB/s, 108 SMs; H100 SXM5 3.35 TB/s HBM3, 132 SMs; H200 SXM 4.8 TB/s
#:   HBM3e, 132 SMs (the GPUs' datasheets; SM counts from NVIDIA's A100 / H100 architecture
#:   whitepapers). Not measured here.
HARDWARE: Dict[str, Hardware] = {
    "A100-80GB": Hardware("A100-80GB", 80, 312, 300, host_gbps=32.0, internode_gbps=25.0,
                          hbm_gbps=2039.0, sms=108,
                          source="NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, NVLink3 "
                                 "600 GB/s total (300 per direction), 80 GB"),
    "H100-80GB": Hardware("H100-80GB", 80, 989, 450,
                          source="NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense (1979 "
                                 "sparse), NVLink4 900 GB/s total (450 per direction), 80 GB"),
    "H200-141GB": Hardware("H200-141GB", 141, 989, 450, measured_tflops=708, hbm_gbps=4800.0,
                           source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, NVLink "
                                  "900 GB/s total (450 per direction), 141 GB; measured bf16 "
                                  "matmul 708 TFLOP/s (DESIGN.md §4)"),
}
