"""One table of kernel names and rates (``megatron_metp/ops/kernel_rates.py``) read by the
run-time choice (``ops/kernel_choice.py``, ``auto``) and the planner (``tools/plan/rates.py``).

Emulated machines (``kernel_choice.platform`` replaced): on an H100 with cuDNN and
FlashAttention-3 at head dim 128 the choice takes FA3 by the FA3 paper's figures (616 / 561
against 539 / 516) and its log line names the kernel, the rate and the source; negative controls:
no rate at the head width, the dtype or the GPU (the order decides: cuDNN), FA3 absent. A
measured file (``METP_KERNEL_RATES``) decides instead; one of another GPU, or a broken one, is
refused naming the variable. The planner's default kernel is the run-time choice's with every
rated kernel installed, its rates are the table's rows, and its ``--rates`` file picks the
``--kernel`` it measured."""

import json

import pytest
import torch

from megatron_metp.ops import kernel_choice, kernel_rates as KR
from megatron_metp.ops.kernel_choice import Platform, select_name
from megatron_metp.tools.plan import rates as plan_rates
from tests.harness import unset_env

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
BOTH = {"flash_attn_interface": "", "flash_attn": ""}
H100 = Platform((2, 13), (9, 0), 90100, dict(BOTH), "NVIDIA H100 80GB HBM3")


def _on(monkeypatch, pf):
    monkeypatch.setattr(kernel_choice, "platform", lambda: pf)
    monkeypatch.setattr(kernel_choice, "_logged", set())
    unset_env(monkeypatch, "METP_ATTENTION_KERNEL")
    unset_env(monkeypatch, "METP_KERNEL_RATES")


def test_fa3_before_cudnn_on_h100_by_published_rate(monkeypatch, caplog):
    _on(monkeypatch, H100)
    with caplog.at_level("INFO", logger="megatron_metp.attention_kernel"):
        assert select_name(CUDA, BF16, head_dim=128) == "flash_attn_3"
    line = caplog.records[-1].getMessage()
    assert line.startswith("[METP] attention kernel: flash_attn_3 (auto: fastest by published "
                           "rate for cuda bfloat16, head dim 128;")
    assert "flash_attn_3 on H100: 616/561 TFLOP/s fwd/bwd (FlashAttention-3: " in line
    assert "arXiv 2407.08608" in line
    # H200: the H100's figures (derived, said so)
    _on(monkeypatch, Platform((2, 13), (9, 0), 90100, dict(BOTH), "NVIDIA H200"))
    assert select_name(CUDA, BF16, head_dim=128) == "flash_attn_3"
    # negative controls: FA3 absent -> cuDNN by rate (539/516 > FA2's 335/322)
    _on(monkeypatch, Platform((2, 13), (9, 0), 90100, {"flash_attn": ""}, "NVIDIA H100"))
    assert select_name(CUDA, BF16, head_dim=128) == "cudnn"
    # no rate at this head width / dtype / GPU: the order decides (cuDNN first), said so
    for pf, dtype, hd in ((H100, BF16, 64), (H100, torch.float16, 128),
                          (Platform((2, 13), (9, 0), 90100, dict(BOTH)), BF16, 128)):
        _on(monkeypatch, pf)
        with caplog.at_level("INFO", logger="megatron_metp.attention_kernel"):
            assert select_name(CUDA, dtype, head_dim=hd) == "cudnn"
        assert "auto: best available" in caplog.records[-1].getMessage()
        assert "no published rate for cudnn, flash_attn_3" in caplog.records[-1].getMessage()
    # A100: cuDNN has no A100 row, so the order keeps cuDNN; without cuDNN, FA2 by rate
    _on(monkeypatch, Platform((2, 13), (8, 0), 90100, dict(BOTH), "NVIDIA A100-SXM4-80GB"))
    assert select_name(CUDA, BF16, head_dim=128) == "cudnn"
    _on(monkeypatch, Platform((2, 4), (8, 0), 90100, dict(BOTH), "NVIDIA A100-SXM4-80GB"))
    assert select_name(CUDA, BF16, head_dim=128) == "flash_attn"
    # an explicit name still wins over the rates
    _on(monkeypatch, H100)
    assert select_name(CUDA, BF16, "cudnn", head_dim=128) == "cudnn"


def _measured(tmp_path, name="rates.json", **kw):
    d = {"hardware": "NVIDIA H100 80GB HBM3", "kernel": "flash_attn_3", "gemm_tflops": 650.0,
         "attention_fwd_tflops": 400.0, "attention_bwd_tflops": 300.0, "pcie_gbs": 50.0,
         "source": "benchmarks/gpu_check.py", "measured_at": "2026-12-05T00:00:00+00:00",
         "head_dim": 128, "dtype": "bfloat16",
         "kernels": {"flash_attn_3": {"attention_fwd_tflops": 400.0,
                                      "attention_bwd_tflops": 300.0},
                     "cudnn": {"attention_fwd_tflops": 500.0, "attention_bwd_tflops": 450.0},
                     "fa2": {"attention_fwd_tflops": 300.0, "attention_bwd_tflops": 250.0},
                     "torch_flash": {"attention_fwd_tflops": 290.0,
                                     "attention_bwd_tflops": 240.0}}}
    d.update(kw)
    path = tmp_path / name
    path.write_text(json.dumps({k: v for k, v in d.items() if v is not None}))
    return str(path)


