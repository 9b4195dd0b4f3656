"""Kernel rates the step-time model (:mod:`.step_time`) assumes: dense bf16 GEMM, attention
forward and attention backward, per hardware preset and attention kernel, each from a published
figure (sources below), and ``--rates FILE`` (measured rates, e.g. written by
``benchmarks/gpu_check.py``) overriding them.

FLOP conventions (those the published attention figures use): a causal attention forward over
``s`` queries and keys with ``a`` heads of width ``d`` does ``4·s²·a·d/2`` FLOPs (``QKᵀ`` and
``P·V``, half the square visible); its backward does ``2.5×`` the forward's (five matmuls of the
score matrix's size against the forward's two: ``S = QKᵀ`` again, ``dV = PᵀdO``, ``dP = dO·Vᵀ``,
``dQ = dS·K``, ``dK = dSᵀQ``). :data:`ATTENTION_BWD_FLOP_RATIO` is that 2.5.

Sources (bf16, H100 80GB SXM5, head dim 128, sequence length 16k, batch × length = 16k, the
largest lengths published, i.e. the plateau the plan's million-token rings run at):

* **FlashAttention-3 paper** (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, 2024, arXiv
  2407.08608), Fig. 5 (forward) and Fig. 6 (backward), "Attention forward/backward speed, head
  dim 128 (H100 80GB SXM5)", which also benchmarks FlashAttention-2 and cuDNN on the same GPU:

  ============  ==================  ===================  ===========================
  kernel        forward, causal     forward, no mask     backward (no mask; the only
                                                         head-dim-128 backward figure)
  ============  ==================  ===================  ===========================
  FA2           335                 370                  322
  cuDNN         539                 595                  516
  FA3           616                 648                  561
  standard      35                  139                  181
  ============  ==================  ===================  ===========================

  The table takes the *causal* forward figure for every kernel (the lower of the two, and
  what a causal ring's diagonal pieces and a whole causal sequence run at; a ring's full
  off-diagonal blocks run somewhat faster, so this is conservative) and the published backward.
  FlashAttention-2's own paper (Dao 2023, arXiv 2307.08691) quotes "up to 335 TFLOPs/s" on H100
  in its H100 paragraph: the same figure. ``torch_flash`` (torch's SDPA flash backend) is
  FlashAttention-2's kernel built into PyTorch (PyTorch 2.2 release notes: "FlashAttention-2
  ... scaled_dot_product_attention"), so it takes FA2's rates. ``unfused`` (the materialised
  score matrix, ``--kernel unfused``) takes the "standard attention" rows of the same figures
  *without* the mask, halved: it computes the whole square and the plan counts the causal half.
* **A100** (80GB SXM4): FlashAttention-2 paper, abstract and §4.1: forward "up to 73 %" and
  backward "up to 63 %" of the 312 TFLOP/s dense bf16 peak, i.e. 228 and 197; these are the
  paper's best cases (no A100 figures at the causal plateau are published beside them), so the
  A100 plan is an optimistic bound. FA3 is Hopper-only; no cuDNN A100 figures are cited here,
  so A100 plans FA2. Its ``unfused`` row applies Hopper's standard-attention utilisation to
  A100's peak (derived, said so in its source).
* **H200** has the H100 SXM's compute (NVIDIA H200 datasheet: 989 TFLOP/s dense bf16, the
  H100's figure) and more memory bandwidth; its attention rates are planned at the H100's
  published figures (conservative: attention at long sequence is compute-bound).
* **GEMM**: the dense bf16 matmul rate this project measured on one H200 (DESIGN.md §4,
  2026-11-30: 708 TFLOP/s, 72 % of the 989 datasheet figure), used for H100 SXM too (same SM
  count, clocks and tensor cores per the datasheets); A100: 70 % of its datasheet rate (218), the
  plan's previous rule, not measured here.

Which kernel a GPU runs (:func:`default_kernel`): the run-time choice takes the first available
in the order cudnn > flash_attn_3 > flash_attn > torch_flash > reference
(``megatron_metp/ops/kernel_choice.py``, ``METP_ATTENTION_KERNEL`` overriding it; here named
cudnn, fa3, fa2, torch_flash, unfused: :data:`KERNEL_ALIASES`); the plan assumes the first of that
order the table has figures for: cudnn on H100 and H200, fa2 on A100 (no cuDNN A100 figures are
cited here, though the run-time choice would take cudnn there). ``--kernel NAME`` forces another (e.g.
``fa2`` for a like-for-like with ALST, which ran FlashAttention-2).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from ...ops.kernel_choice import PLAN_NAMES, plan_kernel_names
from .host_link import host_copy_gbps

#: a flash backward's FLOPs over its forward's (five score-sized matmuls against two)
ATTENTION_BWD_FLOP_RATIO = 2.5
#: the kernel names, in the run-time choice's order of preference (then the CPU reference):
#: ``ops/kernel_choice.KERNELS`` by their planner names (``kernel_choice.PLAN_NAMES``)
KERNELS = plan_kernel_names()
#: the run-time kernel registry's names (``METP_ATTENTION_KERNEL``, ``benchmarks/gpu_rates.py``)
#: for the same kernels, where they differ from the planner's
KERNEL_ALIASES = {k: v for k, v in PLAN_NAMES.items() if k != v}


def kernel_name(kernel: str) -> str:
    """The table's name of ``kernel`` (a registry alias resolved)."""
    return KERNEL_ALIASES.get(kernel, kernel)


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


_FA3 = "FlashAttention-3 paper (arXiv 2407.08608) Fig. 5/6, H100 SXM5, hdim 128, 16k"
_GEMM_H = 708.0   # measured bf16 matmul, one H200 (DESIGN.md §4); H100 SXM: same compute
_GEMM_A100 = 0.7 * 312

