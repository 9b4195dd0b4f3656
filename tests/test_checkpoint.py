"""Checkpoints move between METP and stock TP layouts and resume with nothing lost."""

import json
import os
import shutil

import pytest

from megatron_metp.megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_metp.megatron.checkpoint_integrity import WHOLE_FILES
from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, setup, train
from tests.harness import run_ranks

SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
               vocab_size=64, seq_length=16, swiglu=True)
SAVE_AT, TOTAL = 2, 5


def _rng_digest():
    """This rank's torch RNG state and Megatron RNG tracker states, hashed."""
    import hashlib

    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    for name, st in sorted(get_cuda_rng_tracker().get_states().items()):
        h.update(name.encode() + st.numpy().tobytes())
    return h.hexdigest()


def _save_and_continue(rank, world, layout, directory, size=SIZE):
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout)
    recs = train(size, layout, SAVE_AT, state=state)
    save_checkpoint(directory, state, SAVE_AT, layout.describe())
    rng = _rng_digest()
    recs += train(size, layout, TOTAL - SAVE_AT, state=state, start_step=SAVE_AT)
    return [r.lm_loss for r in recs], rng


def _resume(rank, world, layout, directory, size=SIZE, load_rng=True, with_rng=False):
    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout, seed=999)  # different weights: the checkpoint must replace them
    if with_rng:  # and different RNG states
        import torch
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(999)
        model_parallel_cuda_manual_seed(999)
    before = _rng_digest()
    try:
        it = load_checkpoint(directory, state, load_rng=load_rng)
    except CheckpointError as exc:
        return ("CheckpointError", str(exc))
    rng = (before, _rng_digest())
    losses = [r.lm_loss for r in train(size, layout, TOTAL - it, state=state, start_step=it)]
    return (losses, rng) if with_rng else losses


