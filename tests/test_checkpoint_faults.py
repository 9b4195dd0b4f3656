"""Checkpoint faults found by fault injection: a save that dies half way while it replaces or adds
to a save directory, flipped bytes in a shard, missing files. Loading the save directory
afterwards gives the last published iteration bit for bit, or a CheckpointError naming the file;
never a mix of iterations or silently different numbers. Two forked gloo ranks, METP=2."""

import io
import os
import pickle
import shutil
import time

import pytest

from megatron_metp.megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_metp.megatron.checkpoint_integrity import WHOLE_FILES
from megatron_metp.megatron.training import Layout, init_parallel, setup, train
from tests.harness import run_ranks
from tests.test_checkpoint import SIZE, iteration_dir

LAYOUT, WORLD = Layout(metp=2), 2
FIRST, SECOND = 2, 4
TRACKER = "latest_checkpointed_iteration.txt"


def _digest(state):
    """sha256 of this rank's weights and of its Adam moments (in the optimizer's order)."""
    import hashlib

    from megatron_metp.megatron.checkpoint import _param_pairs

    weights, adam = hashlib.sha256(), hashlib.sha256()
    for name, p in sorted(state["model"].module.named_parameters()):
        weights.update(name.encode() + p.detach().numpy().tobytes())
    for _, topt, p in _param_pairs(state["optimizer"]):
        st = topt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                adam.update(st[k].numpy().tobytes())
    return weights.hexdigest(), adam.hexdigest()


def _start(seed=1234):
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(LAYOUT, SIZE.seq_length)
    return setup(SIZE, LAYOUT, seed=seed)


