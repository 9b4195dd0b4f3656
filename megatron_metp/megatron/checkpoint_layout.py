"""Where a checkpoint lives on disk and how a save becomes visible.

Layout of a save directory (Megatron-LM's ``--save`` conventions: one directory per iteration and
a tracker file naming the newest)::

    <save dir>/
        latest_checkpointed_iteration.txt   newest published iteration ("4"); written last
        iter_0000002/                       a complete checkpoint
            .metadata  metadata.json  common.pt  __<rank>_<n>.distcp   (dist_checkpointing)
            metp_integrity/rank_00000.json ...  checksums, one manifest per saving rank
            metp_checkpoint.json             written last inside, before the rename
        iter_0000004/
        .iter_0000006.saving/               a save in progress or one that died: never loaded
        .iter_0000004.replaced/             the old copy while iteration 4 is saved again

A save writes everything into ``.iter_<n>.saving``, and only after every rank's shards and
manifests are on disk does rank 0 write ``metp_checkpoint.json``, rename the directory to
``iter_<n>`` and replace the tracker (temporary file, fsync, ``os.replace``, fsync of the
directory). A crash at any point leaves the tracker naming the previous complete iteration.

Loading a save directory follows the tracker. If the tracker names a directory that is missing
or incomplete, loading refuses and names it together with the newest complete iteration found
(it does not fall back silently: the tracker is the record of what was published, so a
mismatch means something outside the save removed or damaged files). Loading an iteration
directory itself (``<save dir>/iter_0000002``) loads exactly that one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

from .checkpoint_errors import CheckpointError
from .compat import checkpoint_whole_files

#: Megatron-LM's tracker file name (its content is the iteration number)
TRACKER = "latest_checkpointed_iteration.txt"
#: written last into an iteration directory: iteration, layout, world size, manifests
METP_META = "metp_checkpoint.json"
#: format of METP_META; 2 = with integrity manifests
META_FORMAT = 2
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_STAGING_RE = re.compile(r"^\.iter_(\d{7,})\.saving$")


def iteration_dirname(iteration: int) -> str:
    """``iter_0000004``: Megatron-LM's name for iteration 4's directory."""
    return f"iter_{iteration:07d}"


def staging_path(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f".{iteration_dirname(iteration)}.saving")


def replaced_path(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f".{iteration_dirname(iteration)}.replaced")


def fsync_path(path: str) -> None:
    """Make a file's bytes, or a directory's entries (new or renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    """Write ``path`` so that a crash leaves either the old content or the new one: a temporary
    file in the same directory, fsync, ``os.replace``, fsync of the directory."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(directory)


def write_json_durably(path: str, obj, indent: Optional[int] = 1) -> None:
    write_durably(path, json.dumps(obj, indent=indent, sort_keys=True).encode())


def read_tracker(save_dir: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names, ``None`` if there is none."""
    path = os.path.join(save_dir, TRACKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint tracker {path!r}: {exc}") from exc
    if not text.isdigit():
        raise CheckpointError(f"the checkpoint tracker {path!r} holds {text[:40]!r}, not an "
                              f"iteration number; write the iteration of a complete "
                              f"iter_<n> directory into it, or load that directory directly")
    return int(text)


def read_meta(path: str) -> Optional[dict]:
    """``metp_checkpoint.json`` of an iteration directory, ``None`` if missing or unreadable."""
    try:
        with open(os.path.join(path, METP_META)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def incomplete_reason(path: str) -> Optional[str]:
    """Why ``path`` is not a complete iteration directory, or ``None`` if it is one (all files a
    published save has are present; their contents are checked when loading)."""
    if not os.path.isdir(path):
        return "does not exist"
    meta = read_meta(path)
    if meta is None:
        return (f"is not a complete METP/Megatron distributed checkpoint (missing or unreadable "
                f"{METP_META}); was the save interrupted?")
    for name in checkpoint_whole_files():
        if not os.path.isfile(os.path.join(path, name)):
            return (f"is not a complete METP/Megatron distributed checkpoint (missing Megatron's "
                    f"{name}); was the save interrupted?")
    integrity = meta.get("integrity")
    if meta.get("format") != META_FORMAT or not isinstance(integrity, dict) or \
            not isinstance(integrity.get("manifests"), list):
        return (f"has no integrity manifest ({METP_META} format {meta.get('format', 1)!r}, "
                f"expected {META_FORMAT}): it was written by an older megatron_metp, whose "
                f"checkpoints are not verified; save it again with this version")
    for name in integrity["manifests"]:
        if not isinstance(name, str) or not os.path.isfile(os.path.join(path, name)):
            return f"is missing its integrity manifest {name!r}; was the save interrupted?"
    return None


def _looks_like_iteration_dir(path: str) -> bool:
    names = set(os.listdir(path))
    return bool(names & {METP_META, ".metadata", "metadata.json", "common.pt"}) or \
        any(n.endswith(".distcp") for n in names)


def iteration_dirs(save_dir: str) -> List[Tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_<n>`` directory, oldest first."""
    out = []
    for name in os.listdir(save_dir):
        m = _ITER_RE.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(out)


def newest_complete(save_dir: str) -> Optional[str]:
    for _, path in reversed(iteration_dirs(save_dir)):
        if incomplete_reason(path) is None:
            return path
    return None


def resolve(directory: str) -> str:
    """The iteration directory ``load_checkpoint(directory)`` loads: the one the tracker in
    ``directory`` names, else ``directory`` itself if it is one. Raises :class:`CheckpointError`
    naming what is wrong and the newest complete iteration directory, if any."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
    iteration = read_tracker(directory)
    # the tracker first: a directory the old flat layout was saved into and that now also holds
    # iter_<n> directories is a save directory
    if iteration is None and _looks_like_iteration_dir(directory):
        return directory
    newest = newest_complete(directory)
    hint = (f"The newest complete one is {newest!r}: load it directly, or write its iteration "
            f"into {os.path.join(directory, TRACKER)!r}." if newest else
            "There is no complete iter_<n> directory in it.")
    if iteration is None:
        staging = sorted(n for n in os.listdir(directory) if _STAGING_RE.match(n))
        if staging or iteration_dirs(directory):
            found = ", ".join(staging + [os.path.basename(p) for _, p in iteration_dirs(directory)])
            raise CheckpointError(f"{directory!r} has no {TRACKER}, so no save into it was "
                                  f"published (found {found}). {hint}")
        raise CheckpointError(f"{directory!r} holds no checkpoint (no {TRACKER}, no iter_<n> "
                              f"directory, no checkpoint files)")
    path = os.path.join(directory, iteration_dirname(iteration))
    why = incomplete_reason(path)
    if why is None:
        return path
    old = replaced_path(directory, iteration)
    if os.path.isdir(old):
        hint = (f"A save of iteration {iteration} that replaced an earlier copy was interrupted "
                f"between two renames; the earlier copy is {old!r}: rename it to {path!r}. "
                f"{hint}")
    raise CheckpointError(f"{os.path.join(directory, TRACKER)!r} names iteration {iteration}, but "
                          f"{path!r} {why} {hint}")


def prepare_staging(save_dir: str, iteration: int) -> str:
    """Rank 0, before a save: an empty ``.iter_<n>.saving`` (leftovers of saves that died are
    removed, whatever their iteration). Returns its path."""
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):
        if _STAGING_RE.match(name):
            shutil.rmtree(os.path.join(save_dir, name))
    staging = staging_path(save_dir, iteration)
    os.makedirs(staging)
    return staging


def publish(save_dir: str, iteration: int, meta: dict) -> str:
    """Rank 0, after every rank's shards and manifests are on disk: write ``metp_checkpoint.json``
    into the staging directory, rename it to ``iter_<n>`` (an existing ``iter_<n>`` is moved
    aside first and removed at the end) and point the tracker at it. Returns the final path."""
    staging = staging_path(save_dir, iteration)
    final = os.path.join(save_dir, iteration_dirname(iteration))
    write_json_durably(os.path.join(staging, METP_META), meta)
    fsync_path(staging)
    old = None
    if os.path.lexists(final):
        old = replaced_path(save_dir, iteration)
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    fsync_path(save_dir)
    write_durably(os.path.join(save_dir, TRACKER), f"{iteration}\n".encode())
    if old is not None:
        shutil.rmtree(old)
    return final
