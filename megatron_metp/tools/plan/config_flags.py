"""Integer flag values out of a config's ``EXTRA_ARGS`` (read by :mod:`.config` and :mod:`.mla`)."""

from __future__ import annotations

from typing import Dict, List


def flag_values(argv: List[str], flags: Dict[str, str]) -> Dict[str, int]:
    """``{field: N}`` for each of ``flags`` (``--flag N`` or ``--flag=N``, an integer; the last
    occurrence wins) in ``argv`` (a config's ``EXTRA_ARGS`` split); ``ValueError`` naming the
    flag when its value is missing or not an integer."""
    out: Dict[str, int] = {}
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if name not in flags:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            out[flags[name]] = int(value)
        except ValueError:
            raise ValueError(f"{name} {value!r} in the config's EXTRA_ARGS: an integer is "
                             f"needed (e.g. {name} 4096)") from None
    return out
