"""A checksum per file of each Megatron-LM checkpoint iteration, written at ``--save`` before the
tracker moves and checked at ``--load`` before any rank reads a shard.

Megatron-LM (``pretrain_gpt.py --save DIR``) writes ``DIR/iter_NNNNNNN/`` (the ``torch_dist``
format: one or more ``__R_I.distcp`` shards per rank, ``.metadata``, ``common.pt`` and
``metadata.json``; the ``torch`` format: ``mp_rank_*/model_optim_rng.pt``) and then
``DIR/latest_checkpointed_iteration.txt``, the tracker ``--load DIR`` follows. Nothing in either
says what the shards should hold: a truncated shard fails every rank minutes later with a bare
``EOFError``, a deleted one with a ``FileNotFoundError``, and a flipped bit loads in silence.

**Save.** The patched ``save_checkpoint`` (``patches/<tag>/0002-metp-checkpoint-manifest.patch``)
calls :func:`publish_checkpoint_manifest` on rank 0 inside Megatron's own tracker-writing step,
just before the tracker is written. Megatron runs that step only once every rank's shards are on disk:
after its ``torch.distributed.barrier()`` for a synchronous save, and, for ``--async-save``, as a
finalize function that its async queue calls only after an all-reduce has confirmed that every
rank's write finished (the checkpoint's own ``.metadata`` is written by an earlier finalize
function of the same request). So the manifest sees complete files; if hashing fails (a shard
vanished), the exception keeps the tracker where it was. The manifest, ``metp_manifest.json`` in
the iteration folder, lists every other file of the folder (recursively) with its size and
SHA-256, and is written to a temporary name and renamed into place.

**Load.** :func:`load_problems` checks the iteration ``--load`` resumes from (the tracker's, or
``--ckpt-step N``): every listed file present, of its size, with its digest. A damaged iteration
is refused naming each file, with the newest older iteration that verifies and the flag that
loads it (``--ckpt-step N``, in core_v0.16.1 and core_v0.19.0 alike, or the tracker edit). The
launcher's preflight runs it in one process before torchrun starts; inside the ranks
(``validate_metp_args``, before Megatron reads anything of the checkpoint) every rank checks all
sizes and hashes its own share of the files (:func:`shares`), so the ranks together read the
checkpoint once. An iteration without a manifest (saved before this existed, or by an unpatched
Megatron-LM) loads as before, with one line saying it is unverified.

Why SHA-256: with the SHA extensions of current x86 (Intel since Ice Lake, AMD since Zen) and
ARMv8 CPUs, :mod:`hashlib`'s SHA-256 runs at about twice BLAKE2b's speed (1.8 GB/s against 0.9
on one core of the machine of docs/megatron-lm.md, section 8), it is a
cryptographic hash (no corruption collides by chance), :mod:`hashlib` releases the GIL while it
hashes (threads over the files scale over cores), and ``sha256sum`` checks a file by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

from ..megatron.checkpoint_layout import write_json_durably

__all__ = ["MANIFEST", "HASH", "publish_checkpoint_manifest", "write_manifest", "hash_file",
           "list_files", "verify_iteration", "load_problems", "rank_checkpoint_problems",
           "shares", "iteration_name", "newest_intact_iteration"]

#: the manifest's file name inside each iteration folder
MANIFEST = "metp_manifest.json"
#: the :mod:`hashlib` algorithm of the manifest
HASH = "sha256"
#: the temporary name :func:`write_json_durably` writes the manifest under before its rename
_MANIFEST_TMP = f".{MANIFEST}.tmp-"
_FORMAT = "megatron-metp checkpoint manifest"
_VERSION = 1
_CHUNK = 8 << 20
_TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7,})$")
#: the ``args`` :func:`rank_load_problems` has checked (a rank validates its args once)
_CHECKED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def iteration_name(iteration, release: bool = False) -> str:
    """Megatron-LM's folder name of an iteration (``iter_0000012``, or ``release``)."""
    return "release" if release else f"iter_{int(iteration):07d}"


