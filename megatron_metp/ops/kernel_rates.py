"""The one home of the attention kernels' names and rates: the run-time choice
(:mod:`.kernel_choice`) and the planner (``tools/plan/rates.py``) read this table.

Names. :data:`KERNELS` are the run-time names (``METP_ATTENTION_KERNEL``, ``kernel=``,
``--metp-attention-kernel``), in the order the choice falls back to where no rate is known;
:data:`SHORT_NAMES` gives each the name the published figures use (``metp plan --kernel`` and the
planner's output print those: ``fa3`` is ``flash_attn_3``). :func:`kernel_of` takes either name.

Rates. :data:`ROWS`: one :class:`KernelRate` per kernel, GPU, head width (``None``: the source
states none) and dtype, TFLOP/s of a causal forward and of the backward, each with its source.
FLOPs as the sources count them: a causal forward over ``s`` queries and keys with ``a`` heads
of width ``d`` does ``4·s²·a·d/2``; the backward ``2.5×`` that (:data:`ATTENTION_BWD_FLOP_RATIO`).

* **H100** (80GB SXM5), bf16, head dim 128, sequence length 16k: FlashAttention-3 paper (Shah et
  al. 2024, arXiv 2407.08608) Fig. 5 (forward, causal) and Fig. 6 (backward), which benchmark
  FA3, cuDNN, FA2 and standard attention on the same GPU: cuDNN 539 / 516, FA3 616 / 561,
  FA2 335 / 322 (FA2's own paper, arXiv 2307.08691, quotes "up to 335" on H100). ``torch_flash``
  (torch's SDPA flash backend) is FlashAttention-2's kernel inside PyTorch (PyTorch 2.2 release
  notes), so it takes FA2's figures (derived). ``reference`` (the materialised score matrix)
  takes the standard-attention figures without the mask (139 / 181), halved: it computes the
  whole square and the causal half is counted (derived).
* **H200**: the H100 SXM's compute (NVIDIA H200 datasheet: 989 TFLOP/s dense bf16, the H100's
  figure); its rows are the H100's figures (derived; attention at long sequence is
  compute-bound).
* **A100** (80GB SXM4), bf16: FlashAttention-2 paper, abstract and §4.1: forward "up to 73 %" and
  backward "up to 63 %" of the 312 TFLOP/s peak (228 and 197), best cases over its head widths
  (so no head width here); ``torch_flash`` the same (derived), ``reference`` Hopper's
  standard-attention utilisation on A100's peak, halved (derived). No cuDNN or FA3 A100 figure is
  cited: cuDNN has no A100 row.

The choice by rate (:func:`fastest`): the kernel with the least time per forward FLOP of a
training step, ``1/fwd + 2.5/bwd``; ties go to the earlier of :data:`KERNELS`. On an H100 at head
dim 128 that is FA3 (616 / 561) before cuDNN (539 / 516).

Measured rates (:func:`load_measured`): the JSON file ``benchmarks/gpu_check.py`` writes (the
planner's ``--rates FILE``, the run time's ``METP_KERNEL_RATES``): ``hardware``, ``kernel``,
``gemm_tflops``, ``attention_fwd_tflops``, ``attention_bwd_tflops``, ``pcie_gbs``, ``source``,
``measured_at``, and optionally ``kernels`` (``{name: {"attention_fwd_tflops": x,
"attention_bwd_tflops": y}}``, every kernel measured; names of either vocabulary), ``head_dim``
and ``dtype`` (what the attention rates were measured at). Its rows replace the table's for its
GPU.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterable, Optional, Tuple

#: run-time kernel names; the order the choice falls back to where no rate is known
KERNELS = ("cudnn", "flash_attn_3", "flash_attn", "torch_flash", "reference")
#: each kernel's name in the published figures (the planner's ``--kernel`` and output)
SHORT_NAMES = {"cudnn": "cudnn", "flash_attn_3": "fa3", "flash_attn": "fa2",
               "torch_flash": "torch_flash", "reference": "unfused"}
#: a flash backward's FLOPs over its forward's (five score-sized matmuls against two)
ATTENTION_BWD_FLOP_RATIO = 2.5
#: GPUs of the table, as a device name (``torch.cuda.get_device_name()``) contains them
GPUS = ("H100", "H200", "A100")


@dataclass(frozen=True)
class KernelRate:
    """TFLOP/s of ``kernel`` (a run-time name) on ``gpu`` at ``head_dim`` (``None``: any, the
    source states none) and ``dtype``: a causal forward ``fwd`` and the backward ``bwd``."""

    kernel: str
    gpu: str
    head_dim: Optional[int]
    dtype: str
    fwd: float
    bwd: float
    source: str

    @property
    def seconds_per_flop(self) -> float:
        """Time of a training step's attention per forward FLOP (forward + backward)."""
        return 1.0 / self.fwd + ATTENTION_BWD_FLOP_RATIO / self.bwd


_FA3 = "FlashAttention-3 paper (arXiv 2407.08608) Fig. 5/6, H100 SXM5, hdim 128, 16k"
_FA2 = "FlashAttention-2 paper (arXiv 2307.08691)"


