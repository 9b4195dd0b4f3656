"""Which block attention kernel runs: the registry, its availability probes, the choice at run
time, and the record of it.

The kernels (:data:`KERNELS`, from :mod:`.kernel_rates`, the one home of their names and rates;
listed in the order the choice falls back to) and what each needs (:func:`unavailable` says why
not):

================  ===========================================================================
``cudnn``         CUDA, 16-bit, compute capability ≥ 8.0, torch ≥ 2.5 with cuDNN ≥ 9 (torch's
                  SDPA cuDNN ops), head dim a multiple of 8 and ≤ 128
``flash_attn_3``  CUDA, 16-bit, compute capability exactly 9.0 (Hopper), ``flash_attn_interface``
                  (FlashAttention-3) importable with the interface :mod:`.gpu_kernels` calls,
                  head dim a multiple of 8 and ≤ 256
``flash_attn``    CUDA, 16-bit, compute capability ≥ 8.0, ``flash_attn`` ≥ 2.7, head dim a
                  multiple of 8 and ≤ 256
``torch_flash``   CPU (any float dtype), or CUDA 16-bit with compute capability ≥ 8.0 where it
                  is known (head dim ≤ 256 on CUDA)
``reference``     always (plain PyTorch, fp32)
================  ===========================================================================

Each probe only imports and inspects (no download, no kernel launch); the facts about this
process (torch, cuDNN, device capability, the installed packages) are gathered once by
:func:`platform`, which the tests replace to emulate other machines.

The choice: ``kernel=`` of an op, else ``METP_ATTENTION_KERNEL`` (``auto`` or unset: the fastest
available by the rates of :mod:`.kernel_rates` for this GPU, head width and dtype, the measured
file ``METP_KERNEL_RATES`` replacing the published table; the first available in the order where
an available kernel has no rate; the plain reference only when nothing else runs). An unknown
or unavailable name is refused (``ValueError`` naming the variable, why the kernel is
unavailable here and which are). Every distinct choice is logged once per process
(``megatron_metp`` logger, and printed on global rank 0)::

    [METP] attention kernel: flash_attn_3 (auto: fastest by published rate for cuda bfloat16,
    head dim 128; order cudnn > flash_attn_3 > ...; flash_attn_3 on H100: 616/561 TFLOP/s
    fwd/bwd (FlashAttention-3: FlashAttention-3 paper ...))

(``auto: best available``, with the kernels that have no rate, where the order decided), and
recorded: :func:`chosen_kernel` returns it (tools, ``benchmarks/gpu_check.py``, the
planner's footer). The ops put the kernel's name among the fields the METP agreement check
compares (:mod:`megatron_metp.runtime.agree`), so ranks that chose differently are refused at
their first op call, naming the field ``kernel``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from ..runtime import overrides
from . import kernel_rates as rates
from .kernel_rates import KERNELS

#: the environment variable that overrides the choice (``auto``: the fastest by rate)
ENV = "METP_ATTENTION_KERNEL"
#: the environment variable naming a measured rates file (``benchmarks/gpu_check.py``'s)
ENV_RATES = "METP_KERNEL_RATES"

_HALF = (torch.float16, torch.bfloat16)
log = logging.getLogger("megatron_metp.attention_kernel")

_16 = ("float16", "bfloat16")
#: what each kernel supports (nothing about speed: rates are :mod:`.kernel_rates`'). ``gqa_native``:
#: K/V with ``hkv < hq`` heads go in as they are for every piece (else: full blocks fold the
#: query heads into rows, causal pieces expand K/V locally); ``masks``: a boolean document mask
#: is taken (else packed sequences run as full/causal pieces per document).
SUPPORTS = {
    "cudnn": dict(devices=("cuda",), dtypes=_16, head_dims="multiple of 8, <= 128",
                  gqa_native=False, causal=True, masks=False, min_capability=(8, 0)),
    "flash_attn_3": dict(devices=("cuda",), dtypes=_16, head_dims="multiple of 8, <= 256",
                         gqa_native=True, causal=True, masks=False, min_capability=(9, 0)),
    "flash_attn": dict(devices=("cuda",), dtypes=_16, head_dims="multiple of 8, <= 256",
                       gqa_native=True, causal=True, masks=False, min_capability=(8, 0)),
    "torch_flash": dict(devices=("cpu", "cuda"), dtypes=("float32",) + _16 + ("float64",),
                        head_dims="any on CPU; multiple of 8, <= 256 on CUDA",
                        gqa_native=False, causal=True, masks="CPU only", min_capability=(8, 0)),
    "reference": dict(devices=("cpu", "cuda"), dtypes="any floating", head_dims="any",
                      gqa_native=False, causal=True, masks=True, min_capability=None),
}


@dataclass(frozen=True)
class Platform:
    """What the probes look at. ``capability``: the current CUDA device's ``(major, minor)``,
    ``None`` where unknown (no CUDA runtime: fake CUDA tensors on a CPU build).
    ``packages``: ``name → ""`` when usable, else why not (absent: not installed).
    ``device_name``: ``torch.cuda.get_device_name()`` (``None`` unknown: no rates apply)."""

    torch_version: Tuple[int, int] = (0, 0)
    capability: Optional[Tuple[int, int]] = None
    cudnn_version: Optional[int] = None
    packages: Dict[str, str] = field(default_factory=dict)
    device_name: Optional[str] = None


def _params(fn) -> set:
    fn = getattr(fn, "_init_fn", fn)  # torch.library custom ops keep the Python function here
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _check_fa3() -> str:  # pragma: no cover - needs the FlashAttention-3 package
    mod = importlib.import_module("flash_attn_interface")
    need_f, need_b = {"softmax_scale", "causal"}, {"dq", "dk", "dv", "softmax_scale", "is_causal"}
    if not (need_f <= _params(mod._flash_attn_forward)
            and need_b <= _params(mod._flash_attn_backward)):
        return "flash_attn_interface has another interface than the one METP calls"
    return ""


def _check_fa2() -> str:  # pragma: no cover - needs the flash-attn package
    mod = importlib.import_module("flash_attn.flash_attn_interface")
    if "window_size_left" not in _params(mod._flash_attn_forward):
        version = getattr(importlib.import_module("flash_attn"), "__version__", "?")
        return f"flash-attn {version}: METP needs >= 2.7"
    return ""


def _package(name: str, check) -> Optional[str]:
    """``""`` usable, a reason, or ``None`` when not installed."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
        return check()
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return f"import failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@functools.lru_cache(maxsize=1)
def platform() -> Platform:
    """The facts of this process, gathered once."""
    tv = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    cap = cudnn = name = None
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        cap = tuple(torch.cuda.get_device_capability())
        name = torch.cuda.get_device_name()
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    packages = {}
    for name, check in (("flash_attn_interface", _check_fa3), ("flash_attn", _check_fa2)):
        state = _package(name, check)
        if state is not None:
            packages[name] = state
    return Platform(torch_version=tv, capability=cap, cudnn_version=cudnn, packages=packages,
                    device_name=name)


