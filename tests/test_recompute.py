"""Megatron's activation recompute with METP: full and selective recompute are exact, the rest
is refused.

``recompute_granularity="full"`` makes Megatron's ``TransformerBlock`` wrap layers in
``tensor_parallel.checkpoint`` and re-run their forward in backward, and with it the METP rings
(weight ring, head-group broadcasts, K/V ring). Each forked group below trains the same tiny GPT
from the same weights several times in one process, without and with recompute (uniform 1 and
2, block 1), with Megatron's DDP, optimizer and pipeline schedules
(``megatron_metp.megatron.training``), and compares losses, grad norms and every gradient
(fp32: within 1e-6; on the CPU they come out bit-identical). The ring counters show that the
recompute re-ran the rings, once per recomputed layer. With hidden dropout the comparison also
checks that the RNG states (CPU generator and tracker, through ``megatron_metp.megatron.cpu``'s shims) are
restored for the recompute. Negative controls: a perturbed initial weight, and dropout with the
RNG restore switched off, are caught by the same comparison. Selective recompute
(megatron/selective.py) runs ``core_attn`` and ``layernorm`` in the METP layer, exactly, with the
recompute observed (the bytes autograd saves, the ring steps, the norm calls; negative control: a
re-formed attention output 0.1 % off), and refuses the other modules;
``--distribute-saved-activations`` and ``--cpu-offloading`` are refused, through the Megatron-LM
arguments and through the project's own model building.
"""

import dataclasses

import pytest
import torch

from megatron_metp import megatron_lm
from megatron_metp.ops import attention as attention_op
from megatron_metp.megatron.training import (GPTSize, Layout, init_parallel, setup,
                                             transformer_config)
from tests.gpt_cases import SIZE
from tests.grads import assert_same, differences, run_result, train_grabbing
from tests.harness import run_ranks
from tests.test_megatron_lm import _args as megatron_lm_args

STEPS = 3
#: what "equal" means between a run and its recompute twin (same layout, fp32)
SAME = 1e-6
#: across layouts (METP vs stock TP vs one rank): fp32 rounding of different reduction orders
CROSS = 1e-5

RECOMPUTE = {
    "uniform1": dict(recompute="full", recompute_method="uniform", recompute_num_layers=1),
    "uniform2": dict(recompute="full", recompute_method="uniform", recompute_num_layers=2),
    "block1": dict(recompute="full", recompute_method="block", recompute_num_layers=1),
}


def _variants(rank, world, size, base, variants, steps=STEPS, probe_builds=False):
    """Train ``size`` for ``steps`` steps once per ``(name, options)`` of ``variants`` on the
    parallel state of ``base``. ``options``: ``layout`` (Layout fields over ``base``), ``seed``
    (initial weights), ``break_rng_restore`` (Megatron's checkpoint does not restore the RNG
    states for the recompute). Returns per name: losses, grad norms, this rank's gradients after
    step 1 (DDP's reduced ``main_grad``) and the METP ring counters."""
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(base, size.seq_length)
    restore = mrandom._set_all_rng_states
    out = {}
    for name, opts in variants:
        layout = dataclasses.replace(base, **opts.get("layout", {}))
        torch.manual_seed(1234)
        mrandom.model_parallel_cuda_manual_seed(1234)
        state = setup(size, layout, seed=opts.get("seed", 1234))
        if opts.get("perturb_core_recompute"):
            _perturb_core_recompute()
        if opts.get("break_rng_restore"):
            # the recompute keeps whatever RNG state it finds (the tracker's is still restored)
            def tracker_only(cpu_state, cuda_state, tracker_states):
                mrandom.get_cuda_rng_tracker().set_states(tracker_states)

            mrandom._set_all_rng_states = tracker_only
        layers = state["model"].module.decoder.layers
        norms = _count_norm_calls(layers)
        saved = [0]

        def pack(t):  # every tensor autograd saves in this run, by its bytes
            saved[0] += t.numel() * t.element_size()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                recs, grads = train_grabbing(size, layout, steps, state)
        finally:
            mrandom._set_all_rng_states = restore
            attention_op.ring_attention_forward = RING_FORWARD
        out[name] = run_result(recs, grads, ring=state["groups"].metp.stats.snapshot(),
                               describe=layout.describe(), saved_bytes=saved[0],
                               norm_calls=norms[0],
                               streaming=any(getattr(m, "stream", False) for m in layers))
    if probe_builds:
        out["refused"] = _refused_builds(size)
    return out