def _hopper(gpu: str, note: str) -> Tuple[KernelRate, ...]:
    std = (f"standard attention (materialised scores): {_FA3}: 139 forward, 181 backward "
           f"without mask, halved (the whole square computed, the causal half counted); derived")
    rows = (("cudnn", 539.0, 516.0, f"cuDNN fused attention: {_FA3}: forward causal 539, "
                                    f"backward 516"),
            ("flash_attn_3", 616.0, 561.0, f"FlashAttention-3: {_FA3}: forward causal 616, "
                                           f"backward 561"),
            ("flash_attn", 335.0, 322.0, f"FlashAttention-2: {_FA3}: forward causal 335 (FA2 "
                                         f"paper: 'up to 335' on H100), backward 322"),
            ("torch_flash", 335.0, 322.0, f"torch SDPA flash backend = FlashAttention-2 kernel: "
                                          f"FA2's rates ({_FA3}); derived"),
            ("reference", 139.0 / 2, 181.0 / 2, std))
    return tuple(KernelRate(k, gpu, 128, "bfloat16", f, b, s + note) for k, f, b, s in rows)


def _a100() -> Tuple[KernelRate, ...]:
    f, b = 0.73 * 312, 0.63 * 312
    up_to = (f"{_FA2}: forward up to 73 %, backward up to 63 % of A100's 312 TFLOP/s (best "
             f"cases over its head widths)")
    return (KernelRate("flash_attn", "A100", None, "bfloat16", f, b, f"FlashAttention-2: {up_to}"),
            KernelRate("torch_flash", "A100", None, "bfloat16", f, b,
                       f"torch SDPA flash backend = FlashAttention-2: {up_to}; derived"),
            KernelRate("reference", "A100", None, "bfloat16", 139.0 / 989 * 312 / 2,
                       181.0 / 989 * 312 / 2,
                       "standard attention: the FA3 paper's H100 utilisation (139/989 forward, "
                       "181/989 backward, no mask) on A100's 312, halved (causal half counted); "
                       "derived"))


#: every published rate (and the rows derived from them, said so in their source)
ROWS: Tuple[KernelRate, ...] = (
    _hopper("H100", "")
    + _hopper("H200", "; H200 = H100 SXM compute (H200 datasheet: 989 TFLOP/s bf16): the "
                      "H100's figures, derived")
    + _a100())


def kernel_of(name: str) -> str:
    """The run-time name of ``name`` (a run-time or a short name); ``ValueError`` otherwise."""
    if name in KERNELS:
        return name
    for k, short in SHORT_NAMES.items():
        if short == name:
            return k
    raise ValueError(f"unknown attention kernel {name!r}: one of {', '.join(KERNELS)} or "
                     f"{', '.join(v for k, v in SHORT_NAMES.items() if v != k)}")


def short_name(kernel: str) -> str:
    """The published name of ``kernel`` (either name)."""
    return SHORT_NAMES[kernel_of(kernel)]


def gpu_of(device_name: Optional[str]) -> Optional[str]:
    """The table's GPU a device name (``"NVIDIA H100 80GB HBM3"``, a planner preset
    ``"H100-80GB"``) denotes, or ``None``."""
    for gpu in GPUS:
        if device_name and gpu.lower() in device_name.lower():
            return gpu
    return None


def rate_of(kernel: str, gpu: Optional[str], head_dim: Optional[int], dtype: str,
            rows: Iterable[KernelRate] = ROWS) -> Optional[KernelRate]:
    """``kernel``'s row for ``gpu``, ``head_dim`` and ``dtype`` (a row without a head width
    matches any), or ``None``: no rate known."""
    kernel = kernel_of(kernel)
    for r in rows:
        if (r.kernel, r.gpu, r.dtype) == (kernel, gpu, dtype) and r.head_dim in (None, head_dim):
            return r
    return None


def fastest(kernels: Iterable[str], gpu: Optional[str], head_dim: Optional[int], dtype: str,
            rows: Iterable[KernelRate] = ROWS) -> Tuple[Optional[KernelRate], Tuple[str, ...]]:
    """``(row, unrated)``: the fastest of ``kernels`` by ``rows`` (least
    :attr:`KernelRate.seconds_per_flop`, ties to the earlier of :data:`KERNELS`), or ``None``
    with the kernels that have no rate when any has none (the caller then keeps its order)."""
    rows = tuple(rows)
    got = [(k, rate_of(k, gpu, head_dim, dtype, rows)) for k in kernels]
    unrated = tuple(k for k, r in got if r is None)
    if unrated or not got:
        return None, unrated
    return best_of(r for _, r in got), ()


def best_of(rows: Iterable[KernelRate]) -> KernelRate:
    """The fastest row: least :attr:`KernelRate.seconds_per_flop`, ties to the earlier of
    :data:`KERNELS`."""
    return min(rows, key=lambda r: (r.seconds_per_flop, KERNELS.index(r.kernel)))


# ------------------------------------------------------------------------------ measured rates

