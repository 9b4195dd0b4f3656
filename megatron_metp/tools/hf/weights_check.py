"""The safetensors of a Hugging Face checkpoint checked on the way in, before ``hf import`` writes
anything.

:func:`read_checked_safetensors` reads ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names, and refuses, naming the file, the tensor and the fix:

* a file too short for its own header, a header that is not the JSON object the format
  defines, a tensor whose byte range disagrees with its dtype and shape, or overlaps another,
  or lies past the end of the file (**truncated**, **garbled**); the header is parsed here,
  before the ``safetensors`` library reads the file, so its own errors (which name no file)
  are not what the user sees;
* an index whose ``weight_map`` is not a map of tensor names to shard files in the folder, a
  tensor the index places in a shard that does not hold it, a shard tensor the index does not
  list, a tensor held by two shards;
* a tensor that ``config.json`` implies and no file holds (**missing**), one no file of this
  family holds (**unexpected**), a **shape** other than ``config.json`` implies, a **dtype**
  that is not a float type the import converts (float32, bfloat16, float16), tensors of mixed
  dtypes, or tensors of a dtype other than ``config.json``'s ``torch_dtype`` / ``dtype`` (when
  it states one);
* **non-finite values** (NaN, ±Inf) in any tensor, counted, with the first index.

All header checks run on every file before any tensor data is read; the values are then checked
file by file as they are loaded. Cost: one ``aminmax`` pass over the data on top of reading
it (docs/huggingface.md, "Weights checked on the way in", gives the measured figures).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .config import HFConfigError, LlamaGeometry

__all__ = ["SafetensorsHeader", "read_header", "checkpoint_files", "check_headers",
           "read_checked_safetensors", "FLOAT_DTYPES"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: safetensors dtype code -> bytes per element (the format's list)
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
#: the float dtypes the import converts: safetensors code -> torch / config.json name
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
#: larger than any real header (the format itself caps it at 100 MB)
_MAX_HEADER = 100_000_000
_REDOWNLOAD = ("re-download or re-copy the file, or re-save the model with "
               "save_pretrained(..., safe_serialization=True)")


@dataclass(frozen=True)
class SafetensorsHeader:
    """One file's parsed header: ``tensors`` maps name -> (dtype code, shape, (begin, end))."""
    path: str
    tensors: Dict[str, Tuple[str, Tuple[int, ...], Tuple[int, int]]]


def _garbled(path: str, what: str) -> HFConfigError:
    return HFConfigError(f"{path}: not a readable safetensors file ({what}); the file is "
                         f"truncated or garbled: {_REDOWNLOAD}")


