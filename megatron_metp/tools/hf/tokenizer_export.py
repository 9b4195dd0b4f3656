"""The tokenizer files ``hf export`` writes beside the weights.

:func:`plan_tokenizer` picks the folder whose Hugging Face tokenizer files are copied, first of:

1. ``--tokenizer DIR`` (``export_hf(tokenizer=...)``), given explicitly;
2. the run's own tokenizer, from the Megatron-LM arguments the checkpoint saved:
   ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` with ``DIR`` a folder here
   (Megatron-LM tokenizes with ``AutoTokenizer.from_pretrained(DIR)``: the same files give
   ``AutoTokenizer.from_pretrained(export)`` the same tokens);
3. the import's folder (``LOAD/hf/``, where ``hf import`` keeps the source's tokenizer files) or
   ``--hf-config``'s folder.

When none has one (a run with ``NullTokenizer``, ``GPT2BPETokenizer``, a SentencePiece or
TikToken model: no Hugging Face files; a hub name that is not a folder here) the export still
writes the weights and prints one line saying so and how to add them. A folder is a Hugging Face
tokenizer when it holds ``tokenizer_config.json`` and a vocabulary file (``tokenizer.json``,
``tokenizer.model``, ``vocab.json``, ``vocab.txt`` or ``spiece.model``), as
``tokenizer.save_pretrained`` writes them. Its token ids must fit the exported model's
vocabulary (checked from ``tokenizer.json`` / ``vocab.json`` / ``vocab.txt`` before anything is
written): a tokenizer with more tokens than the model has rows is another model's, refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

from .config import HFConfigError

__all__ = ["TOKENIZER_FILES", "TokenizerPlan", "plan_tokenizer", "tokenizer_files"]

#: the files of a Hugging Face tokenizer folder that are copied (those present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class TokenizerPlan:
    """``source``: the folder to copy ``files`` from (``None``: no tokenizer is written);
    ``line``: what the export prints about it."""
    source: Optional[str]
    files: List[str] = field(default_factory=list)
    line: str = ""


def tokenizer_files(folder: Optional[str]) -> List[str]:
    """The tokenizer files of ``folder`` to copy; empty unless it is a Hugging Face tokenizer
    folder (``tokenizer_config.json`` and a vocabulary file)."""
    if not folder or not os.path.isdir(folder):
        return []
    have = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    if "tokenizer_config.json" not in have or not any(n in have for n in _VOCAB_FILES):
        return []
    return have


def _max_token_id(folder: str, files: List[str]) -> Optional[tuple]:
    """(largest token id, the file it is read from), or ``None`` where no file says (a
    SentencePiece model only)."""
    try:
        if "tokenizer.json" in files:
            path = os.path.join(folder, "tokenizer.json")
            with open(path) as f:
                tok = json.load(f)
            vocab = (tok.get("model") or {}).get("vocab")
            ids = list(vocab.values()) if isinstance(vocab, dict) else \
                list(range(len(vocab))) if isinstance(vocab, list) else []
            ids += [a["id"] for a in tok.get("added_tokens") or [] if "id" in a]
        elif "vocab.json" in files:
            path = os.path.join(folder, "vocab.json")
            with open(path) as f:
                ids = list(json.load(f).values())
        elif "vocab.txt" in files:
            path = os.path.join(folder, "vocab.txt")
            with open(path, encoding="utf-8") as f:
                ids = list(range(sum(1 for _ in f)))
        else:
            return None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise HFConfigError(f"{path}: not a readable tokenizer file ({exc}); copy the "
                            f"tokenizer folder again") from None
    ints = [i for i in ids if isinstance(i, int)]
    return (max(ints), path) if ints else None


def _run_tokenizer(saved: Optional[dict]):
    """(folder, why not): the run's Hugging Face tokenizer folder from its saved arguments,
    else ``None`` and the reason."""
    if saved is None:
        return None, "the checkpoint holds no saved Megatron-LM arguments"
    kind = saved.get("tokenizer_type")
    if kind != "HuggingFaceTokenizer":
        return None, (f"the run's --tokenizer-type {kind} has no Hugging Face tokenizer files"
                      if kind else "the run's saved arguments name no --tokenizer-type")
    model = saved.get("tokenizer_model")
    if not model:
        return None, "the run's --tokenizer-model is not in its saved arguments"
    if not os.path.isdir(model):
        return None, (f"the run's --tokenizer-model {model!r} is not a folder here (a hub name, "
                      f"or a folder moved since the run)")
    if not tokenizer_files(model):
        return None, (f"the run's --tokenizer-model {model!r} lacks tokenizer_config.json or a "
                      f"vocabulary file")
    return model, ""


def plan_tokenizer(saved: Optional[dict], cfg_dir: Optional[str], tokenizer: Optional[str],
                   vocab_size: int, out_dir: str) -> TokenizerPlan:
    """Which tokenizer files the export of a model with ``vocab_size`` rows writes to
    ``out_dir`` (module docstring); refuses a ``tokenizer`` folder that is not one and a
    tokenizer whose ids do not fit the model. Reads only small JSON files; writes nothing."""
    if tokenizer is not None:
        files = tokenizer_files(tokenizer)
        if not files:
            raise HFConfigError(f"--tokenizer {tokenizer!r}: not a Hugging Face tokenizer folder "
                                f"(it needs tokenizer_config.json and one of "
                                f"{', '.join(_VOCAB_FILES)}, as tokenizer.save_pretrained "
                                f"writes them)")
        source, what = tokenizer, f"--tokenizer {tokenizer}"
    else:
        source, why = _run_tokenizer(saved)
        what = f"the run's --tokenizer-model {source}"
        if source is None and tokenizer_files(cfg_dir):
            source, what = cfg_dir, f"the Hugging Face folder {cfg_dir} ({why})"
        if source is None:
            return TokenizerPlan(None, [], (
                f"no tokenizer written: {why}; AutoTokenizer.from_pretrained({out_dir!r}) will "
                f"fail until a tokenizer folder's files (tokenizer.save_pretrained) are copied "
                f"there, or export again with --tokenizer DIR"))
        files = tokenizer_files(source)
    top = _max_token_id(source, files)
    if top is not None and top[0] >= vocab_size:
        raise HFConfigError(f"{top[1]}: the tokenizer ({what}) has token ids up to {top[0]}, the "
                            f"model's vocabulary has {vocab_size} rows: it is another model's "
                            f"tokenizer; pass --tokenizer with this model's")
    extra = ""
    if saved is not None and saved.get("special_tokens") and source != tokenizer:
        extra = (f" (the run also added --special-tokens {saved['special_tokens']}, which "
                 f"these files do not hold)")
    return TokenizerPlan(source, files, f"tokenizer: {', '.join(files)} from {what}{extra}")
