import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import preload_megatron  # noqa: E402

torch.set_num_threads(1)
preload_megatron()

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# Megatron-LM at core_v0.16.1 as a shallow bare git clone, next to the repository (read-only:
# only ever unpacked into a private temporary directory). See ../shared/megatron-lm/README.md.
MEGATRON_LM_ARCHIVE = os.path.join(os.path.dirname(REPO), "shared", "megatron-lm",
                                   "core_v0.16.1.git.tar")


def _git(*argv):
    proc = subprocess.run(["git", *argv], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)} exited {proc.returncode}\n{proc.stderr}")


def _unpack(archive, dest):
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+ / 3.11.4+: refuse unsafe members
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


@pytest.fixture(scope="session")
def megatron_lm_checkout(tmp_path_factory):
    """A Megatron-LM git checkout at core_v0.16.1: $MEGATRON_LM_DIR if set, else a private clone
    of ../shared/megatron-lm/core_v0.16.1.git.tar, unpacked once per session. Tests must not
    modify it (clone it again to patch it); with neither available the test is skipped, or fails
    under CI=true."""
    env = os.environ.get("MEGATRON_LM_DIR")
    if env:
        return env
    if os.path.isfile(MEGATRON_LM_ARCHIVE):
        if shutil.which("git") is None:
            pytest.fail("git is needed to clone the Megatron-LM archive "
                        f"{MEGATRON_LM_ARCHIVE}")
        tmp = tmp_path_factory.mktemp("megatron-lm-archive")
        _unpack(MEGATRON_LM_ARCHIVE, tmp)
        bare = tmp / "mlm-bare.git"
        if not bare.is_dir():
            pytest.fail(f"{MEGATRON_LM_ARCHIVE} holds no mlm-bare.git")
        dest = tmp / "Megatron-LM"
        _git("clone", "-q", str(bare), str(dest))
        return str(dest)
    reason = ("needs a Megatron-LM checkout at core_v0.16.1: MEGATRON_LM_DIR is unset and the "
              f"archive {MEGATRON_LM_ARCHIVE} does not exist")
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(reason + " (CI=true: not skipping)")
    pytest.skip(reason)


#: Megatron-LM core_v0.16.1
TAG_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"


@pytest.fixture(scope="session")
def patched_megatron_lm(megatron_lm_checkout, tmp_path_factory):
    """A clone of the session's Megatron-LM checkout at the tag commit, patched by
    scripts/apply_patches.sh (the checkout itself stays pristine)."""
    dest = str(tmp_path_factory.mktemp("mlm") / "Megatron-LM")
    _git("clone", "-q", "--shared", "--no-checkout", megatron_lm_checkout, dest)
    _git("-c", "advice.detachedHead=false", "-C", dest, "checkout", "-q", TAG_COMMIT)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_patches.sh"), dest],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"apply_patches.sh {dest} exited {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return dest
