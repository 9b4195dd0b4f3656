"""Write ``tests/data/hf_configs/<transformers version>/<family>.json``: the ``config.json`` that
the installed transformers' ``save_pretrained`` writes for each tiny model of tests/hf_tiny.py
and of tests/test_hf_moe_families.py and tests/test_hf_deepseek.py.

Run once per environment (the committed files came from transformers 4.57.6 and 5.25.0)::

    PYTHONPATH=. .venv/bin/python tests/data/hf_configs/make_fixtures.py
    PYTHONPATH=. .venv-019/bin/python tests/data/hf_configs/make_fixtures.py
"""

import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))


def _write(out: str, family: str, save) -> None:
    """``out/<family>.json``: the config.json that ``save(tmp_dir)`` writes."""
    tmp = tempfile.mkdtemp()
    try:
        save(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            cfg = json.load(f)
    finally:
        shutil.rmtree(tmp)
    with open(os.path.join(out, f"{family}.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {out}/{family}.json")


def main():
    import transformers

    from tests.hf_tiny import FAMILIES, save_tiny
    # the MoE families of tests/test_hf_moe_families.py (their configs only: random weights)
    from tests.test_hf_moe_families import FAMILIES as MOE_FAMILIES, _make_hf

    out = os.path.join(HERE, transformers.__version__)
    os.makedirs(out, exist_ok=True)
    for family in FAMILIES:
        _write(out, family, lambda tmp: save_tiny(tmp, family))
    for family in MOE_FAMILIES:
        _write(out, family, lambda tmp: _make_hf(tmp, family, seed=0))
    # DeepSeek-V2/V3 of tests/test_hf_deepseek.py (V2 without its query latent in both)
    from tests.test_hf_deepseek import BASE as DEEPSEEK, _make_hf as make_deepseek

    for family, cfg in DEEPSEEK.items():
        _write(out, family, lambda tmp: make_deepseek(tmp, family, seed=0,
                                                      q_lora_rank=cfg["q_lora_rank"]))


if __name__ == "__main__":
    main()
