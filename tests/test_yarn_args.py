"""Megatron-LM's YaRN flags with METP (``megatron_metp.megatron_lm.yarn_args``): core_v0.19.0's
flags pass; core_v0.16.1, whose parser has no YaRN, is refused naming the release; YaRN flags
METP cannot honour are refused naming them. No Megatron-LM checkout needed."""

import argparse

import pytest

from megatron_metp import megatron_lm
from megatron_metp.megatron_lm.releases import for_megatron_core
from megatron_metp.megatron_lm.yarn_args import offer_yarn_choice, yarn_problems
from tests.harness import unset_env
from tests.test_megatron_lm import _args

#: core_v0.19.0's YaRN settings at their command-line defaults
YARN_019 = dict(rotary_scaling_factor=1.0, yarn_original_max_position_embeddings=None,
                yarn_beta_fast=None, yarn_beta_slow=None,
                yarn_correction_range_round_to_int=None, mscale=1.0, mscale_all_dim=0.0,
                rotary_percent=1.0, use_rope_scaling=False,
                rotary_seq_len_interpolation_factor=None)


def _megatron_parser(with_yarn: bool):
    """The part of Megatron-LM's parser this touches: core_v0.19.0's (``with_yarn``) or
    core_v0.16.1's ``--position-embedding-type``."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    choices = ["learned_absolute", "rope"] + (["yarn"] if with_yarn else []) + ["mrope", "none"]
    parser.add_argument("--position-embedding-type", default="learned_absolute", choices=choices)
    if with_yarn:
        parser.add_argument("--yarn-beta-fast", type=float, default=None)
    return parser


def test_core_v0_16_1_parses_yarn_only_to_refuse_it_naming_the_release():
    old = _megatron_parser(with_yarn=False)
    with pytest.raises(SystemExit):  # argparse's bare "invalid choice" before the hook
        old.parse_args(["--position-embedding-type", "yarn"])
    megatron_lm.add_metp_args(old)
    args = old.parse_args(["--position-embedding-type", "yarn"])
    with pytest.raises(ValueError) as err:  # any run, METP or not
        megatron_lm.validate_metp_args(_args(position_embedding_type=args.position_embedding_type))
    assert f"needs Megatron-LM core_v0.19.0: this is {for_megatron_core().tag}" in str(err.value)
    # only what trains the same model: not another position embedding
    assert "--position-embedding-type rope" not in str(err.value)
    assert "would train a different model" in str(err.value)
    new = _megatron_parser(with_yarn=True)
    before = list(new._option_string_actions["--position-embedding-type"].choices)
    offer_yarn_choice(new)
    assert new._option_string_actions["--position-embedding-type"].choices == before


def test_yarn_flags_pass_with_metp_on_core_v0_19_0():
    args = _args(metp_parallel_size=2, position_embedding_type="yarn",
                 **{**YARN_019, "rotary_scaling_factor": 4.0, "yarn_beta_fast": 16.0,
                    "yarn_original_max_position_embeddings": 4096, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "yarn_correction_range_round_to_int": False})
    megatron_lm.validate_metp_args(args)
    assert args.context_parallel_size == 2


@pytest.mark.parametrize("kind,change,needle", [
    ("yarn", dict(rotary_percent=0.5), "--rotary-percent 0.5 with --position-embedding-type yarn"),
    ("yarn", dict(use_rope_scaling=True), "--use-rope-scaling with --position-embedding-type yarn"),
    ("yarn", dict(rotary_seq_len_interpolation_factor=2),
     "--rotary-seq-len-interpolation-factor with --position-embedding-type yarn"),
    ("rope", dict(yarn_beta_fast=16.0), "--yarn-beta-fast 16.0 (YaRN's setting"),
    ("rope", dict(rotary_scaling_factor=4.0), "--rotary-scaling-factor 4.0 (YaRN's setting"),
    ("rope", dict(mscale=0.707), "--mscale 0.707 (YaRN's setting"),
    ("rope", dict(yarn_correction_range_round_to_int=False),
     "--[no-]yarn-correction-range-round-to-int False"),
])
def test_yarn_flags_metp_cannot_honour_are_refused_naming_them(kind, change, needle):
    args = _args(metp_parallel_size=2, position_embedding_type=kind, **{**YARN_019, **change})
    with pytest.raises(ValueError) as err:
        megatron_lm.validate_metp_args(args)
    assert needle in str(err.value)
    assert args.context_parallel_size == 1  # refused before anything was mapped
    assert yarn_problems(_args(position_embedding_type=kind, **YARN_019)) == []


def test_yarn_with_metp_passes_the_2_24_guard(monkeypatch):
    """YaRN has exact angles with METP, so the guard on Megatron's fp32 recipe lets it past 2^24;
    without METP (stock angles) it is refused there."""
    from types import SimpleNamespace

    from megatron_metp.megatron.rope import check_args_reach

    unset_env(monkeypatch, "METP_ROPE_RECIPE")
    args = dict(position_embedding_type="yarn", seq_length=1 << 25, metp_rope_fp32_recipe=False)
    check_args_reach(SimpleNamespace(metp_parallel_size=4, **args))
    with pytest.raises(ValueError, match="positions reach 2\\^24"):
        check_args_reach(SimpleNamespace(metp_parallel_size=1, **args))


def test_mla_takes_its_own_yarn_flags_and_refuses_the_others():
    """With --multi-latent-attention, YaRN is MLA's (--rope-type yarn, its default): its
    --rotary-scaling-factor, --mscale and --mscale-all-dim pass; the --yarn-* flags (MLA does not
    read them) and every YaRN flag with --rope-type rope are refused naming them."""
    mla = dict(YARN_019, multi_latent_attention=True, rotary_scaling_factor=40.0, mscale=0.707,
               mscale_all_dim=0.707)
    for rope_type in ("yarn", None):  # None: MLA's default, YaRN
        assert yarn_problems(_args(rope_type=rope_type, **mla)) == []
    beta = yarn_problems(_args(rope_type="yarn", **dict(mla, yarn_beta_fast=16.0)))
    assert len(beta) == 1 and beta[0].startswith("--yarn-beta-fast 16.0 with "
                                                 "--multi-latent-attention"), beta
    rope = yarn_problems(_args(rope_type="rope", **mla))
    assert [p.split()[0] for p in rope] == ["--rotary-scaling-factor", "--mscale",
                                            "--mscale-all-dim"], rope
    assert all("--rope-type rope" in p for p in rope)
    # negative control: the same flags without MLA are GPT YaRN's, refused without
    # --position-embedding-type yarn
    assert len(yarn_problems(_args(rope_type="yarn", **dict(mla, multi_latent_attention=False)))) \
        == 3