RING_FORWARD = attention_op.ring_attention_forward


def _perturb_core_recompute():
    """The negative control of selective ``core_attn``: the backward's re-run of the K/V ring
    forward (the only call without ``kv_packed``) re-forms O 0.1 % too large."""
    def perturbed(*args, **kwargs):
        res = RING_FORWARD(*args, **kwargs)
        if kwargs.get("kv_packed") is None:
            kwargs["out"].mul_(1.001)
        return res

    attention_op.ring_attention_forward = perturbed


def _count_norm_calls(layers):
    """A one-element list counting the calls of every layer's ``input_layernorm`` and
    ``pre_mlp_layernorm`` (forward, and the recompute of selective ``layernorm``)."""
    count = [0]

    def hook(*_):
        count[0] += 1

    for layer in layers:
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            norm.register_forward_hook(hook)
    return count


def _refused_builds(size):
    """Build GPTModel with a TransformerConfig that bypassed Layout's check (as Megatron-LM's
    core_transformer_config_from_args would hand it over): the METP modules refuse it."""
    from megatron.core.models.gpt import GPTModel

    from megatron_metp.megatron.groups import METPGroups
    from megatron_metp.megatron.spec import get_gpt_layer_metp_spec

    groups = METPGroups.from_parallel_state()
    msgs = {}
    for weight_ring in (True, False):
        for field, value in (("recompute_granularity", "selective"),
                             ("distribute_saved_activations", True)):
            cfg = transformer_config(size, Layout(metp=2))
            setattr(cfg, field, value)
            if weight_ring and field == "recompute_granularity":  # core_attn runs there
                cfg.recompute_modules = ["core_attn", "mlp"]
            try:
                GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_metp_spec(
                    groups, weight_ring=weight_ring), vocab_size=size.vocab_size,
                    max_sequence_length=size.seq_length, position_embedding_type="rope")
                msgs[(weight_ring, field)] = None
            except ValueError as exc:
                msgs[(weight_ring, field)] = str(exc)
    return msgs


def _assert_same(per_rank, ref, names):
    assert_same(per_rank, ref, names, SAME)


def _assert_rings_rerun(res, plain, u1, u2, b1):
    """Megatron's recompute re-runs each recomputed layer's forward rings once: uniform 2 (all
    layers) adds twice the traffic of block 1 (first layer of each stage, 2 layers). Uniform 1
    runs the streaming layer op (megatron/streaming.py; METP_STREAMING_LAYER=0 restores
    Megatron's checkpoint): its backward re-runs the attention rings but not the MLP's forward
    ring, and gathers the projection weights for its row passes."""
    extra = {k: res[k]["ring"]["steps"] - res[plain]["ring"]["steps"] for k in (u1, u2, b1)}
    assert extra[u2] > 0 and extra[u2] == 2 * extra[b1], extra
    sent = {k: res[k]["ring"]["bytes_sent"] - res[plain]["ring"]["bytes_sent"] for k in (u2, b1)}
    assert sent[u2] == 2 * sent[b1] > 0, sent
    assert not res[u2]["streaming"] and not res[b1]["streaming"]
    if res[u1]["streaming"]:
        assert extra[u1] > 0, extra
    else:  # TP > 1 inside the METP layer: Megatron's checkpoint, like uniform 2
        assert extra[u1] == extra[u2], extra


def _recompute_variants(prefix="", layout=None, **extra_layout):
    return [(prefix + name, {"layout": {**(layout or {}), **kw, **extra_layout}})
            for name, kw in RECOMPUTE.items()]


#: Megatron's selective recompute (megatron/selective.py): what runs with METP layers
SELECTIVE = {
    "sel-core": {"layout": {"recompute": "selective"}},  # Megatron's default: core_attn
    "sel-ln": {"layout": {"recompute": "selective", "recompute_modules": ["layernorm"]}},
    "sel-core-ln": {"layout": {"recompute": "selective",
                               "recompute_modules": ["core_attn", "layernorm"]}},
}

