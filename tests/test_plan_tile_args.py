"""``metp plan`` takes the tiles from the job it plans (issue 40): ``--metp-mlp-token-tile`` /
``--metp-moe-token-tiles`` in a config's ``EXTRA_ARGS`` (or ``METP_MLP_TOKEN_TILE`` in the config,
which ``scripts/pretrain_gpt.sh`` turns into the flag, or the planner's own flags) are the job's
tiles, not the planner's process environment; and the planner's kernel names are derived from
``ops/kernel_choice``."""

import dataclasses
import pathlib

import pytest

from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import moe as PM
from tests.harness import unset_env

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
TILE_VARS = ("METP_MLP_TOKEN_TILE", "METP_MOE_TOKEN_TILES", "METP_LAYER_TOKEN_TILE",
             "METP_TILE_BUDGET_MIB")


def _config(tmp_path, base: str, lines: str) -> str:
    path = tmp_path / "job.sh"
    path.write_text(f'source "{CONFIGS / base}"\n{lines}\n')
    return str(path)


def _numbers(model, job):
    """The METP plan's largest layer transient and bytes sent per rank (the tiles change both)."""
    res = P.plan(model, job, ["metp"])["modes"]["metp"]
    return res["layer_transient"], res["cost"]["sent"]


@pytest.mark.parametrize("base", ["llama3-8b-6m-metp8.sh", "gpt-7b-128k-metp8.sh"],
                         ids=["streaming-layer", "mlp-op"])
def test_config_extra_args_tile_is_the_plans_tile(tmp_path, monkeypatch, base):
    unset_env(monkeypatch, *TILE_VARS)
    auto_m, auto_j, _ = cli.build_from_argv(["--config", str(CONFIGS / base), "--modes", "metp"])
    assert auto_j.mlp_token_tile is None  # negative control: no tile in the config
    tiled_cfg = _config(tmp_path, base, "EXTRA_ARGS=(--metp-mlp-token-tile 2048)")
    m, j, _ = cli.build_from_argv(["--config", tiled_cfg, "--modes", "metp"])
    assert j.mlp_token_tile == 2048 and m.__dict__ | {"name": ""} == auto_m.__dict__ | {"name": ""}
    tiled, auto = _numbers(m, j), _numbers(auto_m, auto_j)
    # another tile, other numbers (both of them)
    assert tiled[0] != auto[0] and tiled[1] != auto[1], (tiled, auto)
    # the config's tile plans exactly what the same tile from the environment plans
    monkeypatch.setenv("METP_MLP_TOKEN_TILE", "2048")
    # (the written EXTRA_ARGS replaces the config's, its --metp-keep-attention-output too, and a
    # kept layer sends no K/V ring again: compare like with like)
    auto_j = dataclasses.replace(auto_j, keep_attention_output=j.keep_attention_output)
    assert _numbers(auto_m, auto_j) == tiled
    monkeypatch.delenv("METP_MLP_TOKEN_TILE")
    # METP_MLP_TOKEN_TILE in the config (pretrain_gpt.sh: the flag), and EXTRA_ARGS after it wins
    shell = _config(tmp_path, base, "METP_MLP_TOKEN_TILE=2048")
    assert cli.build_from_argv(["--config", shell])[1].mlp_token_tile == 2048
    both = _config(tmp_path, base,
                   "METP_MLP_TOKEN_TILE=4096\nEXTRA_ARGS=(--metp-mlp-token-tile=2048)")
    assert cli.build_from_argv(["--config", both])[1].mlp_token_tile == 2048
    # the planner's own flag wins over the config's, and the launch line carries the tile
    j2 = cli.build_from_argv(["--config", tiled_cfg, "--metp-mlp-token-tile", "0"])[1]
    assert j2.mlp_token_tile == 0
    flags = P.launch.megatron_flags(m, j, "metp")
    assert flags[flags.index("--metp-mlp-token-tile") + 1] == "2048"
    assert "--metp-mlp-token-tile" not in P.launch.megatron_flags(auto_m, auto_j, "metp")


