"""``benchmarks/gpu_check.py --dry --only-rates`` (part 0, :mod:`gpu_rates`) on tiny CPU shapes:
it writes the rates file ``metp plan --rates`` reads, with every key and its type, the kernel
the ring chooses here, and times one streaming layer (host stash) as rank 0 of 8 under the fake
group next to the plan's one-layer figure, then its backward with kept attention against full
recompute's (or says ``keep_attention not available``). The file carries every measured kernel
and is what ``ops/kernel_rates.read_measured`` (``--rates``, ``METP_KERNEL_RATES``) reads.
Timings are printed, never asserted."""

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

FLOATS = ("gemm_tflops", "attention_fwd_tflops", "attention_bwd_tflops", "pcie_gbs")


def test_dry_rates_file_and_layer(tmp_path):
    import gpu_check
    import gpu_rates

    path = tmp_path / "sub" / "rates.json"
    assert gpu_check.main(["--dry", "--out", str(tmp_path), "--only-rates",
                           "--rates", str(path)]) == 0
    rates = json.loads(path.read_text())
    assert tuple(rates) == gpu_rates.RATES_KEYS
    assert all(isinstance(rates[k], float) and rates[k] > 0 for k in FLOATS), rates
    assert rates["kernel"] == "torch_flash" and rates["hardware"] == "cpu (--dry)"
    assert "--dry" in rates["source"] and "not rates for a plan" in rates["source"]
    assert datetime.datetime.fromisoformat(rates["measured_at"]).tzinfo is not None
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "kernels" not in res and "stacks" not in res  # --only-rates stops after part 0
    cases = res["rates"]["detail"]["attention"]["cases"]
    assert [(c["piece"], c["keys"]) for c in cases] == [("full", 32), ("full", 64),
                                                        ("causal", 64)]
    assert all(c["q_heads"] == 4 and c["kv_heads"] == 1 and c["bwd_flops"] == 2.5 * c[
        "fwd_flops"] for c in cases)
    layer = res["rates"]["layer"]
    assert "error" not in layer, layer
    assert layer["tokens_per_rank"] == 1024 // 8 and layer["host_stash"] and layer["p"] == 8
    assert layer["layers"] == 32 and layer["plan_one_layer_s"] > 0
    assert "measured_over_plan" not in layer  # a tiny layer is not the plan's
    assert "rates (cpu (--dry), kernel torch_flash" in (tmp_path / "gpu_check.md").read_text()
    # every kernel measured (on CPU: torch_flash; the reference is never timed), its head width
    assert set(rates["kernels"]) == {"torch_flash"} and rates["head_dim"] == 8
    assert rates["kernels"]["torch_flash"]["attention_fwd_tflops"] == \
        rates["attention_fwd_tflops"] and rates["dtype"] == "bfloat16"
    from megatron_metp.ops import kernel_rates as KR

    (row,) = KR.measured_rows(KR.read_measured(str(path), "METP_KERNEL_RATES"))
    assert (row.kernel, row.head_dim, row.gpu) == ("torch_flash", 8, None)  # --dry: no GPU
    assert layer["fwd_s"] > 0 and layer["bwd_s"] > 0 and not layer["keep_attention"]
    keep = res["rates"]["keep_attention"]
    if gpu_rates.keeps_attention():  # the streaming op keeps attention: its backward timed
        assert "error" not in keep, keep
        assert keep["keep"]["keep_attention"] and keep["keep"]["bwd_s"] > 0
        assert keep["backward_keep_over_recompute"] > 0
        assert "kept attention: backward" in (tmp_path / "gpu_check.md").read_text()
    else:
        assert keep["error"] == gpu_rates.NO_KEEP
        assert "kept attention: keep_attention not available" in \
            (tmp_path / "gpu_check.md").read_text()


def test_kept_attention_check_reports_an_op_without_it(monkeypatch):
    import gpu_rates

    monkeypatch.setattr(gpu_rates, "keeps_attention", lambda: False)
    got = gpu_rates.layer_time("cpu", gpu_rates.GEO["dry"], True)
    assert got == {"error": "keep_attention not available", "keep_attention": True}
    ok = {"bwd_s": 4.0}
    assert gpu_rates.keep_check(ok, got)["error"] == "keep_attention not available"
    c = gpu_rates.keep_check(ok, {"bwd_s": 3.0})
    assert c["backward_keep_over_recompute"] == 0.75 and c["backward_saved_s"] == 1.0


def test_rates_file_takes_the_lower_copy_direction():
    import gpu_rates

    att = {"fwd_tflops": 1.0, "bwd_tflops": 2.0}
    r = gpu_rates.rates_file("H100", "cudnn", 3.0, att, {"h2d_gbs": 50.0, "d2h_gbs": 40.0}, "x")
    assert r["pcie_gbs"] == 40.0 and tuple(r) == gpu_rates.RATES_KEYS
    assert r["kernels"] == {"cudnn": {"attention_fwd_tflops": 1.0, "attention_bwd_tflops": 2.0}}
