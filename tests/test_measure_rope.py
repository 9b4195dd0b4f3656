"""``metp measure`` builds METP models with the RoPE angles training uses (issue 31's 6M gap).

Training (``megatron/training.py``) and the Megatron-LM hooks give a METP model exact angles
for this rank's tokens only (``megatron/rope.py``); ``metp measure`` built Megatron's stock
``RotaryEmbedding``, which, with METP folded into the context-parallel group, forms the fp32
angle table of the whole sequence (``p`` ranks' worth) at the start of the forward and slices
this rank's rows. At 6M tokens (p = 8) that table (1.5 GiB of ``freqs`` + 3 GiB of ``emb``,
beside the 6 GiB embedding output) was the measurement's peak, 2.4 % above the Megatron-LM dry
run and the plan.
"""

from dataclasses import replace

from megatron_metp.megatron import rope as R
from megatron_metp.tools import fakerank as FR
from megatron_metp.tools import measure as M

from .test_fast_dry import JOB, TWIN

#: p = 8, wide heads (d = 128), small tiles: the forward's peak is the RoPE table's
LONG = replace(TWIN, hidden=1024, heads=8, query_groups=8, ffn=1024, vocab=1024, seq=16384,
               name="rope-twin")
JOB8 = replace(JOB, metp=8)


def _forward_peak():
    """The forward's peak of one METP rank (forward only: the angle table lives in the forward)."""
    out = FR.run_isolated(lambda: M.measure_here(LONG, JOB8, "metp", forward_only=True))
    assert out["peak"] == out["phases"]["forward"] and set(out["phases"]) == {"forward"}
    return out["phases"]["forward"]


def test_measure_forms_only_this_ranks_rope_angles_as_training_does(monkeypatch):
    monkeypatch.setenv("METP_TILE_BUDGET_MIB", "2")  # small tiles, few enough passes
    exact = _forward_peak()
    # negative control: the stock whole-sequence table (the bug) on the same twin
    monkeypatch.setattr(R, "use_exact_angles", lambda model, recipe="exact": "megatron")
    stock = _forward_peak()
    # whole-sequence fp32 freqs [s, d/2] + emb [s, d]: 12 MiB here; measured 23.9 vs 19.6 MB
    assert stock > 1.15 * exact, (stock, exact)
    # and the exact figure is the table-free one (19.6 MB); with the MLP untiled, e.g. a
    # METP_MLP_TOKEN_TILE another test left set, the peak is elsewhere (34.95 MB in both cases)
    assert exact < 24e6, exact
