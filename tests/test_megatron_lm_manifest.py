"""The checkpoint manifest of Megatron-LM saves (megatron_metp.megatron_lm.ckpt_manifest) on
folders built here, and the patch that publishes it. Through real Megatron-LM saves and loads:
the manifest section of tests/test_megatron_lm_train.py (it reuses that file's saved runs)."""

import argparse
import hashlib
import json
import os
import re

import pytest

from megatron_metp.megatron_lm import ckpt_manifest as cm
from megatron_metp.megatron_lm import preflight

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST_PATCHES = {tag: os.path.join(REPO, "patches", tag, "0002-metp-checkpoint-manifest.patch")
                    for tag in ("core_v0.16.1", "core_v0.19.0")}


def _iteration(load, it, files, manifest=True):
    d = os.path.join(load, cm.iteration_name(it))
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as fh:
            fh.write(data)
    if manifest:
        cm.publish_checkpoint_manifest(load, it)
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(it))
    return d


FILES = {"__0_0.distcp": bytes(range(256)) * 700, "__1_0.distcp": b"\x01" * 150_000,
         ".metadata": b"meta", "common.pt": b"c" * 999, "sub/model_optim_rng.pt": b"x" * 77}


def test_manifest_lists_every_file_with_its_sha256(tmp_path, capsys):
    d = _iteration(str(tmp_path), 4, FILES)
    assert "sha256 of 5 files" in capsys.readouterr().out
    with open(os.path.join(d, cm.MANIFEST)) as fh:
        doc = json.load(fh)
    assert doc["hash"] == "sha256" and doc["iteration"] == 4
    assert doc["files"] == {rel: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                            for rel, data in FILES.items()}
    # nothing but the files and the manifest: no temporary file left behind
    assert sorted(os.listdir(d)) == sorted({r.split("/")[0] for r in FILES} | {cm.MANIFEST})
    assert cm.verify_iteration(d) == ("ok", [])


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "is truncated: 100000 bytes, the manifest says 150000"),
    ("delete", "is missing (the manifest lists it, 150000 bytes)"),
    ("flip", "has altered contents (sha256 "),
    ("grow", "is longer than saved: 150001 bytes"),
])
def test_each_damage_is_named_with_the_newest_intact_iteration(tmp_path, damage, needle):
    load = str(tmp_path)
    _iteration(load, 1, FILES)
    _iteration(load, 2, FILES, manifest=False)  # saved before the manifest: skipped, named
    d = _iteration(load, 3, FILES)
    victim = os.path.join(d, "__1_0.distcp")
    if damage == "truncate":
        os.truncate(victim, 100_000)
    elif damage == "delete":
        os.remove(victim)
    elif damage == "flip":
        with open(victim, "r+b") as fh:
            fh.seek(123_457)
            b = fh.read(1)[0]
            fh.seek(123_457)
            fh.write(bytes([b ^ 0x10]))
    else:
        with open(victim, "ab") as fh:
            fh.write(b"\0")
    out = cm.load_problems(load)
    assert len(out) == 1 and f"{victim} {needle}" in out[0], out
    assert "the newest intact iteration is 1" in out[0]
    assert "--ckpt-step 1" in out[0] and "latest_checkpointed_iteration.txt" in out[0]
    # the preflight's checkpoint check says the same; --ckpt-step 1 loads
    args = preflight.parse_megatron_args(["--load", load], world_size=2)
    assert preflight.checkpoint_problems(args) == out
    args = preflight.parse_megatron_args(["--load", load, "--ckpt-step", "1"], world_size=2)
    notes = []
    assert preflight.checkpoint_problems(args, notes) == []
    assert notes == [f"--load {load}: iter_0000001 verified against its manifest"]
    # the ranks: every rank checks every size, and one rank (its share) each digest
    per_rank = [cm.load_problems(load, rank=r, world=3) for r in range(3)]
    named = [r for r in range(3) if per_rank[r]]
    assert len(named) == (1 if damage == "flip" else 3), per_rank
    assert all(victim in per_rank[r][0] and needle in per_rank[r][0] for r in named)


def test_no_older_intact_iteration_and_an_unreadable_manifest_are_said(tmp_path, capsys):
    load = str(tmp_path)
    _iteration(load, 1, FILES, manifest=False)
    d = _iteration(load, 2, FILES)
    os.remove(os.path.join(d, "common.pt"))
    (out,) = cm.load_problems(load)
    assert "no older iteration verifies; iter_0000001 has no manifest (unverified)" in out
    assert "--ckpt-step 1 loads it at your own risk" in out
    with open(os.path.join(d, cm.MANIFEST), "w") as fh:
        fh.write("{not json")
    (out,) = cm.load_problems(load)
    assert f"{os.path.join(d, cm.MANIFEST)} is unreadable (JSONDecodeError" in out
    # by hand: python -m megatron_metp.megatron_lm.ckpt_manifest LOAD [--ckpt-step N]
    assert cm.main([load]) == 1 and cm.main([load, "--ckpt-step", "1"]) == 0
    assert "is unreadable" in capsys.readouterr().err