SWIGLU = GPTSize(**{**SIZE.__dict__, "swiglu": True})


# ---------------------------------------------------------------- METP 2 (+ vocabulary ring)

@pytest.fixture(scope="module")
def metp2():
    dropout = {"extra": {"hidden_dropout": 0.1}}
    variants = [("plain", {})] + _recompute_variants() + [
        ("perturbed", {"layout": RECOMPUTE["uniform1"], "seed": 1235}),
        ("vocab", {"layout": {"vocab_parallel": True}}),
        *_recompute_variants("vocab-", vocab_parallel=True),
        ("dropout", {"layout": dropout}),
        ("dropout-uniform1", {"layout": {**dropout, **RECOMPUTE["uniform1"]}}),
        ("dropout-no-rng-restore", {"layout": {**dropout, **RECOMPUTE["uniform1"]},
                                    "break_rng_restore": True}),
        *SELECTIVE.items(),
        ("sel-core-perturbed", {"layout": SELECTIVE["sel-core"]["layout"],
                                "perturb_core_recompute": True}),
    ]
    return run_ranks(_variants, 2, SWIGLU, Layout(metp=2), variants, timeout=300,
                     probe_builds=True)


def test_metp_modules_refuse_selective_and_distributed_when_built(metp2):
    """Built with a TransformerConfig that bypassed Layout's check: the METP layers refuse
    selective ``mlp`` (naming the module), the ring baseline every selective module."""
    for res in metp2:
        for (weight_ring, field), msg in res["refused"].items():
            needle = ("distribute_saved_activations=True (--distribute-saved-activations)"
                      if field != "recompute_granularity" else
                      "module 'mlp' is refused with METP layers" if weight_ring else
                      "--metp-disable-weight-ring")
            assert msg is not None and needle in msg, (weight_ring, field, msg)
            if field == "recompute_granularity" and weight_ring:
                assert "'core_attn'" not in msg.split("(", 2)[-1], msg  # core_attn runs


def test_metp2_full_recompute_is_exact(metp2):
    _assert_same(metp2, "plain", ["uniform1", "uniform2", "block1"])
    for res in metp2:
        assert res["uniform1"]["streaming"]  # the streaming layer op (megatron/streaming.py)
        assert not res["dropout-uniform1"]["streaming"]  # hidden dropout: Megatron's checkpoint
        _assert_rings_rerun(res, "plain", "uniform1", "uniform2", "block1")
        assert "+recompute=full/uniform/1" in res["uniform1"]["describe"]


def test_selective_recompute_runs_in_the_metp_layer_and_is_exact(metp2):
    """``core_attn``: the METP attention keeps neither O nor its LSE (the bytes autograd saves
    drop by exactly theirs: per call ``s/p·b·A·d`` and ``b·A·s/p``, fp32: every head of the
    rank's tokens) and its
    backward re-runs the K/V ring forward (more ring steps); ``layernorm``: every norm runs
    twice (the forward, the re-formed output in backward), no ring re-run. Gradients, losses and
    grad norms equal the plain run's (bit-identical on the CPU); the negative control, a
    re-formed O 0.1 % off, is caught by the same comparison."""
    _assert_same(metp2, "plain", list(SELECTIVE))
    n, heads = SWIGLU.seq_length // 2, SWIGLU.num_attention_heads  # METP 2
    d = SWIGLU.hidden_size // heads
    calls = STEPS * Layout().global_batch_size * SWIGLU.num_layers  # micro-batches 1, DP 1
    kept = calls * (n * heads * d * 4 + heads * n * 4)  # O and LSE, fp32, b = 1
    for res in metp2:
        plain, core, ln, both = (res[k] for k in ("plain", "sel-core", "sel-ln", "sel-core-ln"))
        assert plain["saved_bytes"] - core["saved_bytes"] == kept, \
            (plain["saved_bytes"], core["saved_bytes"], kept)
        assert core["ring"]["steps"] > plain["ring"]["steps"] == ln["ring"]["steps"]
        assert both["ring"]["steps"] == core["ring"]["steps"]
        assert core["norm_calls"] == plain["norm_calls"] > 0
        assert ln["norm_calls"] == both["norm_calls"] == 2 * plain["norm_calls"]
        assert "+recompute=selective/core_attn" in core["describe"]
        loss, norm, (worst, err), identical = differences(plain, res["sel-core-perturbed"])
        assert not identical and err > 100 * SAME, (worst, err)


