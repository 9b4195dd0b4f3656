"""Checkpoints move between METP and stock TP layouts and resume with nothing lost."""

import os
import shutil

import pytest

from megatron_metp.megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, setup, train
from tests.harness import run_ranks

SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
               vocab_size=64, seq_length=16, swiglu=True)
SAVE_AT, TOTAL = 2, 5


def _save_and_continue(rank, world, layout, directory):
    from megatron_metp import cpu

    cpu.enable()
    init_parallel(layout, SIZE.seq_length)
    state = setup(SIZE, layout)
    recs = train(SIZE, layout, SAVE_AT, state=state)
    save_checkpoint(directory, state, SAVE_AT, layout.describe())
    recs += train(SIZE, layout, TOTAL - SAVE_AT, state=state, start_step=SAVE_AT)
    return [r.lm_loss for r in recs]


def _resume(rank, world, layout, directory, size=SIZE, load_rng=True):
    from megatron_metp import cpu

    cpu.enable()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout, seed=999)  # different weights: the checkpoint must replace them
    try:
        it = load_checkpoint(directory, state, load_rng=load_rng)
    except CheckpointError as exc:
        return ("CheckpointError", str(exc))
    return [r.lm_loss for r in train(size, layout, TOTAL - it, state=state, start_step=it)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt") / "iter2")
    losses = run_ranks(_save_and_continue, 4, Layout(metp=2, tp=2), directory, timeout=300)[0]
    return directory, losses


def test_resume_same_layout_is_bit_exact(saved):
    directory, uninterrupted = saved
    resumed = run_ranks(_resume, 4, Layout(metp=2, tp=2), directory, timeout=300)[0]
    assert resumed == uninterrupted[SAVE_AT:]


@pytest.mark.parametrize("world,layout", [(4, Layout(metp=4)), (4, Layout(tp=4, mode="tp")),
                                          (1, Layout())], ids=["metp4", "stock-tp4", "single"])
def test_resume_in_another_layout_continues_the_loss_curve(saved, world, layout):
    directory, uninterrupted = saved
    resumed = run_ranks(_resume, world, layout, directory, SIZE, False, timeout=300)[0]
    assert len(resumed) == TOTAL - SAVE_AT
    for got, ref in zip(resumed, uninterrupted[SAVE_AT:]):
        assert abs(got - ref) <= 1e-6 * ref, (resumed, uninterrupted)


def test_mismatched_model_is_refused_with_reason(saved):
    directory, _ = saved
    wider = GPTSize(**{**SIZE.__dict__, "hidden_size": 32})
    out = run_ranks(_resume, 2, Layout(metp=2), directory, wider, False)[0]
    assert out[0] == "CheckpointError" and "geometry" in out[1], out


def test_incomplete_or_missing_checkpoint_is_refused(saved, tmp_path):
    directory, _ = saved
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(directory):  # copy all but the metadata: an interrupted save
        if name != "metp_checkpoint.json":
            shutil.copy(os.path.join(directory, name), broken / name)
    out = run_ranks(_resume, 2, Layout(metp=2), str(broken))[0]
    assert out[0] == "CheckpointError" and "not a complete" in out[1], out
    out = run_ranks(_resume, 2, Layout(metp=2), str(tmp_path / "nowhere"))[0]
    assert out[0] == "CheckpointError" and "does not exist" in out[1], out


def test_truncated_shard_file_is_refused(saved, tmp_path):
    directory, _ = saved
    broken = tmp_path / "truncated"
    broken.mkdir()
    for name in os.listdir(directory):
        data = open(os.path.join(directory, name), "rb").read()
        (broken / name).write_bytes(data[: len(data) // 2] if name.endswith(".distcp") else data)
    out = run_ranks(_resume, 2, Layout(metp=2), str(broken))[0]
    assert out[0] == "CheckpointError", out


def _save_distopt(rank, world, directory):
    from megatron_metp import cpu

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


def test_planted_object_in_metadata_is_refused_without_running_it(saved, tmp_path):
    import pickle

    directory, _ = saved
    evil = tmp_path / "evil"
    shutil.copytree(directory, evil)
    marker = tmp_path / "pwned"
    (evil / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    out = run_ranks(_resume, 2, Layout(metp=2), str(evil))[0]
    assert out[0] == "CheckpointError" and "refusing to load" in out[1], out
    assert not marker.exists()