def _train_and_save(rank, world, save_dir):
    state = _start()
    train(SIZE, LAYOUT, FIRST, state=state)
    save_checkpoint(save_dir, state, FIRST, LAYOUT.describe())
    digest = _digest(state)
    losses = [r.lm_loss for r in train(SIZE, LAYOUT, SECOND - FIRST, state=state, start_step=FIRST)]
    return digest, losses


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A save directory holding iteration FIRST only; every rank's digest at the save and the
    losses of the next steps of the uninterrupted run."""
    save_dir = str(tmp_path_factory.mktemp("faults") / "save")
    out = run_ranks(_train_and_save, WORLD, save_dir, timeout=120)
    return save_dir, [d for d, _ in out], out[0][1]


def _load(rank, world, directory, load_optimizer=True, steps=0):
    """Load ``directory`` into a model with other weights; returns ("ok", iteration, digest,
    losses of ``steps`` more steps, seconds) or ("CheckpointError", message, seconds)."""
    state = _start(seed=999)
    t0 = time.monotonic()
    try:
        it = load_checkpoint(directory, state, load_optimizer=load_optimizer, load_rng=False)
    except CheckpointError as exc:
        return ("CheckpointError", str(exc), time.monotonic() - t0)
    seconds = time.monotonic() - t0
    digest = _digest(state)
    losses = [r.lm_loss for r in train(SIZE, LAYOUT, steps, state=state, start_step=it)]
    return ("ok", it, digest, losses, seconds)


def test_untouched_checkpoint_loads_and_resumes_bit_exactly(base):
    """Negative control for everything below: the same loader accepts the intact checkpoint."""
    save_dir, digests, losses = base
    out = run_ranks(_load, WORLD, save_dir, steps=SECOND - FIRST, timeout=120)
    assert [o[0] for o in out] == ["ok"] * WORLD, out
    assert [o[1] for o in out] == [FIRST] * WORLD
    assert [o[2] for o in out] == digests and digests[0] != digests[1]
    assert out[0][3] == losses


def test_the_tracker_decides_what_a_save_directory_loads(base, tmp_path):
    """No ranks needed: which directory load_checkpoint picks, and the refusals naming the
    tracker."""
    from megatron_metp.megatron.checkpoint_layout import resolve

    save_dir = tmp_path / "save"
    shutil.copytree(base[0], save_dir)
    # files of the old flat layout next to iter_<n> directories: the tracker wins
    for name in [n for n in ("common.pt", ".metadata") if n in WHOLE_FILES]:
        shutil.copy(os.path.join(iteration_dir(base[0]), name), save_dir / name)
    assert resolve(str(save_dir)) == iteration_dir(str(save_dir))
    assert resolve(iteration_dir(str(save_dir))) == iteration_dir(str(save_dir))
    (save_dir / TRACKER).write_text("four\n")
    with pytest.raises(CheckpointError, match=f"{TRACKER}.*'four', not an iteration number"):
        resolve(str(save_dir))
    (save_dir / TRACKER).write_text("6\n")
    with pytest.raises(CheckpointError, match=r"names iteration 6, but .*iter_0000006' does not "
                                              r"exist.*newest complete one is .*iter_0000002"):
        resolve(str(save_dir))


def test_a_bad_timeout_variable_is_refused_naming_it(monkeypatch):
    from megatron_metp.megatron.checkpoint_agreement import checkpoint_timeout_s
    from megatron_metp.runtime.watchdog import job_timeout_s

    for bad in ("abc", "nan", "inf", "0", "-3"):
        monkeypatch.setenv("METP_CHECKPOINT_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"METP_CHECKPOINT_TIMEOUT_S={bad!r} must be a "
                                             f"positive finite number"):
            checkpoint_timeout_s()
    monkeypatch.setenv("METP_CHECKPOINT_TIMEOUT_S", "2.5")
    assert checkpoint_timeout_s() == 2.5
    monkeypatch.setenv("METP_RING_TIMEOUT_S", "2")  # longer than the job timeout: contradictory
    with pytest.raises(ValueError, match="METP_CHECKPOINT_TIMEOUT_S='2.5' is longer than the job "
                                         "timeout 2 s"):
        checkpoint_timeout_s()
    monkeypatch.delenv("METP_CHECKPOINT_TIMEOUT_S")
    assert checkpoint_timeout_s() == job_timeout_s() == 2.0  # the one timeout by default
    monkeypatch.delenv("METP_RING_TIMEOUT_S")
    assert checkpoint_timeout_s() == 600.0


# ---------------------------------------------------------------- a rank dies during a save

def _inject_crash(point):
    """Make this process exit (as a killed rank does) at ``point`` of the next save."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_metp.megatron import checkpoint_layout

    if point in ("before-shards", "after-one-shard"):
        write = FileSystemWriterAsync.write_preloaded_data_multiproc

        def dying(transform_list, use_msc, rank, write_buckets, results_queue):
            if point == "after-one-shard":  # the first .distcp file is written and fsynced
                write(transform_list, use_msc, rank, write_buckets[:1], results_queue)
            os._exit(17)

        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(dying)
    elif point == "between-renames":  # a re-save moved the old iter_<n> aside, not yet the new one in
        rename = os.rename

        def dying_rename(src, dst):
            if str(src).endswith(".saving"):
                os._exit(17)
            rename(src, dst)

        os.rename = dying_rename
    elif point == "before-tracker":  # the new iter_<n> is in place, the tracker not yet replaced
        write = checkpoint_layout.write_durably

        def dying_write(path, data):
            if path.endswith(TRACKER):
                os._exit(17)
            write(path, data)

        checkpoint_layout.write_durably = dying_write
    else:
        raise ValueError(point)


def _save_with_crash(rank, world, save_dir, iteration, point, crash_rank):
    """Other weights and two more steps, saved as ``iteration`` while ``crash_rank`` dies."""
    state = _start(seed=999)
    train(SIZE, LAYOUT, SECOND, state=state)
    if rank == crash_rank:
        _inject_crash(point)
    t0 = time.monotonic()
    try:
        save_checkpoint(save_dir, state, iteration)
    except CheckpointError as exc:
        return ("CheckpointError", str(exc), time.monotonic() - t0)
    return ("saved", None, time.monotonic() - t0)


CRASHES = [  # (point, iteration saved, rank that dies)
    ("before-shards", SECOND, 1),
    ("after-one-shard", SECOND, 1),
    ("after-one-shard", FIRST, 1),    # replacing the published iteration's own directory
    ("before-shards", FIRST, 0),      # the coordinator (writes .metadata, publishes) dies
    ("before-tracker", SECOND, 0),
    ("between-renames", FIRST, 0),
]


