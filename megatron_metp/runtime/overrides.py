"""The documented overrides: every ``METP_*`` environment variable the package reads, read here.

Settings reach the ops as arguments (a tile through the spec and the modules, a kernel through
``kernel=``); an environment variable only overrides what no argument set, or switches a
process-wide check. :data:`OVERRIDES` is the table of them (``docs/overrides.md`` prints it and
``tests/test_overrides.py`` checks that the two agree); nothing else in ``megatron_metp`` calls
``os.environ.get`` for a ``METP_*`` name, and :func:`raw` refuses a name the table lacks.

The parsers, one of each kind, name the variable (or the argument) and the fix:

* :func:`parse_int` / :func:`integer`: a non-negative or positive integer (tiles, chunks, the
  tile budget); arguments take ``int`` (not ``bool``, not ``str``), variables a decimal string;
  :func:`integer_setting` is the resolvers' one shape, *argument > variable > (the caller's)
  budget*;
* :func:`flag`: ``0`` or ``1``;
* :func:`choice`: one of the entry's choices.

The readers read at each call, as the modules did (a test's ``monkeypatch.setenv`` applies at
once), except where a module caches its switch at import (``METP_CHECK_FINITE``,
``METP_CHECK_AGREEMENT``: switch those with their ``enable_*`` functions in a running process).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["Override", "OVERRIDES", "raw", "is_set", "parse_int", "integer", "integer_setting",
           "flag", "choice", "head_block", "slurm_node_name", "default_nccl_async_error_handling"]


@dataclass(frozen=True)
class Override:
    """One documented variable: ``kind`` is ``int >= 0``, ``int >= 1``, ``0/1``, ``choice``,
    ``seconds`` (a positive finite float) or ``text``; ``default`` what applies when it is unset
    or blank; ``unit`` what an integer counts (in its error message); ``choices`` a choice's
    values (``fold_case``: compared lower-cased)."""

    name: str
    kind: str
    default: str
    meaning: str
    unit: str = ""
    choices: Tuple[str, ...] = ()
    fold_case: bool = False


_ROWS = "token rows per tile, 0 = whole"

#: every ``METP_*`` environment variable the package reads (name -> entry), in the order of
#: ``docs/overrides.md``
OVERRIDES: Dict[str, Override] = {o.name: o for o in (
    Override("METP_MLP_TOKEN_TILE", "int >= 0", "auto",
             "token rows per pass of the METP MLP's weight ring and the streaming layer's row "
             "passes (the op's `token_tile` / the spec's `mlp_token_tile` win)", _ROWS),
    Override("METP_LAYER_TOKEN_TILE", "int >= 0", "auto",
             "tokens per row pass and query tile of the streaming layer op", _ROWS),
    Override("METP_LOSS_TOKEN_TILE", "int >= 0", "auto",
             "token rows per tile of the ring loss's (and ring logits') backward", _ROWS),
    Override("METP_LOSS_TOKEN_CHUNK", "int >= 1", "auto",
             "tokens per chunk of the ring loss (auto: at most 2^28 logits per chunk)",
             "tokens per chunk"),
    Override("METP_MOE_TOKEN_TILES", "int >= 1", "auto",
             "token tiles of every MoE layer's routed part (the spec's `moe_token_tiles` wins)",
             "token tiles per MoE layer, 1 = whole"),
    Override("METP_TILE_BUDGET_MIB", "int >= 1", "1024",
             "bytes (MiB) of token-proportional transient the auto tiles stay within",
             "MiB"),
    Override("METP_MLP_TILE_ORDER", "choice", "outer",
             "the MLP's tiles: the whole ring per tile (outer) or the tiles inside each step",
             choices=("outer", "inner"), fold_case=True),
    Override("METP_HEAD_BLOCK", "text", "auto",
             "head groups per attention block: auto or a divisor of the METP size"),
    Override("METP_ATTENTION_KERNEL", "text", "auto",
             "the K/V ring's block kernel when no `kernel=` is given: auto or a name of "
             "`ops/kernel_choice.KERNELS`"),
    Override("METP_KERNEL_RATES", "text", "unset",
             "a measured rates file (`benchmarks/gpu_check.py`'s `--rates` output, of this GPU) "
             "replacing the published table `ops/kernel_rates.py` in the `auto` kernel choice"),
    Override("METP_ROPE_RECIPE", "choice", "exact",
             "RoPE angles: METP's exact ones or Megatron's fp32 recipe",
             choices=("exact", "megatron")),
    Override("METP_STREAMING_LAYER", "0/1", "1",
             "full recompute of one layer runs the streaming layer op (0: Megatron's "
             "checkpoint over the separate ops)"),
    Override("METP_LOSS_GRAD_INTO_HIDDEN", "0/1", "1",
             "the ring loss writes its input gradient into the final hidden states' storage"),
    Override("METP_OFFLOAD_PREFETCH", "0/1", "1",
             "host offload prefetches the previous layer's group in a layer's backward"),
    Override("METP_ALLOW_CROSS_NODE_RING", "0/1", "0",
             "accept a METP group whose ranks span nodes"),
    Override("METP_CHECK_FINITE", "text", "0",
             "NaN/Inf checks on what enters the METP ops (anything but 0/false: on; read at "
             "import)"),
    Override("METP_CHECK_AGREEMENT", "text", "1",
             "cross-rank agreement check: 1 (scheduled), every (each call) or 0 (off; read at "
             "import)"),
    Override("METP_RING_TIMEOUT_S", "seconds", "600",
             "how long a ring step waits for its peer (under Megatron-LM at most "
             "--distributed-timeout-minutes)"),
    Override("METP_CHECKPOINT_TIMEOUT_S", "seconds", "job timeout",
             "bound of each checkpoint agreement's wait (at most the job timeout)"),
    Override("METP_TEST_STALL_RANK", "text", "unset",
             "test hook: the rank that stops for good in Megatron-LM's loop"),
    Override("METP_TEST_STALL_AT", "text", "unset",
             "test hook: the recorded step label at which that rank stops"),
)}


def _entry(name: str) -> Override:
    try:
        return OVERRIDES[name]
    except KeyError:
        raise KeyError(f"{name} is not a documented override (add it to "
                       f"megatron_metp.runtime.overrides.OVERRIDES and docs/overrides.md)") \
            from None


def raw(name: str) -> Optional[str]:
    """The variable's value, stripped; ``None`` when unset or blank (a documented name only)."""
    _entry(name)
    value = os.environ.get(name, "").strip()
    return value or None