def _gpu_common(pf: Platform, device, dtype, min_cap=(8, 0)) -> Optional[str]:
    if device.type != "cuda":
        return "GPU only"
    if dtype not in _HALF:
        return f"16-bit inputs only (got {str(dtype).replace('torch.', '')})"
    if pf.capability is None:
        return "no CUDA device capability known in this process"
    if pf.capability < min_cap:
        return f"needs compute capability >= {min_cap[0]}.{min_cap[1]}, this GPU has " \
               f"{pf.capability[0]}.{pf.capability[1]}"
    return None


def _head_dim(head_dim, top: int) -> Optional[str]:
    if head_dim is not None and (head_dim % 8 or head_dim > top):
        return f"head dim {head_dim}: needs a multiple of 8, at most {top}"
    return None


def _pkg(pf: Platform, name: str, pip: str) -> Optional[str]:
    state = pf.packages.get(name)
    if state is None:
        return f"{name} not installed (pip install {pip}, or an NGC PyTorch container)"
    return state or None


def unavailable(name: str, device, dtype, head_dim: Optional[int] = None,
                pf: Optional[Platform] = None) -> Optional[str]:
    """Why kernel ``name`` cannot run ``dtype`` tensors on ``device`` (head dim ``head_dim``
    when given) here, or ``None`` when it can."""
    pf = platform() if pf is None else pf
    device = torch.device(device)
    if name == "reference":
        return None
    if name == "torch_flash":
        if device.type == "cpu":
            return None
        if device.type != "cuda" or dtype not in _HALF:
            return "CPU, or CUDA with 16-bit inputs"
        if pf.capability is not None and pf.capability < (8, 0):
            return "needs compute capability >= 8.0 on CUDA"
        return _head_dim(head_dim, 256)
    if name == "cudnn":
        return (_gpu_common(pf, device, dtype)
                or (None if pf.torch_version >= (2, 5) else
                    f"needs torch >= 2.5 (its SDPA cuDNN ops), this is "
                    f"{pf.torch_version[0]}.{pf.torch_version[1]}")
                or (None if (pf.cudnn_version or 0) >= 90000 else
                    f"needs cuDNN >= 9 (torch has {pf.cudnn_version or 'none'})")
                or _head_dim(head_dim, 128))
    if name == "flash_attn_3":
        if pf.capability is not None and pf.capability != (9, 0) and device.type == "cuda":
            return f"Hopper (compute capability 9.0) only, this GPU has " \
                   f"{pf.capability[0]}.{pf.capability[1]}"
        return (_gpu_common(pf, device, dtype, (9, 0))
                or _pkg(pf, "flash_attn_interface",
                        "the hopper/ package of Dao-AILab/flash-attention")
                or _head_dim(head_dim, 256))
    if name == "flash_attn":
        return (_gpu_common(pf, device, dtype) or _pkg(pf, "flash_attn", "flash-attn")
                or _head_dim(head_dim, 256))
    raise ValueError(f"unknown attention kernel {name!r}")


