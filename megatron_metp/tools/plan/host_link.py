"""The host link one GPU gets for its copies (activation offload, the streaming layer's reads of
its host-resident input): per GPU, the smaller of its PCIe link's sustained rate and its share of
the node's host memory bandwidth, eight GPUs copying at once.

* PCIe, per direction: 5.0 x16 (H100 / H200 SXM) 64 GB/s nominal, 4.0 x16 (A100) 32 GB/s
  (PCI-SIG; NVIDIA's HGX specifications list one x16 link per GPU). Sustained copies reach about
  85 % of it: 128b/130b line encoding (1.5 %) and the transaction-layer packet headers and link
  acknowledgements at a 256-byte payload (~10 %); published outputs of NVIDIA's nvbandwidth
  tool show about 55 GB/s for a pinned host→device copy-engine copy on a Gen5 x16 link (e.g.
  the nvbandwidth tutorial at dev.smart-guide.co.kr: ``host_to_device_memcpy_ce`` 55.63 GB/s),
  0.87 of 64. Planned: 0.85 ×
  nominal = 54.4 GB/s (Gen5), 27.2 GB/s (Gen4).
* Host memory, per node: DGX H100 / H200 (NVIDIA DGX H100/H200 user guide, hardware overview):
  two Intel Xeon Platinum 8480C, each with eight DDR5-4800 channels (Intel ARK): 2 × 8 × 38.4 =
  614.4 GB/s. DGX A100 (user guide): two AMD EPYC 7742, eight DDR4-3200 channels each (AMD): 2 ×
  8 × 25.6 = 409.6 GB/s. Sustained: 80 % of it (a STREAM-like fraction; assumed, not measured
  here), shared by the node's eight GPUs: 61.4 GB/s (DGX H100/H200) and 41 GB/s (DGX A100) per
  GPU, both directions together.

So each GPU copies at ``min(PCIe sustained, host share)`` = 54.4 GB/s (H100, H200) and 27.2 GB/s
(A100): the PCIe link binds when one direction runs at a time; the host share binds
(61.4 GB/s for both directions together) when reads and writes overlap, which the time model
does not assume (it charges the reads, the bulk of the streaming layer's traffic).
"""

from __future__ import annotations

from typing import Dict

#: GPUs per node sharing its host memory
GPUS = 8
#: sustained fraction of nominal PCIe (see the module docstring)
PCIE_EFFICIENCY = 0.85
#: sustained fraction of the host memory's theoretical bandwidth (assumed)
HOST_MEMORY_EFFICIENCY = 0.8

#: hardware → (PCIe nominal GB/s per direction, node host memory GB/s theoretical)
LINKS: Dict[str, tuple] = {
    "A100-80GB": (32.0, 2 * 8 * 25.6),
    "H100-80GB": (64.0, 2 * 8 * 38.4),
    "H200-141GB": (64.0, 2 * 8 * 38.4),
}


def host_link(hardware: str) -> Dict[str, float]:
    """``{"pcie_nominal_gbs", "pcie_sustained_gbs", "host_memory_node_gbs",
    "host_share_gbs", "gbs"}`` for one GPU of ``hardware`` (``gbs`` the rate planned)."""
    pcie, mem = LINKS[hardware]
    sustained = PCIE_EFFICIENCY * pcie
    share = HOST_MEMORY_EFFICIENCY * mem / GPUS
    return {"pcie_nominal_gbs": pcie, "pcie_sustained_gbs": sustained,
            "host_memory_node_gbs": mem, "host_share_gbs": share,
            "gbs": min(sustained, share)}


def host_copy_gbps(hardware: str) -> float:
    """GB/s one GPU's host copies run at (:func:`host_link`'s ``gbs``)."""
    return host_link(hardware)["gbs"]
