"""Keep attention, recompute the rest (``--metp-keep-attention-output``, issue 41), separate ops.

Under Megatron's full recompute (``tensor_parallel.checkpoint``, here two layers per chunk or
one per block, where the layers run the separate METP ops) each kept layer's first forward
queues every head group's attention output ``O`` and fp32 LSE
(:mod:`megatron_metp.megatron.keep_attention`), and the re-run inside the backward takes them
instead of running the K/V ring. Each forked group trains the same tiny GPT from the same weights
with Megatron's DDP, optimizer and pipeline schedules (2 micro-batches per step), with full
recompute and with the kept attention, and compares losses, grad norms and every gradient
(fp32: within 1e-6) at METP 2 and 3, METP 2 x CP 2, TP 2 x METP 2, METP 2 x PP 2 (1F1B: two
micro-batches in flight per stage), packed documents and a MoE model, with and without the host
offload. The
point is counted: the attention forward's ring runs once per kept layer and micro-batch instead
of twice. Negative controls: a perturbed kept ``O`` or LSE changes the gradients; a forward that
has no backward keeps nothing; a re-run handed another micro-batch's ``O`` is refused.
"""

import dataclasses

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from tests.gpt_cases import SIZE
from tests.grads import assert_same, differences, run_result
from tests.harness import run_ranks

STEPS = 2
#: what "equal" means between the kept attention and full recompute (same layout, fp32)
SAME = 1e-6
#: Megatron's checkpoint of chunks of two layers (the streaming layer op takes one per chunk)
FULL = dict(recompute="full", recompute_method="uniform", recompute_num_layers=2)
#: one layer per chunk: the streaming layer op (megatron/streaming.py)
UNIFORM1 = dict(recompute="full", recompute_method="uniform", recompute_num_layers=1)
#: every layer its own chunk (block): both layers, the MoE model's 3 layers
BLOCK2 = dict(recompute="full", recompute_method="block", recompute_num_layers=2)
BLOCK3 = dict(recompute="full", recompute_method="block", recompute_num_layers=3)
#: micro-batches per step (global batch 2, micro-batch 1, DP 1)
MICRO = 2
EOD = 5
#: 3 layers: MoE, dense, MoE; head dim 4
MOE = GPTSize(num_layers=3, hidden_size=48, num_attention_heads=12, num_query_groups=12,
              ffn_hidden_size=48, vocab_size=72, seq_length=SIZE.seq_length, num_experts=4,
              moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=2, bias=False)
MOE_EXTRA = {"moe_token_dispatcher_type": "allgather", "moe_aux_loss_coeff": 0.0}


def _packed_batch(size, step, global_batch_size):
    """The training loop's batch with documents ending at tokens 6 and 15 (EOD)."""
    from megatron_metp.megatron.training import global_batch

    tokens, labels = global_batch(size, step, global_batch_size)
    tokens[:, [6, 15]] = EOD
    return tokens, labels


def _grab(size, layout, steps, state, batch_fn):
    """Train ``steps`` steps; per step (loss, grad norm) and every gradient after step 1."""
    from megatron_metp.megatron.training import _global_name, train

    grads = {}

    def grab(step, st):
        if step == 1:
            model = st["model"].module
            for pname, p in model.named_parameters():
                grads[_global_name(model, pname)] = p.main_grad.detach().clone()

    recs = train(size, layout, steps, state=state, checkpoint_fn=grab, batch_fn=batch_fn)
    return recs, grads


def _perturbing(what):
    """``AttentionKeeper.put`` that adds 1e-2 to the first kept ``O`` or LSE before queuing it
    (after the first forward formed its output from it)."""
    from megatron_metp.megatron.keep_attention import AttentionKeeper

    put = AttentionKeeper.put

    def perturbed(self, outs, lses, fingerprint):
        (outs if what == "out" else lses)[0].add_(1e-2)
        put(self, outs, lses, fingerprint)
    return perturbed


