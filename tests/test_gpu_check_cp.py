"""``benchmarks/gpu_check.py --dry`` runs its METP × CP path (mode ``metp-cp``) on tiny CPU
shapes: rank 0 of a fake world of p·c ranks, s/(p·c) tokens, the K/V ring over the CP group."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))


def test_gpu_check_dry_metp_times_cp(tmp_path):
    import gpu_check

    assert gpu_check.main(["--dry", "--out", str(tmp_path), "--modes", "metp-cp"]) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["cp"] == 2 and res["p"] == 4
    (row,) = res["stacks"]
    assert "error" not in row and row["mode"] == "metp-cp", row
    assert row["tokens_per_rank"] == 256 // (4 * 2)
    assert row["metp_ranks"] == 4 and row["kv_ring_ranks"] == 8
    assert row["cpu_instrument_peak"] > 0 and row["fwd_bwd_s"] > 0
    assert row["launches_per_layer"] > 0
    assert "metp-cp" in (tmp_path / "gpu_check.md").read_text()