#: (forward causal, backward) TFLOP/s per kernel on Hopper (H100 SXM5; H200 the same compute)
_HOPPER = {
    "cudnn": (539.0, 516.0, f"cuDNN fused attention: {_FA3}: forward causal 539, backward 516"),
    "fa3": (616.0, 561.0, f"FlashAttention-3: {_FA3}: forward causal 616, backward 561"),
    "fa2": (335.0, 322.0, f"FlashAttention-2: {_FA3}: forward causal 335 (FA2 paper: 'up to "
                          f"335' on H100), backward 322"),
    "torch_flash": (335.0, 322.0, f"torch SDPA flash backend = FlashAttention-2 kernel: FA2's "
                                  f"rates ({_FA3})"),
    "unfused": (139.0 / 2, 181.0 / 2, f"standard attention (materialised scores): {_FA3}: 139 "
                                      f"forward, 181 backward without mask, halved (the whole "
                                      f"square computed, the causal half counted)"),
}
_A100 = {
    "fa2": (0.73 * 312, 0.63 * 312, "FlashAttention-2 paper (arXiv 2307.08691): forward up to "
                                    "73 %, backward up to 63 % of A100's 312 TFLOP/s"),
    "torch_flash": (0.73 * 312, 0.63 * 312, "torch SDPA flash backend = FlashAttention-2: FA2 "
                                            "paper's A100 figures"),
    # no published A100 figure for the materialised score matrix: Hopper's standard-attention
    # utilisation (139 and 181 of 989, no mask) applied to A100's 312, halved as above
    "unfused": (139.0 / 989 * 312 / 2, 181.0 / 989 * 312 / 2,
                "standard attention: the FA3 paper's H100 utilisation (139/989 forward, 181/989 "
                "backward, no mask) on A100's 312, halved (causal half counted); derived"),
}



def _table() -> Dict[Tuple[str, str], Rates]:
    out = {}
    for hw, kernels, gemm, gsrc in (
            ("H100-80GB", _HOPPER, _GEMM_H, "GEMM 708 measured on H200 (DESIGN.md §4; H100 SXM "
                                            "same compute per the datasheets)"),
            ("H200-141GB", _HOPPER, _GEMM_H, "GEMM 708 measured on H200 (DESIGN.md §4)"),
            ("A100-80GB", _A100, _GEMM_A100, "GEMM 70 % of the 312 datasheet rate")):
        for k, (f, b, src) in kernels.items():
            out[(hw, k)] = Rates(hw, k, gemm, f, b, host_copy_gbps(hw), f"{src}; {gsrc}")
    return out


#: ``(hardware, kernel) → Rates``: every published figure the plan uses
RATES: Dict[Tuple[str, str], Rates] = _table()


def default_kernel(hardware: str) -> str:
    """The kernel a GPU of ``hardware`` runs by default: the first of :data:`KERNELS` the table
    has figures for (cuDNN on Hopper; FlashAttention-2 on A100)."""
    for k in KERNELS:
        if (hardware, k) in RATES:
            return k
    raise ValueError(f"no kernel rates for hardware {hardware!r}")


def _positive(d: Dict, key: str, path: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"--rates {path}: {key!r} must be a positive number, got {v!r}")
    return float(v)


def load_rates(path: str, hardware: Optional[str] = None) -> Rates:
    """Measured rates from ``--rates FILE``: JSON ``{"hardware", "kernel", "gemm_tflops",
    "attention_fwd_tflops", "attention_bwd_tflops", "pcie_gbs", "source", "measured_at"}``.
    Errors name ``--rates`` and the field; a file measured on other hardware than the plan's is
    refused (plan that hardware, or measure this one)."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except OSError as e:
        raise ValueError(f"--rates {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--rates {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--rates {path}: expected a JSON object, got {type(d).__name__}")
    keys = ("hardware", "kernel", "gemm_tflops", "attention_fwd_tflops", "attention_bwd_tflops",
            "pcie_gbs", "source", "measured_at")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"--rates {path}: missing {', '.join(missing)} (the file takes "
                         f"{', '.join(keys)})")
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise ValueError(f"--rates {path}: unknown key(s) {', '.join(unknown)}")
    for k in ("hardware", "kernel", "source", "measured_at"):
        if not isinstance(d[k], str) or not d[k]:
            raise ValueError(f"--rates {path}: {k!r} must be a non-empty string, got {d[k]!r}")
    preset = preset_of(d["hardware"])
    if preset is None:
        raise ValueError(f"--rates {path}: measured on {d['hardware']!r}, not a GPU of a "
                         f"hardware preset (a --dry file holds no rates for a plan): measure "
                         f"on an A100, H100 or H200")
    if hardware is not None and preset != hardware:
        raise ValueError(f"--rates {path}: measured on {d['hardware']!r}, the plan is for "
                         f"--hardware {hardware}: plan --hardware {preset} or measure "
                         f"{hardware}")
    return Rates(preset, kernel_name(d["kernel"]),
                 *(_positive(d, k, path) for k in keys[2:6]), d["source"], d["measured_at"])


def resolve_rates(hardware: str, kernel: Optional[str] = None,
                  rates_file: Optional[str] = None) -> Rates:
    """The rates a plan assumes: ``--rates FILE`` when given, else the table's row for
    ``kernel`` (``--kernel``; default :func:`default_kernel`) on ``hardware``."""
    if rates_file:
        return load_rates(rates_file, hardware)
    k = kernel_name(kernel) if kernel else default_kernel(hardware)
    if (hardware, k) not in RATES:
        have = sorted(kk for hw, kk in RATES if hw == hardware)
        raise ValueError(f"--kernel {k}: no published rates for {hardware} (it has: "
                         f"{', '.join(have)})")
    return RATES[(hardware, k)]