def test_metp2_vocab_ring_full_recompute_is_exact(metp2):
    _assert_same(metp2, "vocab", ["vocab-uniform1", "vocab-uniform2", "vocab-block1"])
    for res in metp2:
        _assert_rings_rerun(res, "vocab", "vocab-uniform1", "vocab-uniform2", "vocab-block1")
        # the vocabulary ring is outside the block: same losses as the replicated vocabulary
        assert max(abs(a - b) / b for a, b in zip(res["vocab"]["losses"],
                                                  res["plain"]["losses"])) <= CROSS


def test_recompute_restores_the_cpu_rng_state_for_dropout(metp2):
    """Hidden dropout draws from the CPU generator (megatron_metp.megatron.cpu's tracker): the recompute
    must draw the same masks as the first forward, so dropout + recompute equals dropout."""
    _assert_same(metp2, "dropout", ["dropout-uniform1"])
    for res in metp2:
        assert res["dropout"]["losses"] != res["plain"]["losses"]  # dropout did something


def test_negative_controls_are_caught_by_the_same_comparison(metp2):
    for res in metp2:
        for ref, name in (("plain", "perturbed"), ("dropout", "dropout-no-rng-restore")):
            loss, norm, (worst, err), identical = differences(res[ref], res[name])
            assert not identical and err > 100 * SAME and loss > 10 * SAME, (name, worst, err)


# ---------------------------------------------------------------- METP 3, TP x METP, PP x METP

@pytest.mark.parametrize("world,layout,size", [
    (3, Layout(metp=3), SIZE),
    (4, Layout(metp=2, tp=2), SIZE),
    (4, Layout(metp=2, pp=2), GPTSize(**{**SIZE.__dict__, "num_layers": 4})),
], ids=["metp3", "metp2xtp2", "metp2xpp2"])
def test_full_recompute_is_exact_in_compositions(world, layout, size):
    variants = [("plain", {})] + _recompute_variants()
    out = run_ranks(_variants, world, size, layout, variants, timeout=300)
    _assert_same(out, "plain", ["uniform1", "uniform2", "block1"])
    for res in out:
        _assert_rings_rerun(res, "plain", "uniform1", "uniform2", "block1")
        assert res["uniform1"]["streaming"] == (layout.tp == 1)  # TP > 1: Megatron's checkpoint


# ---------------------------------------------------------------- the reference chain

def test_metp_recompute_matches_stock_tp_and_single_rank(metp2):
    """METP 2 with recompute = stock TP 2 (with and without recompute) = one rank."""
    variants = [("plain", {}), ("uniform1", {"layout": RECOMPUTE["uniform1"]})]
    stock = run_ranks(_variants, 2, SWIGLU, Layout(tp=2, mode="tp"), variants)
    single = run_ranks(_variants, 1, SWIGLU, Layout(), variants[:1])[0]["plain"]
    _assert_same(stock, "plain", ["uniform1"])
    ref_losses, ref_norms = single["losses"], single["norms"]
    for got in (metp2[0]["uniform1"], metp2[0]["block1"], metp2[0]["vocab-uniform1"],
                stock[0]["plain"]):
        for step, (loss, norm, ref_loss, ref_norm) in enumerate(zip(
                got["losses"], got["norms"], ref_losses, ref_norms)):
            assert abs(loss - ref_loss) <= CROSS * ref_loss, (got["describe"], step, loss)
            assert abs(norm - ref_norm) <= CROSS * ref_norm, (got["describe"], step, norm)


# ---------------------------------------------------------------- refused: Megatron-LM args

def _args(**kw):
    """METP 2 on 2 ranks at Megatron's command-line defaults, the recompute/offload flags too."""
    base = dict(metp_parallel_size=2, world_size=2,
                # Megatron-LM's defaults for the recompute/offload flags (before validate_args)
                recompute_activations=False, recompute_granularity=None, recompute_method=None,
                recompute_num_layers=None, recompute_modules=None,
                distribute_saved_activations=False, cpu_offloading=False,
                cpu_offloading_num_layers=0)
    base.update(kw)
    return megatron_lm_args(**base)