def test_a_measured_file_decides_and_bad_ones_are_refused(monkeypatch, tmp_path, caplog):
    _on(monkeypatch, H100)
    monkeypatch.setenv("METP_KERNEL_RATES", _measured(tmp_path))
    with caplog.at_level("INFO", logger="megatron_metp.attention_kernel"):
        assert select_name(CUDA, BF16, head_dim=128) == "cudnn"  # measured faster here
    line = caplog.records[-1].getMessage()
    assert "auto: fastest by measured rate" in line and "cudnn on H100: 500/450" in line
    # negative controls: a kernel the file did not measure -> the order, said so
    path = _measured(tmp_path, "part.json", kernels={"cudnn": {"attention_fwd_tflops": 1.0,
                                                               "attention_bwd_tflops": 1.0}})
    monkeypatch.setenv("METP_KERNEL_RATES", path)
    with caplog.at_level("INFO", logger="megatron_metp.attention_kernel"):
        assert select_name(CUDA, BF16, head_dim=128) == "cudnn"
    assert "no measured rate for flash_attn, torch_flash" in caplog.records[-1].getMessage()
    for kw, msg in ((dict(hardware="NVIDIA A100-SXM4-80GB"), r"measured on \['A100'\], this "
                     r"GPU is NVIDIA H100 80GB HBM3: measure this GPU"),
                    (dict(hardware="cpu (--dry)"), r"measured on \['None'\]"),
                    (dict(gemm_tflops=0), "'gemm_tflops' must be a positive number"),
                    (dict(kernels={"fa4": {}}), "unknown attention kernel 'fa4'"),
                    (dict(kernels={"cudnn": {"attention_fwd_tflops": 1.0}}),
                     "kernels.cudnn: 'attention_bwd_tflops' must be a positive number"),
                    (dict(extra=1), "unknown key")):
        monkeypatch.setenv("METP_KERNEL_RATES", _measured(tmp_path, "bad.json", **kw))
        with pytest.raises(ValueError, match=r"^METP_KERNEL_RATES=.*bad\.json: .*" + msg):
            select_name(CUDA, BF16, head_dim=128)
    # checked even where one fused kernel runs (no choice to make): never accepted and ignored
    _on(monkeypatch, Platform((2, 13), (9, 0), 90100, {}, "NVIDIA H100 80GB HBM3"))
    monkeypatch.setenv("METP_KERNEL_RATES", _measured(tmp_path, "bad.json", gemm_tflops=0))
    with pytest.raises(ValueError, match="METP_KERNEL_RATES=.*'gemm_tflops' must be a positive"):
        select_name(CUDA, BF16, head_dim=128)
    monkeypatch.setenv("METP_KERNEL_RATES", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="METP_KERNEL_RATES=.*missing.json: cannot read it"):
        select_name(CUDA, BF16, head_dim=128)


def test_planner_and_run_time_agree_on_names_and_rates(monkeypatch):
    # one vocabulary: the planner's names are the table's short names of the run-time kernels
    assert kernel_choice.KERNELS is KR.KERNELS
    assert tuple(KR.kernel_of(k) for k in plan_rates.KERNELS) == KR.KERNELS
    assert {KR.short_name(k) for k in KR.KERNELS} == set(plan_rates.KERNELS)
    # the planner's rates are the table's rows (head dim 128 / any, bf16), source included
    for (hw, k), r in plan_rates.RATES.items():
        row = KR.rate_of(k, KR.gpu_of(hw), 128, "bfloat16")
        assert (r.attention_fwd_tflops, r.attention_bwd_tflops) == (row.fwd, row.bwd)
        assert r.source.startswith(row.source)
    assert {KR.gpu_of(hw) for hw, _ in plan_rates.RATES} == set(KR.GPUS)
    # the planner's default kernel = the run-time choice with every rated kernel installed
    for hw, pf in (("H100-80GB", H100),
                   ("H200-141GB", Platform((2, 13), (9, 0), 90100, dict(BOTH), "NVIDIA H200")),
                   ("A100-80GB", Platform((2, 4), (8, 0), 90100, dict(BOTH), "NVIDIA A100"))):
        _on(monkeypatch, pf)
        assert KR.kernel_of(plan_rates.default_kernel(hw)) == select_name(CUDA, BF16,
                                                                          head_dim=128), hw
    assert plan_rates.default_kernel("H100-80GB") == "fa3"
    # negative control: a table where cuDNN were faster moves both
    slow = tuple(r if r.kernel != "flash_attn_3" else KR.KernelRate(
        r.kernel, r.gpu, r.head_dim, r.dtype, 100.0, 100.0, r.source) for r in KR.ROWS)
    monkeypatch.setattr(KR, "ROWS", slow)
    _on(monkeypatch, H100)
    assert select_name(CUDA, BF16, head_dim=128) == "cudnn"
    assert plan_rates.default_kernel("H100-80GB") == "cudnn"


def test_planner_rates_file_picks_the_kernel_it_measured(tmp_path):
    path = _measured(tmp_path)
    r = plan_rates.resolve_rates("H100-80GB", None, path)  # the file's own kernel
    assert (r.kernel, r.attention_fwd_tflops, r.gemm_tflops) == ("fa3", 400.0, 650.0)
    r = plan_rates.resolve_rates("H100-80GB", "cudnn", path)  # --kernel cudnn: its row
    assert (r.kernel, r.attention_fwd_tflops, r.attention_bwd_tflops) == ("cudnn", 500.0, 450.0)
    assert plan_rates.resolve_rates("H100-80GB", "flash_attn", path).kernel == "fa2"
    with pytest.raises(ValueError, match=r"--rates .*: --kernel unfused was not measured \(the "
                                         r"file has fa3, cudnn, fa2, torch_flash\)"):
        plan_rates.resolve_rates("H100-80GB", "unfused", path)
