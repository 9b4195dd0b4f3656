"""The documented overrides (megatron_metp/runtime/overrides.py): the one place ``METP_*``
environment variables are read. Its table is the table of docs/overrides.md; no other module of
ops/, runtime/, megatron/ reads the environment, and megatron_lm/ writes none of it; the one
integer parser, the flag and choice parsers name the variable (or argument) and the fix."""

import ast
import pathlib
import re

import pytest

from megatron_metp.runtime import overrides as O

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_metp"
#: modules allowed to read the environment besides runtime/overrides.py (none)
PENDING = set()


def _doc_rows(text: str) -> dict:
    body = text.split("<!-- overrides-table -->", 1)[1].split("<!-- /overrides-table -->", 1)[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows[cells[0].strip("`")] = (cells[1].replace("\\|", "|"), cells[2], cells[3])
    return rows


def _code_rows() -> dict:
    return {o.name: (o.kind if o.kind != "choice" else " | ".join(o.choices), o.default,
                     o.meaning) for o in O.OVERRIDES.values()}


def _differences(text: str) -> list:
    doc, code = _doc_rows(text), _code_rows()
    out = [f"{n}: only in the code" for n in code if n not in doc]
    out += [f"{n}: only in the doc" for n in doc if n not in code]
    out += [f"{n}: doc {doc[n]} != code {code[n]}" for n in code if n in doc and doc[n] != code[n]]
    return out


def test_doc_table_is_the_code_table():
    text = (ROOT / "docs" / "overrides.md").read_text()
    assert _differences(text) == []
    assert len(_doc_rows(text)) == len(O.OVERRIDES) >= 20
    # negative controls: a row dropped, a default changed
    dropped = "\n".join(line for line in text.splitlines() if "`METP_TILE_BUDGET_MIB`" not in line)
    assert _differences(dropped) == ["METP_TILE_BUDGET_MIB: only in the code"]
    changed = text.replace("| `METP_OFFLOAD_PREFETCH` | 0/1 | 1 |",
                           "| `METP_OFFLOAD_PREFETCH` | 0/1 | 0 |")
    assert len(_differences(changed)) == 1 and "METP_OFFLOAD_PREFETCH" in _differences(changed)[0]


def _environment_uses(source: str) -> list:
    """Line numbers of ``os.environ`` / ``os.getenv`` uses in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            out.append(node.lineno)
    return out


def _environment_writes(source: str) -> list:
    """Line numbers of ``os.environ[...] = ...``, ``.update``, ``.setdefault``, ``.pop``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Assign):
            target = node.targets[0]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("update", "setdefault", "pop", "__setitem__"):
            target = node.func
        inner = getattr(target, "value", None)
        if isinstance(inner, ast.Attribute) and inner.attr == "environ":
            out.append(node.lineno)
    return out


def test_only_overrides_reads_the_environment_below_megatron_lm():
    found = {}
    for layer in ("runtime", "ops", "megatron"):
        for path in sorted((PKG / layer).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            lines = _environment_uses(path.read_text())
            if lines and rel not in PENDING:
                found[rel] = lines
    assert found == {"megatron_metp/runtime/overrides.py": found.get(
        "megatron_metp/runtime/overrides.py")} and found["megatron_metp/runtime/overrides.py"]
    # negative control: a module that reads a METP_* variable itself is found
    assert _environment_uses('import os\nx = os.environ.get("METP_MLP_TOKEN_TILE")\n') == [2]


def test_megatron_lm_writes_no_environment_and_reads_no_metp_variable():
    writes, reads = {}, {}
    for path in sorted((PKG / "megatron_lm").rglob("*.py")):
        text = path.read_text()
        if _environment_writes(text):
            writes[path.name] = _environment_writes(text)
        if re.search(r"environ(\.get\(|\[)\s*[\"']METP_", text):
            reads[path.name] = True
    assert writes == {} and reads == {}, (writes, reads)
    assert _environment_writes('import os\nos.environ["METP_X"] = "1"\n') == [2]
    assert _environment_writes('import os\nos.environ.update(A="1")\n') == [2]


def test_parsers_name_the_variable_and_the_fix(monkeypatch):
    for name in ("METP_MLP_TOKEN_TILE", "METP_MOE_TOKEN_TILES", "METP_STREAMING_LAYER",
                 "METP_MLP_TILE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    assert O.integer("METP_MLP_TOKEN_TILE") is None
    monkeypatch.setenv("METP_MLP_TOKEN_TILE", " 7 ")
    assert O.integer("METP_MLP_TOKEN_TILE") == 7
    for bad in ("seven", "-1", "1.5"):
        monkeypatch.setenv("METP_MLP_TOKEN_TILE", bad)
        with pytest.raises(ValueError, match=r"the environment variable METP_MLP_TOKEN_TILE must "
                           r"be a non-negative integer \(token rows per tile, 0 = whole\), got "
                           r".*; unset it for the default \(auto\)"):
            O.integer("METP_MLP_TOKEN_TILE")
    monkeypatch.setenv("METP_MOE_TOKEN_TILES", "0")  # int >= 1
    with pytest.raises(ValueError, match="METP_MOE_TOKEN_TILES must be a positive integer"):
        O.integer("METP_MOE_TOKEN_TILES")
    # the argument wins over the variable; bool and str arguments are refused naming it
    monkeypatch.setenv("METP_MOE_TOKEN_TILES", "3")
    assert O.integer_setting(5, "METP_MOE_TOKEN_TILES", "moe_token_tiles") == 5
    assert O.integer_setting(None, "METP_MOE_TOKEN_TILES", "moe_token_tiles") == 3
    for bad in (True, "4", 0, 2.0):
        with pytest.raises(ValueError, match=r"^moe_token_tiles must be a positive integer"):
            O.integer_setting(bad, "METP_MOE_TOKEN_TILES", "moe_token_tiles")
    monkeypatch.delenv("METP_MOE_TOKEN_TILES")
    assert O.integer_setting(None, "METP_MOE_TOKEN_TILES", "moe_token_tiles") is None
    assert O.flag("METP_STREAMING_LAYER") is True  # the default
    monkeypatch.setenv("METP_STREAMING_LAYER", "0")
    assert O.flag("METP_STREAMING_LAYER") is False
    monkeypatch.setenv("METP_STREAMING_LAYER", "yes")
    with pytest.raises(ValueError, match=r"METP_STREAMING_LAYER must be 0 or 1, got "
                       r"METP_STREAMING_LAYER='yes'.*unset it for the default 1"):
        O.flag("METP_STREAMING_LAYER")
    monkeypatch.setenv("METP_MLP_TILE_ORDER", "INNER")
    assert O.choice("METP_MLP_TILE_ORDER") == "inner"
    monkeypatch.setenv("METP_MLP_TILE_ORDER", "sideways")
    with pytest.raises(ValueError, match=r"METP_MLP_TILE_ORDER must be one of \('outer', "
                       r"'inner'\), got METP_MLP_TILE_ORDER='sideways'"):
        O.choice("METP_MLP_TILE_ORDER")
    with pytest.raises(KeyError, match="METP_NOT_A_SETTING is not a documented override"):
        O.raw("METP_NOT_A_SETTING")