@pytest.mark.parametrize("kw,needles", [
    (dict(recompute_granularity="selective", recompute_modules=["mlp"]),
     ["--recompute-granularity selective --recompute-modules mlp", "module 'mlp' is refused",
      "--recompute-granularity full"]),
    (dict(recompute_activations=True, metp_disable_weight_ring=True),
     ["--recompute-activations --recompute-modules core_attn", "--metp-disable-weight-ring",
      "--recompute-granularity full"]),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
     ["--recompute-modules core_attn mlp", "--recompute-granularity full"]),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
          distribute_saved_activations=True, tensor_model_parallel_size=2, world_size=4),
     ["--distribute-saved-activations", "TP only"]),
    (dict(cpu_offloading=True), ["--cpu-offloading", "--metp-offload-activations"]),
    (dict(cpu_offloading_num_layers=2), ["--cpu-offloading", "--metp-offload-activations"]),
], ids=["selective", "recompute-activations", "recompute-modules", "distribute-saved",
        "cpu-offloading", "cpu-offloading-num-layers"])
def test_megatron_lm_args_refuse_selective_distribute_and_cpu_offloading(kw, needles):
    args = _args(**kw)
    with pytest.raises(ValueError) as err:
        megatron_lm.validate_metp_args(args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert args.context_parallel_size == 1  # refused before anything was mapped


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_megatron_lm_args_accept_full_recompute(method):
    args = _args(recompute_granularity="full", recompute_method=method, recompute_num_layers=2)
    megatron_lm.validate_metp_args(args)
    assert args.context_parallel_size == 2
    # selective: Megatron's default module (core_attn), --recompute-activations, and layernorm
    for kw in (dict(recompute_granularity="selective"), dict(recompute_activations=True),
               dict(recompute_granularity="selective",
                    recompute_modules=["core_attn", "layernorm"])):
        args = _args(**kw)
        megatron_lm.validate_metp_args(args)
        assert args.context_parallel_size == 2, kw
    # METP off: Megatron's own recompute options are not METP's business
    plain = _args(metp_parallel_size=1, recompute_granularity="selective",
                  distribute_saved_activations=True, cpu_offloading=True)
    assert megatron_lm.validate_metp_args(plain) is plain


# ---------------------------------------------------------------- refused: the project's model

@pytest.mark.parametrize("mode", ["metp", "ring"])
@pytest.mark.parametrize("extra,needles", [
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]},
     ["recompute_granularity='selective'", "module 'moe' is refused", "--metp-moe-token-tiles",
      "--recompute-granularity full"]),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
     ["recompute_granularity='selective'", "['mlp']"]),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
      "distribute_saved_activations": True}, ["--distribute-saved-activations"]),
    ({"cpu_offloading": True}, ["--cpu-offloading", "--metp-offload-activations"]),
], ids=["selective", "selective-mlp", "distribute-saved", "cpu-offloading"])
def test_layout_extra_refuses_them_before_building(mode, extra, needles):
    with pytest.raises(ValueError) as err:
        transformer_config(SIZE, Layout(metp=2, mode=mode, extra=extra))
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.filterwarnings("ignore:If you are using transformer_engine")
def test_stock_layout_keeps_megatrons_own_recompute_options():
    cfg = transformer_config(SIZE, Layout(tp=2, mode="tp",
                                          extra={"recompute_granularity": "selective"}))
    assert cfg.recompute_granularity == "selective"


