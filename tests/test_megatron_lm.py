"""The Megatron-LM glue (megatron_metp.megatron_lm) and the patch that calls it.

Everything here runs against megatron-core alone: no Megatron-LM checkout is needed (the
end-to-end run against a checkout is in tests/test_scripts.py).
"""

import argparse
import collections
import copy
import os
import re
import subprocess

import pytest

import megatron_metp.megatron_lm as megatron_lm_package
from megatron_metp import megatron_lm
from megatron_metp.megatron_lm import checks, releases
from tests.harness import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = {tag: os.path.join(REPO, "patches", tag, "0001-metp.patch")
           for tag in ("core_v0.16.1", "core_v0.19.0")}
PATCHED_FILES = {"pretrain_gpt.py", "megatron/training/arguments.py",
                 "megatron/training/initialize.py", "megatron/training/training.py"}


# ------------------------------------------------------------------------------ flags

def _parser():
    return megatron_lm.add_metp_args(argparse.ArgumentParser(allow_abbrev=False))


def test_add_metp_args_registers_flags_with_defaults_and_help():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    assert megatron_lm.add_metp_args(parser) is parser
    args = parser.parse_args([])
    assert args.metp_parallel_size == 1
    assert args.metp_disable_weight_ring is False
    assert args.metp_attention_kernel == "auto"
    assert args.metp_keep_intermediate is False
    assert args.metp_ring_timeout is None
    assert args.metp_vocab_parallel is False
    flags = {opt: a for a in parser._actions for opt in a.option_strings}
    for flag in ("--metp-parallel-size", "--metp-disable-weight-ring", "--metp-attention-kernel",
                 "--metp-keep-intermediate", "--metp-ring-timeout", "--metp-vocab-parallel"):
        assert flags[flag].help and len(flags[flag].help) > 30, flag
    assert tuple(flags["--metp-attention-kernel"].choices) == \
        ("auto", "cudnn", "flash_attn_3", "flash_attn", "torch_flash", "reference")
    group = [g for g in parser._action_groups if g.title.startswith("METP")]
    assert len(group) == 1 and "context-parallel" in group[0].description


def test_metp_flags_parse():
    args = _parser().parse_args(["--metp-parallel-size", "8", "--metp-disable-weight-ring",
                                 "--metp-attention-kernel", "torch_flash",
                                 "--metp-keep-intermediate", "--metp-ring-timeout", "30"])
    assert (args.metp_parallel_size, args.metp_disable_weight_ring, args.metp_attention_kernel,
            args.metp_keep_intermediate, args.metp_ring_timeout) == (8, True, "torch_flash",
                                                                     True, 30.0)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--metp-attention-kernel", "xformers"])