def available_kernels(device, dtype: torch.dtype = torch.float32,
                      head_dim: Optional[int] = None) -> Tuple[str, ...]:
    """Kernels usable for ``dtype`` tensors on ``device`` here, best first."""
    return tuple(n for n in KERNELS if unavailable(n, device, dtype, head_dim) is None)


def kernel_names() -> Tuple[str, ...]:
    """The kernel names, best first (what the planner and ``--metp-attention-kernel`` list)."""
    return KERNELS


def kernel_support(name: str) -> dict:
    """What kernel ``name`` supports (:data:`SUPPORTS`; a copy)."""
    if name not in SUPPORTS:
        raise ValueError(f"unknown attention kernel {name!r}; kernels: {KERNELS}")
    return dict(SUPPORTS[name])


# ------------------------------------------------------------------------------ choice record

_choices: Dict[Tuple[str, str], str] = {}  # (device type, dtype) -> name, latest choice
_last: list = [None]
_logged: set = set()


def chosen_kernel(device=None, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """The kernel chosen in this process: for ``device``/``dtype`` when given, else the latest
    choice; ``None`` before any op chose one."""
    if device is None:
        return _last[0]
    key = (torch.device(device).type, str(dtype).replace("torch.", ""))
    return _choices.get(key)


def _rank0() -> bool:
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _record(name: str, device, dtype, head_dim, how: str, note: str = "") -> None:
    dt = str(dtype).replace("torch.", "")
    _choices[(device.type, dt)] = name
    _last[0] = name
    key = (name, device.type, dt, how)
    if key in _logged:
        return
    _logged.add(key)
    missing = [f"{n} ({unavailable(n, device, dtype, head_dim)})" for n in KERNELS[:KERNELS.index(
        name)] if unavailable(n, device, dtype, head_dim) is not None]
    hd = "" if head_dim is None else f", head dim {head_dim}"
    line = (f"[METP] attention kernel: {name} ({how} for {device.type} {dt}{hd}; order "
            f"{' > '.join(KERNELS)}" + (f"; not here: {', '.join(missing)}" if missing else "")
            + (f"; {note}" if note else "") + ")")
    log.info(line)
    if _rank0():
        print(line, flush=True)


def select_name(device, dtype: torch.dtype = torch.float32, requested: Optional[str] = None,
                head_dim: Optional[int] = None) -> str:
    """The kernel name for ``dtype`` tensors on ``device``: ``requested`` (``kernel=``), else
    ``$METP_ATTENTION_KERNEL``, else the fastest available by rate (else the first in the
    order); recorded and logged (see module)."""
    device = torch.device(device)
    how = "kernel= argument"
    if not requested:
        requested = overrides.raw(ENV)
        how = f"{ENV}={requested}"
    if requested == "auto":
        requested = None
    avail = available_kernels(device, dtype, head_dim)
    note = ""
    if requested is None:
        name, how, note = _by_rate(avail, device, dtype, head_dim)
    elif requested not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS} or 'auto' (kernel= or "
                         f"{ENV}), got {requested!r}; available here: {avail}")
    elif requested not in avail:
        why = unavailable(requested, device, dtype, head_dim)
        raise ValueError(f"attention kernel {requested!r} ({how}) is not available for "
                         f"{str(dtype).replace('torch.', '')} on {device.type}: {why}; "
                         f"available: {avail} (unset {ENV} or set it to auto for the best)")
    else:
        name = requested
    _record(name, device, dtype, head_dim, how, note)
    return name


