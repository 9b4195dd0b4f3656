"""Is a Megatron-LM checkout patched with *this* version of ``patches/``? (torch-free)

Each file the patch series changes must contain the call the current patches put there
(:data:`PATCHED_FILES`). A checkout patched by an older version of the series lacks the newer
calls: its ``setup_model_and_optimizer`` without ``wire_ddp`` would train METP with
``--overlap-param-gather`` on stale weights, silently. ``scripts/pretrain_gpt.sh`` runs
``python -m megatron_metp.megatron_lm.patch_markers DIR`` before any rank starts, and the dry
run calls :func:`missing`; both name the unchanged files and how to patch again.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

#: files the patches change, and the call each must contain once patched
PATCHED_FILES = {
    "pretrain_gpt.py": "add_metp_args",  # both releases' patches register the flags there
    "megatron/training/arguments.py": "validate_metp_args",
    "megatron/training/initialize.py": "metp_expert_model_parallel_size",
    "megatron/training/training.py": "wire_ddp",
}


def missing(checkout: str) -> List[str]:
    """The files of :data:`PATCHED_FILES` in ``checkout`` without their call (absent files
    count as unpatched)."""
    out = []
    for rel, needle in PATCHED_FILES.items():
        try:
            with open(os.path.join(checkout, rel), encoding="utf-8") as fh:
                if needle in fh.read():
                    continue
        except OSError:
            pass
        out.append(rel)
    return out


def problem(checkout: str) -> Optional[str]:
    """What is wrong with ``checkout`` as a patched Megatron-LM for METP, with the fix; None when
    nothing is."""
    d = os.path.abspath(checkout)
    if not os.path.isfile(os.path.join(d, "pretrain_gpt.py")):
        return f"{d} is not a Megatron-LM checkout (no pretrain_gpt.py)"
    files = missing(d)
    if not files:
        return None
    if len(files) == len(PATCHED_FILES):
        return f"{d} is not patched for METP: run scripts/apply_patches.sh {d}"
    return (f"{d} is not patched for METP by this version of megatron-metp ({', '.join(files)} "
            f"without the calls the current patches add: an older patch): put those files "
            f"back to the release (git -C {d} checkout -- {' '.join(PATCHED_FILES)}) and run "
            f"scripts/apply_patches.sh {d}")


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m megatron_metp.megatron_lm.patch_markers MEGATRON_LM_DIR",
              file=sys.stderr)
        return 2
    msg = problem(args[0])
    if msg:
        print(f"pretrain_gpt.sh: error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