def is_set(name: str) -> bool:
    """Whether the variable is set to something other than blanks."""
    return raw(name) is not None


def parse_int(value, what: str, *, minimum: int = 0, unit: str = "", fix: str = "") -> int:
    """``value`` as an integer ``>= minimum`` (0: non-negative, 1: positive), else ``ValueError``
    ``"<what> must be a non-negative|positive integer (<unit>), got <value>"`` and ``fix``.

    An argument is an ``int`` (``bool`` and ``str`` are refused); a variable's text is passed
    as the ``int`` it spells, or as the text when it spells none."""
    kind = "non-negative" if minimum <= 0 else "positive"
    unit_text = f" ({unit})" if unit else ""
    n = None
    if not isinstance(value, bool):
        try:
            n = operator.index(value)
        except TypeError:
            n = None
    if n is None or n < minimum:
        raise ValueError(f"{what} must be a {kind} integer{unit_text}, got {value!r}"
                         + (f"; {fix}" if fix else ""))
    return n


def integer(name: str) -> Optional[int]:
    """An ``int >= 0`` / ``int >= 1`` variable (``None`` when unset), parsed by
    :func:`parse_int` (the error names the variable)."""
    entry = _entry(name)
    text = raw(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = text
    return parse_int(value, f"the environment variable {name}",
                     minimum=1 if entry.kind == "int >= 1" else 0, unit=entry.unit,
                     fix=f"unset it for the default ({entry.default})")


def integer_setting(value, name: str, arg: str, unit: Optional[str] = None) -> Optional[int]:
    """The shape every tile and chunk resolver shares: the argument ``value`` (named ``arg`` in
    the error) when it is not ``None``, else the variable ``name`` (:func:`integer`), else
    ``None`` (the caller's auto value from its budget). Both are parsed by :func:`parse_int`
    with the variable's bounds and unit (``unit`` overrides the unit in the message)."""
    entry = _entry(name)
    if value is not None:
        return parse_int(value, arg, minimum=1 if entry.kind == "int >= 1" else 0,
                         unit=entry.unit if unit is None else unit)
    return integer(name)


def flag(name: str) -> bool:
    """A ``0/1`` variable (its default when unset), else ``ValueError`` naming it."""
    entry = _entry(name)
    text = raw(name) or entry.default
    if text not in ("0", "1"):
        raise ValueError(f"the environment variable {name} must be 0 or 1, got {name}={text!r} "
                         f"({entry.meaning}); unset it for the default {entry.default}")
    return text == "1"


def choice(name: str) -> str:
    """A ``choice`` variable (its default when unset), else ``ValueError`` naming it."""
    entry = _entry(name)
    text = raw(name) or entry.default
    if entry.fold_case:
        text = text.lower()
    if text not in entry.choices:
        raise ValueError(f"the environment variable {name} must be one of {entry.choices}, got "
                         f"{name}={text!r} ({entry.meaning}); unset it for the default "
                         f"{entry.default}")
    return text


def head_block() -> str:
    """``METP_HEAD_BLOCK`` as given (``"auto"`` when unset); its value is checked against the
    group size by :func:`megatron_metp.ops.attention.head_block_size`."""
    return raw("METP_HEAD_BLOCK") or "auto"


# Two variables that are not METP overrides but belong to the launcher and torch; read and set
# here so that this module stays the one place below megatron_lm that touches the environment.

def slurm_node_name() -> Optional[str]:
    """Slurm's name of this task's node (``$SLURMD_NODENAME``, set by ``slurmd`` in every task
    of a job step; distinct per node also where several ``slurmd`` share one host), ``None``
    outside Slurm (:func:`megatron_metp.runtime.placement.node_name`)."""
    return os.environ.get("SLURMD_NODENAME", "").strip() or None


def default_nccl_async_error_handling() -> None:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the user set it: NCCL's watchdog then aborts
    a timed-out op's communicators and leaves the error to the rank's main thread, which names
    the stalled rank (``docs/reliability.md``); torch's default (3) kills the process and names
    nobody. Read by each ``ProcessGroupNCCL`` created after the call."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
