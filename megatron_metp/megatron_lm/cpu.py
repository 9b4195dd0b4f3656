"""Run Megatron-LM's own training script (``pretrain_gpt.py`` → ``pretrain()``) on CPU ranks.

Opt-in and for machines without a GPU only (CI, laptops, login nodes): torchrun starts this
module instead of the script, and the module applies the shims below, then runs the script
unchanged as ``__main__``::

    torchrun --nproc-per-node 2 -m megatron_metp.megatron_lm.cpu pretrain_gpt.py \\
        --distributed-backend gloo ... (the usual pretrain_gpt.py arguments)

``scripts/pretrain_gpt.sh`` does this when the config (or the environment) sets ``METP_CPU=1``
(the tiny ``configs/tiny-cpu-*.sh`` do). With CUDA available the module refuses to start, so
the shims can never replace a real device.

What ``enable_training()`` patches, on top of :func:`megatron_metp.megatron.cpu.enable` (megatron-core's
CPU shims, documented there):

* ``triton`` missing: the one Megatron module importing it at import time
  (``megatron.core.transformer.custom_layers.batch_invariant_kernels``, for
  ``--batch-invariant-mode``) is replaced by functions that refuse that flag;
* ``initialize_megatron``'s "Megatron requires CUDA" assertion: called with ``allow_no_cuda``;
* ``torch.cuda.device_count`` reports 1, so Megatron seeds its RNG tracker (a CPU one here);
  ``set_device``, ``empty_cache``, ``Stream``/``Event``/``current_stream`` become CPU no-ops;
  ``get_rng_state``/``set_rng_state`` read and write the CPU generator (saved in checkpoints);
* ``get_device_arch_version`` (``validate_args``' device-architecture query) reports 0;
* the fused CUDA kernels (``megatron.legacy.fused_kernels.load``) are not compiled, and the
  CUDA jit warm-up (``set_jit_fusion_options``) does not run;
* the script runs inside :func:`megatron_metp.megatron.cpu.cuda_to_cpu` (``device="cuda"`` and
  ``.cuda()`` in the training loop give CPU tensors);
* the dataset index helpers (C++): ``compile_helpers`` builds them with ``python3`` from
  ``PATH``, which need not be the interpreter running; the glue uses the build the installed
  megatron-core wheel ships for this interpreter when it is the same version or built from the
  same ``helpers.cpp``, else builds them for ``sys.executable`` (``pybind11`` from the ``[megatron-lm]`` extra);
* Megatron's memory report (``torch.cuda.memory_*``) reports the CPU process's resident set
  size, labelled as such.

The flags a CPU run needs besides these (``--distributed-backend gloo``, no CUDA fusions,
``--transformer-impl local``) are set by ``scripts/pretrain_gpt.sh``; :func:`check_cpu_args`
(:mod:`.cpu_checks`) refuses the ones that cannot work without CUDA before any rank starts work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import sys
import types

import torch

from . import releases
from .cpu_checks import check_cpu_args, cpu_arg_problems  # noqa: F401 (re-exported)

__all__ = ["enable_training", "stub_batch_invariant_kernels", "check_cpu_args",
           "cpu_arg_problems", "shut_down_process_groups", "main"]

_ENABLED = False


def stub_batch_invariant_kernels() -> bool:
    """Without triton, stand in for the one Megatron module that imports it at import time
    (``megatron/training/initialize.py`` imports it for ``--batch-invariant-mode``); return
    whether the stand-in was installed."""
    if importlib.util.find_spec("triton") is not None:
        return False
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    mod = types.ModuleType(name)

    def unavailable(*_a, **_k):
        raise RuntimeError("--batch-invariant-mode needs triton, which is not installed here; "
                           "drop the flag")

    for fn in ("set_batch_invariant_mode", "disable_batch_invariant_mode",
               "enable_batch_invariant_mode"):
        setattr(mod, fn, unavailable)
    mod.is_batch_invariant_mode_enabled = lambda: False
    mod.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                   "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    sys.modules[name] = mod
    return True


class _Stream:
    """CPU stand-in for ``torch.cuda.Stream``: work is already ordered on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True


