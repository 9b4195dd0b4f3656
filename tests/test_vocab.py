"""METP word embedding and output layer + cross-entropy against a single-device reference built
from the same full (padded) weights; composed with TP; bf16 against stock Megatron TP."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import (metp_embedding, metp_output_cross_entropy, metp_output_logits,
                               padded_vocab_size)
from tests.harness import assert_messages, run_ranks, value_errors
from tests.numerics import rel_err
from tests.vocab_cases import full_vocab_case, reference, smoothed_ce

S, B, H = 12, 2, 8  # s divisible by 1..4


def _shard(t, p, r):
    return t.chunk(p, dim=0)[r]


def rank_inputs(case, p, r, tp, tp_rank, tied, emb_shard=None):
    """This rank's leaves of a vocabulary case: embedding / output shards (``emb_shard``: the
    embedding's shard index, default its own), the mixing matrix, and its ``s/p`` tokens,
    labels and mask; plus the first vocabulary row of its shards (``vstart``)."""
    n = case["tokens"].shape[1] // p
    own = tp_rank * p + r
    emb = _shard(case["emb"], tp * p, own if emb_shard is None else emb_shard)
    emb = emb.clone().requires_grad_()
    out = emb if tied else _shard(case["out"], tp * p, own).clone().requires_grad_()
    mix = case["mix"].clone().requires_grad_()
    cut = slice(r * n, (r + 1) * n)
    return (emb, out, mix, case["tokens"][:, cut], case["labels"][:, cut], case["mask"][:, cut],
            tp_rank * p * emb.shape[0])


def _metp_rank(rank, world, p, tied, smoothing=0.0, tp=1, wrong_shard=False, dtype=torch.float32,
               dims=(S, B, H)):
    """Rank ``rank`` of TP×METP (``world = tp·p``, TP-major: tp_rank = rank // p)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    s, b, h = dims
    case = full_vocab_case(s, b, h, p, tied=tied, tp=tp, dtype=dtype)
    tp_rank, r = divmod(rank, p)
    metp_groups = [dist.new_group(list(range(t * p, (t + 1) * p))) for t in range(tp)]
    tp_groups = [dist.new_group([t * p + i for t in range(tp)]) for i in range(p)]
    g = METPGroup.from_process_group(metp_groups[tp_rank] if p > 1 else None, name="vocab-test")
    tpg = tp_groups[r] if tp > 1 else None
    V = case["V"]
    idx = tp_rank * p + (r + 1) % p if wrong_shard else tp_rank * p + r
    emb, out, mix, tokens, labels, mask, vstart = rank_inputs(case, p, r, tp, tp_rank, tied, idx)
    x = metp_embedding(tokens, emb, group=g, vocab_start=vstart, vocab_size=V)
    if tpg is not None:
        x = reduce_from_tensor_model_parallel_region(x, group=tpg)
    hidden = x.transpose(0, 1) @ mix
    hidden.retain_grad()
    loss = metp_output_cross_entropy(hidden, out, labels, group=g, tp_group=tpg,
                                     vocab_start=vstart, vocab_size=V, label_smoothing=smoothing)
    total = (loss * mask).sum() / case["mask"].sum()
    total.backward()
    return {"loss": total.detach(), "per_token": loss.detach(), "demb": emb.grad,
            "dout": None if tied else out.grad, "dmix": mix.grad, "dhidden": hidden.grad,
            "stats": g.stats.snapshot(), "contiguous": loss.is_contiguous()}


def _gather(out, p, tp=1):
    """Full-model quantities from the per-rank results (rank = tp_rank·p + r)."""
    metp0 = out[:p]  # TP rank 0's METP group holds every token once
    res = {"loss": sum(o["loss"].double() for o in metp0),
           "per_token": torch.cat([o["per_token"] for o in metp0], dim=1),
           "dhidden": torch.cat([o["dhidden"] for o in metp0], dim=0),
           "demb": torch.cat([o["demb"] for o in out], dim=0),  # shard index = rank
           "dmix": sum(o["dmix"].double() for o in metp0)}
    if out[0]["dout"] is not None:
        res["dout"] = torch.cat([o["dout"] for o in out], dim=0)
    return res


def _errors(got, ref):
    return {k: rel_err(got[k], ref[k]) for k in got if ref.get(k) is not None}


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_fp32_parity_with_single_device_reference(p, tied):
    case = full_vocab_case(S, B, H, p, tied=tied)
    assert case["V"] == padded_vocab_size(50, 2, 1, p) and (p < 3 or case["V"] > 50)
    ref = reference(case)
    out = run_ranks(_metp_rank, p, p, tied)
    errs = _errors(_gather(out, p), ref)
    assert {"loss", "per_token", "dhidden", "demb", "dmix"} <= set(errs)
    assert ("dout" in errs) != tied
    assert max(errs.values()) <= 1e-5, errs
    assert all(o["contiguous"] for o in out)  # [b, s/p] viewable like Megatron's loss


def test_label_smoothing_matches_megatron_formula():
    p = 3
    case = full_vocab_case(S, B, H, p)
    ref = reference(case, smoothing=0.1)
    errs = _errors(_gather(run_ranks(_metp_rank, p, p, False, 0.1), p), ref)
    assert max(errs.values()) <= 1e-5, errs
    # the smoothed loss differs from the plain one: the test can see smoothing
    assert rel_err(reference(case)["per_token"], ref["per_token"]) > 1e-3


def _megatron_smoothing_reference(rank, world, smoothing):
    """Megatron's own vocab_parallel_cross_entropy (TP=1) on the same logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    case = full_vocab_case(S, B, H, 1)
    logits = (case["emb"][case["tokens"]].transpose(0, 1) @ case["mix"]) @ case["out"].t()
    ours = smoothed_ce(logits, case["labels"].t(), smoothing)
    theirs = vocab_parallel_cross_entropy(logits.clone(), case["labels"].t().contiguous(),
                                          smoothing)
    return rel_err(ours, theirs)


def test_reference_smoothing_formula_is_megatrons():
    assert run_ranks(_megatron_smoothing_reference, 1, 0.1)[0] <= 1e-6


@pytest.mark.parametrize("tied", [False, True])
def test_composes_with_tp(tied):
    tp, p = 2, 2
    case = full_vocab_case(S, B, H, p, tied=tied, tp=tp)
    ref = reference(case)
    out = run_ranks(_metp_rank, tp * p, p, tied, 0.0, tp)
    # every TP rank of a METP position computes the same loss and hidden gradient
    for r in range(p):
        assert torch.allclose(out[r]["loss"], out[p + r]["loss"], atol=1e-6)
    errs = _errors(_gather(out, p, tp), ref)
    assert max(errs.values()) <= 1e-5, errs


def test_negative_control_wrong_shard_is_caught():
    p = 3
    case = full_vocab_case(S, B, H, p)
    ref = reference(case)
    errs = _errors(_gather(run_ranks(_metp_rank, p, p, False, 0.0, 1, True), p), ref)
    assert errs["loss"] > 1e-3 and errs["demb"] > 1e-2, errs


def test_exchanger_counts_match_closed_form():
    p = 3
    out = run_ranks(_metp_rank, p, p, False)
    v = padded_vocab_size(50, 2, 1, p) // p
    shard = v * H * 4
    # embedding: p-1 shards fwd, p-1 gradient sums bwd; output: p-1 fwd, (p-1) weights +
    # (p-1) gradient sums bwd; plus no logits-sized message anywhere
    for o in out:
        assert o["stats"]["steps"] == 5 * (p - 1)
        assert o["stats"]["bytes_sent"] == 5 * (p - 1) * shard


# ---------------------------------------------------------------- logits path

def _logits_rank(rank, world, p):
    case = full_vocab_case(S, B, H, p)
    g = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="logits")
    n = S // p
    hidden = (case["emb"][case["tokens"]].transpose(0, 1) @ case["mix"])[rank * n:(rank + 1) * n]
    hidden = hidden.clone().requires_grad_()
    w = _shard(case["out"], p, rank).clone().requires_grad_()
    logits = metp_output_logits(hidden, w, group=g)
    gl = torch.randn(logits.shape, generator=torch.Generator().manual_seed(rank))
    logits.backward(gl)
    return logits.detach(), hidden.grad, w.grad, gl


@pytest.mark.parametrize("p", [1, 3])
def test_logits_path_matches_full_matmul(p):
    case = full_vocab_case(S, B, H, p)
    out = run_ranks(_logits_rank, p, p)
    hidden = (case["emb"][case["tokens"]].transpose(0, 1) @ case["mix"]).requires_grad_()
    w = case["out"].clone().requires_grad_()
    logits = hidden @ w.t()
    logits.backward(torch.cat([o[3] for o in out]))
    assert rel_err(torch.cat([o[0] for o in out]), logits.detach()) <= 1e-6
    assert rel_err(torch.cat([o[1] for o in out]), hidden.grad) <= 1e-6
    assert rel_err(torch.cat([o[2] for o in out]), w.grad) <= 1e-6


# ---------------------------------------------------------------- bf16 against stock Megatron TP

BF16_DIMS = (32, 2, 32)


def _stock_tp_rank(rank, p, tied, dims=BF16_DIMS):
    """VocabParallelEmbedding → mix → ColumnParallelLinear → vocab_parallel_cross_entropy, TP=p."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                               vocab_parallel_cross_entropy)

    s, b, h = dims
    dt = torch.bfloat16
    ps.initialize_model_parallel(tensor_model_parallel_size=p, create_gloo_process_groups=False)
    case = full_vocab_case(s, b, h, p, tied=tied, dtype=dt)
    cfg = ModelParallelConfig(tensor_model_parallel_size=p, use_cpu_initialization=True,
                              perform_initialization=False, params_dtype=dt)
    tp = ps.get_tensor_model_parallel_group()
    emb = VocabParallelEmbedding(case["V"], h, init_method=lambda w: None, config=cfg, tp_group=tp)
    out = ColumnParallelLinear(h, case["V"], config=cfg, init_method=lambda w: None, bias=False,
                               gather_output=False, skip_weight_param_allocation=tied, tp_group=tp)
    with torch.no_grad():
        emb.weight.copy_(_shard(case["emb"], p, rank))
        if not tied:
            out.weight.copy_(_shard(case["out"], p, rank))
    mix = case["mix"].clone().requires_grad_()
    hidden = emb(case["tokens"]).transpose(0, 1) @ mix
    hidden.retain_grad()
    logits, _ = out(hidden, weight=emb.weight if tied else None)
    loss = vocab_parallel_cross_entropy(logits, case["labels"].t().contiguous()).t()
    total = (loss * case["mask"]).sum() / case["mask"].sum()
    total.backward()
    return {"loss": total.detach(), "per_token": loss.detach(), "demb": emb.weight.grad,
            "dout": None if tied else out.weight.grad, "dmix": mix.grad,
            "dhidden": hidden.grad}


def stock_tp_errors(p, tied, ref):
    """Errors of Megatron's stock vocab-parallel embedding + output + loss over TP = ``p``
    (bf16) against ``ref``: the bar the METP vocabulary ops must clear."""
    st = run_ranks(_stock_tp_rank, p, tied)
    stock = {"loss": st[0]["loss"], "per_token": st[0]["per_token"],
             "dhidden": st[0]["dhidden"], "demb": torch.cat([o["demb"] for o in st]),
             "dmix": st[0]["dmix"]}
    if not tied:
        stock["dout"] = torch.cat([o["dout"] for o in st])
    return _errors(stock, ref)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_no_worse_than_stock_megatron_tp(tied):
    p = 2
    s, b, h = BF16_DIMS
    case = full_vocab_case(s, b, h, p, tied=tied, dtype=torch.bfloat16)
    ref = reference(case, dtype=torch.float32)  # same bf16 weights, fp32 math
    metp = _errors(_gather(run_ranks(_metp_rank, p, p, tied, 0.0, 1, False, torch.bfloat16,
                                     BF16_DIMS), p), ref)
    stock = stock_tp_errors(p, tied, ref)
    print(f"\nbf16 vocab p={p} tied={tied}: METP {metp}\n  stock TP {stock}")
    assert sum(metp.values()) <= sum(stock.values()), (metp, stock)
    for k in stock:
        assert metp[k] <= 1.1 * stock[k] + 1e-6, (k, metp[k], stock[k])


# ---------------------------------------------------------------- bad input

def _bad_ids(rank, p, what):
    g = METPGroup.from_process_group(dist.group.WORLD, name="bad-ids")
    v, h, n = 4, 8, 3
    w = torch.randn(v, h)
    ids = torch.zeros(1, n, dtype=torch.long)
    if rank == 1 and what != "labels_too_big":  # one rank has the bad id: all must refuse
        ids[0, 1] = {"too_big": p * v, "negative": -1}[what]
    try:
        if what == "labels_too_big":
            lab = torch.zeros(1, n, dtype=torch.long)
            if rank == 1:
                lab[0, 2] = p * v + 5
            metp_output_cross_entropy(torch.randn(n, 1, h), w, lab, group=g)
        else:
            metp_embedding(ids, w, group=g)
    except ValueError as exc:
        return str(exc), g.stats.steps
    return None, g.stats.steps


@pytest.mark.parametrize("what", ["too_big", "negative", "labels_too_big"])
def test_out_of_range_ids_refused_on_every_rank_before_any_transfer(what):
    p = 3
    for msg, steps in run_ranks(_bad_ids, p, what, timeout=60):
        assert msg is not None and "out of range" in msg and "METP group" in msg, msg
        assert steps == 0


def _bad_inputs(rank, p):
    g = METPGroup.from_process_group(dist.group.WORLD, name="bad-input")
    v, h, n = 4, 8, 3
    w = torch.randn(v, h)
    x = torch.randn(n, 1, h)
    lab = torch.zeros(1, n, dtype=torch.long)
    ids = torch.zeros(1, n, dtype=torch.long)
    cases = {
        "tokens_rank": lambda: metp_embedding(ids[0], w, group=g),
        "tokens_float": lambda: metp_embedding(ids.float(), w, group=g),
        "table_rank": lambda: metp_embedding(ids, w[0], group=g),
        "hidden_rank": lambda: metp_output_cross_entropy(x[0], w, lab, group=g),
        "hidden_size": lambda: metp_output_cross_entropy(torch.randn(n, 1, h + 1), w, lab, group=g),
        "labels_shape": lambda: metp_output_cross_entropy(x, w, lab[:, :2], group=g),
        "dtype": lambda: metp_output_cross_entropy(x.double(), w, lab, group=g),
        "vocab_size": lambda: metp_output_cross_entropy(x, w, lab, group=g, vocab_size=p * v + 1),
        "smoothing": lambda: metp_output_cross_entropy(x, w, lab, group=g, label_smoothing=1.0),
        "vocab_small": lambda: metp_embedding(ids, w, group=g, vocab_size=v),
    }
    return value_errors(cases), g.stats.steps


def test_bad_input_raises_value_error_naming_the_argument_before_any_transfer():
    expect = {"tokens_rank": "tokens must be", "tokens_float": "integer",
              "table_rank": "weight must be", "hidden_rank": "hidden must be",
              "hidden_size": "does not match", "labels_shape": "labels must be",
              "dtype": "dtype", "vocab_size": "do not cover", "smoothing": "label_smoothing",
              "vocab_small": "smaller than"}
    for msgs, steps in run_ranks(_bad_inputs, 2):
        assert steps == 0
        assert_messages(msgs, expect)


def test_padded_vocab_size_is_megatrons_rule_times_metp():
    assert padded_vocab_size(50257, 128, 1, 1) == 50304  # Megatron's GPT-2 padding
    assert padded_vocab_size(50257, 128, 2, 4) == 51200
    assert padded_vocab_size(50, 2, 1, 3) == 54
    assert padded_vocab_size(128, 128, 1, 1) == 128
    with pytest.raises(ValueError, match="metp_parallel_size"):
        padded_vocab_size(50, 2, 1, 0)


# ---------------------------------------------------------------- cross-rank agreement (opt-in)

def _disagree(rank, p, what):
    from megatron_metp.runtime import agree

    agree.enable_agreement_checks(True)
    g = METPGroup.from_process_group(dist.group.WORLD, name="vocab-agree", timeout_s=20)
    v, h, n = 4, 8, 3
    ids = torch.zeros(1, n, dtype=torch.long)
    w = torch.randn(v + (rank == 1 and what == "rows"), h)
    try:
        if what == "smoothing":
            metp_output_cross_entropy(torch.randn(n, 1, h), torch.randn(v, h), ids, group=g,
                                      label_smoothing=0.1 * (rank == 1))
        else:
            metp_embedding(ids, w, group=g, vocab_size=p * v + 4)
    except agree.GroupDisagreementError as exc:
        return str(exc), g.stats.steps
    return None, g.stats.steps


@pytest.mark.parametrize("what,field", [("rows", "weight"), ("smoothing", "label_smoothing")])
def test_ranks_disagreeing_on_the_vocabulary_all_refuse_with_checks_on(what, field):
    for msg, steps in run_ranks(_disagree, 3, what, timeout=60):
        assert msg is not None and field in msg, msg
        assert steps == 0
