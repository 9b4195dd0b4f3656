"""``hf import`` checks the weights on the way in (:mod:`megatron_metp.tools.hf.weights_check`):
non-finite values, truncated or garbled safetensors files, a stale or broken index, missing or
unexpected tensors, shapes and dtypes other than config.json implies are each refused naming
the file, the tensor (where there is one) and the fix, and no output folder is created or left
behind (:mod:`megatron_metp.tools.hf.output`). Negative control: the intact files, single and
sharded, import (and to the same checkpoint)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf import convert
from megatron_metp.tools.hf.config import HFConfigError
from megatron_metp.tools.hf.weights_check import read_header
from tests.harness import run_ranks
from tests.test_hf import _import_on_a_rank

#: a tiny untied Llama (embed_tokens: 64 x 16 fp32 = 4,096 bytes)
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            tie_word_embeddings=False)
ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
EMB = "model.embed_tokens.weight"
UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """``single``: config.json + model.safetensors; ``sharded``: the same model saved in shards
    with an index (transformers' own save_pretrained)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hfw")
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**TINY, dtype="float32")).float()
    single, sharded = str(root / "single"), str(root / "sharded")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="10KB")
    assert os.path.isfile(os.path.join(sharded, INDEX))
    return dict(single=single, sharded=sharded)


def _copy(src: str, tmp_path) -> str:
    dst = str(tmp_path / "hf")
    shutil.copytree(src, dst)
    return dst


def _tensors(hf_dir: str, name: str = ST) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, name))


def _save(hf_dir: str, tensors: dict, name: str = ST) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(hf_dir, name),
              metadata={"format": "pt"})


def _refused(hf_dir: str, tmp_path, *fragments: str) -> str:
    """``import`` of ``hf_dir`` raises naming every fragment, and writes nothing: no output
    folder and no staging folder beside it."""
    out = str(tmp_path / "out")
    with pytest.raises(HFConfigError) as e:
        H.import_hf(hf_dir, out, make_vocab_size_divisible_by=1, log=lambda _m: None)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out")]
    return msg


# ---------------------------------------------------------------- negative control