def test_offload_activations_flag_takes_an_optional_layer_count():
    """--metp-offload-activations [N]: no N = every layer (as before), N = the first N layers of
    each pipeline stage; N is refused before any work when it does not fit the stage or splits
    a uniform recompute chunk, naming the flag and the fix."""
    assert _parser().parse_args([]).metp_offload_activations is False
    assert _parser().parse_args(["--metp-offload-activations"]).metp_offload_activations is True
    assert _parser().parse_args(["--metp-offload-activations", "3"]).metp_offload_activations == 3
    for bad in ("0", "-1", "all"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--metp-offload-activations", bad])
    ok = _args(metp_parallel_size=4, num_layers=8, pipeline_model_parallel_size=2,
               metp_offload_activations=4)
    megatron_lm.validate_metp_args(ok)
    for kw, needle in ((dict(metp_offload_activations=5),
                        "--metp-offload-activations 5: 5 layers offloaded, but a pipeline stage "
                        "has 4 layers; offload 1 to 4"),
                       (dict(metp_offload_activations=3, recompute_granularity="full",
                             recompute_method="uniform", recompute_num_layers=2),
                        "offload a multiple of 2 (2, 4)"),
                       (dict(metp_offload_activations=2, num_layers_per_virtual_pipeline_stage=2),
                        "with a virtual pipeline")):
        args = _args(metp_parallel_size=4, num_layers=8, pipeline_model_parallel_size=2, **kw)
        with pytest.raises(ValueError) as err:
            megatron_lm.validate_metp_args(args)
        assert needle in str(err.value)
        assert args.context_parallel_size == 1  # refused before anything was mapped


def test_compose_extra_args_providers_keeps_other_providers():
    calls = []

    def modelopt_like(parser):
        calls.append("modelopt")
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    provider = megatron_lm.compose_extra_args_providers(None, modelopt_like,
                                                        megatron_lm.add_metp_args)
    parser = argparse.ArgumentParser()
    assert provider(parser) is parser and calls == ["modelopt"]
    args = parser.parse_args(["--export-te-mcore-model", "--metp-parallel-size", "2"])
    assert args.export_te_mcore_model and args.metp_parallel_size == 2
    assert provider.providers == (modelopt_like, megatron_lm.add_metp_args)

    def forgets_to_return(parser):
        parser.add_argument("--x")

    with pytest.raises(TypeError, match="forgets_to_return.*must return the parser"):
        megatron_lm.compose_extra_args_providers(forgets_to_return)(argparse.ArgumentParser())
    with pytest.raises(TypeError, match="not callable"):
        megatron_lm.compose_extra_args_providers("add_metp_args")


# ------------------------------------------------------------------------------ validation

def _args(**kw):
    """The attributes validate_metp_args reads, at Megatron's command-line defaults."""
    base = dict(
        metp_parallel_size=1, metp_disable_weight_ring=False, metp_attention_kernel="auto",
        metp_keep_intermediate=False, metp_ring_timeout=None, metp_vocab_parallel=False,
        make_vocab_size_divisible_by=128, world_size=8, rank=0,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=None,
        hierarchical_context_parallel_sizes=None, hybrid_context_parallel=False,
        seq_length=4096, num_experts=None, sequence_parallel=False, use_legacy_models=False,
        attention_dropout=0.0, spec=None, experimental_attention_variant=None,
        heterogeneous_layers_config_path=None, mtp_num_layers=None,
        multi_latent_attention=False, qk_layernorm=False, rotary_interleaved=False,
        squared_relu=False, num_attention_heads=32, group_query_attention=False,
        num_query_groups=1, ffn_hidden_size=11008, normalization="RMSNorm",
        no_persist_layer_norm=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_p1_leaves_args_untouched():
    args = _args(attention_dropout=0.1, sequence_parallel=True, tensor_model_parallel_size=8,
                 no_persist_layer_norm=False, num_experts=8, world_size=7)
    before = copy.deepcopy(vars(args))
    assert megatron_lm.validate_metp_args(args) is args
    assert vars(args) == before
    # another entry point (no METP flags at all)
    plain = argparse.Namespace(context_parallel_size=1)
    assert vars(megatron_lm.validate_metp_args(plain)) == {"context_parallel_size": 1}


def test_metp_is_mapped_onto_context_parallelism(capsys):
    args = _args(metp_parallel_size=8)
    megatron_lm.validate_metp_args(args)
    assert args.context_parallel_size == 8
    assert args.expert_model_parallel_size == 1  # only parallel_state gets the fold
    assert "context-parallel size 8" in capsys.readouterr().out
    megatron_lm.validate_metp_args(args)  # again: harmless
    assert args.context_parallel_size == 8
    # Megatron's own arithmetic after the hook: DP = world / (tp * pp * cp)
    assert args.world_size // (args.tensor_model_parallel_size * args.context_parallel_size) == 1


def test_metp_times_cp_maps_onto_context_parallelism_of_p_times_c(capsys):
    """--context-parallel-size c with METP is the outer factor: Megatron's CP size is p·c, the
    world TP × p × c × PP × DP; validating again keeps it (not p·c·c)."""
    args = _args(metp_parallel_size=8, context_parallel_size=4, world_size=64,
                 seq_length=16 * 2 ** 20)
    megatron_lm.validate_metp_args(args)
    assert args.context_parallel_size == 32
    assert "--context-parallel-size 4 (the outer factor" in capsys.readouterr().out
    megatron_lm.validate_metp_args(args)
    assert args.context_parallel_size == 32
    assert args.world_size // (args.tensor_model_parallel_size * args.context_parallel_size) == 2
    with pytest.raises(ValueError, match="2×METP×CP = 64"):
        megatron_lm.validate_metp_args(_args(metp_parallel_size=8, context_parallel_size=4,
                                             world_size=32, seq_length=4096 + 32))


def test_vocab_parallel_folds_metp_into_megatrons_vocab_padding(capsys):
    from megatron_metp.ops import padded_vocab_size

    args = _args(metp_parallel_size=4, world_size=8, tensor_model_parallel_size=2,
                 metp_vocab_parallel=True)
    megatron_lm.validate_metp_args(args)
    megatron_lm.validate_metp_args(args)  # again: the factor is applied once
    assert args.make_vocab_size_divisible_by == 128 * 4
    assert "vocabulary padded to a multiple of 128 x 2 x 4" in capsys.readouterr().out
    # Megatron's _vocab_size_with_padding: multiple of divisible_by * TP
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    padded = -(-50257 // multiple) * multiple
    assert padded == padded_vocab_size(50257, 128, 2, 4) and padded % (2 * 4 * 128) == 0
    # the switch without METP is refused, naming both flags
    with pytest.raises(ValueError, match="--metp-vocab-parallel needs --metp-parallel-size"):
        megatron_lm.validate_metp_args(_args(metp_vocab_parallel=True))
    # without the switch the vocabulary is padded as stock TP of size TP x METP pads it
    plain = _args(metp_parallel_size=4, world_size=8, tensor_model_parallel_size=2)
    megatron_lm.validate_metp_args(plain)
    assert plain.make_vocab_size_divisible_by == 128 * 4
    # and with METP off, as Megatron pads it
    off = _args(world_size=8, tensor_model_parallel_size=2)
    megatron_lm.validate_metp_args(off)
    assert off.make_vocab_size_divisible_by == 128


def test_sequence_parallel_with_tp1_is_left_to_megatron():
    args = _args(metp_parallel_size=2, world_size=2, sequence_parallel=True)
    megatron_lm.validate_metp_args(args)  # Megatron turns SP off itself when TP is 1
    assert args.context_parallel_size == 2


@pytest.mark.parametrize("kw,needles", [
    (dict(world_size=12), ["world size 12", "--metp-parallel-size"]),
    (dict(context_parallel_size=2, world_size=24), ["world size 24", "--context-parallel-size"]),
    (dict(seq_length=4100), ["--seq-length 4100", "2×METP = 16"]),
    (dict(num_experts=12), ["--num-experts 12 is not divisible by --metp-parallel-size 8"]),
    (dict(tensor_model_parallel_size=2, world_size=16, sequence_parallel=True),
     ["--sequence-parallel"]),
    (dict(attention_dropout=0.1), ["--attention-dropout 0.1", "--attention-dropout 0"]),
    (dict(expert_model_parallel_size=2), ["--expert-model-parallel-size 2"]),
    (dict(expert_tensor_parallel_size=2), ["--expert-tensor-parallel-size 2"]),
    (dict(use_legacy_models=True), ["--use-legacy-models"]),
    (dict(spec=["my.module", "layer_spec"]), ["--spec"]),
    (dict(mtp_num_layers=1), ["--mtp-num-layers 1", "multi-token prediction", "drop the flag"]),
    (dict(qk_l2_norm=True), ["--qk-l2-norm", "--qk-layernorm"]),
    (dict(window_size=(4096, 0)), ["--window-size (4096, 0)", "sliding-window"]),
    (dict(squared_relu=True), ["--squared-relu"]),
    (dict(num_attention_heads=36), ["--num-attention-heads 36", "TP x METP = 8"]),
    (dict(group_query_attention=True, num_query_groups=4), ["--num-query-groups 4"]),
    (dict(ffn_hidden_size=11004), ["--ffn-hidden-size 11004"]),
    (dict(no_persist_layer_norm=False), ["--no-persist-layer-norm"]),
    (dict(metp_ring_timeout=0.0), ["--metp-ring-timeout 0.0"]),
    (dict(metp_parallel_size=0), ["--metp-parallel-size must be >= 1"]),
])
def test_bad_metp_arguments_name_the_flag(kw, needles):
    args = _args(**{"metp_parallel_size": 8, **kw})
    cp_before = args.context_parallel_size
    with pytest.raises(ValueError) as err:
        megatron_lm.validate_metp_args(args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert args.context_parallel_size == cp_before  # nothing mapped on failure


def test_several_problems_are_reported_together():
    args = _args(metp_parallel_size=8, attention_dropout=0.1, qk_l2_norm=True)
    with pytest.raises(ValueError, match="--attention-dropout.*; --metp-parallel-size 8 cannot "
                                         "be used with: --qk-l2-norm"):
        megatron_lm.validate_metp_args(args)


def test_expert_model_parallel_size_for_parallel_state():
    assert megatron_lm.metp_expert_model_parallel_size(_args()) == 1
    assert megatron_lm.metp_expert_model_parallel_size(_args(expert_model_parallel_size=4)) == 4
    args = _args(metp_parallel_size=8)
    assert megatron_lm.metp_expert_model_parallel_size(args) == 8
    assert args.expert_model_parallel_size == 1
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2"):
        megatron_lm.metp_expert_model_parallel_size(_args(metp_parallel_size=8,
                                                          expert_model_parallel_size=2))


# ------------------------------------------------------------------------------ the builder

def _model_args(**kw):
    """What the builder reads from Megatron's args (a tiny GPT, METP 2)."""
    return _args(**{
        "world_size": 2, "metp_parallel_size": 2, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "seq_length": 32, "normalization": "LayerNorm",
        "padded_vocab_size": 128, "max_position_embeddings": 32, "fp16_lm_cross_entropy": False,
        "untie_embeddings_and_output_weights": False, "position_embedding_type": "rope",
        "rotary_percent": 1.0, "rotary_base": 10000, "use_rope_scaling": False,
        "yaml_cfg": None, **kw})


def _build(rank, world, fold=True, **kw):
    """Validate, initialise parallel state as the patched initialize.py does, then build through
    wrap_gpt_builder; returns what was built."""
    from megatron.core import parallel_state as ps

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import GPTSize, Layout, transformer_config

    cpu.enable()
    args = _model_args(**kw)
    megatron_lm.validate_metp_args(args)
    ep = megatron_lm.metp_expert_model_parallel_size(args) if fold else 1
    ps.initialize_model_parallel(context_parallel_size=args.context_parallel_size,
                                 expert_model_parallel_size=ep,
                                 create_gloo_process_groups=False)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    config = transformer_config(GPTSize(num_layers=1, hidden_size=32, num_attention_heads=4,
                                        ffn_hidden_size=64, vocab_size=128, seq_length=32),
                                Layout(metp=2))
    calls = []

    def stock(*a, **k):
        calls.append((a, k))
        return "stock model"

    builder = megatron_lm.wrap_gpt_builder(stock)
    try:
        model = builder(args, True, True, None, config=config, pg_collection=None)
    except (RuntimeError, ValueError) as exc:
        return {"error": str(exc)}
    layer = model.decoder.layers[0]
    return {"stock_calls": len(calls), "model": type(model).__name__,
            "tables": sorted((n, tuple(p.shape)) for n, p in model.named_parameters()
                             if "word_embeddings" in n or "output_layer" in n),
            "attention": type(layer.self_attention).__name__,
            "core": type(layer.self_attention.core_attention).__name__,
            "mlp": type(layer.mlp).__name__,
            "kernel": getattr(layer.self_attention, "kernel", None),
            "keep": getattr(layer.mlp, "keep_intermediate", None),
            "vocab": model.vocab_size, "tied": model.share_embeddings_and_output_weights,
            "timeout": layer.self_attention.core_attention.groups.metp.timeout_s}


def test_wrap_gpt_builder_delegates_unchanged_for_p1():
    calls = []

    def stock(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        calls.append((args, pre_process, post_process, vp_stage, config, pg_collection))
        return "stock model"

    builder = megatron_lm.wrap_gpt_builder(stock)
    args = _args()
    assert builder(args, True, False, 3, config="cfg", pg_collection="pgc") == "stock model"
    assert calls == [(args, True, False, 3, "cfg", "pgc")]
    assert builder.__name__ == "stock" and builder.metp_wrapped_builder is stock


def test_wrap_gpt_builder_builds_the_metp_spec_for_p_gt_1():
    out = run_ranks(_build, 2, metp_attention_kernel="reference", metp_keep_intermediate=True,
                    metp_ring_timeout=42.0)
    for r in out:
        assert r["stock_calls"] == 0
        assert (r["model"], r["attention"], r["core"], r["mlp"]) == \
            ("GPTModel", "METPSelfAttention", "METPRingCoreAttention", "METPMLP")
        assert r["kernel"] == "reference" and r["keep"] is True
        assert r["vocab"] == 128 and r["tied"] is True and r["timeout"] == 42.0


def test_wrap_gpt_builder_vocab_parallel():
    out = run_ranks(_build, 2, metp_vocab_parallel=True)
    for r in out:
        assert r["model"] == "METPGPTModel" and r["mlp"] == "METPMLP"
        assert r["tables"] == [("embedding.word_embeddings.weight", (64, 32))]  # tied, V/2 rows
    plain = run_ranks(_build, 2)[0]
    assert plain["tables"] == [("embedding.word_embeddings.weight", (128, 32))]
    untied = run_ranks(_build, 2, metp_vocab_parallel=True,
                       untie_embeddings_and_output_weights=True)[0]
    assert untied["tables"] == [("embedding.word_embeddings.weight", (64, 32)),
                                ("output_layer.weight", (64, 32))]
    bad = run_ranks(_build, 2, metp_vocab_parallel=True, padded_vocab_size=127)[0]
    assert "--metp-vocab-parallel" in bad["error"] and "127" in bad["error"]


def test_wrap_gpt_builder_ring_self_attention_baseline():
    out = run_ranks(_build, 2, metp_disable_weight_ring=True)
    for r in out:
        assert (r["attention"], r["core"], r["mlp"]) == \
            ("SelfAttention", "METPRingCoreAttention", "MLP")


def test_builder_refuses_parallel_state_without_the_expert_fold():
    out = run_ranks(_build, 2, fold=False)
    for r in out:
        assert "expert-model-parallel" in r["error"] and "apply_patches.sh" in r["error"]


# ------------------------------------------------------------------------------ the patch

Hunk = collections.namedtuple("Hunk", "file old_start old_len new_start new_len lines")


def _hunks(text):
    hunks, current = [], None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            current = None
        elif line.startswith("+++ b/"):
            current = line[6:]
        elif line.startswith("@@"):
            m = re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", line)
            assert m and current, line
            hunks.append(Hunk(current, *map(int, m.groups()), []))
        elif hunks and current and line[:1] in (" ", "+", "-") and not line.startswith("--- "):
            hunks[-1].lines.append(line)
    return hunks


@pytest.mark.parametrize("tag", sorted(PATCHES))
def test_patch_parses_and_touches_only_the_intended_files(tag):
    with open(PATCHES[tag]) as fh:
        text = fh.read()
    assert releases.by_tag(tag).commit in text  # says what it applies to
    stat = subprocess.run(["git", "apply", "--numstat", PATCHES[tag]], capture_output=True,
                          text=True, cwd=REPO)
    assert stat.returncode == 0, stat.stderr
    touched = {line.split("\t")[2] for line in stat.stdout.splitlines()}
    assert touched == PATCHED_FILES
    hunks = _hunks(text)
    assert {h.file for h in hunks} == PATCHED_FILES
    for h in hunks:  # the header counts match the body (git apply would call it corrupt)
        assert sum(1 for ln in h.lines if ln[0] != "+") == h.old_len, h
        assert sum(1 for ln in h.lines if ln[0] != "-") == h.new_len, h
    added = sum(1 for h in hunks for ln in h.lines if ln[0] == "+")
    # 18: two lines in training.py hand the DDP-wrapped chunks to wire_ddp
    assert added <= 18, f"the patch should stay tiny, it adds {added} lines"


_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


def _foreign_calls(patch_text):
    """Added code in ``patch_text`` that does anything but import/call megatron_lm's public
    functions (calls the replaced lines already made are allowed)."""
    public = set(megatron_lm_package.__all__)
    bad = []
    imports = collections.defaultdict(set)  # per file: names bound to megatron_lm
    for h in _hunks(patch_text):
        imported = imports[h.file]
        added = [ln[1:] for ln in h.lines if ln[0] == "+"]
        removed = [ln[1:] for ln in h.lines if ln[0] == "-"]
        old_calls = collections.Counter(c for ln in removed for c in _CALL.findall(ln))
        for line in added:
            code = line.split("#", 1)[0].strip()
            if not code:
                continue
            if code.startswith(("from ", "import ")):
                m = re.fullmatch(r"from megatron_metp\.megatron_lm import (\w+)|"
                                 r"from megatron_metp import megatron_lm as (\w+)", code)
                if not m or (m.group(1) and m.group(1) not in public):
                    bad.append(f"{h.file}: import {code}")
                elif m.group(1):
                    imported.add(m.group(1))
                else:
                    imported.add(m.group(2) + ".")
                continue
            for call in _CALL.findall(code):
                if old_calls[call] > 0:  # a call the replaced line already made
                    old_calls[call] -= 1
                    continue
                module_calls = tuple(i for i in imported if i.endswith("."))
                if not (call in imported or (module_calls and call.startswith(module_calls)
                                             and call.split(".")[-1] in public)):
                    bad.append(f"{h.file}: call {call}() in {code}")
            for ref in re.findall(r"\bmetp\.(\w+)", code):
                if ref not in public:
                    bad.append(f"{h.file}: metp.{ref} is not public")
    return bad


@pytest.mark.parametrize("tag", sorted(PATCHES))
def test_every_added_line_only_calls_megatron_lm(tag):
    with open(PATCHES[tag]) as fh:
        text = fh.read()
    assert _foreign_calls(text) == []
    # the check itself can fail
    evil = text.replace("+    validate_metp_args(args)\n",
                        "+    validate_metp_args(args)\n+    os.system('true')\n", 1)
    evil = re.sub(r"(@@ -\d+,6 \+\d+),10 @@", r"\1,11 @@", evil, count=1)
    assert _foreign_calls(evil) == ["megatron/training/arguments.py: call os.system() in "
                                    "os.system('true')"]
    assert _foreign_calls(text.replace("metp.add_metp_args", "metp._private", 1)) == \
        ["pretrain_gpt.py: metp._private is not public"]


# ------------------------------------------------------------- every Megatron flag: honoured or refused

@pytest.mark.parametrize("kw,needles", [
    (dict(fp8="hybrid"), ["--fp8-format hybrid", "drop --fp8-format"]),
    (dict(fp4="nvfp4"), ["--fp4-format nvfp4"]),
    (dict(tp_comm_overlap=True), ["--tp-comm-overlap", "drop it"]),
    (dict(use_flash_attn=True, metp_attention_kernel="reference"),
     ["--use-flash-attn with --metp-attention-kernel reference", "keep one"]),
    (dict(context_parallel_size=2, world_size=16, metp_disable_weight_ring=True),
     ["--metp-disable-weight-ring", "--context-parallel-size 2"]),
    (dict(recompute_activations=True, recompute_modules=["moe_act"]),
     ["--recompute-activations", "module 'moe_act' is refused", "--recompute-granularity full"]),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
     ["--recompute-granularity selective", "module 'mlp' is refused"]),
    (dict(cpu_offloading=True), ["--cpu-offloading", "--metp-offload-activations"]),
    (dict(fine_grained_activation_offloading=True),
     ["--fine-grained-activation-offloading", "--metp-offload-activations"]),
    (dict(distribute_saved_activations=True), ["--distribute-saved-activations"]),
])
def test_megatron_flags_metp_cannot_honour_are_refused(kw, needles):
    args = _args(**{"metp_parallel_size": 8, **kw})
    with pytest.raises(ValueError) as err:
        megatron_lm.validate_metp_args(args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_megatron_flags_metp_honours_are_mapped_with_a_note(capsys, monkeypatch):
    # --use-flash-attn selects the flash-attn block kernel (when flash-attn is importable)
    monkeypatch.setattr(checks, "_have_module", lambda name: True)
    from megatron_metp.megatron import gpu_stack

    monkeypatch.setattr(gpu_stack, "have_transformer_engine", lambda: False)
    args = _args(metp_parallel_size=8, use_flash_attn=True, transformer_impl="transformer_engine",
                 sequence_parallel=True)
    megatron_lm.validate_metp_args(args)
    out = capsys.readouterr().out
    assert args.metp_attention_kernel == "flash_attn" and "--use-flash-attn" in out
    assert "--transformer-impl transformer_engine: transformer-engine is not installed here" in out
    assert "--sequence-parallel with TP 1: Megatron turns it off" in out
    # without flash-attn installed the flag is refused, naming the package
    monkeypatch.setattr(checks, "_have_module", lambda name: name != "flash_attn")
    with pytest.raises(ValueError, match="flash-attn package is not installed"):
        megatron_lm.validate_metp_args(_args(metp_parallel_size=8, use_flash_attn=True))
    # the recompute that works: full, whole layers
    ok = _args(metp_parallel_size=8, recompute_granularity="full", recompute_method="uniform",
               recompute_num_layers=1)
    megatron_lm.validate_metp_args(ok)
    assert ok.context_parallel_size == 8
