"""Kernel rates the step-time model (:mod:`.step_time`) assumes: dense bf16 GEMM, attention
forward and attention backward, per hardware preset and attention kernel, and ``--rates FILE``
(measured rates, e.g. written by ``benchmarks/gpu_check.py``) overriding them.

The attention rates and the kernels' names are the one table of
``megatron_metp/ops/kernel_rates.py`` (the run-time choice reads it too; its docstring gives
every figure's source: the FlashAttention-3 paper's H100 head-dim-128 figures, H200 planned at
them, the FlashAttention-2 paper's A100 figures). The planner names each kernel by its published
name (``kernel_rates.SHORT_NAMES``: cudnn, fa3, fa2, torch_flash, unfused; the run-time names
cudnn > flash_attn_3 > flash_attn > torch_flash > reference are taken too, :func:`kernel_name`).
FLOP conventions are that module's: a causal forward ``4·s²·a·d/2``, the backward 2.5× it
(:data:`ATTENTION_BWD_FLOP_RATIO`). The plan uses the table's rows whatever the model's head
width (its figures are head dim 128, the width of the presets' long-sequence models).

* **GEMM**: the dense bf16 matmul rate this project measured on one H200 (DESIGN.md §4,
  2026-11-30: 708 TFLOP/s, 72 % of the 989 datasheet figure), used for H100 SXM too (same SM
  count, clocks and tensor cores per the datasheets); A100: 70 % of its datasheet rate (218), the
  plan's previous rule, not measured here.
* **Host link**: :func:`.host_link.host_copy_gbps`.

Which kernel a GPU runs (:func:`default_kernel`): the one the run-time choice takes with every
kernel installed, the fastest by the table (``kernel_rates.fastest``: least ``1/fwd + 2.5/bwd``):
fa3 on H100 and H200 (616 / 561 against cuDNN's 539 / 516), fa2 on A100 (no cuDNN A100 figures
are cited, so the run-time choice keeps its order there: cudnn). ``--kernel NAME`` forces
another (e.g. ``fa2`` for a like-for-like with ALST, which ran FlashAttention-2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from ...ops import kernel_rates as KR
from .host_link import host_copy_gbps

#: a flash backward's FLOPs over its forward's (``ops/kernel_rates.py``)
ATTENTION_BWD_FLOP_RATIO = KR.ATTENTION_BWD_FLOP_RATIO
#: the kernels by their published names, in the run-time order (``ops/kernel_rates.py``'s
#: ``KERNELS`` through its ``SHORT_NAMES``)
KERNELS = tuple(KR.SHORT_NAMES[k] for k in KR.KERNELS)
#: the run-time names that differ from the published ones (``--kernel`` takes both)
KERNEL_ALIASES = {k: v for k, v in KR.SHORT_NAMES.items() if k != v}


def kernel_name(kernel: str) -> str:
    """The table's (published) name of ``kernel`` (a run-time name resolved)."""
    return KR.short_name(kernel)


def preset_of(device: str) -> Optional[str]:
    """The hardware preset a device name (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100
    80GB HBM3") or preset name denotes, or None."""
    for preset in ("A100-80GB", "H100-80GB", "H200-141GB"):
        if device == preset or preset.split("-")[0].lower() in device.lower():
            return preset
    return None


@dataclass(frozen=True)
class Rates:
    """TFLOP/s of one GPU: ``gemm_tflops`` (dense bf16 matmuls), ``attention_fwd_tflops`` and
    ``attention_bwd_tflops`` (the attention kernel, FLOPs counted as in the module docstring),
    the host link ``pcie_gbs`` (GB/s per direction, one GPU), and where the figures come from."""

    hardware: str
    kernel: str
    gemm_tflops: float
    attention_fwd_tflops: float
    attention_bwd_tflops: float
    pcie_gbs: float
    source: str
    measured_at: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


_GEMM_H = 708.0   # measured bf16 matmul, one H200 (DESIGN.md §4); H100 SXM: same compute
_GEMM_A100 = 0.7 * 312
_GEMM = {"H100-80GB": (_GEMM_H, "GEMM 708 measured on H200 (DESIGN.md §4; H100 SXM same "
                                "compute per the datasheets)"),
         "H200-141GB": (_GEMM_H, "GEMM 708 measured on H200 (DESIGN.md §4)"),
         "A100-80GB": (_GEMM_A100, "GEMM 70 % of the 312 datasheet rate")}


