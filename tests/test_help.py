"""Every ``metp`` subcommand's ``--help`` is plain text (no reStructuredText / Sphinx markup) and
the Hugging Face ones name every family that converts (issue 39, Deliver 6)."""

import re

import pytest

from megatron_metp.tools import cli, hf
from megatron_metp.tools.hf import families as hf_families
from megatron_metp.tools.helptext import FAMILY_NAMES, plain

#: every ``metp`` command line whose ``--help`` a user reads
COMMANDS = [[], ["plan"], ["measure"], ["hf"], ["hf", "import"], ["hf", "export"], ["hf", "flags"]]
#: what Sphinx markup looks like in a help text
MARKUP = re.compile(r"``|:(?:func|mod|class|data|meth|attr|obj|exc|ref|doc):`|^\s*::\s*$"
                    r"|::(?=\s|$)", re.M)


def markup(text):
    """The markup found in ``text`` (empty when plain)."""
    return [m.group(0) for m in MARKUP.finditer(text)]


def missing_families(text):
    """The family names ``text`` does not name (whitespace folded: argparse wraps lines)."""
    flat = " ".join(text.split())
    return [n for n in FAMILY_NAMES.values() if not re.search(rf"\b{re.escape(n)}(?![\w-])", flat)]


def _help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_subcommand_help_is_plain_text(capsys):
    for argv in COMMANDS:
        text = _help(argv, capsys)
        assert text.startswith("usage: metp"), argv
        assert markup(text) == [], (argv, markup(text))


def test_hf_helps_name_every_family(capsys):
    for argv in ([], ["hf"]):
        assert missing_families(_help(argv, capsys)) == [], argv
    # one list of names, the families the converter takes
    assert set(FAMILY_NAMES) == set(hf_families.FAMILIES)


def test_negative_controls_catch_markup_and_a_missing_family():
    """The docstrings the help texts came from (raw) are caught; the old ``metp hf`` line naming
    Llama only is caught; plain() of them passes."""
    for doc in (cli.__doc__.split("\n\n")[0], hf.__doc__.split("\n\n")[0], cli._Plan.__doc__):
        assert markup(doc), doc
        assert markup(plain(doc)) == [], plain(doc)
    assert markup("see ::\n\n    code") and markup("text::")
    assert markup(plain("see ::\n\n    code\ntext::")) == []
    old = "Hugging Face Llama checkpoints in and out: metp hf {import,export,flags}"
    assert missing_families(old) == ["Mistral", "Qwen2.5", "Qwen3", "Qwen3-MoE", "Qwen2-MoE",
                                     "GLM-4.5", "gpt-oss", "DeepSeek-V2", "DeepSeek-V3",
                                     "Mixtral"]
    # Qwen3 is not named by Qwen3-MoE alone
    assert missing_families("Llama, Mistral, Qwen2.5, Qwen3-MoE, Qwen2-MoE, GLM-4.5, gpt-oss, "
                            "DeepSeek-V2, DeepSeek-V3, Mixtral") == ["Qwen3"]


def test_the_python_m_entry_points_helps_are_plain_text(capsys):
    """The demo (README: ``python -m megatron_metp.demo --help`` lists the sizes) and the
    agreement table's entry point, whose descriptions are their module docstrings."""
    from megatron_metp.tools import agreement, demo

    for main in (demo.main, agreement.main):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith("usage:") and markup(text) == [], (main, markup(text))
