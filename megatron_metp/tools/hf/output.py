"""An output folder that appears whole or not at all (``hf import`` / ``hf export``).

:func:`staged_dir` yields a fresh hidden sibling of the output folder to write into; when the
block ends without an error the sibling is renamed to the output folder (an existing one, which
``--force`` allowed, is removed only then), and on any error the sibling is removed and the
output folder is left as it was: a failure while writing leaves no partial checkpoint behind,
and a failed ``--force`` run keeps the old one. (A process killed mid-write leaves the hidden
``.NAME.partial-*`` sibling, never a half-written ``NAME``.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from typing import Iterator

__all__ = ["staged_dir"]


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
    """Yield the folder to write ``out_dir``'s contents into (module docstring)."""
    out = os.path.abspath(out_dir)
    parent, base = os.path.split(out)
    created = []  # parent folders made here, removed again on failure
    p = parent
    while not os.path.isdir(p):
        created.append(p)
        p = os.path.dirname(p)
    os.makedirs(parent, exist_ok=True)
    stage = os.path.join(parent, f".{base}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    os.makedirs(stage)
    try:
        yield stage
        old = None
        if os.path.lexists(out):
            old = stage + ".old"
            os.rename(out, old)
        try:
            os.rename(stage, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
        if old is not None:
            shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) \
                else os.remove(old)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise
