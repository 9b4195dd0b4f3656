"""Token tiles of the ring loss's backward (``token_tile`` of ``metp_output_cross_entropy`` and of
``metp_output_logits``) and its ``grad_into_hidden``: tiled equals untiled.

Each configuration runs on the same forked gloo ranks (fp32), on the embedding → mixing →
output layer → cross-entropy model of ``tests/vocab_cases.py`` with a loss mask, at METP 1, 2 and
3 (and TP 2 × METP 2), with and without label smoothing, untied and tied tables. ``S = 42, B = 1``
gives 42, 21 and 14 rows per rank, so tiles of 5 rows are uneven everywhere (9 tiles of 5 and 2;
5, 5, 5, 5, 1; 5, 5, 4) and token chunks of 2 cut every tile unevenly again. Loss, per-token
loss and every gradient must equal the untiled run within 2e-6, and the single-device reference
within 1e-5. The counters show the structure: one backward pass of the ring per tile (bytes sent:
forward once, backward ``T`` times; two ``mm_acc`` per chunk, tile and ring step), and the
gradient of ``hidden`` written into ``hidden`` itself with ``grad_into_hidden``. Negative
controls: an overlapping tile (one row counted twice in ``dW``) and a perturbed weight shard are
caught by the same comparison; another autograd node that saved ``hidden`` fails loudly instead
of reading the overwritten values.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import metp_embedding, metp_output_cross_entropy, metp_output_logits
from megatron_metp.ops import tiles as tiling
from megatron_metp.ops import vocab as V
from tests.harness import assert_messages, run_ranks, unset_env, value_errors
from tests.numerics import rel_err
from tests.test_vocab import _errors, _gather, rank_inputs
from tests.vocab_cases import full_vocab_case, reference

S, B, H = 42, 1, 8
#: tiled against untiled (fp32): tiles of one row sum 42 one-row products into each weight
#: gradient in another order; 1.14e-6 measured on a CPU whose kernels round differently from the
#: earlier CI machine's (under 1e-6 there); the negative controls below are off by more than 1e-4
TOL = 2e-6
#: (token_tile, token_chunk, grad_into_hidden); the first is the untiled baseline
CONFIGS = [(0, None, False), (5, None, False), (5, 2, False), (1, None, False), (5, 2, True),
           (0, None, True)]


def _count_mm_acc(counts):
    from megatron_metp.ops import cross_entropy

    real = cross_entropy.mm_acc

    def counted(*args):
        counts["mm_acc"] += 1
        return real(*args)

    cross_entropy.mm_acc = counted


def _sabotage(where):
    """Negative controls: ``overlap`` makes the second tile start one row early (that row's
    ``dZᵀ·X`` counted twice in ``dW``); ``weight`` (in :func:`_ranks`) perturbs the output
    shards by 1e-2·N(0, 1)."""
    from megatron_metp.ops import cross_entropy

    if where == "overlap":
        real = cross_entropy._backward_tiles

        def overlapping(hidden, token_tile):
            tiles = real(hidden, token_tile)
            if len(tiles) > 1:
                tiles[1] = slice(tiles[1].start - 1, tiles[1].stop)
            return tiles

        cross_entropy._backward_tiles = overlapping


def _ranks(rank, world, p, configs, tied=False, smoothing=0.0, tp=1, sabotage=None):
    """Rank ``rank`` of TP×METP (TP-major): one forward+backward per config of ``configs``."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    case = full_vocab_case(S, B, H, p, tied=tied, tp=tp)
    tp_rank, r = divmod(rank, p)
    metp_groups = [dist.new_group(list(range(t * p, (t + 1) * p))) for t in range(tp)]
    tp_groups = [dist.new_group([t * p + i for t in range(tp)]) for i in range(p)]
    tpg = tp_groups[r] if tp > 1 else None
    counts = {"mm_acc": 0}
    _count_mm_acc(counts)
    if sabotage == "overlap":
        _sabotage(sabotage)
    out = []
    for tile, chunk, into in configs:
        g = METPGroup.from_process_group(metp_groups[tp_rank] if p > 1 else None,
                                         name="loss-tiles")
        emb, w_out, mix, tokens, labels, mask, vstart = rank_inputs(case, p, r, tp, tp_rank, tied)
        if sabotage == "weight" and into:  # the perturbed run: the in-place configs
            with torch.no_grad():  # (a constant shift of all of W would not change the softmax)
                w_out.add_(1e-2 * torch.randn(w_out.shape, generator=torch.Generator()
                                              .manual_seed(rank)))
        x = metp_embedding(tokens, emb, group=g, vocab_start=vstart, vocab_size=case["V"])
        if tpg is not None:
            x = reduce_from_tensor_model_parallel_region(x, group=tpg)
        hidden = x.transpose(0, 1) @ mix
        hidden.retain_grad()
        before = hidden.detach().clone()
        version = hidden._version
        loss = metp_output_cross_entropy(hidden, w_out, labels, group=g, tp_group=tpg,
                                         vocab_start=vstart, vocab_size=case["V"],
                                         label_smoothing=smoothing, token_chunk=chunk,
                                         token_tile=tile, grad_into_hidden=into)
        fwd_sent = g.stats.snapshot()["bytes_sent"]
        total = (loss * mask).sum() / case["mask"].sum()
        counts["mm_acc"] = 0
        total.backward()
        out.append({"loss": total.detach(), "per_token": loss.detach(), "demb": emb.grad,
                    "dout": None if tied else w_out.grad, "dmix": mix.grad,
                    "dhidden": hidden.grad.clone(), "mm_acc": counts["mm_acc"],
                    "fwd_sent": fwd_sent, "sent": g.stats.snapshot()["bytes_sent"],
                    "rows": hidden.shape[0] * hidden.shape[1], "v": w_out.shape[0],
                    # grad_into_hidden: hidden's own storage now holds its gradient
                    "overwritten": torch.equal(hidden.detach(), hidden.grad)
                    and not torch.equal(hidden.detach(), before),
                    "version_bumped": hidden._version > version})
    return out


def _config(out, i):
    return [o[i] for o in out]


def _check(out, p, tp, configs, ref):
    base = _gather(_config(out, 0), p, tp)
    for i, (tile, chunk, into) in enumerate(configs):
        ranks = _config(out, i)
        got = _gather(ranks, p, tp)
        errs = _errors(got, base)
        assert max(errs.values()) <= TOL, (tile, chunk, into, errs)
        assert max(_errors(got, ref).values()) <= 1e-5, (tile, chunk, into)
        for o, o0 in zip(ranks, _config(out, 0)):
            N, v = o["rows"], o["v"]
            tiles = tiling.tile_slices(N, tile or N)
            T = len(tiles)
            # the forward is untouched; the backward's ring runs once per tile
            assert o["fwd_sent"] == o0["fwd_sent"], (tile, chunk)
            ring = (p - 1) * v * H * 4  # one pass: fp32 shards (fp32 test) or fp32 sums
            assert o["sent"] - o0["sent"] == (T - 1) * 2 * ring, (tile, chunk, o["sent"])
            # two mm_acc (dX, dW) per chunk of each tile at each of the p ring steps
            per_tile = [math.ceil((sl.stop - sl.start) / (chunk or N)) for sl in tiles]
            assert o["mm_acc"] == 2 * p * sum(per_tile), (tile, chunk, o["mm_acc"])
            assert o["overwritten"] == into and o["version_bumped"] == into, (tile, into)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("tied,smoothing", [(False, 0.0), (True, 0.1)])
def test_tiled_backward_equals_untiled(p, tied, smoothing):
    out = run_ranks(_ranks, p, p, CONFIGS, tied, smoothing)
    _check(out, p, 1, CONFIGS, reference(full_vocab_case(S, B, H, p, tied=tied),
                                         smoothing=smoothing))
    assert _config(out, 1)[0]["sent"] > _config(out, 0)[0]["sent"] or p == 1


def test_tiled_backward_composes_with_tp():
    tp, p = 2, 2
    configs = CONFIGS[:3] + CONFIGS[4:5]
    out = run_ranks(_ranks, tp * p, p, configs, False, 0.1, tp)
    _check(out, p, tp, configs, reference(full_vocab_case(S, B, H, p, tp=tp), smoothing=0.1))


# ---------------------------------------------------------------- negative controls

def test_negative_control_an_overlapping_tile_is_caught():
    p = 2
    configs = [(0, None, False), (5, None, False)]
    out = run_ranks(_ranks, p, p, configs, False, 0.0, sabotage="overlap")
    errs = _errors(_gather(_config(out, 1), p), _gather(_config(out, 0), p))
    assert errs["dout"] > 1e-3, errs  # one row's dZᵀ·X added twice
    assert errs["loss"] <= TOL, errs
    with pytest.raises(AssertionError):
        _check(out, p, 1, configs, reference(full_vocab_case(S, B, H, p)))


def test_negative_control_a_perturbed_weight_is_caught():
    p = 2
    configs = [(0, None, False), (5, 2, True)]
    out = run_ranks(_ranks, p, p, configs, False, 0.0, sabotage="weight")
    errs = _errors(_gather(_config(out, 1), p), _gather(_config(out, 0), p))
    assert errs["loss"] > 1e-4 and errs["dhidden"] > 1e-3, errs
    with pytest.raises(AssertionError):
        _check(out, p, 1, configs, reference(full_vocab_case(S, B, H, p)))


def _saved_elsewhere(rank, world):
    """``hidden`` also saved by another autograd node (``hidden * hidden`` saves both operands):
    writing the gradient into it must fail loudly, not feed the gradient to that node."""
    case = full_vocab_case(S, B, H, 1)
    emb, w_out, mix, tokens, labels, mask, vstart = rank_inputs(case, 1, 0, 1, 0, False)
    hidden = emb[tokens].transpose(0, 1) @ mix
    # made before the loss, so autograd runs its backward after the loss's (higher sequence
    # numbers first): it then finds hidden overwritten
    other = (hidden * hidden).sum()
    loss = metp_output_cross_entropy(hidden, w_out, labels, group=None, token_tile=5,
                                     grad_into_hidden=True)
    try:
        (loss.sum() + other).backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_another_node_that_saved_hidden_fails_loudly():
    (msg,) = run_ranks(_saved_elsewhere, 1)
    assert msg and "modified by an inplace operation" in msg, msg


# ---------------------------------------------------------------- the logits op

def _logits(rank, world, p, tile):
    case = full_vocab_case(S, B, H, p)
    emb, w_out, mix, tokens, labels, mask, vstart = rank_inputs(case, p, rank, 1, 0, False)
    g = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="logits-tiles")
    hidden = (case["emb"][tokens].transpose(0, 1) @ case["mix"]).requires_grad_()
    logits = metp_output_logits(hidden, w_out, group=g, token_tile=tile)
    gy = torch.randn(logits.shape, generator=torch.Generator().manual_seed(rank))
    logits.backward(gy)
    return {"logits": logits.detach(), "dx": hidden.grad, "dw": w_out.grad,
            "sent": g.stats.snapshot()["bytes_sent"]}


@pytest.mark.parametrize("p", [1, 3])
def test_logits_backward_in_tiles_equals_untiled(p):
    whole, tiled = (run_ranks(_logits, p, p, tile) for tile in (0, 5))
    for a, b in zip(whole, tiled):
        assert torch.equal(a["logits"], b["logits"])
        assert rel_err(b["dx"], a["dx"]) <= TOL and rel_err(b["dw"], a["dw"]) <= TOL
        T = len(tiling.tile_slices(S // p * B, 5))
        v = a["dw"].shape[0]
        assert b["sent"] - a["sent"] == (T - 1) * 2 * (p - 1) * v * H * 4


# ---------------------------------------------------------------- tile policy, refusals

def test_loss_tile_policy(monkeypatch):
    unset_env(monkeypatch, V.LOSS_TOKEN_TILE_ENV, tiling.TILE_BUDGET_ENV)
    # auto: 1 GiB of fp32 dX per tile = 65,536 rows at h = 4096
    assert V.loss_row_bytes(4096) == 16384
    assert V.loss_tiles(None, 65536, 4096) == [slice(0, 65536)]  # fits: one tile (untiled)
    assert len(V.loss_tiles(None, 786432, 4096)) == 12  # 768K rows per rank (6M at METP 8)
    monkeypatch.setenv(tiling.TILE_BUDGET_ENV, "256")
    assert len(V.loss_tiles(None, 786432, 4096)) == 48
    monkeypatch.setenv(V.LOSS_TOKEN_TILE_ENV, "100000")
    assert V.loss_tiles(None, 786432, 4096)[0] == slice(0, 98304)  # 8 balanced tiles
    assert V.loss_tiles(0, 786432, 4096) == [slice(0, 786432)]  # the argument wins; 0 = whole
    monkeypatch.setenv(V.LOSS_TOKEN_TILE_ENV, "0")
    assert V.loss_tiles(None, 786432, 4096) == [slice(0, 786432)]
    assert V.loss_tiles(None, 0, 4096) == [slice(0, 0)]


def _bad(rank, world):
    g = METPGroup.from_process_group(dist.group.WORLD, name="bad-tiles")
    w = torch.randn(4, 8)
    lab = torch.zeros(1, 3, dtype=torch.long)
    leaf = torch.randn(3, 1, 8, requires_grad=True)
    inter = leaf * 1.0

    def call(hidden=inter, **kw):
        def run():
            env = kw.pop("env", None)
            os.environ.pop(V.LOSS_TOKEN_TILE_ENV, None)
            if env is not None:
                os.environ[V.LOSS_TOKEN_TILE_ENV] = env
            try:
                metp_output_cross_entropy(hidden, w, lab, group=g, **kw)
            finally:
                os.environ.pop(V.LOSS_TOKEN_TILE_ENV, None)
        return run

    # an intermediate of its own with permuted strides (elementwise ops keep dense strides)
    strided = torch.randn(8, 1, 3, requires_grad=True).permute(2, 1, 0) * 1.0
    assert strided._base is None and not strided.is_contiguous()
    cases = {
        "negative": call(token_tile=-1), "float": call(token_tile=2.5),
        "env": call(env="abc"), "env_negative": call(env="-3"),
        "leaf": call(leaf, grad_into_hidden=True),
        "view": call(torch.cat([inter, inter])[:3], grad_into_hidden=True),
        "strided": call(strided, grad_into_hidden=True),
        "not_bool": call(grad_into_hidden=1),
        "logits_tile": lambda: metp_output_logits(inter, w, group=g, token_tile=-2),
    }
    msgs = value_errors(cases)
    steps = g.stats.steps  # refused before any transfer
    ok = value_errors({"no_grad_leaf": call(leaf.detach(), grad_into_hidden=True),
                       "env_blank": call(env=" ")})
    return msgs, steps, ok


def test_bad_tiles_and_grad_into_hidden_refused_naming_them():
    tile = "token_tile must be a non-negative integer"
    env = "METP_LOSS_TOKEN_TILE must be a non-negative integer"
    expect = {"negative": tile, "float": tile, "env": env, "env_negative": env,
              "leaf": "grad_into_hidden=True but hidden is a leaf tensor",
              "view": "grad_into_hidden=True but hidden is a view",
              "strided": "grad_into_hidden=True needs a contiguous hidden",
              "not_bool": "grad_into_hidden must be True or False", "logits_tile": tile}
    for msgs, steps, ok in run_ranks(_bad, 2):
        assert steps == 0
        assert_messages(msgs, expect)
        assert ok == {"no_grad_leaf": None, "env_blank": None}


def _disagree(rank, world):
    """Rank 1 asks for tiles of 5 rows, rank 0 for none; then both without a gradient."""
    case = full_vocab_case(S, B, H, 2)
    emb, w_out, mix, tokens, labels, mask, vstart = rank_inputs(case, 2, rank, 1, 0, False)
    g = METPGroup.from_process_group(dist.group.WORLD, name="loss-tiles")
    hidden = (case["emb"][tokens].transpose(0, 1) @ case["mix"]).requires_grad_()
    tile = 5 if rank else 0
    return value_errors({
        "grad": lambda: metp_output_cross_entropy(hidden, w_out, labels, group=g,
                                                  token_tile=tile),
        # no gradient wanted: the backward's tiles do not matter (ranks may hold different
        # token counts in evaluation)
        "eval": lambda: metp_output_cross_entropy(hidden.detach(), w_out.detach(), labels,
                                                  group=g, token_tile=tile)})


def test_ranks_with_different_tile_counts_are_refused():
    from megatron_metp.runtime.agree import GroupDisagreementError

    for msgs in run_ranks(_disagree, 2):
        assert "token_tiles" in msgs["grad"] and "differ" in msgs["grad"], msgs
        assert msgs["eval"] is None, msgs
    assert issubclass(GroupDisagreementError, ValueError)


# ---------------------------------------------------------------- memory of the op

def _loss_peak(tile, into, n=4096, h=512, v=64):
    """Peak bytes (CUDA-faithful fake tensors, MemTracker) of ``hidden = x·M`` (``x`` without
    gradient, so its backward holds no ``[n, h]`` temporary) → the ring loss (p = 1, chunks of
    256 rows) → backward; the caller's ``x`` stays alive throughout, as the model's final-norm
    input does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.runtime import finite
    from megatron_metp.tools import fakerank as FR

    was = finite.finite_checks_enabled()
    finite.enable_finite_checks(False)  # they read values; fake tensors have none
    try:
        with FakeTensorMode():
            x = torch.empty(n, 1, h, dtype=torch.bfloat16)
            m = torch.empty(h, h, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(v, h, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.zeros(1, n, dtype=torch.long)
            trk = FR.tracker()
            trk.track_external(x, m, w, labels)
            with FR.measuring(trk):
                hidden = x @ m
                loss = metp_output_cross_entropy(hidden, w, labels, group=None,
                                                 check_labels=False, token_chunk=256,
                                                 token_tile=tile, grad_into_hidden=into)
                del hidden
                loss.float().sum().backward()
            return FR.snap(trk, "peak")["total"]
    finally:
        finite.enable_finite_checks(was)


def test_the_tiles_and_grad_into_hidden_free_what_they_claim():
    """At the end of the untiled backward the rank holds ``X``, the fp32 ``dX`` and its bf16
    copy; ``grad_into_hidden`` removes the copy (``2·n·h`` bytes), the tiles (16 of 256 rows)
    the fp32 ``dX`` but one tile's (``4·n·h·15/16``, less the ``[v, h]`` fp32 total of the tiles'
    ``dW`` sums they add); with tiles and a new ``dX`` tensor the
    bf16 output is back (``2·n·h``). Everything else is ``[v, h]`` or ``[chunk, v]`` (a ring
    step's logits chunk, 6·256·64 bytes, moves the peak between the end and a ring step: at most
    ``0.05·n·h``)."""
    n, h = 4096, 512
    u = n * h
    small = 0.05 * u
    new, into = _loss_peak(0, False), _loss_peak(0, True)
    tiled_new, tiled_into = _loss_peak(256, False), _loss_peak(256, True)
    assert new - into == pytest.approx(2 * u, abs=small), (new, into)
    # (less the owner's fp32 total of the tiles' dW sums, [v, h])
    assert into - tiled_into == pytest.approx(4 * u * 15 / 16 - 4 * 64 * h, abs=small), \
        (into, tiled_into)
    assert tiled_new - tiled_into == pytest.approx(2 * u, abs=small), (tiled_new, tiled_into)
    # x and hidden / dX (bf16), one fp32 tile, M and the small rest
    assert tiled_into < 5 * u < into, (tiled_into, into)


# ---------------------------------------------------------------- the plan against metp measure

def test_plan_matches_measurement_of_the_loss_tiles(monkeypatch):
    """``metp plan`` models the loss backward as the op and the METP GPT model run it: planned =
    measured (``metp measure``, the real model under fake tensors) within 5 % untiled with a new
    ``dX`` tensor, untiled with ``dX`` in the hidden states, and in 8 tiles of 256 rows; at this
    size the loss's backward is the peak untiled (planned), and the tiles lower the measured
    peak; the measured bytes sent grow by the planned extra passes of the loss's backward ring
    exactly."""
    from megatron_metp.tools import measure as M
    from megatron_metp.tools import plan as P
    from megatron_metp.tools.plan.cost import vocab_traffic

    model = P.Model(hidden=512, layers=1, heads=8, query_groups=2, ffn=256, vocab=2048,
                    seq=4096, tied=False)
    job = P.Job(tp=1, metp=2)
    runs = {}
    for tile, into in (("0", "0"), ("0", "1"), ("256", "1")):
        monkeypatch.setenv(V.LOSS_TOKEN_TILE_ENV, tile)
        monkeypatch.setenv(V.LOSS_GRAD_INTO_HIDDEN_ENV, into)
        (res,) = M.measure(model, job, ["metp+vocab"], jobs=1, timeout=300)
        assert "error" not in res, res["error"]
        mem = P.memory(model, job, "metp+vocab")
        assert abs(mem.measured_part / res["peak"] - 1) <= 0.05, (tile, into,
                                                                  mem.measured_part, res["peak"])
        runs[tile, into] = (res, mem, sum(vocab_traffic(model, job, "metp+vocab").values()))
    (new, m_new, s_new), (into, m_into, s_into), (tiled, m_tiled, s_tiled) = runs.values()
    assert m_new.act.peak_phase.startswith("output layer + loss")
    h = model.hidden
    # dX in the hidden states: measured and planned move together (here the peak of the loss's
    # backward is a ring step, where the dX copy does not exist yet: both 0; the benchmark's
    # test in tests/test_vocab_memory.py sees the copy go)
    assert new["peak"] - into["peak"] == pytest.approx(
        m_new.measured_part - m_into.measured_part, abs=0.01 * new["peak"])
    # the tiles: the loss is no longer the peak; the peak falls
    assert tiled["peak"] < 0.95 * into["peak"]
    assert not m_tiled.act.peak_phase.startswith("output layer + loss")
    # ring bytes: 7 more passes of the backward ring (p - 1 = 1 bf16 shard + 1 fp32 sum each)
    v = 2048 // 2
    assert s_tiled - s_into == 7 * v * h * (2 + 4)
    assert tiled["sent"] - into["sent"] == s_tiled - s_into
    assert into["sent"] == new["sent"]