def _rows(pf: Platform) -> Tuple[Tuple[rates.KernelRate, ...], str]:
    """The rate rows for this GPU (a ``$METP_KERNEL_RATES`` file's when set: it must be of this
    GPU) and where they come from."""
    gpu = rates.gpu_of(pf.device_name)
    path = overrides.raw(ENV_RATES)
    if not path:
        return rates.rows_for(gpu), "published"
    what = f"{ENV_RATES}={path}"
    measured = rates.load_measured(path, what)
    theirs = {r.gpu for r in measured}
    if gpu is None or theirs != {gpu}:
        raise ValueError(f"{what}: measured on {sorted(map(str, theirs))}, this GPU is "
                         f"{pf.device_name or 'unknown'}: measure this GPU "
                         f"(benchmarks/gpu_check.py --only-rates) or unset {ENV_RATES}")
    return rates.rows_for(gpu, measured), "measured"


def _by_rate(avail: Tuple[str, ...], device, dtype, head_dim) -> Tuple[str, str, str]:
    """``(name, how, note)`` of ``auto``: the fastest available kernel by the rates for this
    GPU, head width and dtype (:func:`.kernel_rates.fastest`; the reference kernel only when
    nothing else runs), else the first available (the order), the note saying why."""
    if device.type != "cuda":
        return avail[0], "auto: best available", ""
    pf = platform()
    rows, kind = _rows(pf)  # a $METP_KERNEL_RATES file is checked even where one kernel runs
    fused = tuple(k for k in avail if k != "reference")
    if len(fused) < 2:
        return avail[0], "auto: best available", ""
    dt = str(dtype).replace("torch.", "")
    best, unrated = rates.fastest(fused, rates.gpu_of(pf.device_name), head_dim, dt, rows)
    if best is None:
        on = pf.device_name or "an unknown GPU"
        return avail[0], "auto: best available", (f"no {kind} rate for {', '.join(unrated)} "
                                                   f"on {on}: the order decides")
    return best.kernel, f"auto: fastest by {kind} rate", \
        f"{best.kernel} on {best.gpu}: {rates.describe(best)}"
