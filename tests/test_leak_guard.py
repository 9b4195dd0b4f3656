"""The guard of tests/leak_guard.py (``leaves_no_state``, autouse in tests/conftest.py): it fails
a test that leaves process state changed for the tests after it in the same worker process
(``make test`` runs the files on two workers, in an order they pick)."""
import os

import torch

from megatron_metp.megatron import cpu
from tests import leak_guard
from tests.harness import unset_env

_VAR = "METP_LEAK_GUARD_PROBE"


def test_an_unchanged_process_gives_no_difference():
    before = leak_guard.process_state()
    assert leak_guard.state_diff(before, leak_guard.process_state()) == []


def test_a_variable_set_or_removed_is_named(monkeypatch):
    unset_env(monkeypatch, _VAR)
    before = leak_guard.process_state()
    os.environ[_VAR] = "4096"
    try:
        diff = leak_guard.state_diff(before, leak_guard.process_state())
    finally:
        del os.environ[_VAR]
    assert diff == [f"${_VAR}: '<unset>' -> '4096'"]

    monkeypatch.setenv(_VAR, "1")
    before = leak_guard.process_state()
    del os.environ[_VAR]
    diff = leak_guard.state_diff(before, leak_guard.process_state())
    assert diff == [f"${_VAR}: '1' -> '<unset>'"]


def test_variables_libraries_set_once_per_process_are_not_counted(monkeypatch):
    before = leak_guard.process_state()
    for name in leak_guard.ENV_SET_BY_LIBRARIES:
        monkeypatch.setenv(name, "changed by the library")
    assert leak_guard.state_diff(before, leak_guard.process_state()) == []


def test_cpu_shims_left_on_and_torch_settings_are_named(monkeypatch):
    was_on = cpu.is_enabled()
    assert not was_on, "an earlier test left megatron-core's CPU shims on"
    before = leak_guard.process_state()
    cpu.enable()
    try:
        after_shims = leak_guard.process_state()
    finally:
        cpu.disable()
    assert leak_guard.state_diff(before, after_shims) == [
        "megatron-core CPU shims on: False -> True"]

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        diff = leak_guard.state_diff(before, leak_guard.process_state())
    finally:
        torch.set_default_dtype(dtype)
    assert diff == ["torch default dtype: torch.float32 -> torch.float64"]
    # everything restored: the guard's own teardown passes for this test
    assert leak_guard.state_diff(before, leak_guard.process_state()) == []


def test_a_test_that_leaves_a_variable_set_errors_and_the_next_one_passes(tmp_path):
    """The guard itself, in a pytest run of its own: a test that sets a variable and leaves it
    errors at teardown naming the variable; the same test with monkeypatch passes."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text("from tests.leak_guard import leaves_no_state  # noqa\n")
    (tmp_path / "test_probe.py").write_text(
        "import os\n"
        f"def test_leaves():\n    os.environ[{_VAR!r}] = '1'\n"
        f"def test_undoes(monkeypatch):\n    monkeypatch.setenv({_VAR!r}, '2')\n")
    env = {k: v for k, v in os.environ.items() if k != _VAR}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-p", "no:randomly", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 passed, 1 error" in out, out  # test_leaves: its call passed, its teardown errored
    assert "ERROR at teardown of test_leaves" in out and f"${_VAR}: '<unset>' -> '1'" in out, out