@pytest.mark.parametrize("point,iteration,crash_rank", CRASHES,
                         ids=[f"{p}-iter{i}-rank{r}" for p, i, r in CRASHES])
def test_rank_dying_during_save_never_publishes_a_mixed_checkpoint(base, tmp_path, point, iteration,
                                                                   crash_rank):
    save_dir = str(tmp_path / "save")
    shutil.copytree(base[0], save_dir)
    out = run_ranks(_save_with_crash, WORLD, save_dir, iteration, point, crash_rank,
                    timeout=120, allow_errors=True)
    survivor = out[1 - crash_rank]
    assert out[crash_rank] is None, out  # it died
    assert survivor[0] == "CheckpointError" and f"saving iteration {iteration}" in survivor[1], out
    assert survivor[2] < 20, survivor  # gloo reports the closed sockets at once
    print(f"\n[fault] save, {point}, iteration {iteration}, rank {crash_rank} dies: survivor "
          f"raised after {survivor[2]:.2f} s: {survivor[1][:160]}")
    staging = os.path.join(save_dir, f".iter_{iteration:07d}.saving")
    tracker = open(os.path.join(save_dir, TRACKER)).read().strip()
    assert tracker == str(FIRST), tracker
    if point in ("before-shards", "after-one-shard"):
        # the fault happened where it says: the dead rank wrote no shard, or exactly one
        dead = sorted(n for n in os.listdir(staging) if n.startswith(f"__{crash_rank}_"))
        assert len(dead) == (1 if point == "after-one-shard" else 0), dead
    if point == "after-one-shard" and iteration == SECOND:
        # the staging directory itself is refused, naming what is missing
        direct = run_ranks(_load, WORLD, staging, timeout=120)
        assert all(o[0] == "CheckpointError" and "not a complete" in o[1] for o in direct), direct
    t0 = time.monotonic()
    loaded = run_ranks(_load, WORLD, save_dir, timeout=120)
    if point == "between-renames":
        # the tracker names iteration FIRST, whose directory is gone for the moment: refused,
        # naming the directory and where the previous copy is
        assert all(o[0] == "CheckpointError" and f".iter_{FIRST:07d}.replaced" in o[1]
                   and "rename it" in o[1] for o in loaded), loaded
        old = os.path.join(save_dir, f".iter_{FIRST:07d}.replaced")
        os.rename(old, iteration_dir(save_dir, FIRST))  # the fix the message names
        loaded = run_ranks(_load, WORLD, save_dir, timeout=120)
    assert [o[0] for o in loaded] == ["ok"] * WORLD, loaded
    assert [o[1] for o in loaded] == [FIRST] * WORLD
    assert [o[2] for o in loaded] == base[1], "the loaded state is not the published iteration's"
    print(f"[fault] load after it: iteration {FIRST} bit-exact ({time.monotonic() - t0:.2f} s incl."
          f" fork)")


def test_rank_dying_during_the_first_save_leaves_nothing_to_load(tmp_path):
    save_dir = str(tmp_path / "save")
    out = run_ranks(_save_with_crash, WORLD, save_dir, FIRST, "after-one-shard", 1,
                    timeout=120, allow_errors=True)
    assert out[1] is None and out[0][0] == "CheckpointError", out
    loaded = run_ranks(_load, WORLD, save_dir, timeout=120)
    assert all(o[0] == "CheckpointError" and f"has no {TRACKER}" in o[1]
               and f".iter_{FIRST:07d}.saving" in o[1] for o in loaded), loaded


def _save_with_disk_full(rank, world, save_dir, where):
    """Rank 1's disk is full: its shard writer or its manifest fails (an exception, no crash)."""
    import errno

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_metp.megatron import checkpoint

    state = _start(seed=999)
    train(SIZE, LAYOUT, 1, state=state)
    full = OSError(errno.ENOSPC, "No space left on device")
    if rank == 1 and where == "shard-writer":
        def failing_writer(transform_list, use_msc, rank, write_buckets, results_queue):
            results_queue.put(full)  # what Megatron's writer process reports

        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(failing_writer)
    elif rank == 1:
        def failing_manifest(*args):
            raise full

        checkpoint.write_manifest = failing_manifest
    t0 = time.monotonic()
    try:
        save_checkpoint(save_dir, state, SECOND)
    except CheckpointError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("where", ["shard-writer", "manifest"])