def test_a_checkpoint_without_manifest_loads_with_the_unverified_line(tmp_path, capsys,
                                                                      monkeypatch):
    load = str(tmp_path)
    _iteration(load, 5, FILES, manifest=False)
    notes = []
    assert cm.load_problems(load, notes=notes) == []
    assert notes == [f"--load {load}: iter_0000005 has no checkpoint manifest (metp_manifest.json; "
                     f"saved before megatron-metp wrote one, or by an unpatched Megatron-LM): it "
                     f"loads as before, unverified"]
    # inside the ranks: rank 0 prints it, once per args
    args = argparse.Namespace(load=load, rank=0, world_size=2)
    assert cm.rank_checkpoint_problems(args) == [] and cm.rank_checkpoint_problems(args) == []
    assert capsys.readouterr().out.count("unverified") == 1
    assert vars(args) == {"load": load, "rank": 0, "world_size": 2}  # Megatron saves its args
    # a checkout that would save without the manifest is said at the start (rank 0)
    monkeypatch.setattr(cm, "_checkout_publishes", lambda: False)
    cm.rank_checkpoint_problems(argparse.Namespace(load=None, save=load, rank=0, world_size=2))
    assert "0002-metp-checkpoint-manifest.patch is not applied" in capsys.readouterr().out
    monkeypatch.setattr(cm, "_checkout_publishes", lambda: True)
    cm.rank_checkpoint_problems(argparse.Namespace(load=None, save=load, rank=0, world_size=2))
    assert capsys.readouterr().out == ""
    # nothing to check: no --load, a first run's empty --save directory
    assert cm.load_problems(None) == [] and cm.load_problems(str(tmp_path / "none")) == []


def test_shares_split_the_bytes_and_cover_every_file_once():
    sizes = {f"f{i}": s for i, s in enumerate([100, 90, 80, 10, 10, 5, 5, 1])}
    parts = cm.shares(sizes, 3)
    assert sorted(sum(parts, [])) == sorted(sizes)
    loads = [sum(sizes[f] for f in p) for p in parts]
    assert max(loads) - min(loads) <= 10, loads
    assert cm.shares(sizes, 3) == parts  # the same on every rank


def test_a_save_to_object_storage_is_said_and_a_vanished_file_fails_the_save(tmp_path, capsys,
                                                                              monkeypatch):
    assert cm.publish_checkpoint_manifest("msc://bucket/ckpt", 3) == ""
    assert "no checkpoint manifest for msc://bucket/ckpt/iter_0000003" in capsys.readouterr().out
    # a shard gone between the listing and the hash: the error propagates (Megatron's tracker
    # step then stops before the tracker is written) and no manifest is left behind
    d = os.path.join(str(tmp_path), "iter_0000003")
    os.makedirs(d)
    listed = cm.list_files
    monkeypatch.setattr(cm, "list_files", lambda folder: listed(folder) + ["__9_0.distcp"])
    with pytest.raises(FileNotFoundError, match="__9_0.distcp"):
        cm.publish_checkpoint_manifest(str(tmp_path), 3)
    assert os.listdir(d) == []


@pytest.mark.parametrize("tag", sorted(MANIFEST_PATCHES))
def test_the_manifest_patch_calls_only_the_hook_before_the_tracker_write(tag):
    from tests.test_megatron_lm import _foreign_calls, _hunks

    with open(MANIFEST_PATCHES[tag]) as fh:
        text = fh.read()
    from megatron_metp.megatron_lm import releases

    assert releases.by_tag(tag).commit in text
    assert _foreign_calls(text) == []
    (hunk,) = _hunks(text)
    assert hunk.file == "megatron/training/checkpointing.py"
    added = [i for i, ln in enumerate(hunk.lines) if ln[0] == "+"]
    assert len(added) == 3 and all(ln[0] in " +" for ln in hunk.lines)
    call = next(i for i in added if "publish_checkpoint_manifest(save_dir" in hunk.lines[i])
    tracker_write = next(i for i, ln in enumerate(hunk.lines)
                         if re.search(r"open\w*\(tracker_filename, 'w'\)", ln))
    assert call < tracker_write  # published before the tracker moves


def test_the_optimizer_layout_check_reads_the_ckpt_step_iteration(tmp_path):
    """--ckpt-step N: the saved args the resume check reads are iteration N's, as Megatron-LM
    then loads N whatever the tracker says."""
    import torch

    from megatron_metp.megatron_lm.resume import resume_layout_problems

    load = str(tmp_path)
    for it, dist in ((3, False), (6, True)):
        d = os.path.join(load, cm.iteration_name(it))
        os.makedirs(d)
        torch.save({"args": argparse.Namespace(metp_parallel_size=2,
                                               use_distributed_optimizer=dist)},
                   os.path.join(d, "common.pt"))
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("6")
    plain = dict(load=load, metp_parallel_size=2, use_distributed_optimizer=False)
    (out,) = resume_layout_problems(argparse.Namespace(**plain))
    assert "iter_0000006 holds the distributed optimizer's" in out
    assert resume_layout_problems(argparse.Namespace(**plain, ckpt_step=3)) == []
