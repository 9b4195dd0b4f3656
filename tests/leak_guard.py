"""A guard against tests that leave process state changed for the tests after them: ``make test``
runs the files on two ``pytest-xdist`` workers, in an order they pick, so a variable or switch one
file leaves behind reaches whichever file its worker runs next. tests/conftest.py makes
``leaves_no_state`` autouse; a test that trips it errors at teardown naming what it changed.
Undo such changes with ``monkeypatch``, ``tests.harness.unset_env`` or the ``cpu_shims`` fixture."""
import os

import pytest
import torch

# set by pytest for each test, and by torch's inductor once per process on its first compile
ENV_SET_BY_LIBRARIES = frozenset({"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})


def process_state():
    """What one test may not leave changed for the tests after it in the same process (under
    ``JOBS=2`` a worker runs files in an order it picks): the environment, megatron-core's CPU
    shims, torch's default dtype, grad mode and thread count, and a default process group."""
    from megatron_metp.megatron import cpu

    return {
        "environment": {k: v for k, v in os.environ.items() if k not in ENV_SET_BY_LIBRARIES},
        "megatron-core CPU shims on": cpu.is_enabled(),
        "torch default dtype": torch.get_default_dtype(),
        "torch grad enabled": torch.is_grad_enabled(),
        "torch threads": torch.get_num_threads(),
        "torch.distributed initialized": torch.distributed.is_available()
        and torch.distributed.is_initialized(),
    }


def state_diff(before, after):
    lines = []
    for key, was in before.items():
        now = after[key]
        if key == "environment":
            for name in sorted(set(was) | set(now)):
                if was.get(name) != now.get(name):
                    lines.append(f"${name}: {was.get(name, '<unset>')!r} -> "
                                 f"{now.get(name, '<unset>')!r}")
        elif was != now:
            lines.append(f"{key}: {was!r} -> {now!r}")
    return lines


@pytest.fixture(autouse=True)
def leaves_no_state():
    """Fail the test (as an error in its teardown) that leaves the process state of
    ``process_state`` changed, naming what it changed: undo it with monkeypatch,
    ``tests.harness.unset_env`` or the ``cpu_shims`` fixture."""
    before = process_state()
    yield
    diff = state_diff(before, process_state())
    if diff:
        pytest.fail("this test left process state changed for later tests in this process:\n  "
                    + "\n  ".join(diff), pytrace=False)