def _unpaired(state, size, layout):
    """Negative controls on a trained keeping model: a forward under ``torch.no_grad()`` keeps
    nothing; two forwards with autograd, then the backward of the second: its re-run finds the
    first one's ``O`` and is refused."""
    from megatron_metp.megatron.keep_attention import pending
    from megatron_metp.megatron.training import _microbatches

    model = state["model"].module
    batches = _microbatches(size, layout, 5)
    first, second = next(batches), next(batches)

    def run(batch):
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    out = {}
    with torch.no_grad():
        run(first)
    out["after_no_grad"] = pending(model.decoder)
    run(first)
    loss = run(second).sum()
    out["after_two_forwards"] = pending(model.decoder)
    try:
        loss.backward()
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    return out


def _keep_runs(rank, world, base, variants, steps=STEPS, unpaired=None):
    """Train each ``(name, options)`` of ``variants`` on the parallel state of ``base``.
    ``options``: ``layout`` (Layout fields over ``base``), ``size`` (default ``SIZE``),
    ``packed`` (documents), ``perturb`` (``"out"``/``"lse"``). Returns per name: losses, grad
    norms, gradients after step 1, the calls of the attention forward's ring, the keepers'
    statistics, what is still queued after the steps and the offloader's host bytes."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_metp.ops.attention as attention
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.keep_attention import AttentionKeeper, keep_stats, pending
    from megatron_metp.megatron.training import init_parallel, setup
    from megatron_metp.runtime.offload import ActivationOffloader

    cpu.enable()
    init_parallel(base, SIZE.seq_length)
    ring_forward, calls = attention.ring_attention_forward, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return ring_forward(*args, **kwargs)

    attention.ring_attention_forward = counted
    put = AttentionKeeper.put
    out = {}
    for name, opts in variants:
        size = opts.get("size", SIZE)
        layout = dataclasses.replace(base, **opts.get("layout", {}))
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        state = setup(size, layout)
        decoder = state["model"].module.decoder
        calls[0] = 0
        if opts.get("perturb"):
            AttentionKeeper.put = _perturbing(opts["perturb"])
        try:
            recs, grads = _grab(size, layout, steps, state,
                                _packed_batch if opts.get("packed") else None)
        finally:
            AttentionKeeper.put = put
        stats = keep_stats(decoder)
        off = ActivationOffloader.attached_to(decoder)
        out[name] = run_result(
            recs, grads, ring_calls=calls[0], pending=pending(decoder),
            stats=None if stats is None else dataclasses.asdict(stats),
            host_bytes=None if off is None else off.stats.host_bytes,
            host_peak=None if off is None else off.stats.host_peak,
            streaming=any(getattr(m, "stream", False) for m in decoder.layers),
            ring={**state["groups"].metp.stats.snapshot(),
                  "blocks": sum(state["groups"].metp.stats.blocks.values())},
            describe=layout.describe())
        if unpaired == name:
            out["unpaired"] = _unpaired(state, size, layout)
    return out


def _assert_same(per_rank, ref, names):
    assert_same(per_rank, ref, names, SAME)


def _assert_ring_once(per_rank, full, keep, kept_layers, blocks):
    """The kept run ran the attention forward's ring once fewer per kept layer, micro-batch and
    head-group block than full recompute (which runs it twice per layer), launched fewer
    attention kernels, posted fewer ring exchanges and sent fewer bytes, and queued, took and
    freed one entry per kept layer and micro-batch."""
    for res in per_rank:
        saved = kept_layers * MICRO * STEPS * blocks
        assert res[full]["ring_calls"] - res[keep]["ring_calls"] == saved > 0, \
            (res[full]["ring_calls"], res[keep]["ring_calls"], saved)
        # fewer attention kernel launches, ring exchanges and bytes (no K/V block travels)
        for what in ("blocks", "steps", "bytes_sent"):
            assert res[keep]["ring"][what] < res[full]["ring"][what], (what, res[keep]["ring"])
        st = res[keep]["stats"]
        assert st["kept"] == st["taken"] == kept_layers * MICRO * STEPS, st
        assert res[keep]["pending"] == 0 and not res[keep]["streaming"]
        assert res[full]["stats"] is None


# ---------------------------------------------------------------- METP 2: the whole set

@pytest.fixture(scope="module")
def metp2():
    moe = {"size": MOE, "layout": {**BLOCK3, "extra": MOE_EXTRA}}
    variants = [
        ("full", {"layout": FULL}),
        ("keep", {"layout": {**FULL, "keep_attention_output": True}}),
        ("keep-offload", {"layout": {**FULL, "keep_attention_output": True,
                                     "offload_activations": True}}),
        # layer 0 keeps (its input and O on the host), layer 1 recomputes attention
        ("keep1-offload1", {"layout": {**BLOCK2, "keep_attention_output": 1,
                                       "offload_activations": 1}}),
        # one layer per chunk: a perturbed O of layer 1 does not reach layer 2's re-run input
        # (within a chunk the fingerprint of the next layer's input would refuse it)
        ("perturb-out", {"layout": {**BLOCK2, "keep_attention_output": True},
                         "perturb": "out"}),
        ("perturb-lse", {"layout": {**BLOCK2, "keep_attention_output": True},
                         "perturb": "lse"}),
        ("packed", {"layout": {**FULL, "packed_eod": EOD}, "packed": True}),
        ("packed-keep", {"layout": {**FULL, "packed_eod": EOD, "keep_attention_output": True},
                         "packed": True}),
        # full recompute of one layer per checkpoint: the streaming layer op keeps them
        ("stream", {"layout": UNIFORM1}),
        ("stream-keep", {"layout": {**UNIFORM1, "keep_attention_output": True}}),
        ("stream-keep1-offload", {"layout": {**UNIFORM1, "keep_attention_output": 1,
                                             "offload_activations": True}}),
        ("moe", moe),
        ("moe-keep", {**moe, "layout": {**moe["layout"], "keep_attention_output": True}}),
    ]
    return run_ranks(_keep_runs, 2, Layout(metp=2, global_batch_size=MICRO), variants,
                     timeout=300, unpaired="keep")


def test_kept_attention_gradients_equal_full_recompute_at_metp2(metp2):
    _assert_same(metp2, "full", ["keep", "keep-offload", "keep1-offload1"])
    _assert_same(metp2, "packed", ["packed-keep"])
    _assert_same(metp2, "moe", ["moe-keep"])


def test_the_attention_forward_ring_runs_once_per_kept_layer(metp2):
    _assert_ring_once(metp2, "full", "keep", kept_layers=2, blocks=2)
    _assert_ring_once(metp2, "full", "keep1-offload1", kept_layers=1, blocks=2)
    _assert_ring_once(metp2, "packed", "packed-keep", kept_layers=2, blocks=2)
    _assert_ring_once(metp2, "moe", "moe-keep", kept_layers=3, blocks=2)  # MoE layers' too
    for res in metp2:  # full recompute: twice per layer and micro-batch
        assert res["full"]["ring_calls"] == 2 * 2 * MICRO * STEPS * 2


def test_kept_outputs_wait_on_the_host_where_the_layer_is_offloaded(metp2):
    for res in metp2:
        assert res["keep"]["stats"]["kept_on_host"] == 0 and res["keep"]["host_bytes"] is None
        st = res["keep-offload"]["stats"]
        assert st["kept_on_host"] == st["kept"] > 0, st
        st = res["keep1-offload1"]["stats"]  # only layer 0 is offloaded (and keeps)
        assert st["kept_on_host"] == st["kept"] == MICRO * STEPS, st
        for name in ("keep-offload", "keep1-offload1"):
            assert res[name]["host_bytes"] == 0  # every host copy given back


def test_a_perturbed_kept_output_or_lse_changes_the_gradients(metp2):
    for res in metp2:
        for name in ("perturb-out", "perturb-lse"):
            _, _, (worst, err), identical = differences(res["full"], res[name])
            assert not identical and err > 100 * SAME, (name, worst, err)
            # the first forward's loss does not read the kept copy
            assert res[name]["losses"][0] == res["full"]["losses"][0]


def test_a_forward_without_backward_keeps_nothing_and_a_stray_entry_is_refused(metp2):
    for res in metp2:
        got = res["unpaired"]
        assert got["after_no_grad"] == 0
        assert got["after_two_forwards"] == 4  # two layers, two forwards
        assert got["refused"] is not None and "belongs to another input" in got["refused"]


# ---------------------------------------------------------------- METP 3, METP x CP, PP

@pytest.mark.parametrize("world,layout,size,per_stage", [
    (3, Layout(metp=3, global_batch_size=MICRO), SIZE, 2),
    (4, Layout(metp=2, cp=2, global_batch_size=MICRO), SIZE, 2),
    (4, Layout(metp=2, tp=2, global_batch_size=MICRO), SIZE, 2),
    (4, Layout(metp=2, pp=2, global_batch_size=MICRO), GPTSize(**{**SIZE.__dict__,
                                                                  "num_layers": 4}), 2),
], ids=["metp3", "metp2xcp2", "metp2xtp2", "metp2xpp2"])
def test_kept_attention_in_compositions(world, layout, size, per_stage):
    variants = [("full", {"layout": FULL, "size": size}),
                ("keep", {"layout": {**FULL, "keep_attention_output": True}, "size": size})]
    if layout.cp > 1:
        variants.append(("keep-offload", {"layout": {**FULL, "keep_attention_output": True,
                                                     "offload_activations": True},
                                          "size": size}))
    out = run_ranks(_keep_runs, world, layout, variants, timeout=300)
    _assert_same(out, "full", [name for name, _ in variants[1:]])
    _assert_ring_once(out, "full", "keep", kept_layers=per_stage, blocks=layout.metp)
    if layout.pp > 1:  # 1F1B: the first stage runs two forwards before its first backward
        assert max(res["keep"]["stats"]["max_depth"] for res in out) == 2


# ---------------------------------------------------------------- the flag, the settings, rules

def _mlm(*argv, **megatron):
    """Megatron-LM ``args`` of a METP 2 job (4 layers, 2 ranks) with the METP flags ``argv``
    parsed, at Megatron's defaults otherwise."""
    import argparse

    from megatron_metp.megatron_lm.flags import add_metp_args
    from tests.test_megatron_lm import _args

    parsed = add_metp_args(argparse.ArgumentParser()).parse_args(list(argv))
    base = dict(metp_parallel_size=2, world_size=2, num_layers=4, recompute_granularity=None,
                recompute_method=None, recompute_num_layers=None, transformer_impl="local",
                reset_attention_mask=False)
    return _args(**{**{k: v for k, v in vars(parsed).items() if v is not None}, **base,
                    **megatron})


