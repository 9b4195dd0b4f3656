"""The supported Megatron-LM releases (megatron_metp/megatron_lm/releases.py) and the
megatron-core differences (megatron_metp/megatron/compat.py), without a Megatron-LM checkout."""

import argparse
import dataclasses
import functools
import importlib.metadata
import os
import subprocess

import pytest

from megatron_metp.megatron import compat
from megatron_metp.megatron_lm import releases

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_release_has_its_patch_series_and_the_script_knows_its_commit():
    script = open(os.path.join(REPO, "scripts", "apply_patches.sh")).read()
    assert {r.tag for r in releases.RELEASES} == set(os.listdir(os.path.join(REPO, "patches")))
    for r in releases.RELEASES:
        assert f"[{r.tag}]={r.commit}" in script
        series = os.path.join(REPO, "patches", r.tag)
        for patch in os.listdir(series):
            assert r.commit in open(os.path.join(series, patch)).read()
        assert releases.by_tag(r.tag) is r and releases.by_commit(r.commit) is r
    assert releases.by_commit("0" * 40) is None
    with pytest.raises(ValueError, match="core_v0.17.0.*not supported.*core_v0.16.1"):
        releases.by_tag("core_v0.17.0")


def test_the_installed_megatron_core_names_its_release():
    installed = importlib.metadata.version("megatron-core")
    assert releases.for_megatron_core().megatron_core == ".".join(installed.split(".")[:2])
    assert releases.for_megatron_core("0.16.1").tag == "core_v0.16.1"
    assert releases.for_megatron_core("0.19.2").tag == "core_v0.19.0"
    with pytest.raises(ValueError, match="0.18.0 matches no supported"):
        releases.for_megatron_core("0.18.0")


@dataclasses.dataclass
class _Container:
    model: object
    train: object


def _builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    return ("stock", args.metp_parallel_size)


def _provider(builder, pre_process=True, post_process=True, vp_stage=None, config=None,
              pg_collection=None):
    return builder


def test_route_model_provider_hands_metp_the_provider_and_leaves_stock_alone():
    stock = argparse.Namespace(metp_parallel_size=1, metp_offload_activations=False)
    cfg = _Container(model="GPTModelConfig", train="t")
    assert releases.route_model_provider(stock, cfg, _provider, _builder) == (cfg, None)
    for args in (argparse.Namespace(metp_parallel_size=2, metp_offload_activations=False),
                 argparse.Namespace(metp_parallel_size=1, metp_offload_activations=True)):
        routed, provider = releases.route_model_provider(args, cfg, _provider, _builder)
        assert routed is not cfg and routed.model is None and routed.train == "t"
        assert cfg.model == "GPTModelConfig"  # the caller's container is not changed
        assert isinstance(provider, functools.partial) and provider.func is _provider
        wrapped = provider()
        assert wrapped.metp_wrapped_builder is _builder  # wrap_gpt_builder(gpt_builder)


def test_gloo_flag_follows_the_release():
    for name in ("use_gloo_process_groups", "enable_gloo_process_groups"):
        args = argparse.Namespace(**{name: True})
        releases.disable_gloo_process_groups(args)
        assert vars(args) == {name: False}


def test_compat_layer_mlp_builds_in_the_installed_form():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLPSubmodules

    layer = get_gpt_layer_local_spec().submodules
    subs = compat.mlp_submodules(layer.mlp)
    assert isinstance(subs, MLPSubmodules)

    class Probe:
        def __init__(self, **kw):
            self.kw = kw

    entry = compat.layer_mlp(layer.mlp, Probe, {"groups": "G"})
    if isinstance(layer.mlp, functools.partial):  # 0.19: TransformerLayer calls the entry
        built = entry(config="C", pg_collection=None, is_mtp_layer=False, name="decoder.mlp")
        assert built.kw == {"config": "C", "submodules": subs, "name": "decoder.mlp",
                            "groups": "G"}
    else:  # 0.16: a ModuleSpec for build_module
        assert entry.module is Probe and entry.params["groups"] == "G"
        assert entry.submodules is subs


def test_compat_checkpoint_files_match_what_megatron_core_writes():
    files = compat.checkpoint_whole_files()
    assert files[:2] == (".metadata", "metadata.json")
    line = importlib.metadata.version("megatron-core").split(".")[1]
    assert ("common.pt" in files) == (line == "16")


def test_apply_patches_help_lists_every_release():
    """(Choosing the series by the commit is tested on real checkouts in tests/test_scripts.py.)"""
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_patches.sh"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    for r in releases.RELEASES:
        assert r.tag in proc.stdout and r.commit in proc.stdout
