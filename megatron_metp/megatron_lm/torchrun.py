"""torchrun for a job that may be preempted: a SIGTERM ends it the way its ranks end.

    python -m megatron_metp.megatron_lm.torchrun TORCHRUN_ARGS...   # as ``torchrun``

Slurm signals every process of a job step: at the time limit with ``--signal=TERM@N``, on
``scancel --signal=TERM`` and on preemption, torchrun gets the SIGTERM together with its ranks.
Stock torchrun then stops waiting for its ranks, sends them SIGTERM again and exits 1
(``SignalException``), so a job whose ranks save a checkpoint and exit 0 on the signal
(Megatron-LM's ``--exit-signal-handler``) still ends as failed, and ``srun --kill-on-bad-exit``
may kill another node's ranks during their save. Here torchrun leaves SIGTERM to this module
(``--signals-to-handle SIGINT,SIGHUP,SIGQUIT``): the signal is passed on to the ranks (its
direct children; under Slurm they have it already) and torchrun keeps monitoring them, so the
job's exit status is the ranks' — 0 after ``--exit-signal-handler``'s save, non-zero when a
rank dies of the signal (no handler) or fails. SIGINT, SIGHUP and SIGQUIT stay torchrun's own.
A torch whose torchrun lacks ``--signals-to-handle`` runs unchanged (said on stderr).
``scripts/pretrain_gpt.sh`` starts the ranks with it under Slurm.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional, Sequence

#: the signals torchrun keeps handling itself (its default minus SIGTERM)
KEPT = "SIGINT,SIGHUP,SIGQUIT"


def children(pid: int) -> List[int]:
    """The direct children of process ``pid`` (Linux ``/proc``; empty where unreadable)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        out = []
        for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: ppid
                out.append(int(name))
        return out


def _forward(signum, _frame) -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(argv: Optional[Sequence[str]] = None) -> None:
    from torch.distributed import run

    argv = list(sys.argv[1:] if argv is None else argv)
    own = run.get_args_parser()._option_string_actions
    if "--signals-to-handle" not in own:
        print("megatron_metp.megatron_lm.torchrun: this torch's torchrun has no "
              "--signals-to-handle; a SIGTERM ends the job as failed even when the ranks save",
              file=sys.stderr)
    elif not any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle")
                 for a in argv):
        argv = ["--signals-to-handle", KEPT] + argv
        signal.signal(signal.SIGTERM, _forward)
    run.main(argv)  # raises (exit status 1, torchrun's report) when a rank failed


if __name__ == "__main__":
    main()
    from .cpu import exit_now

    exit_now(0)  # the ranks succeeded; skip torch's C++ teardown (seconds of CPU)