def read_header(path: str) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file ``path`` against its size: an 8-byte
    little-endian header length, that many bytes of JSON, then the tensor bytes, which the
    tensors' ``data_offsets`` must tile exactly (as the format requires)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _garbled(path, f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise _garbled(path, f"its first 8 bytes give a header of {n} bytes, the file holds "
                                 f"{size - 8} after them")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _garbled(path, f"its {n}-byte header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _garbled(path, "its header is not a JSON object")
    data = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (isinstance(dtype, str) and isinstance(shape, list) and
                  all(isinstance(d, int) and d >= 0 for d in shape) and
                  isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise _garbled(path, f"tensor {name}: header entry {entry!r} is not "
                                 f"{{dtype, shape, data_offsets}}")
        if dtype not in _ITEM_BYTES:
            raise _garbled(path, f"tensor {name}: unknown dtype {dtype!r}")
        want = math.prod(shape) * _ITEM_BYTES[dtype]
        if end - begin != want:
            raise _garbled(path, f"tensor {name}: {dtype} {shape} is {want} bytes, its "
                                 f"data_offsets span {end - begin}")
        tensors[name] = (dtype, tuple(shape), (begin, end))
    at = 0  # the byte ranges tile [0, data) in order, as the format requires
    for name, (_, _, (begin, end)) in sorted(tensors.items(), key=lambda kv: kv[1][2]):
        if begin != at:
            raise _garbled(path, f"tensor {name} starts at data byte {begin}, expected {at} "
                                 f"(overlapping or gapped data_offsets)")
        at = end
    if at > data:
        last = max(tensors, key=lambda k: tensors[k][2][1])
        raise HFConfigError(f"{path}: truncated: its header places tensor {last} up to data "
                            f"byte {at}, the file holds {data} bytes of tensor data "
                            f"({at - data} missing): {_REDOWNLOAD}")
    if at < data:
        raise _garbled(path, f"{data - at} bytes after the last tensor's data")
    return SafetensorsHeader(path, tensors)


def checkpoint_files(hf_dir: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files of ``hf_dir`` (sorted, full paths) and the index's ``weight_map``
    (tensor -> file name; ``None`` for a single ``model.safetensors``). The index is checked:
    a JSON object whose ``weight_map`` maps names to file names in ``hf_dir`` that exist."""
    index = os.path.join(hf_dir, INDEX)
    single = os.path.join(hf_dir, SINGLE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wmap = json.load(f).get("weight_map")
        except (UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise HFConfigError(f"{index}: not a JSON object with a weight_map ({exc}); restore "
                                f"the index file as save_pretrained wrote it") from None
        if not isinstance(wmap, dict) or not wmap:
            raise HFConfigError(f"{index}: weight_map is {'empty' if wmap == {} else 'missing'}"
                                f"; restore the index file as save_pretrained wrote it")
        bad = [(k, v) for k, v in wmap.items() if not isinstance(v, str) or not v or
               os.path.basename(v) != v or v in (".", "..")]
        if bad:
            raise HFConfigError(f"{index}: tensor {bad[0][0]} maps to {bad[0][1]!r}, not a file "
                                f"name in the folder; restore the index file")
        files = sorted(set(wmap.values()))
        for name in files:
            if not os.path.isfile(os.path.join(hf_dir, name)):
                owners = [k for k, v in wmap.items() if v == name]
                raise HFConfigError(f"{os.path.join(hf_dir, name)}, the shard {INDEX} names for "
                                    f"tensor {owners[0]} (and {len(owners) - 1} more), is "
                                    f"missing: copy every shard of the checkpoint")
        return [os.path.join(hf_dir, n) for n in files], wmap
    if os.path.isfile(single):
        return [single], None
    bins = [n for n in os.listdir(hf_dir) if n.endswith(".bin")]
    hint = (" (it holds PyTorch .bin files: re-save with save_pretrained(..., "
            "safe_serialization=True))" if bins else "")
    raise HFConfigError(f"{hf_dir!r} has neither model.safetensors nor "
                        f"model.safetensors.index.json{hint}")


#: buffers older Hugging Face Llama checkpoints carry that hold no weights (recomputed)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _config_dtype(cfg: dict) -> Optional[str]:
    from .config import DTYPES

    stated = cfg.get("torch_dtype", cfg.get("dtype"))
    return DTYPES.get(stated) if isinstance(stated, str) else None


def check_headers(hf_dir: str, g: LlamaGeometry, cfg: dict) -> Dict[str, Tuple[str, str]]:
    """Check every header (and the index) against each other and against what ``config.json``
    implies (the geometry ``g`` and its stated dtype); returns tensor -> (file, float dtype
    name) of the tensors to read. No tensor data is read."""
    from .layout import hf_names, unexpected_hint

    files, wmap = checkpoint_files(hf_dir)
    config = os.path.join(hf_dir, "config.json")
    where: Dict[str, Tuple[str, str, Tuple[int, ...]]] = {}  # name -> (file, dtype code, shape)
    for path in files:
        for name, (dtype, shape, _) in read_header(path).tensors.items():
            if name in where:
                raise HFConfigError(f"tensor {name} is in both {where[name][0]} and {path}: "
                                    f"keep one copy (re-save the model)")
            where[name] = (path, dtype, shape)
    if wmap is not None:
        index = os.path.join(hf_dir, INDEX)
        for name, shard in sorted(wmap.items()):
            if name not in where:
                raise HFConfigError(f"{index} places tensor {name} in "
                                    f"{os.path.join(hf_dir, shard)}, which does not hold it "
                                    f"(no shard does): the shard is from another checkpoint or "
                                    f"the index is stale; copy the checkpoint's own files")
            if os.path.basename(where[name][0]) != shard:
                raise HFConfigError(f"{index} places tensor {name} in {shard}, but "
                                    f"{where[name][0]} holds it: the index is stale; restore "
                                    f"the checkpoint's own index")
        extra = sorted(set(where) - set(wmap))
        if extra:
            raise HFConfigError(f"{where[extra[0]][0]} holds tensor {extra[0]} (and "
                                f"{len(extra) - 1} more) that {index} does not list: the index "
                                f"is stale; restore the checkpoint's own index")
    want = hf_names(g)
    names = {k for k in where if not k.endswith(_IGNORED_SUFFIXES)}
    if g.tie_embeddings and "lm_head.weight" in names:
        names.discard("lm_head.weight")  # a tied model may store its table twice (compared later)
    missing = sorted(set(want) - names)
    if missing:
        hint = (" (config.json says tie_word_embeddings = false but the checkpoint has no "
                "lm_head.weight: set it to true if the head shares the embedding)"
                if missing == ["lm_head.weight"] else
                ": is config.json the checkpoint's own, and are all its files there?")
        raise HFConfigError(f"tensor {missing[0]} (and {len(missing) - 1} more: {missing[1:6]}) "
                            f"is missing from {', '.join(files)}; {config} implies it{hint}")
    unexpected = sorted(names - set(want))
    if unexpected:
        k = unexpected[0]
        hint = unexpected_hint(unexpected, g, ": is config.json the checkpoint's own?")
        raise HFConfigError(f"{where[k][0]} holds tensor {k} (and {len(unexpected) - 1} more: "
                            f"{unexpected[1:6]}) that a {g.family} of {config} does not "
                            f"have{hint}")
    for k in sorted(want):
        path, dtype, shape = where[k]
        if shape != tuple(want[k]):
            raise HFConfigError(f"{path}: tensor {k} has shape {list(shape)}, {config} implies "
                                f"{list(want[k])}: is config.json the checkpoint's own?")
    read = sorted(want) + (["lm_head.weight"] if g.tie_embeddings and "lm_head.weight" in where
                           else [])
    for k in read:
        path, dtype, _ = where[k]
        if dtype not in FLOAT_DTYPES:
            raise HFConfigError(f"{path}: tensor {k} is {dtype}; the import converts float32, "
                                f"bfloat16 or float16 weights (a quantized checkpoint: convert "
                                f"the original, unquantized one)")
    from .moe_layout import FP32_BUFFERS

    read = [k for k in read if not k.endswith(FP32_BUFFERS)] + \
        [k for k in read if k.endswith(FP32_BUFFERS)]  # any float dtype (kept fp32)
    first = where[read[0]]
    for k in read:
        if where[k][1] != first[1] and not k.endswith(FP32_BUFFERS):
            raise HFConfigError(f"{where[k][0]}: tensor {k} is {FLOAT_DTYPES[where[k][1]]}, "
                                f"{first[0]}'s {read[0]} is {FLOAT_DTYPES[first[1]]}: the "
                                f"checkpoint mixes dtypes; cast every tensor to one dtype first")
    stated = _config_dtype(cfg)
    if stated is not None and stated != FLOAT_DTYPES[first[1]]:
        raise HFConfigError(f"{first[0]}: tensor {read[0]} (like every tensor) is "
                            f"{FLOAT_DTYPES[first[1]]}, {config} says torch_dtype {stated}: set "
                            f"torch_dtype (transformers 5: dtype) to "
                            f"{FLOAT_DTYPES[first[1]]!r} if the tensors are right, or cast them")
    return {k: (where[k][0], FLOAT_DTYPES[where[k][1]]) for k in read}


def _nonfinite(name: str, t: torch.Tensor) -> Optional[str]:
    """``None`` if every value of ``t`` is finite, else what is not. The test is one
    ``aminmax`` pass (NaN propagates into both, an infinity is the min or the max; no mask is
    allocated: about 30x faster than ``isfinite(t).all()`` on CPU); the mask is built only to
    describe a tensor that fails."""
    if t.numel() == 0 or all(bool(torch.isfinite(x)) for x in torch.aminmax(t)):
        return None
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    first = [int(i) for i in torch.nonzero(bad)[0]]
    kinds = [w for w, m in (("NaN", torch.isnan(t)), ("+Inf", t == math.inf),
                            ("-Inf", t == -math.inf)) if bool(m.any())]
    return (f"tensor {name} holds {count} non-finite value(s) ({', '.join(kinds)}; the first "
            f"at index {first} of {list(t.shape)})")


def read_checked_safetensors(hf_dir: str, g: LlamaGeometry, cfg: dict) -> Dict[str, torch.Tensor]:
    """The tensors the geometry ``g`` needs from ``hf_dir``, every check of the module
    docstring passed (:class:`~.config.HFConfigError` naming file, tensor and fix
    otherwise)."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise HFConfigError("the Hugging Face converter needs the safetensors package: "
                            "pip install safetensors") from exc
    plan = check_headers(hf_dir, g, cfg)
    by_file: Dict[str, List[str]] = {}
    for name, (path, _) in plan.items():
        by_file.setdefault(path, []).append(name)
    out: Dict[str, torch.Tensor] = {}
    for path in sorted(by_file):
        problems = []
        try:
            with safe_open(path, framework="pt") as f:
                for name in sorted(by_file[path]):
                    out[name] = t = f.get_tensor(name)
                    p = _nonfinite(name, t)
                    if p:
                        problems.append(p)
        except HFConfigError:
            raise
        except Exception as exc:  # the header checked out: a read error of the file itself
            raise HFConfigError(f"{path}: reading its tensors failed ({type(exc).__name__}: "
                                f"{exc}): {_REDOWNLOAD}") from None
        if problems:
            raise HFConfigError(f"{path}: " + "; ".join(problems[:6]) +
                                (f"; and {len(problems) - 6} more tensors" if len(problems) > 6
                                 else "") +
                                ": either the file is corrupt (re-download or re-copy it) or "
                                "the model diverged (convert an earlier checkpoint)")
    return out
