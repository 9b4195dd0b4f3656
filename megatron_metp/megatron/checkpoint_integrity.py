"""Checksums of every byte a checkpoint holds, recorded at save and verified before loading.

After ``dist_checkpointing`` has written a checkpoint, every saving rank reads back the
``.distcp`` files it wrote (``__<rank>_<n>.distcp``) and records, per stored item (one rank's
shard of one sharded tensor, or one byte object), the item's key and chunk offset, its byte
range in the file and the CRC-32 of those bytes, plus each file's size, in
``metp_integrity/rank_<rank>.json``. Rank 0's manifest also covers the whole files
``.metadata``, ``metadata.json`` and (megatron-core 0.16) ``common.pt``. The manifests are written (fsync) before the
checkpoint is published, so a published checkpoint always has them.

Before a load touches the model, the loading ranks split the manifests between them and each
verifies its share: every file's size, every item's bytes against its CRC-32, and that every
item of ``.metadata`` is listed in exactly the place a manifest says. A mismatch raises
:class:`CheckpointError` naming the file, the tensor key and chunk, and what to do. CRC-32 finds
accidental corruption (flipped bits, truncated or mixed-up files); it is not a signature.

Verification reads the bytes it checks once more (spread over the ranks); the items a load does
not use (the optimizer's with ``load_optimizer=False``, the RNG states with ``load_rng=False``)
are not read.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Dict, Iterable, Optional, Tuple

from .checkpoint_errors import CheckpointError
from .compat import checkpoint_whole_files
from .checkpoint_layout import fsync_path, write_json_durably

ALGORITHM = "crc32"
MANIFEST_DIR = "metp_integrity"
MANIFEST_FORMAT = 1
#: files of an iteration directory checksummed as a whole (rank 0's manifest)
WHOLE_FILES = checkpoint_whole_files()  # megatron-core's own files (0.19 has no common.pt)
_CHUNK = 16 << 20
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def manifest_name(rank: int) -> str:
    return f"{MANIFEST_DIR}/rank_{rank:05d}.json"


def crc32_range(path: str, start: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of ``path`` from ``start``; :class:`CheckpointError` naming
    the file if they cannot all be read."""
    crc, left = 0, length
    try:
        with open(path, "rb") as f:
            f.seek(start)
            while left:
                data = f.read(min(left, _CHUNK))
                if not data:
                    raise CheckpointError(
                        f"checkpoint file {path!r} ends at byte {start + length - left}, before "
                        f"the end of the data it should hold (byte {start + length}): the file is "
                        f"truncated")
                crc = zlib.crc32(data, crc)
                left -= len(data)
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} cannot be read: {exc}") from exc
    return crc


def writer_rank(relative_path: str) -> int:
    """The rank that wrote a ``.distcp`` file (``__<rank>_<n>.distcp``; 0 for other names)."""
    m = _SHARD_RE.match(relative_path)
    return int(m.group(1)) if m else 0


def _offset(offset) -> Optional[tuple]:
    """A chunk offset as a tuple (``None`` for a byte object, which has none)."""
    return None if offset is None else tuple(int(o) for o in offset)


def _what(key: str, offset: Optional[tuple], where: str) -> str:
    """``tensor 'k' (chunk at offset [0, 24], <where>)`` / ``byte object 'k' (<where>)``."""
    return f"byte object {key!r} ({where})" if offset is None else \
        f"tensor {key!r} (chunk at offset {list(offset)}, {where})"


def _storage_items(metadata) -> Dict[Tuple[str, Optional[tuple]], object]:
    """``(key, chunk offset) -> _StorageInfo`` of a ``torch.distributed.checkpoint`` Metadata."""
    return {(index.fqn, _offset(index.offset)): info
            for index, info in metadata.storage_data.items()}


