import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import preload_megatron  # noqa: E402
from tests.leak_guard import leaves_no_state  # noqa: E402,F401  (autouse: every test)
from tests.megatron_lm_checkout import (  # noqa: E402
    MEGATRON_LM_ARCHIVE, REPO, CheckoutError, patched_clone, unpack_release)
from tests.megatron_lm_release import ENV as RELEASE_ENV, RELEASE  # noqa: E402

torch.set_num_threads(1)
preload_megatron()


#: the Hugging Face tests that ``make test-019`` runs against transformers 5 (.venv-019) too
#: (marker ``hf``; node ids as in tests/markers.py): every family's import, logits and export
#: in the installed transformers' layout (tests/test_hf_versions.py, ~10 s) and the config
#: checks built from the installed transformers' configs; the rest of tests/test_hf*.py runs
#: on 4.57 only (their Megatron-LM ones on both releases as release_sensitive)
HF_TESTS = (
    "tests/test_hf_versions.py::",
    "tests/test_hf_from_args.py::",
    "tests/test_hf_weights.py::",
    "tests/test_hf_tokenizer.py::",
    "tests/test_hf.py::test_bad_configs_are_refused_naming_the_field",
    "tests/test_hf_families.py::test_family_fields_are_refused_or_accepted_naming_the_field",
    "tests/test_hf_families.py::test_cli_refuses_before_reading_the_weights",
    "tests/test_hf_moe.py::test_bad_moe_configs_are_refused_naming_the_field",
    "tests/test_hf_moe.py::test_flags_of_the_published_models",
    "tests/test_hf_moe.py::test_config_from_saved_moe_arguments",
    "tests/test_hf_yarn.py::test_every_family_takes_yarn",
    # Qwen2-MoE / GLM-4.5: 5.x's layout (partial RoPE in rope_parameters) in and out
    "tests/test_hf_moe_families.py::test_import_export_round_trip_is_bit_exact",
    "tests/test_hf_moe_families.py::test_unconvertible_settings_are_refused_naming_them",
    "tests/test_hf_moe_families.py::test_config_from_saved_arguments",
    "tests/test_hf_moe_families.py::test_flags_of_the_published_models",
    "tests/test_hf_moe_families.py::test_both_versions_config_files_read_alike",
    # gpt-oss: a run's saved flags against the config (5.x's rope_parameters), from-args config
    "tests/test_hf_moe_families.py::test_export_checks_a_gpt_oss_runs_flags_against_the_config",
    "tests/test_hf_moe_families.py::test_gpt_oss_config_from_saved_arguments",
    # DeepSeek-V2/V3: import, METP 2 logits (each release's MLASelfAttention), export, refusals
    "tests/test_hf_deepseek.py::",
)

#: the test files that ``make test-019`` runs against .venv-019's megatron-core 0.19 too (marker
#: ``core_sensitive``), though they launch no Megatron-LM: megatron-core's MoE with METP (its CPU
#: shims and dispatcher seams differ between 0.16 and 0.19), and the kept attention's and the
#: selective recompute's gradients (Megatron's checkpoint and schedules; the streaming and
#: separate ops under each release's torch and megatron-core)
CORE_SENSITIVE_FILES = (
    "tests/test_moe.py", "tests/test_moe_tiles.py", "tests/test_moe_routers.py",
    "tests/test_model_variants.py", "tests/test_attention_sinks.py",
    "tests/test_keep_attention.py", "tests/test_layer_keep.py", "tests/test_selective_op.py",
    "tests/test_mla_megatron.py",
    "tests/test_moe_ep_wide.py",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "hf: a Hugging Face test that `make test-019` runs "
                                       "against transformers 5 too (tests/conftest.py HF_TESTS)")
    config.addinivalue_line("markers", "core_sensitive: a test that `make test-019` runs against "
                                       "megatron-core 0.19 too (tests/conftest.py "
                                       "CORE_SENSITIVE_FILES)")
    missing = [f for f in CORE_SENSITIVE_FILES if not os.path.isfile(os.path.join(REPO, f))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py CORE_SENSITIVE_FILES names files that do not "
                                f"exist (renamed? update it): {missing}")
    # the heaviest files first, for make test's two workers (tests/file_order.py)
    from tests.file_order import HeaviestFilesFirst

    config.pluginmanager.register(HeaviestFilesFirst(), "metp-heaviest-files-first")