def iteration_dir(save_dir, iteration=SAVE_AT):
    """The ``iter_<n>`` directory save_checkpoint published under ``save_dir``."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def reseal(ckpt_dir):
    """Record the checksums of ``ckpt_dir``'s files as they are now (for tests that tamper with
    a checkpoint on purpose and need it to reach the loader behind the integrity check)."""
    import pickle

    from megatron_metp.megatron.checkpoint_integrity import write_manifest

    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own checkpoint: trusted here
    for rank in range(json.load(open(os.path.join(ckpt_dir, "metp_checkpoint.json")))["world_size"]):
        write_manifest(ckpt_dir, md, rank)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The save directory, rank 0's losses of the uninterrupted run and every rank's RNG digest
    at the save."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "save")
    out = run_ranks(_save_and_continue, 4, Layout(metp=2, tp=2), directory, timeout=300)
    return directory, out[0][0], [rng for _, rng in out]


def test_resume_same_layout_is_bit_exact(saved):
    directory, uninterrupted, rng_at_save = saved
    out = run_ranks(_resume, 4, Layout(metp=2, tp=2), directory, with_rng=True, timeout=300)
    assert out[0][0] == uninterrupted[SAVE_AT:]
    # every rank's RNG states come back (the tiny model draws no random numbers after step 2, so
    # the losses alone would not show it); the tensor-parallel ranks' tracker states differ
    before, after = zip(*(rng for _, rng in out))
    assert list(after) == rng_at_save and len(set(rng_at_save)) > 1
    assert not set(before) & set(rng_at_save)


@pytest.mark.parametrize("world,layout", [(4, Layout(metp=4)), (4, Layout(tp=4, mode="tp")),
                                          (1, Layout()), (4, Layout(metp=4, vocab_parallel=True))],
                         ids=["metp4", "stock-tp4", "single", "metp4-vocab"])
def test_resume_in_another_layout_continues_the_loss_curve(saved, world, layout):
    directory, uninterrupted, _ = saved
    resumed = run_ranks(_resume, world, layout, directory, SIZE, False, timeout=300)[0]
    assert len(resumed) == TOTAL - SAVE_AT
    for got, ref in zip(resumed, uninterrupted[SAVE_AT:]):
        assert abs(got - ref) <= 1e-6 * ref, (resumed, uninterrupted)


@pytest.mark.parametrize("world,layout,tied", [
    (2, Layout(metp=2, vocab_parallel=True), False),
    (4, Layout(metp=2, pp=2, vocab_parallel=True), True),
], ids=["metp2", "metp2xpp2-tied"])
def test_vocab_parallel_checkpoint_resumes_exactly_and_as_stock_tp(tmp_path, world, layout, tied):
    """Saved with the vocabulary sharded over METP: resumes bit-exactly in the same layout and
    continues the loss curve as stock TP (embedding/output keys and global shapes are Megatron's;
    with PP and tied embeddings the last stage's copy is saved as a replica of the embedding)."""
    size = GPTSize(**{**SIZE.__dict__, "tie_embeddings": tied})
    directory = str(tmp_path / "vocab")
    uninterrupted = run_ranks(_save_and_continue, world, layout, directory, size,
                              timeout=300)[0][0]
    same = run_ranks(_resume, world, layout, directory, size, timeout=300)[0]
    assert same == uninterrupted[SAVE_AT:]
    stock = run_ranks(_resume, 2, Layout(tp=2, mode="tp"), directory, size, False, timeout=300)[0]
    for got, ref in zip(stock, uninterrupted[SAVE_AT:]):
        assert abs(got - ref) <= 1e-6 * ref, (stock, uninterrupted)


def test_mismatched_model_is_refused_with_reason(saved):
    directory = saved[0]
    wider = GPTSize(**{**SIZE.__dict__, "hidden_size": 32})
    out = run_ranks(_resume, 2, Layout(metp=2), directory, wider, False)[0]
    assert out[0] == "CheckpointError" and "geometry" in out[1], out


def test_incomplete_or_missing_checkpoint_is_refused(saved, tmp_path):
    directory = saved[0]
    assert sorted(os.listdir(directory)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    broken = tmp_path / "broken"
    shutil.copytree(iteration_dir(directory), broken)
    os.unlink(broken / "metp_checkpoint.json")  # all but the metadata: an interrupted save
    out = run_ranks(_resume, 2, Layout(metp=2), str(broken))[0]
    assert out[0] == "CheckpointError" and "not a complete" in out[1], out
    out = run_ranks(_resume, 2, Layout(metp=2), str(tmp_path / "nowhere"))[0]
    assert out[0] == "CheckpointError" and "does not exist" in out[1], out
    out = run_ranks(_resume, 2, Layout(metp=2), directory)[0]  # 4 ranks' RNG states, 2 ranks
    assert out[0] == "CheckpointError" and "load_rng=False" in out[1], out


def test_truncated_shard_file_is_refused(saved, tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(iteration_dir(saved[0]), broken)
    shard = broken / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = run_ranks(_resume, 2, Layout(metp=2), str(broken), SIZE, False)[0]
    assert out[0] == "CheckpointError" and str(shard) in out[1] and "truncated" in out[1], out


def _save_distopt(rank, world, directory):
    from megatron_metp.megatron import cpu

    cpu.enable()
    layout = Layout(metp=2, distributed_optimizer=True)
    init_parallel(layout, SIZE.seq_length)
    state = setup(SIZE, layout)
    train(SIZE, layout, 1, state=state)
    try:
        save_checkpoint(directory, state, 1)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_distributed_optimizer_state_is_refused_clearly(tmp_path):
    msg = run_ranks(_save_distopt, 4, str(tmp_path / "d"), timeout=300)[0]
    assert msg is not None and "distributed optimizer" in msg


class _Planted:
    """A pickle payload that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dotted_global_payload(marker: str) -> bytes:
    """Protocol-4 pickle calling ``os.open(marker, O_WRONLY | O_CREAT)``, reached as the dotted
    name ``os.open`` inside ``torch.distributed.checkpoint.filesystem`` (a module whose classes
    the metadata check allows): an allow-list by module alone would let it through."""
    import pickle

    def short(s: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()

    flags = os.O_WRONLY | os.O_CREAT
    return (pickle.PROTO + b"\x04" + short("torch.distributed.checkpoint.filesystem")
            + short("os.open") + pickle.STACK_GLOBAL + short(marker) + pickle.BININT
            + flags.to_bytes(4, "little") + pickle.TUPLE2 + pickle.REDUCE + pickle.STOP)


@pytest.mark.parametrize("payload", ["object", "dotted-global"])
def test_planted_object_in_metadata_is_refused_without_running_it(saved, tmp_path, payload):
    import pickle

    evil = tmp_path / "evil"
    shutil.copytree(iteration_dir(saved[0]), evil)
    marker = tmp_path / "pwned"
    (evil / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))) if payload == "object"
                                     else _dotted_global_payload(str(marker)))
    out = run_ranks(_resume, 2, Layout(metp=2), str(evil), SIZE, False)[0]
    assert not marker.exists(), "the planted object ran"
    assert out[0] == "CheckpointError" and "refusing to load" in out[1], out


def _plant_in_shard_file(directory, payload: bytes) -> str:
    """Replace the bytes of one ``_extra_state`` byte object in a ``.distcp`` file by ``payload``
    (appended to the file; ``.metadata`` points there). Every rank of any layout reads it: the
    extra states are replicated. Returns the object's key."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md_path = os.path.join(directory, ".metadata")
    with open(md_path, "rb") as f:
        md = pickle.load(f)  # our own checkpoint: trusted here
    key = next(k for k, v in md.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and "linear_fc1._extra_state" in k)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    shard = os.path.join(directory, info.relative_path)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(payload)
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    return key


# megatron-core 0.19 writes no common.pt (its common state is an object in rank 0's shard)
@pytest.mark.parametrize("where", ["distcp"] + [n for n in WHOLE_FILES if n == "common.pt"])
def test_planted_object_in_shard_or_common_file_is_refused_without_running_it(
        saved, tmp_path, monkeypatch, where):
    """torch's checkpoint reader unpickles byte objects with ``weights_only=False`` and Megatron
    reads ``common.pt`` with torch's default, which this variable (inherited by the forked ranks)
    turns into a full unpickle: both would create the marker without the safe readers."""
    import io

    import torch

    evil = tmp_path / "evil"
    shutil.copytree(iteration_dir(saved[0]), evil)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save([_Planted(str(marker))], buf)  # as Megatron packs a ShardedObject
    if where == "distcp":
        what = _plant_in_shard_file(str(evil), buf.getvalue())
    else:
        (evil / "common.pt").write_bytes(buf.getvalue())
        what = "common.pt"
    reseal(str(evil))  # checksums that match the planted bytes: the safe reader must refuse them
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    out = run_ranks(_resume, 2, Layout(metp=2), str(evil), SIZE, False)[0]
    assert not marker.exists(), "the planted object ran"
    assert out[0] == "CheckpointError" and "refusing to load" in out[1] and what in out[1], out