def test_modules_refuse_a_config_that_reaches_them():
    """A TransformerConfig built elsewhere (Megatron-LM's core_transformer_config_from_args)
    reaches the METP modules' own check."""
    from megatron_metp.megatron.modules import check_config, check_recompute_config

    ok = transformer_config(SIZE, Layout(metp=2, **RECOMPUTE["block1"]))
    check_config(ok)
    for field, value, needle in (
            ("recompute_modules", ["layernorm", "mlp"], "module 'mlp' is refused"),
            ("distribute_saved_activations", True, "--distribute-saved-activations"),
            ("cpu_offloading", True, "--metp-offload-activations")):
        cfg = transformer_config(SIZE, Layout(metp=2))
        setattr(cfg, field, value)
        if field == "recompute_modules":
            cfg.recompute_granularity = "selective"
            cfg.recompute_modules = ["layernorm"]  # runs
            check_config(cfg)
            cfg.recompute_modules = value
        for check in (check_config, check_recompute_config):
            with pytest.raises(ValueError, match="--metp-parallel-size does not support") as err:
                check(cfg)
            assert needle in str(err.value)


def test_layout_recompute_fields_set_the_config_and_are_validated():
    cfg = transformer_config(SIZE, Layout(metp=2, recompute="full", recompute_method="block",
                                          recompute_num_layers=2))
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == \
        ("full", "block", 2)
    plain = transformer_config(SIZE, Layout(metp=2, extra={"hidden_dropout": 0.25}))
    assert plain.recompute_granularity is None and plain.hidden_dropout == 0.25  # extra works
    bad = [("recompute", dict(recompute="always")),
           ("recompute_method", dict(recompute="full", recompute_method="blocks")),
           ("recompute_num_layers", dict(recompute="full", recompute_num_layers=0)),
           ("recompute_num_layers", dict(recompute="full", recompute_num_layers="1"))]
    for field, kw in bad:
        with pytest.raises(ValueError, match=f"Layout.{field} must"):
            Layout(metp=2, **kw)
    sel = transformer_config(SIZE, Layout(metp=2, recompute="selective"))
    assert (sel.recompute_granularity, sel.recompute_modules) == ("selective", ["core_attn"])
    for kw, needle in ((dict(recompute_modules=["mlp"]), "module 'mlp' is refused"),
                       (dict(recompute_modules=["attn"]), "'attn' is not a Megatron-LM"),
                       (dict(recompute_modules=["layernorm"], offload_activations=True),
                        "'layernorm' with --metp-offload-activations"),
                       (dict(mode="ring"), "--metp-disable-weight-ring")):
        with pytest.raises(ValueError, match="Layout.recompute='selective'") as err:
            Layout(metp=2, recompute="selective", **kw)
        assert needle in str(err.value), (kw, str(err.value))
    with pytest.raises(ValueError, match="needs recompute='selective'"):
        Layout(metp=2, recompute="full", recompute_modules=["core_attn"])
    # against the layers of a pipeline stage (2 layers, PP 2: one per stage)
    for kw in (dict(recompute_num_layers=3), dict(recompute_num_layers=2, pp=2),
               dict(recompute_num_layers=2, recompute_method="block", pp=2)):
        with pytest.raises(ValueError, match="Layout.recompute_num_layers"):
            transformer_config(SIZE, Layout(metp=2, recompute="full", **kw))
    with pytest.raises(ValueError, match="does not divide"):
        transformer_config(GPTSize(**{**SIZE.__dict__, "num_layers": 3}),
                           Layout(metp=2, recompute="full", recompute_num_layers=2))


def test_preflight_refuses_layernorm_recompute_on_gpu_ranks_without_transformer_engine(
        monkeypatch):
    """Megatron's output-discarding checkpoint (selective ``layernorm``) needs Transformer
    Engine on GPU ranks; CPU ranks run it through the shim (megatron/cpu.py (k)); other
    modules need nothing. (Whether TE is importable is set here, either way.)"""
    import importlib.util

    from megatron_metp.megatron_lm.preflight import job_problems

    real = importlib.util.find_spec
    te = {"installed": False}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (real("torch") if te["installed"] else None) if name == "transformer_engine"
        else real(name, *a)))
    argv = ["--metp-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--mock-data", "--recompute-granularity", "selective"]
    ln = argv + ["--recompute-modules", "core_attn", "layernorm"]
    needle = "--recompute-modules layernorm needs Transformer Engine on GPU ranks"

    def refused(*a, **kw):
        return any(needle in p for p in job_problems(*a, **kw))

    assert refused(ln, 2)
    assert not refused(ln, 2, cpu=True) and not refused(argv, 2)  # core_attn needs no TE
    te["installed"] = True
    assert not refused(ln, 2)