def test_intact_single_and_sharded_files_import_alike(hf_dirs, tmp_path):
    outs = {}
    for kind, src in hf_dirs.items():
        outs[kind] = str(tmp_path / kind)
        run_ranks(_import_on_a_rank, 1, src, outs[kind], {"make_vocab_size_divisible_by": 1})
        assert sorted(os.listdir(tmp_path / kind)) == sorted(
            ["hf", "latest_checkpointed_iteration.txt", "megatron_args.txt", "metp_hf.json",
             "model.sh", "release"])
    stray = os.path.join(outs["sharded"], "stray")  # --force replaces the whole folder
    open(stray, "w").close()
    run_ranks(_import_on_a_rank, 1, hf_dirs["sharded"], outs["sharded"],
              {"make_vocab_size_divisible_by": 1, "force": True})
    assert not os.path.exists(stray) and os.path.isdir(os.path.join(outs["sharded"], "release"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left
    a, b = (H.read_checkpoint_tensors(H.checkpoint_dir(outs[k])) for k in ("single", "sharded"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    src = _tensors(hf_dirs["single"])
    assert torch.equal(a["embedding.word_embeddings.weight"], src[EMB])


# ---------------------------------------------------------------- values

def test_nan_bytes_are_refused(hf_dirs, tmp_path):
    """The issue's case: 1,000 bytes of 0xff in the file are 250 float32 NaNs in the embedding."""
    d = _copy(hf_dirs["single"], tmp_path)
    path = os.path.join(d, ST)
    h = read_header(path)
    begin = h.tensors[EMB][2][0]
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    with open(path, "r+b") as f:
        f.seek(8 + n + begin + 400)
        f.write(b"\xff" * 1000)
    _refused(d, tmp_path, path, f"tensor {EMB} holds 250 non-finite value(s) (NaN;",
             "first at index [6, 4]", "re-download", "convert an earlier checkpoint")


def test_an_infinity_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    t = _tensors(d)
    t[UP][3, 5] = -math.inf
    _save(d, t)
    _refused(d, tmp_path, os.path.join(d, ST), f"tensor {UP} holds 1 non-finite value(s) "
             f"(-Inf; the first at index [3, 5] of [32, 16])")


# ---------------------------------------------------------------- the file itself

def test_a_truncated_file_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    path = os.path.join(d, ST)
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    last = max(read_header(os.path.join(hf_dirs["single"], ST)).tensors.items(),
               key=lambda kv: kv[1][2][1])[0]
    _refused(d, tmp_path, f"{path}: truncated", f"tensor {last}", "(100 missing)",
             "re-download")
    os.truncate(path, 5)
    _refused(d, tmp_path, path, "shorter than the 8-byte header length")


def test_a_garbled_header_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    path = os.path.join(d, ST)
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"\x00\xfe garbage \x01")
    _refused(d, tmp_path, path, "header is not JSON", "truncated or garbled", "re-download")
    with open(path, "r+b") as f:
        f.write((10 ** 12).to_bytes(8, "little"))
    _refused(d, tmp_path, path, "header of 1000000000000 bytes")


def test_a_header_whose_offsets_disagree_with_a_shape_is_refused(hf_dirs, tmp_path):
    """Same-length edit of the header: one tensor's shape changed, its byte range not."""
    d = _copy(hf_dirs["single"], tmp_path)
    path = os.path.join(d, ST)
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    entry = json.dumps(json.loads(header)[UP], separators=(",", ":"))
    assert '"shape":[32,16]' in entry and entry in header
    header = header.replace(entry, entry.replace('"shape":[32,16]', '"shape":[32,17]'))
    with open(path, "wb") as f:
        f.write(data[:8] + header.encode() + data[8 + n:])
    _refused(d, tmp_path, path, f"tensor {UP}: F32 [32, 17] is 2176 bytes, its data_offsets "
                                f"span 2048")


# ---------------------------------------------------------------- names, shapes, dtypes

def test_a_missing_tensor_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    t = _tensors(d)
    del t[UP]
    _save(d, t)
    _refused(d, tmp_path, f"tensor {UP} (and 0 more", f"is missing from {os.path.join(d, ST)}",
             os.path.join(d, "config.json"), "are all its files there")


def test_a_shape_other_than_config_json_implies_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    t = _tensors(d)
    t[UP] = torch.zeros(33, 16)
    _save(d, t)
    _refused(d, tmp_path, f"{os.path.join(d, ST)}: tensor {UP} has shape [33, 16]",
             "implies [32, 16]", "config.json the checkpoint's own")


def test_dtypes_are_refused_naming_the_tensor(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    t = _tensors(d)
    _save(d, dict(t, **{UP: t[UP].half()}))
    _refused(d, tmp_path, f"tensor {UP} is float16", "mixes dtypes", "cast every tensor")
    _save(d, dict(t, **{UP: t[UP].to(torch.int8)}))
    _refused(d, tmp_path, f"tensor {UP} is I8", "quantized")
    _save(d, {k: v.bfloat16() for k, v in t.items()})  # config.json still says float32
    _refused(d, tmp_path, "is bfloat16", os.path.join(d, "config.json"),
             "says torch_dtype float32", "set torch_dtype")


# ---------------------------------------------------------------- the index of a sharded save

def _shards(d):
    with open(os.path.join(d, INDEX)) as f:
        return json.load(f)


def test_a_stale_or_broken_index_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["sharded"], tmp_path)
    index = os.path.join(d, INDEX)
    orig = _shards(d)
    wmap = orig["weight_map"]
    a, b = sorted(set(wmap.values()))[:2]
    moved = next(k for k, v in wmap.items() if v == a)
    with open(index, "w") as f:  # a tensor placed in the wrong shard
        json.dump(dict(orig, weight_map=dict(wmap, **{moved: b})), f)
    _refused(d, tmp_path, index, f"places tensor {moved} in {b}", os.path.join(d, a),
             "the index is stale")
    with open(index, "w") as f:  # a shard's tensor not listed
        json.dump(dict(orig, weight_map={k: v for k, v in wmap.items() if k != moved}), f)
    _refused(d, tmp_path, os.path.join(d, a), f"holds tensor {moved}", "does not list")
    with open(index, "w") as f:
        f.write('{"weight_map": {')
    _refused(d, tmp_path, index, "not a JSON object", "restore the index")
    with open(index, "w") as f:
        json.dump(orig, f)
    os.remove(os.path.join(d, a))
    _refused(d, tmp_path, os.path.join(d, a), "is missing", "copy every shard")


def test_a_truncated_shard_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["sharded"], tmp_path)
    shard = os.path.join(d, sorted(set(_shards(d)["weight_map"].values()))[-1])
    os.truncate(shard, os.path.getsize(shard) - 7)
    _refused(d, tmp_path, f"{shard}: truncated", "(7 missing)")


# ---------------------------------------------------------------- nothing written, or all

def test_force_keeps_the_old_output_when_the_input_is_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["single"], tmp_path)
    os.truncate(os.path.join(d, ST), 1000)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old checkpoint")
    with pytest.raises(HFConfigError, match="truncated"):
        H.import_hf(d, str(out), force=True, log=lambda _m: None)
    assert os.listdir(out) == ["keep"]


def test_a_failure_while_writing_leaves_no_output(hf_dirs, tmp_path, monkeypatch):
    def half_written(stage, *args, **kwargs):
        os.makedirs(os.path.join(stage, "release"))
        open(os.path.join(stage, "release", "__0_0.distcp"), "w").close()
        raise OSError("disk full")

    monkeypatch.setattr(convert, "_write_import", half_written)
    out = tmp_path / "deep" / "out"
    with pytest.raises(OSError, match="disk full"):
        H.import_hf(hf_dirs["single"], str(out), make_vocab_size_divisible_by=1,
                    log=lambda _m: None)
    assert os.listdir(tmp_path) == []  # neither out, its staging folder, nor the parent made


def test_the_command_line_prints_the_refusal(hf_dirs, tmp_path, capsys):
    d = _copy(hf_dirs["single"], tmp_path)
    os.truncate(os.path.join(d, ST), 3000)
    assert H.main(["import", "--hf-dir", d, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m megatron_metp.tools.hf import: error: ")
    assert f"{os.path.join(d, ST)}: truncated" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "out")