def _hf_test(nodeid: str) -> bool:
    return any(nodeid.startswith(e) and (e.endswith("::") or nodeid == e or
                                         nodeid[len(e)] == "[") for e in HF_TESTS)


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect: every entry is checked
def pytest_collection_modifyitems(config, items):
    """Every test that needs a Megatron-LM checkout (directly or through a fixture) carries the
    ``megatron_lm`` and ``slow`` markers: ``pytest -m megatron_lm`` runs them against the
    session's release. tests/markers.py adds ``release_sensitive`` (what the core_v0.19.0 leg
    runs) and ``slow`` on the listed tests over 5 s and the users of its slow fixtures."""
    from tests import markers

    for item in items:
        if _hf_test(item.nodeid):
            item.add_marker(pytest.mark.hf)
        if item.nodeid.split("::", 1)[0] in CORE_SENSITIVE_FILES:
            item.add_marker(pytest.mark.core_sensitive)
        if "megatron_lm_checkout" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.megatron_lm)
            item.add_marker(pytest.mark.slow)
            if not markers.matches(item.nodeid, markers.RELEASE_INDEPENDENT):
                item.add_marker(pytest.mark.release_sensitive)
        elif item.get_closest_marker("release_sensitive"):
            raise pytest.UsageError(f"{item.nodeid} is marked release_sensitive but uses no "
                                    "Megatron-LM checkout (the megatron_lm_checkout fixture)")
        if markers.matches(item.nodeid, markers.SLOW) or markers.uses_slow_fixture(item):
            item.add_marker(pytest.mark.slow)
    # (a run of single node ids collects part of a file: nothing to check then)
    stale = [] if any("::" in a for a in config.args) else markers.stale(items)
    files = {i.nodeid.split("::", 1)[0] for i in items}
    if not any("::" in a for a in config.args):
        stale += [e for e in HF_TESTS if e.split("::", 1)[0] in files and
                  not any(i.nodeid.startswith(e) for i in items)]
    if stale:
        raise pytest.UsageError("tests/markers.py (or HF_TESTS here) names tests that were not "
                                "collected from "
                                f"their collected files (renamed? update it): {stale}")


_SLOW_S = 5.0
_unmarked_slow = {}


def pytest_runtest_logreport(report):
    """Note the tests over 5 s (setup + call) that ``make test-fast`` still runs."""
    if report.when in ("setup", "call") and "slow" not in report.keywords:
        _unmarked_slow[report.nodeid] = _unmarked_slow.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    over = {k: v for k, v in _unmarked_slow.items() if v > _SLOW_S}
    if over:
        terminalreporter.write_sep("-", f"tests over {_SLOW_S:g} s without the slow marker "
                                        "(add them to tests/markers.py SLOW / SLOW_FIXTURES)")
        for nodeid, s in sorted(over.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{s:6.1f} s  {nodeid}")


def pytest_report_header(config):
    return (f"Megatron-LM tests against {RELEASE.tag} ({RELEASE.commit[:12]}; "
            f"{RELEASE_ENV} to choose)")


@pytest.fixture
def cpu_shims():
    """megatron-core's CPU shims in this (pytest's own) process, undone afterwards so that no
    later test finds them on (tests/test_megatron_ref.py checks they are off)."""
    from megatron_metp.megatron import cpu

    was = cpu.is_enabled()
    cpu.enable()
    yield
    if not was:
        cpu.disable()


@pytest.fixture(scope="session")
def megatron_lm_checkout(tmp_path_factory):
    """A Megatron-LM git checkout holding the session's release commit (``RELEASE``, chosen by
    $METP_MEGATRON_LM_RELEASE or the installed megatron-core): $MEGATRON_LM_DIR if set, else a
    private clone of ../shared/megatron-lm/<tag>.git.tar, unpacked once per session. Tests must
    not modify it (clone it again to patch it); with neither available the test is skipped, or
    fails under CI=true. A release whose megatron-core line is not the installed one fails."""
    import importlib.metadata

    installed = importlib.metadata.version("megatron-core")
    if not installed.startswith(RELEASE.megatron_core + "."):
        pytest.fail(f"the Megatron-LM tests run against {RELEASE.tag}, whose megatron-core is "
                    f"{RELEASE.megatron_core}.x, but megatron-core {installed} is installed: "
                    f"use that release's environment (make venv / make venv-019) or set "
                    f"{RELEASE_ENV}")
    env = os.environ.get("MEGATRON_LM_DIR")
    if env:
        return env
    if os.path.isfile(MEGATRON_LM_ARCHIVE):
        try:
            return unpack_release(str(tmp_path_factory.mktemp("megatron-lm-archive")))
        except CheckoutError as exc:
            pytest.fail(str(exc))
    reason = (f"needs a Megatron-LM checkout at {RELEASE.tag}: MEGATRON_LM_DIR is unset and the "
              f"archive {MEGATRON_LM_ARCHIVE} does not exist")
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(reason + " (CI=true: not skipping)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def patched_megatron_lm(megatron_lm_checkout, tmp_path_factory):
    """A clone of the session's Megatron-LM checkout at the tag commit, patched by
    scripts/apply_patches.sh (the checkout itself stays pristine)."""
    dest = str(tmp_path_factory.mktemp("mlm") / "Megatron-LM")
    try:
        return patched_clone(megatron_lm_checkout, dest)
    except CheckoutError as exc:
        pytest.fail(str(exc))