def build_manifest(ckpt_dir: str, metadata, rank: int) -> dict:
    """The manifest of the files ``rank`` wrote into ``ckpt_dir`` (read back from disk)."""
    files: Dict[str, dict] = {}
    for (key, offset), info in sorted(_storage_items(metadata).items(),
                                      key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if writer_rank(info.relative_path) != rank:
            continue
        path = os.path.join(ckpt_dir, info.relative_path)
        entry = files.setdefault(info.relative_path, {"size": os.path.getsize(path), "items": []})
        entry["items"].append({"key": key, "offset": None if offset is None else list(offset),
                               "start": int(info.offset),
                               "length": int(info.length),
                               ALGORITHM: crc32_range(path, info.offset, info.length)})
    whole = {}
    if rank == 0:
        for name in WHOLE_FILES:
            path = os.path.join(ckpt_dir, name)
            size = os.path.getsize(path)
            whole[name] = {"size": size, ALGORITHM: crc32_range(path, 0, size)}
    return {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "rank": rank, "files": files,
            "whole_files": whole}


def write_manifest(ckpt_dir: str, metadata, rank: int) -> str:
    """Build ``rank``'s manifest and write it durably; returns its name inside ``ckpt_dir``.
    Rank 0 first makes ``dist_checkpointing``'s own files durable (``common.pt`` and
    ``metadata.json`` are written without fsync; the ``.distcp`` files are fsynced by their
    writers)."""
    if rank == 0:
        for name in WHOLE_FILES:
            fsync_path(os.path.join(ckpt_dir, name))
    os.makedirs(os.path.join(ckpt_dir, MANIFEST_DIR), exist_ok=True)
    name = manifest_name(rank)
    write_json_durably(os.path.join(ckpt_dir, name), build_manifest(ckpt_dir, metadata, rank),
                       indent=None)
    return name


def read_manifest(ckpt_dir: str, name: str) -> dict:
    path = os.path.join(ckpt_dir, name)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"integrity manifest {path!r} is missing or unreadable ({exc}); "
                              f"the checkpoint cannot be verified: load an older iteration") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or \
            manifest.get("algorithm") != ALGORITHM or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"integrity manifest {path!r} is not a format-{MANIFEST_FORMAT} "
                              f"{ALGORITHM} manifest of megatron_metp; the checkpoint cannot be "
                              f"verified")
    return manifest


def _check_file_size(path: str, recorded: int, manifest_path: str) -> None:
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} is missing or unreadable ({exc}); "
                              f"{manifest_path!r} lists it: load an older iteration or restore "
                              f"the file") from exc
    if size != recorded:
        what = "truncated" if size < recorded else "longer than written"
        raise CheckpointError(f"checkpoint file {path!r} is {size} bytes, {manifest_path!r} "
                              f"recorded {recorded} at save: the file is {what}; load an older "
                              f"iteration or restore the file")


def verify_manifest(ckpt_dir: str, name: str, metadata,
                    skip_prefixes: Iterable[str] = ()) -> int:
    """Verify the files of one manifest; returns how many stored items it lists.

    Items whose key starts with one of ``skip_prefixes`` are matched against ``.metadata`` but
    their bytes are not read (a load that does not use them)."""
    manifest_path = os.path.join(ckpt_dir, name)
    manifest = read_manifest(ckpt_dir, name)
    skip = tuple(skip_prefixes)
    stored = _storage_items(metadata)
    for fname, rec in sorted(manifest.get("whole_files", {}).items()):
        path = os.path.join(ckpt_dir, fname)
        _check_file_size(path, rec["size"], manifest_path)
        if crc32_range(path, 0, rec["size"]) != rec[ALGORITHM]:
            raise CheckpointError(f"checkpoint file {path!r} does not match its {ALGORITHM} in "
                                  f"{manifest_path!r}: the file is corrupt; load an older "
                                  f"iteration or restore the file")
    if manifest.get("rank") == 0 and set(manifest.get("whole_files", {})) != set(WHOLE_FILES):
        raise CheckpointError(f"integrity manifest {manifest_path!r} does not cover "
                              f"{', '.join(WHOLE_FILES)}; the checkpoint cannot be verified")
    count = 0
    for fname, rec in sorted(manifest["files"].items()):
        path = os.path.join(ckpt_dir, fname)
        items = rec.get("items", [])
        if any(not it["key"].startswith(skip) for it in items):
            _check_file_size(path, rec["size"], manifest_path)
        for it in items:
            key, offset = it["key"], _offset(it["offset"])
            start, length = it["start"], it["length"]
            info = stored.get((key, offset))
            if info is None or info.relative_path != fname or info.offset != start or \
                    info.length != length:
                where = "is not in it" if info is None else \
                    f"is at {info.relative_path} bytes {info.offset}+{info.length} there"
                listed = _what(key, offset, f"{fname} bytes {start}+{length}")
                raise CheckpointError(
                    f"{manifest_path!r} lists {listed}, but {ckpt_dir}/.metadata {where}: the "
                    f"files of this checkpoint do not belong together; load an older iteration")
            count += 1
            if key.startswith(skip):
                continue
            got = crc32_range(path, start, length)
            if got != it[ALGORITHM]:
                item = _what(key, offset, f"file bytes {start}..{start + length}")
                raise CheckpointError(
                    f"checkpoint file {path!r}: the bytes of {item} have {ALGORITHM} "
                    f"{got:08x}, {manifest_path!r} recorded {it[ALGORITHM]:08x} at save: the "
                    f"file is corrupt; load an older iteration or restore the file")
    return count


def verify_share(ckpt_dir: str, manifests, metadata, rank: int, world: int,
                 skip_prefixes: Iterable[str] = ()) -> int:
    """This loading rank's share (manifests ``rank``, ``rank + world``, ...). Returns the number
    of stored items those manifests list; the caller checks that all ranks' counts add up to
    the items of ``.metadata``."""
    count = 0
    for i, name in enumerate(manifests):
        if i % world == rank:
            count += verify_manifest(ckpt_dir, name, metadata, skip_prefixes)
    return count
