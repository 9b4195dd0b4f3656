"""``metp measure`` builds METP models with the RoPE angles training uses (issue 31's 6M gap).

Training (``megatron/training.py``) and the Megatron-LM hooks give a METP model exact angles
for this rank's tokens only (``megatron/rope.py``); ``metp measure`` built Megatron's stock
``RotaryEmbedding``, which, with METP folded into the context-parallel group, forms the fp32
angle table of the whole sequence (``p`` ranks' worth) at the start of the forward and slices
this rank's rows. At 6M tokens (p = 8) that table (1.5 GiB of ``freqs`` + 3 GiB of ``emb``,
beside the 6 GiB embedding output) was the measurement's peak, 2.4 % above the Megatron-LM dry
run and the plan.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: rank 0's forward peak of ``metp measure`` on a p = 8 twin with wide heads (d = 128) and small
#: tiles, where the forward's peak is the RoPE table's; ``stock`` builds Megatron's
#: whole-sequence table instead of this rank's exact angles (the bug: the negative control)
_SCRIPT = """
import json, sys
from dataclasses import replace
from megatron_metp.megatron import rope as R
from megatron_metp.tools import fakerank as FR
from megatron_metp.tools import measure as M
from tests.test_fast_dry import JOB, TWIN
if sys.argv[1] == "stock":
    R.use_exact_angles = lambda model, recipe="exact": "megatron"
LONG = replace(TWIN, hidden=1024, heads=8, query_groups=8, ffn=1024, vocab=1024, seq=16384,
               name="rope-twin")
res = FR.run_isolated(lambda: M.measure_here(LONG, replace(JOB, metp=8), "metp"))
print(json.dumps(res["phases"]["forward"]))
"""


def _forward_peak(angles: str) -> int:
    """In a fresh interpreter with a clean environment: under two test workers another file
    left ``METP_MLP_TOKEN_TILE`` (or ``METP_LAYER_TOKEN_TILE``) set in the worker, and with
    untiled MLPs the forward's peak is elsewhere (34,951,168 B in both cases)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "METP_TILE_BUDGET_MIB": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, angles], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_measure_forms_only_this_ranks_rope_angles_as_training_does():
    exact = _forward_peak("exact")
    stock = _forward_peak("stock")  # negative control: the whole-sequence table (the bug)
    # whole-sequence fp32 freqs [s, d/2] + emb [s, d]: 12 MiB here; measured 24.0 vs 19.1 MB
    assert stock > 1.15 * exact, (stock, exact)
    assert exact < 24e6, exact  # the fork's figure: 19.1 MB
