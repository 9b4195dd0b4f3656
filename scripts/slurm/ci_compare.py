"""The Slurm leg's comparisons of Megatron-LM logs (scripts/slurm/ci_test.sh); each exits non-zero
with the mismatch named.

    python scripts/slurm/ci_compare.py twins METP_LOG TWIN_LOG ITERS
        lm loss at iterations 1..ITERS in both logs, within 1e-5 relative (as
        scripts/compare_tp.sh and tests/test_megatron_lm_train.py ask of a METP job and its
        stock-TP twin)
    python scripts/slurm/ci_compare.py resumed REF_LOG LOG FIRST LAST
        LOG (a job resumed from iteration FIRST - 1) printed iterations FIRST..LAST and nothing
        else; each one's lm loss and grad norm, compared as printed strings, equal the
        uninterrupted REF_LOG's. Megatron-LM's log quirk (docs/megatron-lm.md): a run's second
        iteration prints the mean lm loss of its first two (its accumulator is not reset after
        the first), so at FIRST + 1 the grad norm strings must be equal and the lm loss the mean
        of REF's two within the printed precision.
    python scripts/slurm/ci_compare.py checkpoints REF_ITER_DIR ITER_DIR
        every tensor of the two torch_dist checkpoints (weights, Adam moments) is identical, bit
        for bit (as tests/test_megatron_lm_train.py compares resumes; the saved RNG state is not
        a tensor of it: docs/megatron-lm.md)
"""

from __future__ import annotations

import os
import re
import sys
from typing import Dict, Tuple

_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\blm loss: (\S+) \|.*?\bgrad norm: (\S+) \|")


def printed(path: str) -> Dict[int, Tuple[str, str]]:
    """``{iteration: (lm loss, grad norm)}`` as Megatron-LM printed them (strings)."""
    with open(path, errors="replace") as fh:
        return {int(m.group(1)): (m.group(2), m.group(3)) for m in _LINE.finditer(fh.read())}


def twins(metp_log: str, twin_log: str, iters: int) -> str:
    from megatron_metp.tools.compare import loss_rel_diffs, parse_log

    runs = {}
    for name, path in (("metp", metp_log), ("twin", twin_log)):
        with open(path, errors="replace") as fh:
            runs[name] = parse_log(fh.read())
        got = sorted(i.iteration for i in runs[name].iterations if i.lm_loss is not None)
        if got != list(range(1, iters + 1)):
            raise SystemExit(f"{name} ({path}): lm loss at iterations {got}, expected 1..{iters}")
    diffs = loss_rel_diffs(runs)
    worst = max(diffs.values())
    if worst > 1e-5:
        bad = sorted(k for k, d in diffs.items() if d > 1e-5)
        raise SystemExit(f"lm loss differs by more than 1e-5 at iterations {bad} "
                         f"({metp_log} against {twin_log})")
    return f"lm loss equal at {len(diffs)} iterations (max rel. diff {worst:.1e})"


def resumed(ref_log: str, log: str, first: int, last: int) -> str:
    ref, got = printed(ref_log), printed(log)
    if sorted(got) != list(range(first, last + 1)):
        raise SystemExit(f"{log}: iterations {sorted(got)} printed, expected {first}..{last}")
    lines = []
    for k in range(first, last + 1):
        if k not in ref:
            raise SystemExit(f"{ref_log} printed no iteration {k}")
        (loss, norm), (ref_loss, ref_norm) = got[k], ref[k]
        if k == first + 1:  # the log quirk: the mean of this run's first two iterations
            mean = (float(ref[k - 1][0]) + float(ref_loss)) / 2
            same = norm == ref_norm and abs(float(loss) - mean) <= 1e-6 * abs(mean)
            lines.append(f"iteration {k}: grad norm {norm} = {ref_norm}; lm loss {loss} printed "
                         f"as the mean of iterations {k - 1} and {k} ({mean:.6E})")
        else:
            same = (loss, norm) == (ref_loss, ref_norm)
            lines.append(f"iteration {k}: lm loss {loss} = {ref_loss}, grad norm {norm} = "
                         f"{ref_norm}")
        if not same:
            raise SystemExit(f"iteration {k}: resumed lm loss {loss} grad norm {norm}, "
                             f"uninterrupted {ref_loss} / {ref_norm} ({log} against {ref_log})")
    return "\n".join(lines)


def checkpoints(ref_dir: str, other_dir: str) -> str:
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, d in enumerate((ref_dir, other_dir)):
            dcp_to_torch_save(d, os.path.join(tmp, f"{i}.pt"))
            sds.append(torch.load(os.path.join(tmp, f"{i}.pt"), weights_only=False))
    a, b = sds
    if set(a) != set(b):
        raise SystemExit(f"{other_dir} and {ref_dir} hold different keys: {set(a) ^ set(b)}")
    tensors = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor))
    differ = [k for k in tensors if not torch.equal(a[k], b[k])]
    if differ or len(tensors) < 10:
        raise SystemExit(f"{other_dir} differs from {ref_dir} in {differ or 'no tensors'}")
    return f"{len(tensors)} tensors (weights, Adam moments) identical bit for bit"


def main(argv) -> int:
    commands = {"twins": (twins, (str, str, int)), "resumed": (resumed, (str, str, int, int)),
                "checkpoints": (checkpoints, (str, str))}
    if not argv or argv[0] not in commands or len(argv) - 1 != len(commands[argv[0]][1]):
        print(__doc__, file=sys.stderr)
        return 2
    fn, types = commands[argv[0]]
    print(fn(*(t(a) for t, a in zip(types, argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