class _Event:
    """CPU stand-in for ``torch.cuda.Event`` (timers: elapsed times measured on the host)."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None) -> None:
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return (end._t - self._t) * 1000.0


def _rss_bytes(*_a, **_k) -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _no_op(*_a, **_k):
    return None


def _cpu_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_cpu_rng_state(state, device="cuda"):
    torch.set_rng_state(state)


def _same_helpers(wheel_version: str, checkout_version: str, wheel_dir: str,
                  checkout_dir: str) -> bool:
    """Whether the wheel's compiled helpers are the checkout's: the same version, or the same
    ``helpers.cpp`` (core_v0.19.0's checkout says 0.19.1; the 0.19.2 wheel's source is identical)."""
    if wheel_version == checkout_version:
        return True
    try:
        with open(os.path.join(wheel_dir, "helpers.cpp"), "rb") as a, \
                open(os.path.join(checkout_dir, "helpers.cpp"), "rb") as b:
            return a.read() == b.read()
    except OSError:
        return False


def _helpers_importable() -> bool:
    """Whether ``megatron.core.datasets.helpers_cpp`` imports, after pointing the package at
    the same-version build the installed megatron-core wheel ships for this interpreter."""
    import importlib
    import sysconfig

    import megatron.core.datasets as datasets

    name = "megatron.core.datasets.helpers_cpp"
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        pass
    try:
        from importlib import metadata

        from megatron.core import package_info

        dist = metadata.distribution("megatron-core")
        wheel_dir = str(dist.locate_file("megatron/core/datasets"))
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if not _same_helpers(dist.version, package_info.__version__, wheel_dir,
                             datasets.__path__[0]) or wheel_dir in datasets.__path__ or \
                not os.path.isfile(os.path.join(wheel_dir, "helpers_cpp" + suffix)):
            return False
        datasets.__path__.append(wheel_dir)
        importlib.import_module(name)
        return True
    except (ImportError, OSError):
        return False


def _compile_helpers() -> None:
    """Megatron's ``compile_helpers`` (rank 0), for the interpreter that runs."""
    import subprocess
    import sysconfig

    import megatron.core.datasets as datasets

    if _helpers_importable():
        return
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    src = os.path.dirname(datasets.__file__)
    try:
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                                  capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise RuntimeError("building Megatron's dataset helpers needs pybind11 for "
                           f"{sys.executable}: pip install pybind11 (or the package's "
                           "[megatron-lm] extra)") from None
    proc = subprocess.run(["make", "-C", src, f"CPPFLAGS={includes}", f"LIBEXT={suffix}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building Megatron's dataset helpers in {src} failed:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def enable_training(force: bool = False) -> None:
    """Apply every shim above (and megatron-core's); a second call does nothing.

    Raises ``RuntimeError`` when CUDA is available (unless ``force``): on a GPU machine run
    ``pretrain_gpt.py`` directly.
    """
    global _ENABLED
    from ..megatron import cpu

    if _ENABLED and cpu.is_enabled():  # cpu.disable() undoes these shims too
        return
    if torch.cuda.is_available() and not force:
        raise RuntimeError("megatron_metp.megatron_lm.cpu: CUDA is available on this machine; "
                           "the CPU training shims are for machines without a GPU. Unset "
                           "METP_CPU (or set it to 0) and run on the GPUs")
    stub_batch_invariant_kernels()
    from ..megatron.cpu import patch  # recorded with megatron-core's shims (cpu.disable undoes both)

    cpu.enable(force=force)
    for name, value in (("device_count", lambda: 1), ("set_device", _no_op),
                        ("empty_cache", _no_op), ("Stream", _Stream), ("Event", _Event),
                        ("current_stream", lambda *a, **k: _Stream()),
                        ("stream", lambda *a, **k: contextlib.nullcontext()),
                        ("get_rng_state", _cpu_rng_state), ("set_rng_state", _set_cpu_rng_state),
                        ("memory_allocated", _rss_bytes), ("max_memory_allocated", _rss_bytes),
                        ("memory_reserved", _rss_bytes), ("max_memory_reserved", _rss_bytes),
                        ("reset_peak_memory_stats", _no_op)):
        patch(torch.cuda, name, value)
    from megatron.training import arguments, initialize, training

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    original = initialize.initialize_megatron
    for mod in (initialize, training):
        patch(mod, "initialize_megatron", initialize_megatron)
    patch(arguments, "get_device_arch_version", lambda: 0)  # "no GPU architecture"
    try:
        from megatron.legacy import fused_kernels
    except ImportError:
        fused_kernels = None
    if fused_kernels is not None:
        patch(fused_kernels, "load", _no_op)
    from megatron.core.datasets import utils as dataset_utils

    patch(dataset_utils, "compile_helpers", _compile_helpers)
    _helpers_importable()  # every rank
    patch(training, "set_jit_fusion_options", _no_op)  # warms up CUDA kernels
    owner = releases.validate_args_owner()
    patch(owner, "validate_args", _validating(owner.validate_args))
    _ENABLED = True


def _validating(validate_args):
    def validate(args, defaults={}):  # noqa: B006 - Megatron's signature
        out = validate_args(args, defaults)
        check_cpu_args(args)
        return out

    return validate


def main(argv=None) -> None:
    """``python -m megatron_metp.megatron_lm.cpu SCRIPT [ARGS...]``: run SCRIPT as ``__main__``
    with the CPU shims applied (the script's directory first on ``sys.path``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_metp.megatron_lm.cpu: {argv[0]} is not a file (give the path "
                         f"of Megatron-LM's pretrain_gpt.py)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    sys.path.insert(0, os.path.dirname(script))
    enable_training()
    sys.argv = [script] + argv[1:]
    from ..megatron.cpu import cuda_to_cpu

    if os.environ.get("RANK", "0") == "0":
        print("> METP_CPU: Megatron-LM on CPU ranks (gloo) through megatron_metp.megatron_lm.cpu; "
              "Megatron's memory reports give each process's resident set size", flush=True)
    with cuda_to_cpu():  # the training loop's device="cuda" tensors and .cuda() calls
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # Megatron-LM's loop ends with sys.exit(0) after the save of
            if exc.code not in (None, 0):  # --exit-interval, --exit-duration-in-mins or
                raise  # --exit-signal-handler: a clean end like pretrain() returning
    shut_down_process_groups()


def shut_down_process_groups() -> None:
    """End the run's process groups before the interpreter exits.

    ``pretrain()`` returns with its gloo groups alive; left to the interpreter's exit, a
    group's C++ threads can be destroyed while still joinable, which aborts the process
    ("terminate called without an active exception", SIGABRT) after training succeeded, at
    random. All ranks first meet in a barrier (bounded by the group's timeout, so a missing
    rank ends in gloo's timeout error rather than a hang), then destroy every group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()


def exit_now(code: int = 0) -> None:
    """End the process after Python's own clean-up, skipping torch's C++ teardown.

    After a run, the interpreter's exit spends seconds of CPU per rank in libtorch's static
    destructors (``TorchLibraryInit`` deregistering every dispatcher kernel: measured 5-7 s
    from Megatron's "after training is done" to the rank's exit with 2 ranks on 2 cores, about
    1 s this way). The ``atexit`` handlers run (logging, multiprocessing and Megatron's own
    clean-up), stdout and stderr are flushed, then ``os._exit``."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    exit_now(0)  # only after a run that returned: a failure keeps its traceback and exit status
