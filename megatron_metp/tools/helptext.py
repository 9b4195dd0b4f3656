"""Plain text for the ``metp`` commands' ``--help``: the module docstrings are written for Sphinx
(````x````, ``:func:`x```, ``::`` before a literal block); :func:`plain` turns such text into what a
terminal shows, and :data:`FAMILY_NAMES` names every Hugging Face family ``metp hf`` converts, in
one place (``tests/test_help.py`` checks it against :data:`.hf.families.FAMILIES` and scans every
subcommand's ``--help`` for markup). Imports nothing heavy: ``metp --help`` stays fast."""

from __future__ import annotations

import re

#: ``model_type`` of config.json → the family's name as users know it (every family that converts)
FAMILY_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2.5", "qwen3": "Qwen3",
                "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "glm4_moe": "GLM-4.5",
                "gpt_oss": "gpt-oss", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3",
                "mixtral": "Mixtral"}
#: the families, as the help texts list them
FAMILIES_TEXT = ", ".join(list(FAMILY_NAMES.values())[:-1]) + " and " + \
    list(FAMILY_NAMES.values())[-1]

_ROLE = re.compile(r":(?:func|mod|class|data|meth|attr|obj|exc|ref|doc):`~?\.?([^`<]*?)"
                   r"(?: <[^>]*>)?`")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ````x```` → ``x``, ``:func:`.a.b``` → ``a.b``
    (a leading ``.`` or ``~`` dropped), a paragraph's closing ``text::`` → ``text:`` and
    ``text ::`` → ``text``, a lone ``::`` line dropped."""
    text = _ROLE.sub(lambda m: m.group(1), text)
    text = text.replace("``", "")
    text = re.sub(r"(?m)^\s*::\s*$\n?", "", text)
    text = re.sub(r"[ \t]+::(?=\s|$)", "", text)
    return re.sub(r"(?<=\S)::(?=\s|$)", ":", text)


#: ``metp hf``'s description
HF_DESCRIPTION = (f"Hugging Face checkpoints of the families {FAMILIES_TEXT} in and out of "
                  f"Megatron/METP torch_dist checkpoints (docs/huggingface.md).")
