"""Megatron-LM's indexed datasets as the launcher's preflight sees them: the ``.idx`` header
and how ``--split`` cuts each ``--data-path`` prefix, without numpy arrays or megatron-core.

The ``.idx`` file of a prefix (written by Megatron-LM's ``tools/preprocess_data.py`` through
``megatron.core.datasets.indexed_dataset``; the same layout in core_v0.16.1 and core_v0.19.0),
all integers little-endian::

    offset  size   field
    0       9      magic b"MMIDIDX\\x00\\x00"
    9       8      version, uint64 (1)
    17      1      token dtype code, uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                   6 float64, 7 float32, 8 uint16)
    18      8      sequence count S, uint64
    26      8      document-index count D, uint64 (D - 1 documents: the index starts with 0)
    34      4 S    sequence lengths, int32 (tokens)
    ..      8 S    sequence byte offsets into the .bin file, int64
    ..      8 D    document index, int64 (the sequence number where each document ends)
    ..      S      sequence modes, int8 (multimodal datasets only)

The ``.bin`` file holds the tokens of every sequence back to back in the dtype above.

The split (``--split 949,50,1``): the weights are normalised to fractions ``f_i`` with
cumulative bounds ``[a_i, b_i)``; a split with weight 0 is not built; otherwise a GPT dataset
takes the sequences ``round(a_i·S) .. round(b_i·S)`` of each prefix (GPT datasets split by
sequence, which for ``preprocess_data.py`` without ``--split-sentences`` is one per document).
A built split that gets no sequence makes Megatron's dataset builder loop forever (it adds
epochs until the requested tokens are reached, and an empty split adds none).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["INDEX_MAGIC", "IndexHeader", "read_index_header", "parse_blend", "parse_split",
           "split_ranges", "write_indexed_dataset", "SPLIT_NAMES"]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
#: dtype code -> (struct format, bytes per token)
_DTYPES = {1: ("B", 1), 2: ("b", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 6: ("d", 8),
           7: ("f", 4), 8: ("H", 2)}
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class IndexHeader:
    """The fixed-size header of a ``.idx`` file."""
    version: int
    dtype_code: int
    sequences: int
    documents: int  # documents in the prefix (the document index has one entry more)


def read_index_header(idx_path: str) -> IndexHeader:
    """The header of ``idx_path``; ``ValueError`` saying what is wrong when it is not a
    Megatron-LM index (wrong magic, version, dtype code, or shorter than its header says)."""
    with open(idx_path, "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx_path} is not a Megatron-LM index file (it does not start with "
                         f"{INDEX_MAGIC!r})")
    version, code, sequences, doc_index = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise ValueError(f"{idx_path}: index version {version}, Megatron-LM reads version 1")
    if code not in _DTYPES:
        raise ValueError(f"{idx_path}: unknown token dtype code {code}")
    need = 34 + 12 * sequences + 8 * doc_index
    if os.path.getsize(idx_path) < need:
        raise ValueError(f"{idx_path} is truncated ({os.path.getsize(idx_path)} bytes, its "
                         f"header announces {need})")
    return IndexHeader(version, code, sequences, max(doc_index - 1, 0))


def parse_blend(words: Sequence[str]) -> List[Tuple[Optional[float], str]]:
    """``--data-path`` words as ``(weight or None, prefix)`` pairs, as Megatron-LM reads them:
    an even number of words whose every other word is a number are weight/prefix pairs, anything
    else a list of prefixes."""
    words = list(words)
    if words and len(words) % 2 == 0:
        try:
            weights = [float(w) for w in words[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            return list(zip(weights, words[1::2]))
    return [(None, w) for w in words]


def parse_split(text: str) -> List[float]:
    """``--split`` as three fractions summing to 1 (missing trailing weights are 0; the numbers
    are read as Megatron-LM reads them); ``ValueError`` for more than three or an all-zero
    split."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", text)]
    if len(weights) > 3:
        raise ValueError(f"--split {text}: at most three weights (train, valid, test)")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--split {text}: the weights sum to 0")
    return [w / total for w in weights]


def split_ranges(fractions: Sequence[float], sequences: int) -> List[Optional[Tuple[int, int]]]:
    """The ``[begin, end)`` sequence range of each split of a prefix with ``sequences``
    sequences, ``None`` for a split of weight 0 (not built)."""
    out: List[Optional[Tuple[int, int]]] = []
    lo = 0.0
    for f in fractions:
        hi = lo + f
        out.append(None if f <= 0 else (int(round(lo * sequences)), int(round(hi * sequences))))
        lo = hi
    return out


def write_indexed_dataset(prefix: str, documents: Sequence[Sequence[int]],
                          dtype_code: int = 8) -> None:
    """Write ``prefix.bin`` / ``prefix.idx`` holding ``documents`` (token ids), one sequence per
    document, in the layout above (tests and tiny examples; Megatron-LM's
    ``tools/preprocess_data.py`` writes real ones)."""
    fmt, size = _DTYPES[dtype_code]
    offsets, pos = [], 0
    with open(prefix + ".bin", "wb") as fh:
        for doc in documents:
            fh.write(struct.pack(f"<{len(doc)}{fmt}", *doc))
            offsets.append(pos)
            pos += len(doc) * size
    n = len(documents)
    with open(prefix + ".idx", "wb") as fh:
        fh.write(INDEX_MAGIC + struct.pack("<QBQQ", 1, dtype_code, n, n + 1))
        fh.write(struct.pack(f"<{n}i", *(len(d) for d in documents)))
        fh.write(struct.pack(f"<{n}q", *offsets))
        fh.write(struct.pack(f"<{n + 1}q", *range(n + 1)))
