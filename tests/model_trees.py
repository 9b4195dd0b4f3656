"""The model tree (modules, parameter shapes, digest: ``megatron_metp.megatron.build.model_tree``)
of one METP model as each place that builds it reports it: a Megatron-LM training log (the
``METP model:`` line of ``build_metp_gpt``), the dry run's JSON report and ``metp measure``."""

import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LINE = re.compile(r"^METP model: (.+)$", re.M)


def in_log(log: str) -> str:
    """The tree of the first model a Megatron-LM training log built (rank 0's line)."""
    found = _LINE.findall(log)
    assert found, "no 'METP model:' line in the training log"
    return found[0].strip()


def of_dry_run(megatron_lm_dir: str, config: str, json_path, **env) -> dict:
    """The dry run's report (``model_tree``, ``padded_vocab_size``, ...) of ``config`` through
    scripts/pretrain_gpt.sh; ``env`` overrides the config's variables."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
             "PYTHON": sys.executable, "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
             "MEGATRON_LM_DIR": megatron_lm_dir, **{k: str(v) for k, v in env.items()}}
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config", config, "--dry-run",
                           "--json", str(json_path)], cwd=REPO, capture_output=True, text=True,
                          env=clean, timeout=300)
    assert proc.returncode == 0, f"dry run of {config}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return json.loads(open(json_path).read())


def of_measure(model, job, mode: str = "metp") -> str:
    """The tree ``metp measure`` builds for ``model`` and ``job`` (one forked fake rank)."""
    from megatron_metp.tools import fakerank as FR
    from megatron_metp.tools import measure as M

    FR.preload_megatron()
    return FR.run_isolated(lambda: M.measure_here(model, job, mode), timeout=300)["model_tree"]
