"""A model's training recipe as its ``configs/models/<name>.sh`` gives it: the ``MOE_ARGS``
array (``--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001``, ...), the one
home of the flags the plan does not model. A launch line or a written config of the plan takes the
plan's own MoE flags and adds every other flag of this recipe (:func:`merge_recipe`), so the job
trains with the model's load-balancing loss."""

from __future__ import annotations

import re
import shlex
from typing import Dict, List, Optional, Tuple

from .config import read_config

Group = Tuple[str, List[str]]


def groups(argv: List[str]) -> List[Group]:
    """``["--a", "1", "--b"]`` → ``[("--a", ["1"]), ("--b", [])]``: each ``--flag`` with the
    values that follow it."""
    out: List[Group] = []
    for a in argv:
        if a.startswith("--"):
            out.append((a, []))
        elif out:
            out[-1][1].append(a)
        else:
            raise ValueError(f"recipe: value {a!r} before any --flag")
    return out


def _expand(text: str, values: Dict[str, object]) -> str:
    def sub(m: "re.Match[str]") -> str:
        name = (m.group(1) or m.group(2)).lower()
        if name not in values:
            raise ValueError(f"recipe: ${name.upper()} is not set in the model file")
        v = values[name]
        return str(int(v) if isinstance(v, bool) else v)

    return re.sub(r'\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)', sub, text)


def recipe_flags(path: Optional[str]) -> List[str]:
    """The ``pretrain_gpt.py`` flags of the model file's ``MOE_ARGS`` array, its variables
    expanded from the file's own defaults; ``[]`` without a file or without ``MOE_ARGS``."""
    if path is None:
        return []
    kv = read_config(path)
    raw = kv.get("moe_args")
    if not raw:
        return []
    text = str(raw).strip()
    if not (text.startswith("(") and text.endswith(")")):
        raise ValueError(f"{path}: MOE_ARGS is not a bash array: {text!r}")
    return shlex.split(_expand(text[1:-1], kv))


def merge_recipe(plan: List[str], recipe: List[str]) -> List[str]:
    """The plan's flags, then each flag of ``recipe`` the plan does not set itself (with the
    recipe's values)."""
    have = {flag for flag, _ in groups(plan)}
    out = list(plan)
    for flag, vals in groups(recipe):
        if flag not in have:
            out += [flag, *vals]
    return out


__all__ = ["groups", "merge_recipe", "recipe_flags"]
