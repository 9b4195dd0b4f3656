"""A Megatron-LM checkout of the session's release (tests/megatron_lm_release.py), for the tests'
fixtures (tests/conftest.py) and for the Slurm leg (scripts/slurm/ci_test.sh), which has no
``MEGATRON_LM_DIR`` in CI either:

    python -m tests.megatron_lm_checkout DEST     # prints the patched checkout DEST/Megatron-LM

The release comes from ``../shared/megatron-lm/<tag>.git.tar`` (a shallow bare clone next to the
repository, only ever unpacked into a private directory); :func:`patched_clone` clones a
checkout at the release's tag commit and applies this repository's patch series
(scripts/apply_patches.sh), leaving the source checkout pristine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile

from tests.megatron_lm_release import RELEASE, TAG_COMMIT

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
#: the session release's archive (see ../shared/megatron-lm/README.md)
MEGATRON_LM_ARCHIVE = os.path.join(os.path.dirname(REPO), "shared", "megatron-lm",
                                   f"{RELEASE.tag}.git.tar")


class CheckoutError(RuntimeError):
    """A step of making the checkout failed (the message names it and its output)."""


def _git(*argv):
    proc = subprocess.run(["git", *argv], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise CheckoutError(f"git {' '.join(argv)} exited {proc.returncode}\n{proc.stderr}")


def _unpack(archive, dest):
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+ / 3.11.4+: refuse unsafe members
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


def unpack_release(tmp) -> str:
    """Unpack :data:`MEGATRON_LM_ARCHIVE` into directory ``tmp`` and clone it: the checkout's
    path (``tmp/Megatron-LM``). :class:`FileNotFoundError` when the archive is missing."""
    if not os.path.isfile(MEGATRON_LM_ARCHIVE):
        raise FileNotFoundError(f"needs a Megatron-LM checkout at {RELEASE.tag}: "
                                f"MEGATRON_LM_DIR is unset and the archive "
                                f"{MEGATRON_LM_ARCHIVE} does not exist")
    if shutil.which("git") is None:
        raise CheckoutError(f"git is needed to clone the Megatron-LM archive {MEGATRON_LM_ARCHIVE}")
    _unpack(MEGATRON_LM_ARCHIVE, tmp)
    bare = os.path.join(tmp, "mlm-bare.git")
    if not os.path.isdir(bare):
        raise CheckoutError(f"{MEGATRON_LM_ARCHIVE} holds no mlm-bare.git")
    dest = os.path.join(tmp, "Megatron-LM")
    _git("clone", "-q", bare, dest)
    return dest


def patched_clone(checkout, dest) -> str:
    """A clone of ``checkout`` at the release's tag commit in ``dest``, patched by
    scripts/apply_patches.sh (``checkout`` itself stays pristine); returns ``dest``."""
    _git("clone", "-q", "--shared", "--no-checkout", str(checkout), str(dest))
    _git("-c", "advice.detachedHead=false", "-C", str(dest), "checkout", "-q", TAG_COMMIT)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_patches.sh"), str(dest)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise CheckoutError(f"apply_patches.sh {dest} exited {proc.returncode}\n"
                            f"{proc.stdout}{proc.stderr}")
    return str(dest)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tests.megatron_lm_checkout DEST", file=sys.stderr)
        return 2
    dest = os.path.abspath(argv[0])
    os.makedirs(dest, exist_ok=True)
    try:
        src = unpack_release(os.path.join(dest, "archive"))
        print(patched_clone(src, os.path.join(dest, "Megatron-LM")))
    except (OSError, CheckoutError) as exc:
        print(f"tests.megatron_lm_checkout: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
