"""How ``metp plan`` fits its text to a terminal: the units legend, the per-mode table split into
blocks of columns that fit ``width`` (each block repeating the row labels), and the comment lines
wrapped (``# ...`` continues on lines that start with :data:`CONT_HASH`, an indented line on lines
that start with :data:`CONT_SPACE`). ``width=None`` (``metp plan --wide``) keeps one table with
every column and every line whole, as the planner printed before.

:func:`unwrap` joins wrapped lines back (for readers that search the text for one sentence).
"""

from __future__ import annotations

import textwrap
from typing import List, Optional, Sequence

from .model import GiB, MiB

#: the default width of ``metp plan``'s output (columns)
DEFAULT_WIDTH = 100
#: the start of a wrapped ``#`` line's continuation (no line of the planner starts so otherwise)
CONT_HASH = "#" + " " * 6
#: the start of a wrapped indented line's continuation
CONT_SPACE = " " * 8

#: the units every figure of ``metp plan`` is given in (printed under its tables)
LEGEND = ("# units: K = 1,024 tokens (131,072 tokens = 128K); MiB = 2^20 bytes, GiB = 2^30 bytes; "
          "s = seconds; GB/s = 10^9 bytes per second; a device's memory is its datasheet figure "
          "(\"80 GB\") taken as GiB; TFLOP/s = 10^12 FLOP per second; figures per rank (GPU) "
          "unless a line says per node")


def table_lines(rows: Sequence[Sequence[str]], cols: Sequence[str],
                width: Optional[int]) -> List[str]:
    """The table of ``rows`` (label, then one cell per column of ``cols``): one table when
    ``width`` is None or it fits, else blocks of as many columns as fit ``width``, separated by
    a blank line, each with the labels."""
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(str(r[i + 1])) for r in list(rows) + [[""] + list(cols)])
          for i in range(len(cols))]
    groups: List[List[int]] = [[]]
    used = w0
    for i, w in enumerate(ws):
        if width is not None and groups[-1] and used + 3 + w > width:
            groups.append([])
            used = w0
        groups[-1].append(i)
        used += 3 + w
    out: List[str] = []
    for g in groups:
        if out:
            out.append("")
        gw = [ws[i] for i in g]
        out.append(" " * w0 + " | " + " | ".join(cols[i].rjust(ws[i]) for i in g))
        out.append("-" * (w0 + 3 + sum(gw) + 3 * (len(gw) - 1)))
        for r in rows:
            out.append(r[0].ljust(w0) + " | " + " | ".join(str(r[i + 1]).rjust(ws[i])
                                                           for i in g))
    return out


def wrap_lines(lines: Sequence[str], width: Optional[int]) -> List[str]:
    """Each line longer than ``width`` wrapped at spaces: a ``#`` line continues after
    :data:`CONT_HASH`, any other after :data:`CONT_SPACE` (a word longer than a line is left
    whole). ``width=None`` returns the lines as they are."""
    if width is None:
        return list(lines)
    out: List[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        cont = CONT_HASH if line.startswith("#") else CONT_SPACE
        head = line[:len(line) - len(line.lstrip("# "))]
        out += textwrap.wrap(line[len(head):], width=width, initial_indent=head,
                             subsequent_indent=cont, break_long_words=False,
                             break_on_hyphens=False)
    return out


def unwrap(text: str) -> str:
    """``text`` with the lines :func:`wrap_lines` continued joined back, one space at each join;
    the table's column blocks are left as they are."""
    out: List[str] = []
    for line in text.split("\n"):
        if out and out[-1] and (line.startswith(CONT_HASH) or
                                (line.startswith(CONT_SPACE) and " | " not in line
                                 and set(line.strip()) != {"-"})):
            out[-1] += " " + line.lstrip("# ")
        else:
            out.append(line)
    return "\n".join(out)


def fmt_bytes(x: float) -> str:
    """Bytes in one format: two decimals and thousands separators, in GiB from 1 GiB (after
    rounding: never ``1,024.00 MiB``), else in MiB."""
    if abs(round(x / GiB, 2)) >= 1:
        return f"{x / GiB:,.2f} GiB"
    return f"{x / MiB:,.2f} MiB"


def fmt_tokens(s: int) -> str:
    """Tokens in K (1,024) with thousands separators, two decimals when not whole."""
    if s >= 1024 and s % 1024 == 0:
        return f"{s // 1024:,}K"
    if s >= 1024:
        return f"{s / 1024:,.2f}K"
    return f"{s:,}"