def test_config_moe_token_tiles_are_the_plans(tmp_path, monkeypatch):
    unset_env(monkeypatch, *TILE_VARS)
    base = "qwen3-30b-a3b-1m-metp4-cp2.sh"
    m, auto_j, _ = cli.build_from_argv(["--config", str(CONFIGS / base)])
    cfg = _config(tmp_path, base, 'EXTRA_ARGS=("${MOE_ARGS[@]}" --metp-moe-token-tiles 3)')
    m3, j3, _ = cli.build_from_argv(["--config", cfg])
    lay = P.layout("metp", j3)
    n = m.seq // (lay.c * 1)
    assert j3.moe_tile_count == 3 and auto_j.moe_tile_count is None
    assert PM.tile_count(m3, j3, lay, n) == 3
    assert PM.tile_count(m, auto_j, P.layout("metp", auto_j), n) != 3  # auto: another count
    assert _numbers(m3, j3) != _numbers(m, auto_j)
    with pytest.raises(ValueError, match="--metp-moe-token-tiles 3 with --no-moe-token-tiles"):
        P.validate(m3, P.Job(**{**j3.__dict__, "moe_token_tiles": False}), ["metp"])
    with pytest.raises(ValueError, match="--metp-moe-token-tiles must be a positive integer"):
        cli.build_from_argv(["--config", cfg, "--metp-moe-token-tiles", "0"])


def test_bad_tile_flag_in_a_config_is_refused_naming_it(tmp_path):
    cfg = _config(tmp_path, "gpt-7b-128k-metp8.sh", "EXTRA_ARGS=(--metp-mlp-token-tile lots)")
    with pytest.raises(ValueError, match="--metp-mlp-token-tile 'lots' in the config's "
                       "EXTRA_ARGS: an integer is needed"):
        cli.build_from_argv(["--config", cfg])
    with pytest.raises(ValueError, match="--metp-mlp-token-tile must be a non-negative integer"):
        cli.build_from_argv(["--config", str(CONFIGS / "gpt-7b-128k-metp8.sh"),
                             "--metp-mlp-token-tile", "-5"])


def test_planner_kernel_names_come_from_kernel_choice():
    from megatron_metp.ops import kernel_choice as K
    from megatron_metp.ops import kernel_rates as KR
    from megatron_metp.tools.plan import rates

    assert K.KERNELS is KR.KERNELS  # one home of the names (issue 41)
    assert rates.KERNELS == tuple(KR.SHORT_NAMES[k] for k in K.KERNELS) == \
        ("cudnn", "fa3", "fa2", "torch_flash", "unfused")
    assert rates.KERNEL_ALIASES == {"flash_attn_3": "fa3", "flash_attn": "fa2",
                                    "reference": "unfused"}
    # every run-time name and planner name is a --kernel choice; reference plans as unfused
    choices = cli._kernel_choices()
    assert set(K.KERNELS) | set(rates.KERNELS) | {"flash"} <= set(choices)
    job = cli.build_from_argv(["--preset", "gpt-7b", "--kernel", "reference"])[1]
    assert job.kernel == "unfused" and job.attention_kernel is None
    # negative control: a name of neither vocabulary is refused, naming both
    with pytest.raises(ValueError, match=r"unknown attention kernel 'new_kernel': one of cudnn, "
                                         r"flash_attn_3.* or fa3, fa2, unfused"):
        KR.kernel_of("new_kernel")


def test_measure_builds_the_job_tile_as_the_override_would(monkeypatch):
    """``metp measure`` builds its model from the job's settings (tools/plan/settings.py), so a
    job tile (flag or a config's EXTRA_ARGS) is measured as the same tile given as
    METP_MLP_TOKEN_TILE: the same bytes sent (one weight-ring pass per tile) and the same peak.
    Negative control: without the tile (whole, one pass) the traffic is smaller."""
    from dataclasses import replace

    from megatron_metp.tools import fakerank as FR
    from megatron_metp.tools import measure as M

    unset_env(monkeypatch, *TILE_VARS)
    model = P.Model(hidden=64, layers=1, heads=4, ffn=256, vocab=256, seq=256, name="tiny")
    job = P.Job(tp=1, metp=2)
    FR.preload_megatron()

    def measured(j):
        r = FR.run_isolated(lambda: M.measure_here(model, j, "metp"), timeout=300)
        return r["sent"], r["peak"]

    by_job = measured(replace(job, mlp_token_tile=32))
    monkeypatch.setenv("METP_MLP_TOKEN_TILE", "32")
    by_override = measured(job)
    monkeypatch.delenv("METP_MLP_TOKEN_TILE")
    whole = measured(replace(job, mlp_token_tile=0))
    assert by_job == by_override
    assert by_job[0] > whole[0]