def test_a_rank_failing_its_part_of_a_save_fails_every_rank_and_publishes_nothing(base, tmp_path,
                                                                                 where):
    save_dir = str(tmp_path / "save")
    shutil.copytree(base[0], save_dir)
    out = run_ranks(_save_with_disk_full, WORLD, save_dir, where, timeout=120)
    assert all(m is not None and "rank 1" in m and "No space left" in m
               and "Nothing was published" in m for m, _ in out), out
    assert out[0][0] == out[1][0]  # the same message on every rank
    print(f"\n[fault] save, rank 1's disk full in its {where}: both raised after "
          f"{max(t for _, t in out):.2f} s: {out[0][0][:200]}")
    assert open(os.path.join(save_dir, TRACKER)).read().strip() == str(FIRST)
    assert not os.path.exists(iteration_dir(save_dir, SECOND))


def _save_with_stall(rank, world, save_dir):
    """Rank 1 stalls (a hung file system) before checksumming its shards."""
    from megatron_metp.megatron import checkpoint

    state = _start(seed=999)
    train(SIZE, LAYOUT, 1, state=state)
    if rank == 1:
        write = checkpoint.write_manifest

        def stalled(*args):
            time.sleep(2.5)
            return write(*args)

        checkpoint.write_manifest = stalled
    t0 = time.monotonic()
    try:
        save_checkpoint(save_dir, state, SECOND)
    except CheckpointError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_a_stalled_rank_fails_the_save_within_the_bound_and_publishes_nothing(base, tmp_path,
                                                                            monkeypatch):
    save_dir = str(tmp_path / "save")
    shutil.copytree(base[0], save_dir)
    monkeypatch.setenv("METP_CHECKPOINT_TIMEOUT_S", "1")
    out = run_ranks(_save_with_stall, WORLD, save_dir, timeout=120, allow_errors=True)
    msg, seconds = out[0]
    assert msg is not None and "died or hangs" in msg and "METP_CHECKPOINT_TIMEOUT_S=1" in msg, out
    assert 1 <= seconds < 2.5, out  # the bound, not the stall
    assert out[1] is not None and out[1][0] is not None, out  # the stalled rank raises too
    print(f"\n[fault] save, rank 1 stalls 2.5 s while checksumming: rank 0 raised after "
          f"{seconds:.2f} s: {msg[:200]}; rank 1 after {out[1][1]:.2f} s: {out[1][0][:300]}")
    assert open(os.path.join(save_dir, TRACKER)).read().strip() == str(FIRST)
    assert not os.path.exists(iteration_dir(save_dir, SECOND))


# ---------------------------------------------------------------- corrupt bytes on disk