def _workers(n_files: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(n_files, cores, 16))


def hash_file(path: str) -> str:
    """The hex digest (:data:`HASH`) of the file ``path``, read in 8 MiB chunks."""
    h = hashlib.new(HASH)
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def list_files(folder: str) -> List[str]:
    """Every file under ``folder`` (recursively, relative ``/``-separated paths, sorted), the
    manifest and its temporary file excepted."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel != MANIFEST and not rel.startswith(_MANIFEST_TMP):
                out.append(rel)
    return sorted(out)


def _hash_all(folder: str, rels: Sequence[str]) -> Dict[str, str]:
    paths = [os.path.join(folder, r) for r in rels]
    with ThreadPoolExecutor(max_workers=_workers(len(paths))) as pool:
        return dict(zip(rels, pool.map(hash_file, paths)))


def write_manifest(folder: str, iteration=None) -> Tuple[str, int, int, float]:
    """Hash every file of the iteration folder ``folder`` (threads over the files) and write
    its manifest atomically; return (manifest path, files, bytes, seconds)."""
    start = time.perf_counter()
    rels = list_files(folder)
    sizes = {r: os.path.getsize(os.path.join(folder, r)) for r in rels}
    digests = _hash_all(folder, rels)
    doc = {"format": _FORMAT, "version": _VERSION, "hash": HASH, "iteration": iteration,
           "files": {r: {"bytes": sizes[r], HASH: digests[r]} for r in rels}}
    path = os.path.join(folder, MANIFEST)
    write_json_durably(path, doc)  # temporary file, fsync, os.replace, fsync of the folder
    return path, len(rels), sum(sizes.values()), time.perf_counter() - start


def publish_checkpoint_manifest(save_dir: str, iteration, release: bool = False) -> str:
    """Called by the patched Megatron-LM on rank 0 right before it writes the tracker of
    ``save_dir`` (every rank's shards are written then): write the manifest of the iteration's
    folder and print one line; any error propagates, so the tracker does not move."""
    folder = os.path.join(save_dir, iteration_name(iteration, release))
    if "://" in str(save_dir) or not os.path.isdir(folder):  # e.g. msc:// object storage
        print(f"> METP: no checkpoint manifest for {folder}: not a local folder (the manifest "
              f"is written for file-system checkpoints only); --load will load it unverified",
              flush=True)
        return ""
    path, n, size, took = write_manifest(folder, None if release else int(iteration))
    rate = f", {size / took / 1e6:.0f} MB/s" if took > 0 and size >= 1 << 20 else ""
    print(f"> METP: checkpoint manifest {path}: {HASH} of {n} files, {size / 1e6:.1f} MB, in "
          f"{took:.2f} s{rate} (written before {_TRACKER})", flush=True)
    return path


# --------------------------------------------------------------------------------- loading

def _read_manifest(folder: str):
    """The manifest of ``folder``: a dict, ``None`` when there is none, or a problem string."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            doc = json.load(fh)
        files = doc["files"]
        if doc.get("format") != _FORMAT or doc.get("hash") not in hashlib.algorithms_available:
            raise ValueError("not a megatron-metp manifest")
        for rel, entry in files.items():
            int(entry["bytes"]), str(entry[doc["hash"]])
        return doc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{path} is unreadable ({type(exc).__name__}: {exc})"


def shares(sizes: Dict[str, int], world: int) -> List[List[str]]:
    """The files split over ``world`` ranks with about equal bytes each (largest first, each to
    the least-loaded rank; the same on every rank)."""
    out: List[List[str]] = [[] for _ in range(max(world, 1))]
    load = [0] * len(out)
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        i = min(range(len(out)), key=lambda k: (load[k], k))
        out[i].append(rel)
        load[i] += sizes[rel]
    return out


def verify_iteration(folder: str, rank: int = 0, world: int = 1):
    """Check ``folder`` against its manifest: (``"ok"`` | ``"unverified"`` | ``"damaged"``, the
    problems, each naming the file). Every file's presence and size is checked; only this
    rank's share of the digests (:func:`shares`; all of them with ``world == 1``)."""
    doc = _read_manifest(folder)
    if doc is None:
        return "unverified", []
    if isinstance(doc, str):
        return "damaged", [doc]
    algo, files = doc["hash"], doc["files"]
    problems, present = [], {}
    for rel in sorted(files):
        want = int(files[rel]["bytes"])
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing (the manifest lists it, {want} bytes)")
            continue
        got = os.path.getsize(path)
        if got != want:
            what = "truncated" if got < want else "longer than saved"
            problems.append(f"{path} is {what}: {got} bytes, the manifest says {want}")
            continue
        present[rel] = got
    mine = shares(present, world)[rank] if world > 1 else sorted(present)
    if mine:
        paths = [os.path.join(folder, r) for r in mine]
        with ThreadPoolExecutor(max_workers=_workers(len(paths))) as pool:
            got = dict(zip(mine, pool.map(lambda p: _digest(p, algo), paths)))
        for rel in mine:
            if got[rel] != files[rel][algo]:
                problems.append(f"{os.path.join(folder, rel)} has altered contents ({algo} "
                                f"{got[rel][:16]}…, the manifest says {files[rel][algo][:16]}…)")
    return ("damaged" if problems else "ok"), problems


def _digest(path: str, algo: str) -> str:
    if algo == HASH:
        return hash_file(path)
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _tracker_iteration(load: str) -> Optional[str]:
    tracker = os.path.join(load, _TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as fh:
        text = fh.read().strip()
    return text if text == "release" or text.isdigit() else None


def newest_intact_iteration(load: str, below: Optional[int]) -> Tuple[Optional[int], List[int]]:
    """The newest iteration of ``load`` older than ``below`` whose folder verifies against its
    manifest, and the iterations tried on the way that have no manifest (newest first)."""
    its = sorted((int(m.group(1)) for m in map(_ITER.match, os.listdir(load)) if m),
                 reverse=True)
    unverified = []
    for it in its:
        if below is not None and it >= below:
            continue
        status, _ = verify_iteration(os.path.join(load, iteration_name(it)))
        if status == "ok":
            return it, unverified
        if status == "unverified":
            unverified.append(it)
    return None, unverified


def _damaged_message(load: str, name: str, iteration: Optional[int],
                     problems: List[str]) -> str:
    good, unverified = newest_intact_iteration(load, iteration)
    tracker = os.path.join(load, _TRACKER)
    if good is not None:
        way = (f"the newest intact iteration is {good} ({iteration_name(good)} verifies against "
               f"its manifest): load it with --ckpt-step {good} (or write {good} into {tracker}), "
               f"or restore the files")
    elif unverified:
        way = (f"no older iteration verifies; {iteration_name(unverified[0])} has no manifest "
               f"(unverified): --ckpt-step {unverified[0]} loads it at your own risk, or restore "
               f"the files")
    else:
        way = "no older iteration is there to fall back on: restore the files or start anew"
    return (f"--load {load}: {name} does not match its checkpoint manifest "
            f"({os.path.join(load, name, MANIFEST)}): " + "; ".join(problems) +
            f". Megatron-LM would fail reading it or load altered values; {way}")


def _target(load: str, ckpt_step) -> Optional[Tuple[str, Optional[int]]]:
    """(folder name, iteration) that ``--load load`` (``--ckpt-step``) resumes from, if any."""
    if ckpt_step:  # Megatron-LM takes --ckpt-step over the tracker when it is set and not 0
        return iteration_name(ckpt_step), int(ckpt_step)
    text = _tracker_iteration(load)
    if text is None:
        return None
    return (("release", None) if text == "release" else (iteration_name(text), int(text)))


def load_problems(load: Optional[str], ckpt_step=None, rank: int = 0, world: int = 1,
                  notes: Optional[List[str]] = None) -> List[str]:
    """The problems of the iteration ``--load load`` resumes from against its manifest (empty
    when it verifies, or there is no checkpoint, or no manifest: then a line saying it is
    unverified goes to ``notes``). ``rank``/``world``: hash only this rank's share."""
    if not load or not os.path.isdir(load):
        return []
    target = _target(load, ckpt_step)
    if target is None:
        return []
    name, iteration = target
    folder = os.path.join(load, name)
    if not os.path.isdir(folder):
        return []  # reported by the preflight's tracker check / Megatron-LM
    status, problems = verify_iteration(folder, rank, world)
    if status == "damaged":
        return [_damaged_message(load, name, iteration, problems)]
    if notes is not None:
        if status == "unverified":
            notes.append(f"--load {load}: {name} has no checkpoint manifest ({MANIFEST}; saved "
                         f"before megatron-metp wrote one, or by an unpatched Megatron-LM): it "
                         f"loads as before, unverified")
        else:
            share = "" if world <= 1 else f" (sizes of all files; digests of this rank's share)"
            notes.append(f"--load {load}: {name} verified against its manifest{share}")
    return problems


def _checkout_publishes() -> Optional[bool]:
    """Whether the imported Megatron-LM's ``save_checkpoint`` calls
    :func:`publish_checkpoint_manifest` (``0002-metp-checkpoint-manifest.patch`` applied);
    ``None`` when there is no Megatron-LM to ask."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron.training.checkpointing")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    with open(spec.origin, encoding="utf-8") as fh:
        return "publish_checkpoint_manifest(" in fh.read()


def rank_checkpoint_problems(args) -> List[str]:
    """:func:`load_problems` inside a rank of ``pretrain_gpt.py`` (from ``validate_metp_args``,
    before Megatron reads the checkpoint): this rank's share of the digests; rank 0 prints the
    line of an unverified or verified iteration, and, with ``--save``, a line when the
    Megatron-LM checkout would save without a manifest. Checked once per ``args``."""
    if _CHECKED.get(id(args)) is args:
        return []
    rank, world = int(getattr(args, "rank", 0) or 0), int(getattr(args, "world_size", 1) or 1)
    notes: List[str] = []
    problems = load_problems(getattr(args, "load", None), getattr(args, "ckpt_step", None),
                             rank=rank, world=world, notes=notes)
    _CHECKED[id(args)] = args  # (not an attribute: Megatron prints and saves its args)
    if rank == 0 and getattr(args, "save", None) and _checkout_publishes() is False:
        notes.append(f"--save {args.save}: this Megatron-LM checkout saves without the "
                     f"checkpoint manifest (0002-metp-checkpoint-manifest.patch is not applied): "
                     f"its checkpoints will load unverified; run scripts/apply_patches.sh on it")
    if rank == 0:
        for note in notes:
            print(f"> METP: {note}", flush=True)
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_metp.megatron_lm.ckpt_manifest LOAD_DIR [--ckpt-step N]``: verify
    the iteration a ``--load LOAD_DIR`` would resume from, as the preflight does."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_metp.megatron_lm.ckpt_manifest",
                                 description="Verify the checkpoint iteration --load DIR resumes "
                                             "from against its megatron-metp manifest.")
    ap.add_argument("load", help="the directory --save wrote (holding " + _TRACKER + ")")
    ap.add_argument("--ckpt-step", type=int, default=None, help="the iteration to check "
                    "(default: the tracker's)")
    opts = ap.parse_args(argv)
    notes: List[str] = []
    problems = load_problems(opts.load, opts.ckpt_step, notes=notes)
    if not notes and not problems:
        notes.append(f"--load {opts.load}: no checkpoint there to check (no {_TRACKER}, or the "
                     f"iteration it names is missing)")
    for line in notes + problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