FILE_KEYS = ("hardware", "kernel", "gemm_tflops", "attention_fwd_tflops",
             "attention_bwd_tflops", "pcie_gbs", "source", "measured_at")
OPTIONAL_KEYS = ("kernels", "head_dim", "dtype")


def positive(d: Dict, key: str, what: str) -> float:
    """``d[key]`` as a positive finite float; ``ValueError`` naming ``what`` and the key."""
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what}: {key!r} must be a positive number, got {v!r}")
    return float(v)


def read_measured(path: str, what: str) -> Dict:
    """The measured-rates file at ``path`` as a checked dict (:data:`FILE_KEYS` required,
    :data:`OPTIONAL_KEYS` allowed, ``kernels``' names resolved to run-time names); errors start
    with ``what`` (``--rates FILE``, ``METP_KERNEL_RATES=FILE``)."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except OSError as e:
        raise ValueError(f"{what}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in FILE_KEYS if k not in d]
    if missing:
        raise ValueError(f"{what}: missing {', '.join(missing)} (the file takes "
                         f"{', '.join(FILE_KEYS)}; optional {', '.join(OPTIONAL_KEYS)})")
    unknown = sorted(set(d) - set(FILE_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {', '.join(unknown)}")
    for k in ("hardware", "kernel", "source", "measured_at"):
        if not isinstance(d[k], str) or not d[k]:
            raise ValueError(f"{what}: {k!r} must be a non-empty string, got {d[k]!r}")
    for k in FILE_KEYS[2:6]:
        positive(d, k, what)
    if "head_dim" in d and (isinstance(d["head_dim"], bool) or not isinstance(d["head_dim"], int)
                            or d["head_dim"] <= 0):
        raise ValueError(f"{what}: 'head_dim' must be a positive integer, got {d['head_dim']!r}")
    if "dtype" in d and d["dtype"] not in ("bfloat16", "float16"):
        raise ValueError(f"{what}: 'dtype' must be bfloat16 or float16, got {d['dtype']!r}")
    try:
        d["kernel"] = kernel_of(d["kernel"])
        kernels = d.get("kernels", {})
        if not isinstance(kernels, dict):
            raise ValueError(f"'kernels' must be an object name -> rates, got "
                             f"{type(kernels).__name__}")
        d["kernels"] = {kernel_of(k): {f: positive(v if isinstance(v, dict) else {}, f,
                                                   f"{what}: kernels.{k}")
                                       for f in ("attention_fwd_tflops", "attention_bwd_tflops")}
                        for k, v in kernels.items()}
    except ValueError as e:
        raise ValueError(e.args[0] if str(e).startswith(what) else f"{what}: {e}") from None
    return d


def measured_rows(d: Dict) -> Tuple[KernelRate, ...]:
    """The rows of a checked measured file (:func:`read_measured`): its ``kernels`` and its
    ``kernel`` (the top-level rates), on its GPU, at its head width and dtype (bf16 where it
    names none)."""
    gpu = gpu_of(d["hardware"])
    per = dict(d.get("kernels") or {})
    per.setdefault(d["kernel"], {"attention_fwd_tflops": d["attention_fwd_tflops"],
                                 "attention_bwd_tflops": d["attention_bwd_tflops"]})
    src = f"measured: {d['source']} ({d['measured_at']})"
    return tuple(KernelRate(k, gpu, d.get("head_dim"), d.get("dtype", "bfloat16"),
                            v["attention_fwd_tflops"], v["attention_bwd_tflops"], src)
                 for k, v in per.items())


@lru_cache(maxsize=8)
def _measured_cached(path: str, mtime: float, what: str) -> Tuple[KernelRate, ...]:
    return measured_rows(read_measured(path, what))


def load_measured(path: str, what: str) -> Tuple[KernelRate, ...]:
    """The rows of the measured file at ``path`` (read once per modification), for
    :func:`fastest`; errors name ``what``."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError as e:
        raise ValueError(f"{what}: cannot read it ({e.strerror or e})") from None
    return _measured_cached(path, mtime, what)


def rows_for(gpu: Optional[str], measured: Tuple[KernelRate, ...] = ()) -> Tuple[KernelRate, ...]:
    """The rows that apply on ``gpu``: measured ones when any were measured on it (they replace
    the table's), else the table's."""
    mine = tuple(r for r in measured if r.gpu == gpu)
    return mine if mine else tuple(r for r in ROWS if r.gpu == gpu)


def describe(row: KernelRate) -> str:
    """``"<fwd>/<bwd> TFLOP/s fwd/bwd (<source>)"`` of a row, for the log line."""
    return f"{row.fwd:.4g}/{row.bwd:.4g} TFLOP/s fwd/bwd ({row.source})"


__all__ = ["KERNELS", "SHORT_NAMES", "ATTENTION_BWD_FLOP_RATIO", "GPUS", "KernelRate", "ROWS",
           "kernel_of", "short_name", "gpu_of", "rate_of", "fastest", "best_of", "FILE_KEYS",
           "OPTIONAL_KEYS", "positive", "read_measured", "measured_rows", "load_measured",
           "rows_for", "describe"]
