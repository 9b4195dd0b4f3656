"""One settings value (issue 40): Megatron-LM's ``args``, the training ``Layout`` and a planner job
describing the same METP job give the same :class:`METPSettings`, and its ``problems()`` (the
METP rules, held once) names what each source's user typed. Negative controls: a different tile,
a different size give different settings; each rule fires alone."""

import argparse
import dataclasses

import pytest

from megatron_metp.megatron.settings import METPSettings
from megatron_metp.megatron.training import Layout
from megatron_metp.megatron_lm.flags import add_metp_args
from megatron_metp.megatron_lm.settings_args import metp_settings
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan.settings import settings_for
from tests.harness import unset_env


def _megatron_args(*argv, **megatron):
    """Megatron-LM's ``args`` as its parser leaves them: the METP flags parsed, Megatron's own
    as attributes (defaults of a plain job)."""
    args = add_metp_args(argparse.ArgumentParser()).parse_args(list(argv))
    for name, value in {**dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               context_parallel_size=1, transformer_impl="local",
                               reset_attention_mask=False), **megatron}.items():
        setattr(args, name, value)
    return args


def _same(settings: METPSettings) -> METPSettings:
    """The settings without what only names the source (its RoPE-recipe flag)."""
    return dataclasses.replace(settings, rope_recipe_source="")


def test_three_sources_of_one_job_give_one_settings_value(monkeypatch):
    unset_env(monkeypatch, "METP_ROPE_RECIPE")
    from_args = metp_settings(_megatron_args(
        "--metp-parallel-size", "2", "--metp-vocab-parallel", "--metp-mlp-token-tile", "64",
        "--metp-offload-activations", "2", "--metp-attention-kernel", "torch_flash",
        context_parallel_size=2))
    from_layout = Layout(metp=2, cp=2, vocab_parallel=True, offload_activations=2,
                         kernel="torch_flash").settings()
    from_job = settings_for("metp", P.Job(metp=2, cp=2, vocab_parallel=True, offload=True,
                                          offload_layers=2, mlp_token_tile=64),
                            kernel="torch_flash")
    expected = METPSettings(mode="metp", metp=2, context=2, vocab_parallel=True,
                            mlp_token_tile=64, offload_activations=2, kernel="torch_flash")
    # the training Layout has no tile field (its ops take the override or the auto tile) and
    # the planner's offload carries its prefetch switch
    assert _same(from_args) == _same(expected)
    assert _same(from_layout) == _same(expected.replace(mlp_token_tile=None))
    assert _same(from_job.replace(offload_prefetch=None)) == _same(expected)
    # negative controls: another tile or another METP size is another value
    assert metp_settings(_megatron_args("--metp-parallel-size", "2", "--metp-vocab-parallel",
                                        "--metp-mlp-token-tile", "32", "--metp-offload-"
                                        "activations", "2", "--metp-attention-kernel",
                                        "torch_flash", context_parallel_size=2)) != from_args
    assert Layout(metp=3, cp=2, vocab_parallel=True, offload_activations=2,
                  kernel="torch_flash").settings() != from_layout


def test_after_validate_args_maps_cp_the_settings_are_the_same():
    """``validate_metp_args`` sets Megatron's CP to p·c and keeps c aside: the settings read c."""
    from megatron_metp.megatron_lm.flags import CP_OUTER, MAPPED

    before = _megatron_args("--metp-parallel-size", "2", context_parallel_size=3)
    after = _megatron_args("--metp-parallel-size", "2", context_parallel_size=6)
    setattr(after, CP_OUTER, 3)
    setattr(after, MAPPED, True)
    assert metp_settings(before) == metp_settings(after)
    assert metp_settings(before).context == 3 and metp_settings(before).ring_size == 6
    assert metp_settings(_megatron_args()).mode == "tp"
    assert metp_settings(_megatron_args("--metp-parallel-size", "2",
                                        "--metp-disable-weight-ring")).mode == "ring"


@pytest.mark.parametrize("settings,facts,needle", [
    (METPSettings(mode="tp", mlp_token_tile=8), {}, "--metp-mlp-token-tile tiles the METP MLP"),
    (METPSettings(mode="ring", metp=2, mlp_token_tile=8), {}, "runs Megatron's own MLP"),
    (METPSettings(metp=2, mlp_token_tile=-1), {}, "must be >= 0"),
    (METPSettings(metp=2, moe_token_tiles=2), {"num_experts": 0}, "needs --num-experts"),
    (METPSettings(metp=2, moe_token_tiles=0), {"num_experts": 4}, "must be >= 1"),
    (METPSettings(mode="tp", vocab_parallel=True), {}, "--metp-vocab-parallel needs"),
    (METPSettings(mode="ring", metp=2, context=2), {}, "ring baseline runs over the METP group"),
    (METPSettings(mode="tp", context=2), {}, "mode='metp'"),
    (METPSettings(metp=2, kernel="nope"), {}, "--metp-attention-kernel must be one of"),
    (METPSettings(metp=2, offload_activations=0), {}, "--metp-offload-activations must be"),
    (METPSettings(metp=2, rope_recipe="fp16"), {}, "RoPE recipe must be one of"),
    (METPSettings(metp=2, packed_layout="zigzag"), {}, "--metp-packed-layout must be one of"),
    (METPSettings(metp=0), {}, "--metp-parallel-size must be >= 1"),
    (METPSettings(metp=2), {"world_size": 3}, "world size 3 is not divisible"),
    (METPSettings(metp=2), {"seq_length": 6}, "--seq-length 6 is not divisible by 2×METP"),
])
def test_each_rule_fires_alone_and_names_the_flag(settings, facts, needle):
    problems = settings.problems(**facts)
    assert len(problems) == 1 and needle in problems[0], problems
    with pytest.raises(ValueError, match="--"):
        settings.check(**facts)


def test_a_clean_job_has_no_problems_and_each_source_names_its_own_flags():
    assert METPSettings(metp=2, context=2, vocab_parallel=True, mlp_token_tile=0,
                        offload_activations=True).problems(world_size=8, seq_length=16) == []
    # the same rule, named as the training Layout's and the planner's users wrote it
    with pytest.raises(ValueError, match=r"Layout\.cp=2 .* needs METP"):
        Layout(mode="tp", cp=2)
    with pytest.raises(ValueError, match=r"^--kernel must be one of"):
        settings_for("metp", P.Job(metp=2), kernel="nope")
    with pytest.raises(ValueError, match=r"^--metp-attention-kernel must be one of"):
        METPSettings(metp=2, kernel="nope").check()
    # a stock mode of the planner carries no METP tile (stock layers have none)
    assert settings_for("tp", P.Job(metp=2, mlp_token_tile=8)).mlp_token_tile is None