def _table() -> Dict[Tuple[str, str], Rates]:
    """One :class:`Rates` per preset and kernel of ``ops/kernel_rates.py``'s bf16 rows."""
    out = {}
    for hw, (gemm, gsrc) in _GEMM.items():
        for r in KR.rows_for(KR.gpu_of(hw)):
            if r.dtype == "bfloat16":
                k = KR.short_name(r.kernel)
                out[(hw, k)] = Rates(hw, k, gemm, r.fwd, r.bwd, host_copy_gbps(hw),
                                     f"{r.source}; {gsrc}")
    return out


#: ``(hardware, kernel) → Rates``: every published figure the plan uses
RATES: Dict[Tuple[str, str], Rates] = _table()


def default_kernel(hardware: str) -> str:
    """The kernel a GPU of ``hardware`` runs by default: the fastest of the table's bf16 rows
    for it (``kernel_rates.best_of``: what the run-time choice takes with all of them
    installed): fa3 on Hopper, fa2 on A100."""
    rows = [r for r in KR.rows_for(KR.gpu_of(hardware)) if r.dtype == "bfloat16"]
    if not rows:
        raise ValueError(f"no kernel rates for hardware {hardware!r}")
    return KR.short_name(KR.best_of(rows).kernel)


def load_rates(path: str, hardware: Optional[str] = None, kernel: Optional[str] = None) -> Rates:
    """Measured rates from ``--rates FILE`` (the format of ``ops/kernel_rates.read_measured``:
    ``hardware``, ``kernel``, ``gemm_tflops``, ``attention_fwd_tflops``,
    ``attention_bwd_tflops``, ``pcie_gbs``, ``source``, ``measured_at``; optionally every
    measured kernel's rates under ``kernels``): the file's kernel, or ``kernel`` (``--kernel``)
    when the file measured it. Errors name ``--rates`` and the field; a file measured on other
    hardware than the plan's is refused (plan that hardware, or measure this one), as is a
    ``--kernel`` the file did not measure."""
    what = f"--rates {path}"
    d = KR.read_measured(path, what)
    preset = preset_of(d["hardware"])
    if preset is None:
        raise ValueError(f"{what}: measured on {d['hardware']!r}, not a GPU of a "
                         f"hardware preset (a --dry file holds no rates for a plan): measure "
                         f"on an A100, H100 or H200")
    if hardware is not None and preset != hardware:
        raise ValueError(f"{what}: measured on {d['hardware']!r}, the plan is for "
                         f"--hardware {hardware}: plan --hardware {preset} or measure "
                         f"{hardware}")
    per = {r.kernel: r for r in KR.measured_rows(d)}
    k = KR.kernel_of(kernel) if kernel else d["kernel"]
    if k not in per:
        raise ValueError(f"{what}: --kernel {kernel_name(k)} was not measured (the file has "
                         f"{', '.join(kernel_name(x) for x in per)}): drop --kernel or measure it")
    return Rates(preset, kernel_name(k), KR.positive(d, "gemm_tflops", what), per[k].fwd,
                 per[k].bwd, KR.positive(d, "pcie_gbs", what), d["source"], d["measured_at"])


def resolve_rates(hardware: str, kernel: Optional[str] = None,
                  rates_file: Optional[str] = None) -> Rates:
    """The rates a plan assumes: ``--rates FILE`` when given (its row for ``kernel`` when
    given), else the table's row for
    ``kernel`` (``--kernel``; default :func:`default_kernel`) on ``hardware``."""
    if rates_file:
        return load_rates(rates_file, hardware, kernel)
    k = kernel_name(kernel) if kernel else default_kernel(hardware)
    if (hardware, k) not in RATES:
        have = sorted(kk for hw, kk in RATES if hw == hardware)
        raise ValueError(f"--kernel {k}: no published rates for {hardware} (it has: "
                         f"{', '.join(have)})")
    return RATES[(hardware, k)]