def _flip_in_payload(ckpt_dir, key, how, writer):
    """Flip bits inside the raw data of tensor ``key``'s first chunk in a file rank ``writer``
    wrote (not in a header):
    ``low`` the lowest mantissa bit of one element, ``exponent`` its exponent (a huge value).
    Returns the shard file's path after checking that torch itself reads the changed bytes
    without complaint as a different tensor."""
    import torch

    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own checkpoint: trusted here
    info = next(v for k, v in sorted(md.storage_data.items(), key=lambda kv: str(kv[0]))
                if k.fqn == key and v.relative_path.startswith(f"__{writer}_"))
    path = os.path.join(ckpt_dir, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        blob = bytearray(f.read(info.length))
    tensor = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    raw = tensor.contiguous().numpy().tobytes()
    pos = blob.find(raw)
    assert pos >= 0 and blob.find(raw, pos + 1) < 0, "tensor bytes not found once in the item"
    element = tensor.numel() // 2
    at = pos + element * 4 + (0 if how == "low" else 3)  # float32, little-endian
    blob[at] ^= 0x01 if how == "low" else 0x40
    changed = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    assert not torch.equal(changed, tensor) and torch.isfinite(tensor).all()
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(blob)
    return path


FLIPS = [  # (tensor, which bit, the rank whose file holds it: that rank's manifest catches it)
    ("decoder.layers.mlp.linear_fc1.weight", "low", 1),
    ("optimizer.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight", "exponent", 0),
    ("decoder.layers.self_attention.linear_qkv.weight", "exponent", 0),
]


@pytest.mark.parametrize("key,how,writer", FLIPS, ids=["weight-mantissa", "adam-exponent",
                                                       "weight-exponent"])
def test_flipped_bits_in_a_shard_are_refused_naming_file_and_tensor(base, tmp_path, key, how,
                                                                    writer):
    ckpt = tmp_path / "corrupt"
    shutil.copytree(iteration_dir(base[0]), ckpt)
    path = _flip_in_payload(str(ckpt), key, how, writer)
    assert os.path.basename(path).startswith(f"__{writer}_")
    out = run_ranks(_load, WORLD, str(ckpt), timeout=120)
    # every rank refuses, also the one whose share of the verification was intact
    assert all(o[0] == "CheckpointError" and path in o[1] and repr(key) in o[1]
               and "crc32" in o[1] and f"failed on rank {writer} of" in o[1] for o in out), out
    print(f"\n[fault] {how} bit flip in {key}: refused after {max(o[2] for o in out):.2f} s: "
          f"{out[0][1][:200]}")
    if key.startswith("optimizer."):
        # a load that does not use the Adam state does not read it: the weights load exactly
        out = run_ranks(_load, WORLD, str(ckpt), load_optimizer=False, timeout=120)
        assert [o[0] for o in out] == ["ok"] * WORLD, out
        assert [o[2][0] for o in out] == [d[0] for d in base[1]]


@pytest.mark.parametrize("victim", ["__0_1.distcp", "metp_integrity/rank_00001.json"]
                         + [n for n in WHOLE_FILES if n == "common.pt"])  # none in 0.19
def test_missing_or_truncated_file_is_refused_naming_it(base, tmp_path, victim):
    ckpt = tmp_path / "damaged"
    shutil.copytree(iteration_dir(base[0]), ckpt)
    path = ckpt / victim
    if victim.endswith(".json"):
        path.unlink()
        needle = "missing its integrity manifest"
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size - 7])
        needle = "truncated"
    out = run_ranks(_load, WORLD, str(ckpt), timeout=120)
    assert all(o[0] == "CheckpointError" and victim in o[1] and needle in o[1] for o in out), out
    print(f"\n[fault] {victim} {'deleted' if victim.endswith('.json') else 'truncated'}: refused "
          f"after {max(o[2] for o in out):.2f} s: {out[0][1][:200]}")


def _save_after_a_disagreement(rank, world, save_dir):
    """Two agreeing steps, then one METP op call that disagrees between the agreement check's
    scheduled exchanges (rank 1 says causal=False), then a save."""
    from megatron_metp.runtime import agree

    state = _start()
    train(SIZE, LAYOUT, FIRST, state=state)
    grp = state["groups"].metp
    while agree._scheduled(agree._window(grp).calls):  # reach a call that does not exchange
        agree.check_group_agrees(grp, "metp_mlp 'warm-up'", causal=True)
    agree.check_group_agrees(grp, "metp_mlp 'layer 1 mlp'", causal=rank == 0)
    try:
        save_checkpoint(save_dir, state, FIRST, LAYOUT.describe())
    except ValueError as exc:  # GroupDisagreementError
        return type(exc).__name__, str(exc)
    return "saved", None


def test_a_save_is_refused_when_the_ranks_disagreed_since_the_last_agreement_exchange(tmp_path):
    save_dir = str(tmp_path / "save")
    out = run_ranks(_save_after_a_disagreement, WORLD, save_dir, timeout=120)
    for kind, msg in out:
        assert kind == "GroupDisagreementError" and "metp_mlp 'layer 1 mlp'" in msg, (kind, msg)
        assert "causal differs" in msg, msg
    assert not os.path.exists(os.path.join(save_dir, TRACKER))  # nothing was published
