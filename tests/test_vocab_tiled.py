"""Token-tiled METP vocabulary ops: ``token_chunk`` of ``metp_output_cross_entropy`` (and of
``metp_embedding``) changes neither the loss, nor any gradient, nor one message of the ring.

Every configuration runs on the same forked gloo ranks, once untiled (``token_chunk=None``: auto,
one chunk at these sizes) and with chunks of 1, 3 and 5 token rows (5 divides neither 12 nor 8
rows per rank), on the embedding → mixing → output layer → cross-entropy model of
``tests/vocab_cases.py`` with a loss mask; loss, per-token loss and every gradient must equal the
untiled run within 1e-6 (fp32), and the single-device reference within 1e-5 as in
``tests/test_vocab.py``. The ring traffic (``group.stats`` and the full sequence of exchanges:
what, step, size, dtype; with TP also the all-reduces) must be identical, while the number of
per-chunk matmuls / lookups shows that the tiling really happened. A negative control drops one
chunk's contribution in one ring step (forward or backward) and must be caught.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_metp import METPGroup
from megatron_metp.ops import metp_embedding, metp_output_cross_entropy
from tests.harness import assert_messages, run_ranks, value_errors
from tests.numerics import rel_err
from tests.test_vocab import (BF16_DIMS, B, H, S, _errors, _gather, rank_inputs,
                              stock_tp_errors)
from tests.vocab_cases import full_vocab_case, reference

#: (loss token_chunk, embedding token_chunk); the first is the untiled baseline
CONFIGS = [(None, None), (1, 1), (3, 3), (5, 5), (5, None), (None, 2)]
TILED_TOL = 1e-6


class _Count(TorchFunctionMode):
    """Counts the per-chunk kernels of the two ops' forwards (torch function level; the mode is
    not active inside autograd's backward: see :func:`_count_backward`)."""

    def __init__(self):
        super().__init__()
        self.n = {"mm": 0, "index_select": 0, "index_add_": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = {torch.mm: "mm", torch.Tensor.index_select: "index_select",
                torch.Tensor.index_add_: "index_add_"}.get(func)
        if name:
            self.n[name] += 1
        return func(*args, **(kwargs or {}))


def _log_traffic(log):
    """Record every ring exchange and all-reduce of this process in ``log``."""
    from megatron_metp.runtime import ring

    start, all_reduce = ring.RingExchanger.start, dist.all_reduce

    def logged_start(self, send, recv, *, step):
        log.append(("ring", self.what, step, send.numel(), str(send.dtype)))
        return start(self, send, recv, step=step)

    def logged_all_reduce(t, *args, **kwargs):
        log.append(("all_reduce", tuple(t.shape), str(t.dtype)))
        return all_reduce(t, *args, **kwargs)

    ring.RingExchanger.start = logged_start
    dist.all_reduce = logged_all_reduce


def _count_backward(counts):
    """Count the backward's per-chunk calls: ``mm_acc`` of the loss (two per chunk and step) and
    ``local_rows`` of the embedding (one per chunk and step)."""
    from megatron_metp.ops import cross_entropy, embedding

    mm_acc, local_rows = cross_entropy.mm_acc, embedding.local_rows

    def counted_mm_acc(*args):
        counts["mm_acc"] += 1
        return mm_acc(*args)

    def counted_local_rows(*args):
        counts["emb_local_rows"] += 1
        return local_rows(*args)

    cross_entropy.mm_acc, embedding.local_rows = counted_mm_acc, counted_local_rows


class _SkipOnce(list):
    """Chunk list whose ``skip_pass``-th iteration (one ring step) leaves out chunk 1."""

    def __init__(self, items, skip_pass):
        super().__init__(items)
        self.passes, self.skip_pass = 0, skip_pass

    def __iter__(self):
        k, self.passes = self.passes, self.passes + 1
        items = list(list.__iter__(self))
        return iter([c for i, c in enumerate(items) if not (k == self.skip_pass and i == 1)])


def _sabotage(where):
    """Negative control: one chunk of one ring step is skipped (``where``: loss-fwd, loss-bwd or
    emb-fwd)."""
    from megatron_metp.ops import cross_entropy, embedding

    module = embedding if where.startswith("emb") else cross_entropy
    real, calls = module.token_chunks, []

    def token_chunks(n, chunk):
        chunks = real(n, chunk)
        if len(chunks) < 2:  # the untiled baseline runs unharmed
            return chunks
        calls.append(n)
        # the op calls it once in forward (call 0), once in backward (call 1)
        bad_call = 1 if where == "loss-bwd" else 0
        return _SkipOnce(chunks, 1) if len(calls) - 1 == bad_call else chunks

    module.token_chunks = token_chunks


def _tiled_ranks(rank, world, p, configs, tied=False, smoothing=0.0, tp=1, dtype=torch.float32,
                 dims=(S, B, H), sabotage=None, env=None):
    """Rank ``rank`` of TP×METP (TP-major, as ``tests.test_vocab._metp_rank``): one
    forward+backward per ``(loss_chunk, emb_chunk)`` of ``configs``, each on a fresh METPGroup."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if env is not None:
        os.environ["METP_LOSS_TOKEN_CHUNK"] = env
    s, b, h = dims
    case = full_vocab_case(s, b, h, p, tied=tied, tp=tp, dtype=dtype)
    tp_rank, r = divmod(rank, p)
    metp_groups = [dist.new_group(list(range(t * p, (t + 1) * p))) for t in range(tp)]
    tp_groups = [dist.new_group([t * p + i for t in range(tp)]) for i in range(p)]
    tpg = tp_groups[r] if tp > 1 else None
    log, bwd = [], {"mm_acc": 0, "emb_local_rows": 0}
    _log_traffic(log)
    _count_backward(bwd)
    if sabotage:
        _sabotage(sabotage)
    V, n = case["V"], s // p
    results = []
    for loss_chunk, emb_chunk in configs:
        g = METPGroup.from_process_group(metp_groups[tp_rank], name="vocab-tiled")
        emb, out, mix, tokens, labels, mask, vstart = rank_inputs(case, p, r, tp, tp_rank, tied)
        del log[:]
        with _Count() as fwd:
            x = metp_embedding(tokens, emb, group=g, vocab_start=vstart, vocab_size=V,
                               token_chunk=emb_chunk)
            if tpg is not None:
                x = reduce_from_tensor_model_parallel_region(x, group=tpg)
            hidden = x.transpose(0, 1) @ mix
            hidden.retain_grad()
            loss = metp_output_cross_entropy(hidden, out, labels, group=g, tp_group=tpg,
                                             vocab_start=vstart, vocab_size=V,
                                             label_smoothing=smoothing, token_chunk=loss_chunk)
        total = (loss * mask).sum() / case["mask"].sum()
        bwd.update(mm_acc=0, emb_local_rows=0)
        total.backward()
        results.append({"loss": total.detach(), "per_token": loss.detach(), "demb": emb.grad,
                        "dout": None if tied else out.grad, "dmix": mix.grad,
                        "dhidden": hidden.grad, "stats": g.stats.snapshot(), "log": list(log),
                        "fwd": dict(fwd.n), "bwd": dict(bwd), "rows": n * b})
    return results


def _per_config(out, i):
    return [o[i] for o in out]


def _check_tiled(out, p, tp, configs, ref, tol=TILED_TOL):
    base = _gather(_per_config(out, 0), p, tp)
    for i, (lc, ec) in enumerate(configs):
        ranks = _per_config(out, i)
        got = _gather(ranks, p, tp)
        errs = _errors(got, base)
        assert max(errs.values()) <= tol, (lc, ec, errs)
        if lc is None:  # the embedding's tiling repeats the very same additions in order
            assert all(torch.equal(got[k], base[k]) for k in errs), (lc, ec, errs)
        assert max(_errors(got, ref).values()) <= 1e-5, (lc, ec)
        for o, o0 in zip(ranks, _per_config(out, 0)):
            # the ring is untouched: counters and every exchange (what, step, size, dtype)
            assert o["stats"] == o0["stats"] and o["log"] == o0["log"], (lc, ec)
            # ... and the tiling happened: one matmul / lookup / scatter per chunk and step
            N = o["rows"]
            kl, ke = math.ceil(N / (lc or N)), math.ceil(N / (ec or N))
            assert o["fwd"] == {"mm": p * kl, "index_select": p * ke, "index_add_": 0}, o["fwd"]
            assert o["bwd"] == {"mm_acc": 2 * p * kl, "emb_local_rows": p * ke}, o["bwd"]


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_tiled_equals_untiled_fp32(p, tied, smoothing):
    case = full_vocab_case(S, B, H, p, tied=tied)
    out = run_ranks(_tiled_ranks, p, p, CONFIGS, tied, smoothing)
    _check_tiled(out, p, 1, CONFIGS, reference(case, smoothing=smoothing))
    # the counters are the closed form of test_vocab.test_exchanger_counts_match_closed_form
    v = case["V"] // p
    assert out[0][0]["stats"]["bytes_sent"] == 5 * (p - 1) * v * H * 4


@pytest.mark.parametrize("tied", [False, True])
def test_tiled_composes_with_tp(tied):
    tp, p = 2, 2
    case = full_vocab_case(S, B, H, p, tied=tied, tp=tp)
    out = run_ranks(_tiled_ranks, tp * p, p, CONFIGS[:4], tied, 0.1, tp)
    _check_tiled(out, p, tp, CONFIGS[:4], reference(case, smoothing=0.1))
    assert any(e[0] == "all_reduce" for e in out[0][0]["log"])  # the TP merge was logged


@pytest.mark.parametrize("tied", [False, True])
def test_tiled_bf16_no_worse_than_untiled_nor_stock_tp(tied):
    p = 2
    s, b, h = BF16_DIMS
    configs = [(None, None), (5, 5), (1, 1)]
    case = full_vocab_case(s, b, h, p, tied=tied, dtype=torch.bfloat16)
    ref = reference(case, dtype=torch.float32)
    out = run_ranks(_tiled_ranks, p, p, configs, tied, 0.0, 1, torch.bfloat16, BF16_DIMS)
    errs = [_errors(_gather(_per_config(out, i), p), ref) for i in range(len(configs))]
    stock = stock_tp_errors(p, tied, ref)
    print(f"\nbf16 tiled p={p} tied={tied}: " + "; ".join(
        f"{c}: {e}" for c, e in zip(configs, errs)) + f"\n  stock TP {stock}")
    for c, e in zip(configs[1:], errs[1:]):
        for k in e:
            assert e[k] <= 1.1 * errs[0][k] + 1e-6, (c, k, e[k], errs[0][k])
            assert e[k] <= 1.1 * stock[k] + 1e-6, (c, k, e[k], stock[k])
    for i in range(1, len(configs)):
        assert _per_config(out, i)[0]["log"] == _per_config(out, 0)[0]["log"]


def test_environment_variable_sets_the_loss_chunk():
    p, N = 2, (S // 2) * B
    # env 2 tiles the loss only; the explicit argument wins over it
    out = run_ranks(_tiled_ranks, p, p, [(None, None), (5, None)], False, 0.0, env="2")
    assert out[0][0]["fwd"] == {"mm": p * math.ceil(N / 2), "index_select": p, "index_add_": 0}
    assert out[0][1]["fwd"]["mm"] == p * math.ceil(N / 5)
    untiled = run_ranks(_tiled_ranks, p, p, [(None, None)], False, 0.0, env="")
    assert untiled[0][0]["fwd"]["mm"] == p
    assert rel_err(out[0][0]["demb"], untiled[0][0]["demb"]) <= TILED_TOL


def test_auto_chunk_is_at_most_2_28_elements():
    from megatron_metp.ops.vocab import resolve_token_chunk, token_chunks

    assert resolve_token_chunk(None, 16128) == 16644 and 16644 * 16128 <= 2 ** 28 < 16645 * 16128
    assert resolve_token_chunk(None, 4096) == 65536
    assert resolve_token_chunk(None, 2 ** 30) == 1
    assert resolve_token_chunk(7, 16128) == 7
    assert token_chunks(8, 3) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert token_chunks(0, 3) == []


# ---------------------------------------------------------------- negative control

@pytest.mark.parametrize("where", ["loss-fwd", "loss-bwd", "emb-fwd"])
def test_negative_control_a_skipped_chunk_is_caught(where):
    p = 3
    configs = [(None, None), (3, 3)]
    out = run_ranks(_tiled_ranks, p, p, configs, False, 0.1, sabotage=where)
    base, bad = (_gather(_per_config(out, i), p) for i in range(2))
    errs = _errors(bad, base)
    if where == "loss-bwd":  # the loss is right, the gradients are not
        assert errs["loss"] <= TILED_TOL and errs["per_token"] <= TILED_TOL, errs
        assert errs["dhidden"] > 1e-2 and errs["dout"] > 1e-2, errs
    else:
        assert errs["loss"] > 1e-3 and errs["per_token"] > 1e-2, errs
    assert all(math.isfinite(e) for e in errs.values()), errs
    with pytest.raises(AssertionError):
        _check_tiled(out, p, 1, configs, reference(full_vocab_case(S, B, H, p), smoothing=0.1))


# ---------------------------------------------------------------- bad token_chunk

def _bad_chunks(rank, p):
    g = METPGroup.from_process_group(dist.group.WORLD, name="bad-chunk")
    v, h, n = 4, 8, 3
    w = torch.randn(v, h)
    x = torch.randn(n, 1, h)
    lab = torch.zeros(1, n, dtype=torch.long)

    def loss(chunk=None, env=None):
        def call():
            os.environ.pop("METP_LOSS_TOKEN_CHUNK", None)
            if env is not None:
                os.environ["METP_LOSS_TOKEN_CHUNK"] = env
            try:
                metp_output_cross_entropy(x, w, lab, group=g, token_chunk=chunk)
            finally:
                os.environ.pop("METP_LOSS_TOKEN_CHUNK", None)
        return call

    cases = {
        "zero": loss(0), "negative": loss(-1), "float": loss(2.5), "string": loss("3"),
        "bool": loss(True),
        "env_abc": loss(env="abc"), "env_zero": loss(env="0"), "env_negative": loss(env="-1"),
        "env_float": loss(env="1.5"),
        "emb_zero": lambda: metp_embedding(lab, w, group=g, token_chunk=0),
        "emb_negative": lambda: metp_embedding(lab, w, group=g, token_chunk=-3),
    }
    msgs = value_errors(cases)
    steps = g.stats.steps
    ok = {"env_ignored_by_argument": loss(2, env="abc"), "env_blank": loss(env=" ")}
    return msgs, steps, value_errors(ok)


def test_bad_token_chunk_refused_naming_it_before_any_transfer():
    arg, env = "token_chunk must be a positive integer", "METP_LOSS_TOKEN_CHUNK must be a positive"
    expect = {"zero": arg, "negative": arg, "float": arg, "string": arg, "bool": arg,
              "env_abc": env, "env_zero": env, "env_negative": env, "env_float": env,
              "emb_zero": arg, "emb_negative": arg}
    for msgs, steps, ok in run_ranks(_bad_chunks, 2):
        assert steps == 0
        assert_messages(msgs, expect)
        assert "'abc'" in msgs["env_abc"] and "got 0" in msgs["zero"]
        assert ok == {"env_ignored_by_argument": None, "env_blank": None}