def test_the_flag_takes_an_optional_layer_count():
    import argparse

    from megatron_metp.megatron_lm.flags import add_metp_args

    parser = add_metp_args(argparse.ArgumentParser())
    assert parser.parse_args([]).metp_keep_attention_output is None
    assert parser.parse_args(["--metp-keep-attention-output"]).metp_keep_attention_output is True
    assert parser.parse_args(["--metp-keep-attention-output", "3"]).metp_keep_attention_output \
        == 3
    for bad in ("0", "-1", "all"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--metp-keep-attention-output", bad])


@pytest.mark.parametrize("argv,layout_value,value", [
    (["--metp-keep-attention-output"], True, True),
    (["--metp-keep-attention-output", "1"], 1, 1),
    ([], False, None),
], ids=["every-layer", "first-1", "off"])
def test_megatron_lm_args_and_the_layout_give_one_settings_value(argv, layout_value, value):
    from megatron_metp.megatron_lm.settings_args import metp_settings

    from_args = metp_settings(_mlm(*argv, "--metp-offload-activations", "2",
                                   recompute_granularity="full"))
    from_layout = Layout(metp=2, recompute="full", offload_activations=2,
                         keep_attention_output=layout_value).settings()
    same = dict(rope_recipe_source="")
    assert from_args.replace(**same) == from_layout.replace(**same)
    assert from_args.keep_attention_output == value
    assert from_args.kept_attention_layers(4) == (4 if value is True else value or 0)
    # negative control: another count is another value
    other = Layout(metp=2, recompute="full", offload_activations=2, keep_attention_output=2)
    assert other.settings().replace(**same) != from_layout.replace(**same)


@pytest.mark.parametrize("kw,needles", [
    (dict(metp_parallel_size=1), ["--metp-keep-attention-output keeps the METP attention's",
                                  "--metp-parallel-size > 1"]),
    (dict(metp_disable_weight_ring=True), ["--metp-keep-attention-output keeps the METP",
                                           "without --metp-disable-weight-ring"]),
    (dict(recompute_granularity=None), ["--metp-keep-attention-output keeps the attention "
                                        "output of a recomputed layer",
                                        "add --recompute-granularity full"]),
    (dict(metp_keep_attention_output=5), ["--metp-keep-attention-output 5: 5 layers keep",
                                          "a pipeline stage has 4 layers; give 1 to 4"]),
    (dict(metp_keep_attention_output=2, num_layers_per_virtual_pipeline_stage=2),
     ["--metp-keep-attention-output 2 with a virtual pipeline"]),
], ids=["no-metp", "ring-baseline", "no-recompute", "more-than-a-stage", "virtual-pipeline"])
def test_each_rule_refuses_the_megatron_lm_flags_before_any_rank(kw, needles):
    from megatron_metp import megatron_lm

    args = _mlm("--metp-keep-attention-output", **{"recompute_granularity": "full", **kw})
    with pytest.raises(ValueError) as err:
        megatron_lm.validate_metp_args(args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    # negative control: the same job with full recompute and METP passes
    ok = _mlm("--metp-keep-attention-output", "4", recompute_granularity="full")
    megatron_lm.validate_metp_args(ok)
    assert ok.context_parallel_size == 2


def test_each_rule_names_the_layout_fields():
    from megatron_metp.megatron.settings import METPSettings
    from megatron_metp.megatron.training import transformer_config

    with pytest.raises(ValueError) as err:
        Layout(metp=2, keep_attention_output=True)
    assert "Layout.keep_attention_output" in str(err.value)
    assert "add Layout.recompute='full'" in str(err.value)
    with pytest.raises(ValueError, match="Layout.keep_attention_output keeps the METP"):
        Layout(metp=2, mode="ring", recompute="full", keep_attention_output=True)
    with pytest.raises(ValueError, match="Layout.keep_attention_output must be on"):
        Layout(metp=2, recompute="full", keep_attention_output=-1)
    with pytest.raises(ValueError, match="Layout.keep_attention_output: 3 layers keep"):
        transformer_config(SIZE, Layout(metp=2, recompute="full", keep_attention_output=3))
    # the settings alone: an unknown recompute (None) is not judged, a value is
    assert METPSettings(metp=2, keep_attention_output=True).problems() == []
    assert METPSettings(metp=2, keep_attention_output="2").problems(full_recompute=True)
    assert "attention output kept under full recompute (first 1 layers of a stage)" in \
        METPSettings(metp=2, keep_attention_output=1).describe()


# ---------------------------------------------------------------- the op itself

def _op_rank(rank, p, head_block, packed):
    """One rank of ``metp_attention`` with GQA, a q/k RMSNorm, YaRN-like angles (scaled
    frequencies) and softmax scale (A²/sqrt(d)), optionally packed documents: the plain call
    with autograd, then a keeping call without autograd and the re-run from what it kept;
    also the re-run from a perturbed LSE, and a kept set of the wrong shape."""
    import torch.distributed as dist

    import megatron_metp.ops.attention as attention
    from megatron_metp import METPGroup
    from megatron_metp.ops import metp_attention
    from megatron_metp.ops.attention_keep import AttentionKeep

    torch.manual_seed(7)
    A, G, d, h, n, b = 8, 4, 4, 16, 8, 2
    s = n * p
    rows = (G // p) * (A // G + 2) * d
    full = {"wq": torch.randn(G * (A // G + 2) * d, h) * 0.3, "wo": torch.randn(h, A * d) * 0.3,
            "bq": torch.randn(G * (A // G + 2) * d) * 0.1,
            "qn": 1 + 0.1 * torch.randn(d), "kn": 1 + 0.1 * torch.randn(d)}
    x_all = torch.randn(n * p, b, h)
    dy = torch.randn(n, b, h)
    pos = torch.arange(s, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2) / d)) / torch.tensor([1.0, 4.0])  # YaRN-ish
    angles = (pos[:, None] * inv_freq[None]).repeat(1, 2)[:, None, None, :]
    from megatron_metp.ops import local_positions

    x = x_all.index_select(0, local_positions(rank, p, n)).clone()
    params = {"qkv_weight": full["wq"][rank * rows:(rank + 1) * rows].clone(),
              "proj_weight": full["wo"][:, rank * (A // p) * d:(rank + 1) * (A // p) * d].clone(),
              "qkv_bias": full["bq"][rank * rows:(rank + 1) * rows].clone(),
              "q_norm_weight": full["qn"].clone(), "k_norm_weight": full["kn"].clone()}
    grp = METPGroup.from_process_group(dist.group.WORLD, name="keep-attn")
    kw = dict(group=grp, num_heads=A, num_query_groups=G, rotary_pos_emb=angles,
              softmax_scale=1.3 ** 2 / d ** 0.5, head_block=head_block, qk_norm="RMSNorm",
              cu_seqlens=(0, 5, 11, s) if packed else None)
    calls = [0]
    ring_forward = attention.ring_attention_forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return ring_forward(*args, **kwargs)

    attention.ring_attention_forward = counted

    def run(keep=None):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        xi = x.clone().requires_grad_()
        calls[0] = 0
        y = metp_attention(xi, leaves.pop("qkv_weight"), leaves.pop("proj_weight"), **kw,
                           **leaves, keep=keep)
        ran = calls[0]
        y.backward(dy)
        return y.detach(), [xi.grad] + [t.grad for t in leaves.values()], ran

    y_ref, g_ref, ran_ref = run()
    got = []
    with torch.no_grad():
        y_first = metp_attention(x, **params, **kw,
                                 keep=AttentionKeep(sink=lambda o, lse: got.append((o, lse))))
    outs, lses = got[0]
    y_kept, g_kept, ran_kept = run(AttentionKeep(kept=(outs, lses)))
    bumped = [lses[0] + 0.5] + list(lses[1:])
    _, g_bad, _ = run(AttentionKeep(kept=(outs, bumped)))
    try:
        metp_attention(x, **params, **kw, keep=AttentionKeep(kept=(outs[:1] * 5, lses)))
        wrong = None
    except ValueError as exc:
        wrong = str(exc)
    err = max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(g_kept, g_ref))
    bad = max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(g_bad, g_ref))
    return {"y_same": torch.equal(y_kept, y_ref) and torch.equal(y_first, y_ref), "err": err,
            "bad": bad, "rings": (ran_ref, ran_kept), "blocks": len(outs), "wrong": wrong}


@pytest.mark.parametrize("head_block,packed", [(1, False), (2, True)],
                         ids=["blocks-of-1", "one-block-packed"])
def test_the_op_rerun_from_kept_outputs_equals_the_plain_call(head_block, packed):
    """GQA, q/k norm, YaRN-like angles and scale; packed documents; head-group blocks of one
    group (two ring passes) and of both (one): the re-run runs no ring, gives the same ``y``
    bit for bit and the same gradients; a perturbed LSE changes them; a kept set of the wrong
    shape is refused naming it."""
    for res in run_ranks(_op_rank, 2, head_block, packed):
        assert res["y_same"] and res["err"] <= SAME, res
        assert res["rings"] == (2 // head_block, 0) and res["blocks"] == 2 // head_block, res
        assert res["bad"] > 100 * SAME, res
        assert res["wrong"] is not None and \
            "kept attention outputs: 5 outputs and" in res["wrong"], res


def test_the_streaming_layer_keeps_attention_through_the_same_flag(metp2):
    """Full recompute of one layer per checkpoint runs the streaming layer op, which keeps O
    and the LSE itself (metp_layer(keep_attention=True)): same gradients, fewer attention kernel
    launches and bytes, and no Megatron checkpoint queue in use."""
    _assert_same(metp2, "stream", ["stream-keep", "stream-keep1-offload"])
    _assert_same(metp2, "full", ["stream"])
    for res in metp2:
        for name in ("stream-keep", "stream-keep1-offload"):
            assert res[name]["streaming"] and res[name]["pending"] == 0
            assert res[name]["stats"]["kept"] == 0  # the op keeps them, not the queues
        full, one, kept = (res[n]["ring"] for n in ("stream", "stream-keep1-offload",
                                                     "stream-keep"))
        assert kept["blocks"] < one["blocks"] < full["blocks"], (full, one, kept)
        assert kept["bytes_sent"] < one["bytes_sent"] < full["bytes_sent"], (full, one, kept)
