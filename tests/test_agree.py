"""The cross-rank agreement check (:mod:`megatron_metp.runtime.agree`), on by default.

With the check on, ranks of one METP group that call an op with different shapes, dtypes or options
all raise :class:`GroupDisagreementError` naming the op and the field, before anything is sent; a
rank that refuses its own arguments ends its peers at once; consistent calls compute exactly what
they compute with the check off. With the check off the behaviour is unchanged (the cross-rank
mismatch test in ``tests/test_properties.py`` still ends in the ring's error).
"""

import importlib
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.runtime import agree
from megatron_metp.runtime.agree import GroupDisagreementError
from megatron_metp.ops import metp_attention, metp_mlp, ring_attention
from tests.harness import run_ranks
from tests.mlp_cases import full_mlp_params, reference_mlp, shard_params, unshard_grads
from tests.numerics import rel_err

H = 8  # hidden size of the MLP and attention cases


# ============================================================================== single process

def test_on_by_default_and_a_single_rank_never_exchanges(monkeypatch):
    assert issubclass(GroupDisagreementError, ValueError)
    on = os.environ.get("METP_CHECK_AGREEMENT", "1").strip().lower() not in ("0", "false", "off",
                                                                             "no")
    assert agree.agreement_checks_enabled() == on
    monkeypatch.setattr(agree, "_enabled", True)
    agree.check_group_agrees(METPGroup.single(), "metp_mlp", x=torch.zeros(2))  # nothing to ask
    y = metp_mlp(torch.randn(2, 1, 4), torch.randn(4, 4), torch.randn(4, 4), group=None)
    assert y.shape == (2, 1, 4)


def _reload_with_env(rank, world, value):
    os.environ["METP_CHECK_AGREEMENT"] = value  # a forked child: the reload stays in it
    importlib.reload(agree)
    return agree.agreement_checks_enabled()


def _reload_mode(rank, world, value):
    if value is None:
        os.environ.pop("METP_CHECK_AGREEMENT", None)
    else:
        os.environ["METP_CHECK_AGREEMENT"] = value
    try:
        importlib.reload(agree)
    except ValueError as exc:
        return str(exc)
    return agree._mode


def test_env_var_switches_the_check_off_or_to_every_call():
    assert run_ranks(_reload_with_env, 1, "1") == [True]
    assert run_ranks(_reload_with_env, 1, "0") == [False]
    got = [run_ranks(_reload_mode, 1, v)[0] for v in (None, "", "1", "0", "off", "every")]
    assert got == ["cached", "cached", "cached", "off", "off", "every"]
    msg = run_ranks(_reload_mode, 1, "sometimes")[0]
    assert msg.startswith("METP_CHECK_AGREEMENT='sometimes': use 1"), msg


def test_encoding_is_canonical_and_leaves_the_device_out():
    a = agree.encode({"x": torch.zeros(4, 1, 8), "activation": "gelu", "grad": torch.float32})
    b = agree.encode({"grad": torch.float32, "activation": "gelu",
                      "x": torch.zeros(4, 1, 8, device="meta")})
    assert a == b
    assert b'"x":"float32[4, 1, 8]"' in a and b'"grad":"float32"' in a
    assert agree.encode({"x": torch.zeros(4, 1, 8, dtype=torch.bfloat16)}) != \
        agree.encode({"x": torch.zeros(4, 1, 8)})
    assert agree.encode({"causal": True}) != agree.encode({"causal": 1})
    assert agree._record(a) == agree._record(b) and len(agree._record(a)) == 9


def test_message_names_the_field_and_groups_ranks_by_value():
    g = METPGroup(None, 1, 3, 0, 2, (10, 11, 12), name="metp[dp=0]")
    per_rank = [{"q": "float32[4, 1, 2, 4]", "causal": True},
                {"q": "float32[6, 1, 2, 4]", "causal": True},
                {"q": "float32[6, 1, 2, 4]", "causal": True}]
    msg = agree._message(g, "ring_attention 'layer 2 core_attention'", per_rank)
    assert msg.startswith("METP: the ranks of group 'metp[dp=0]' called ring_attention "
                          "'layer 2 core_attention' with different arguments. q differs: "
                          "float32[4, 1, 2, 4] on rank 0 (global 10); float32[6, 1, 2, 4] on "
                          "ranks 1, 2 (global 11, 12). Every rank"), msg
    assert "causal differs" not in msg
    assert msg.endswith("This rank (1 of 3, global 11) has: causal=true, q=float32[6, 1, 2, 4]")


# ============================================================================== disagreeing ranks

def _attention_weights(p, dtype=torch.float32, h=H):
    """num_heads 2p, num_query_groups p, head dim 4: one query group per rank."""
    return (torch.randn(1 * (2 + 2) * 4, h, dtype=dtype, requires_grad=True),
            torch.randn(h, 2 * 4, dtype=dtype, requires_grad=True))


def _call(case, rank, p, grp):
    """Run one case; rank ``odd`` (0, or the last rank for some cases) differs from the others."""
    odd = rank == (p - 1 if case in ("ring_causal", "mlp_dtype", "attn_layout") else 0)
    if case.startswith("ring"):
        n = {"ring_tokens": 4 if odd else 6, "ring_refused": 3 if odd else 4}.get(case, 4)
        q = torch.randn(n, 1, 2, 4, requires_grad=True)
        causal = not (odd and case == "ring_causal")
        return ring_attention(q, q, q, group=grp, causal=causal, kernel="reference",
                              label="layer 2 core_attention")
    if case.startswith("mlp"):
        h = 6 if odd and case == "mlp_hidden" else H
        dtype = torch.bfloat16 if odd and case == "mlp_dtype" else torch.float32
        act = "swiglu" if odd and case == "mlp_activation" else "gelu"
        k = 2 if act == "swiglu" else 1
        x = torch.randn(4, 1, h, dtype=dtype, requires_grad=True)
        w1 = torch.randn(k * 3, h, dtype=dtype, requires_grad=True)
        w2 = torch.randn(h, 3, dtype=dtype, requires_grad=True)
        label = "layer 4 mlp" if odd and case == "mlp_label" else "layer 3 mlp"
        if odd and case == "mlp_no_grad":
            with torch.no_grad():
                return metp_mlp(x, w1, w2, group=grp, activation=act, label=label)
        return metp_mlp(x, w1, w2, group=grp, activation=act, label=label)
    n = 6 if odd and case == "attn_tokens" else 4
    dtype = torch.bfloat16 if odd and case == "attn_dtype" else torch.float32
    layout = "contiguous" if odd and case == "attn_layout" else "dual_chunk"
    wqkv, wo = _attention_weights(p, dtype)
    x = torch.randn(n, 1, H, dtype=dtype, requires_grad=True)
    return metp_attention(x, wqkv, wo, group=grp, num_heads=2 * p, num_query_groups=p,
                          layout=layout, kernel="reference", label="layer 1 self_attention")


#: case -> (op in the message, what the message must name)
CASES = {
    "ring_tokens": ("ring_attention 'layer 2 core_attention'", "q differs: float32[4, 1, 2, 4]"),
    "ring_causal": ("ring_attention", "causal differs"),  # same bytes: silently wrong without
    "ring_refused": ("ring_attention", "refused its own arguments: layout='dual_chunk' needs an "
                     "even number of local tokens"),
    "mlp_hidden": ("metp_mlp 'layer 3 mlp'", "x_hidden_size differs: 6 on rank 0"),
    "mlp_dtype": ("metp_mlp", "x_dtype differs: float32 on rank"),
    "mlp_activation": ("metp_mlp", "activation differs: swiglu on rank 0"),
    "mlp_label": ("metp_mlp", "label differs: layer 4 mlp on rank 0"),
    "mlp_no_grad": ("metp_mlp", "needs_grad differs: false on rank 0"),
    "attn_tokens": ("metp_attention 'layer 1 self_attention'", "x differs: float32[6, 1, 8]"),
    "attn_dtype": ("metp_attention", "x differs: bfloat16[4, 1, 8] on rank 0"),
    "attn_layout": ("metp_attention", "layout differs"),  # same bytes: silently wrong without
}


def _disagreeing_rank(rank, p, cases, on=True):
    agree.enable_agreement_checks(on)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-test", timeout_s=10.0)
    torch.manual_seed(rank)
    out = {}
    for case in cases:  # every check completes on every rank, so the next case starts in step
        steps, t0 = grp.stats.steps, time.monotonic()
        try:
            _call(case, rank, p, grp)
            out[case] = ("no error", "", grp.stats.steps - steps, time.monotonic() - t0)
        except ValueError as exc:
            out[case] = (type(exc).__name__, str(exc), grp.stats.steps - steps,
                         time.monotonic() - t0)
    # the group still works: a consistent call afterwards runs the ring
    q = torch.randn(4, 1, 2, 4)
    ring_attention(q, q, q, group=grp, kernel="reference")
    out["after"] = grp.stats.steps
    return out


@pytest.mark.parametrize("p", [2, 3])
def test_ranks_that_disagree_all_raise_naming_the_op_and_the_field(p):
    out = run_ranks(_disagreeing_rank, p, list(CASES), timeout=60)
    for case, (op, needle) in CASES.items():
        heads = set()
        for rank, o in enumerate(out):
            kind, msg, steps, elapsed = o[case]
            assert steps == 0, (case, rank, "sent before refusing")
            assert elapsed < 9.0, (case, rank, elapsed)  # ended by the check, not the 10 s timeout
            if case == "ring_refused" and rank == 0:  # the refusing rank raises its own error
                assert kind == "ValueError" and "dual_chunk" in msg, (case, rank, kind, msg)
                continue
            assert kind == GroupDisagreementError.__name__, (case, rank, kind, msg)
            assert f"called {op}" in msg, (case, rank, msg)
            assert needle in msg and "'agree-test'" in msg, (case, rank, needle, msg)
            assert f"This rank ({rank} of {p}, global {rank})" in msg, (case, rank, msg)
            heads.add(msg.split("with different arguments.")[1].split("This rank")[0])
        assert len(heads) == 1, (case, heads)  # the same diagnosis on every rank
    assert all(o["after"] == p - 1 for o in out)


def test_negative_control_without_the_check_same_sized_disagreements_pass_silently():
    """Why the check exists: a causal flag or a token layout that differs between ranks moves
    the same bytes around the ring, so nothing fails, and the result is wrong."""
    cases = ["ring_causal", "attn_layout"]
    for o in run_ranks(_disagreeing_rank, 2, cases, False, timeout=60):
        assert [o[c][0] for c in cases] == ["no error"] * len(cases), o
        assert all(o[c][2] > 0 for c in cases), o  # the ring ran


def _peer_never_arrives(rank, world):
    agree.enable_agreement_checks(True)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-stall", timeout_s=1.5)
    if rank == 1:
        time.sleep(2.5)  # joins the exchange only after rank 0's timeout ...
        # ... then completes rank 0's abandoned all-gather (which gloo keeps running), so that
        # both ranks' exit barriers pair up and the test ends at once
        words = 1 + agree._DIGEST_WORDS + 1 + agree._WINDOW_WORDS  # record + window hash
        dist.all_gather([torch.empty(words, dtype=torch.int64) for _ in range(2)],
                        torch.zeros(words, dtype=torch.int64))
        return "late"
    t0 = time.monotonic()
    try:
        q = torch.randn(4, 1, 2, 4)
        ring_attention(q, q, q, group=grp, kernel="reference", label="layer 7 core_attention")
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error"


def test_a_peer_that_never_joins_the_check_times_out_with_the_group_named():
    out = run_ranks(_peer_never_arrives, 2, allow_errors=True, timeout=30)
    kind, msg, elapsed = out[0]
    assert kind in ("RingTimeoutError", "RingPeerError"), out[0]
    assert "agreement check of ring_attention 'layer 7 core_attention'" in msg, msg
    assert "'agree-stall'" in msg and "METP_CHECK_AGREEMENT" in msg, msg
    assert elapsed < 5.0, elapsed


# ============================================================================== agreeing ranks

def _consistent_rank(rank, p):
    """The same calls with the check off and on: the results and ring traffic must be equal."""
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-same")
    runs = []
    for on in (False, True):
        agree.enable_agreement_checks(on)
        torch.manual_seed(100 + rank)
        x = torch.randn(4, 2, H, requires_grad=True)
        w1, w2 = torch.randn(2 * 3, H, requires_grad=True), torch.randn(H, 3, requires_grad=True)
        q, k, v = (torch.randn(4, 2, hd, 4, requires_grad=True) for hd in (4, 2, 2))
        wqkv, wo = _attention_weights(p)
        grp.stats.reset()
        y1 = metp_mlp(x, w1, w2, group=grp, activation="swiglu", ffn_hidden_size=3 * p)
        y2 = ring_attention(q, k, v, group=grp, kernel="reference")
        y3 = metp_attention(x, wqkv, wo, group=grp, num_heads=2 * p, num_query_groups=p,
                            kernel="reference")
        (y1.sum() + y2.square().sum() + y3.sum()).backward()
        runs.append({"y": [y1, y2, y3], "grads": [t.grad for t in (x, w1, w2, q, k, v, wqkv, wo)],
                     "stats": grp.stats.snapshot()})
    return runs


@pytest.mark.parametrize("p", [2, 3])
def test_consistent_calls_compute_exactly_the_same_with_the_check_on(p):
    for off, on in run_ranks(_consistent_rank, p):
        assert off["stats"] == on["stats"] and on["stats"]["steps"] > 0
        for a, b in zip(off["y"] + off["grads"], on["y"] + on["grads"]):
            assert torch.equal(a, b)


def _uneven_mlp_rank(rank, p, counts):
    """metp_mlp needs only the hidden size to agree: each rank's tokens are its own."""
    agree.enable_agreement_checks(True)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-uneven")
    full = full_mlp_params(sum(counts), 1, H, 3 * p, "gelu", True)
    sh = {k: v.requires_grad_() for k, v in shard_params(full, 3 * p, "gelu", rank, p).items()}
    lo = sum(counts[:rank])
    x = full["x"][lo:lo + counts[rank]].clone().requires_grad_()
    y = metp_mlp(x, sh["w1"], sh["w2"], group=grp, fc1_bias=sh["b1"], fc2_bias=sh["b2"],
                 ffn_hidden_size=3 * p)
    y.backward(full["gy"][lo:lo + counts[rank]])
    return {"y": y.detach(), "dx": x.grad, "grads": {k: v.grad for k, v in sh.items()}}


@pytest.mark.parametrize("p", [2, 3])
def test_mlp_with_different_token_counts_per_rank_is_not_refused_and_is_right(p):
    counts = [2 + r for r in range(p)]
    out = run_ranks(_uneven_mlp_rank, p, counts)
    full = full_mlp_params(sum(counts), 1, H, 3 * p, "gelu", True)
    ref = reference_mlp(full, "gelu")
    dw1, db1, dw2 = unshard_grads([o["grads"] for o in out], 3 * p, "gelu", full)
    got = {"y": torch.cat([o["y"] for o in out]), "dx": torch.cat([o["dx"] for o in out]),
           "dw1": dw1, "db1": db1, "dw2": dw2}
    errs = {k: rel_err(v, ref[k]) for k, v in got.items()}
    assert max(errs.values()) <= 1e-5, errs


# ============================================================================== the schedule

def _scheduled_calls(rank, p, n_calls, odd_call, field, every=False):
    """``n_calls`` agreement checks on one group; at call ``odd_call`` rank 1 passes another
    ``field``. Returns ("raised", call index, message, exchanges) or ("ok", None, None, n)."""
    agree.enable_agreement_checks(True, every=every)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-sched", timeout_s=10.0)
    exchanges = []
    real = agree._all_gather

    def counting(group, t, what, label):
        exchanges.append(what)
        return real(group, t, what, label)

    agree._all_gather = counting
    x = torch.zeros(4, 1, H)
    for i in range(n_calls):
        fields = {"x": x, "activation": "gelu", "causal": True}
        if rank == 1 and i == odd_call:
            fields[field] = {"x": torch.zeros(4, 1, H, dtype=torch.bfloat16),
                             "activation": "swiglu", "causal": False}[field]
        try:
            agree.check_group_agrees(grp, f"metp_mlp 'layer {i % 3} mlp'", **fields)
        except GroupDisagreementError as exc:
            return "raised", i, str(exc), len(exchanges)
    return "ok", None, None, exchanges.count("exchanging the argument digest")


def test_the_schedule_is_the_same_on_every_rank_and_cheap():
    """No disagreement: the ranks exchange at the first FIRST_CALLS calls and every EVERY-th."""
    n = 3 * agree.EVERY + 5
    expect = agree.FIRST_CALLS + sum(1 for i in range(agree.FIRST_CALLS, n) if i % agree.EVERY == 0)
    assert run_ranks(_scheduled_calls, 2, n, -1, "x") == [("ok", None, None, expect)] * 2
    every = run_ranks(_scheduled_calls, 2, 20, -1, "x", every=True)
    assert every == [("ok", None, None, 20)] * 2


@pytest.mark.parametrize("field,needle", [("causal", "causal differs: true on rank"),
                                          ("activation", "activation differs: gelu on rank"),
                                          ("x", "x differs: float32[4, 1, 8] on rank")])
@pytest.mark.parametrize("p", [2, 3])
def test_a_disagreement_between_scheduled_checks_raises_on_every_rank_at_the_next(p, field,
                                                                                   needle):
    """Rank 1 changes one field at a call that does not exchange, after the same signature was
    checked and cached on every rank (the case a cache keyed by the local digest would hang on):
    every rank raises at the next scheduled check, naming the call and the field; none hangs."""
    odd = agree.FIRST_CALLS + 5
    t0 = time.monotonic()
    out = run_ranks(_scheduled_calls, p, 2 * agree.EVERY, odd, field, timeout=60)
    assert time.monotonic() - t0 < 30
    for kind, at, msg, _ in out:
        assert (kind, at) == ("raised", agree.EVERY), out
        assert f"(call {odd} of the METP ops on this group; found by the agreement check at call " \
               f"{agree.EVERY}, {agree.EVERY - odd} calls later" in msg, msg
        assert needle in msg and "bfloat16[4, 1, 8] on rank 1" in msg if field == "x" else \
            needle in msg, msg
    assert len({msg.split(" This rank")[0] for _, _, msg, _ in out}) == 1  # the same diagnosis


@pytest.mark.parametrize("odd", [0, agree.FIRST_CALLS - 1, agree.EVERY])
def test_a_disagreement_at_a_scheduled_call_raises_there(odd):
    for kind, at, msg, _ in run_ranks(_scheduled_calls, 2, agree.EVERY + 3, odd, "causal"):
        assert (kind, at) == ("raised", odd) and "causal differs" in msg, msg
        assert "calls later" not in msg, msg


def test_every_mode_refuses_at_the_call_itself():
    odd = agree.FIRST_CALLS + 5
    for kind, at, msg, _ in run_ranks(_scheduled_calls, 2, 30, odd, "causal", every=True):
        assert (kind, at) == ("raised", odd) and "causal differs" in msg, msg


def _ring_causal_after_warmup(rank, p):
    """Real ops: ring_attention with the same signature for FIRST_CALLS calls, then rank 1 turns
    causal off (the same bytes move: without the check a silently wrong result)."""
    agree.enable_agreement_checks(True)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-ring", timeout_s=10.0)
    q = torch.randn(4, 1, 2, 4)
    for i in range(agree.EVERY + 1):
        causal = not (rank == 1 and i == agree.FIRST_CALLS + 1)
        try:
            ring_attention(q, q, q, group=grp, causal=causal, kernel="reference",
                           label=f"layer {i} core_attention")
        except GroupDisagreementError as exc:
            return i, str(exc)
    return None, None


def test_real_ops_disagreeing_after_the_cached_calls_are_refused_on_every_rank():
    for at, msg in run_ranks(_ring_causal_after_warmup, 2, timeout=60):
        assert at == agree.EVERY, msg
        assert f"ring_attention 'layer {agree.FIRST_CALLS + 1} core_attention' (call " \
               f"{agree.FIRST_CALLS + 1} of the METP ops" in msg and "causal differs" in msg, msg


def _pending_checked(rank, p, odd, calls):
    """``calls`` agreeing checks (rank 1 changes ``causal`` at call ``odd`` unless -1, between
    scheduled exchanges), then :func:`agree.check_pending` as a save does."""
    agree.enable_agreement_checks(True)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-pending", timeout_s=10.0)
    x = torch.zeros(4, 1, H)
    for i in range(calls):
        agree.check_group_agrees(grp, f"metp_mlp 'layer {i % 3} mlp'", x=x, activation="gelu",
                                 causal=not (rank == 1 and i == odd))
    try:
        agree.check_pending(grp, "before saving iteration 3")
    except GroupDisagreementError as exc:
        return "raised", str(exc)
    return "ok", None


def test_check_pending_refuses_a_disagreement_between_scheduled_exchanges_at_once():
    """What a checkpoint save runs first: the calls since the last exchange are checked now,
    not at the next scheduled exchange (call EVERY), on every rank alike."""
    odd = agree.FIRST_CALLS + 2
    out = run_ranks(_pending_checked, 2, odd, agree.FIRST_CALLS + 5, timeout=60)
    for kind, msg in out:
        assert kind == "raised" and "causal differs" in msg and f"call {odd} " in msg, msg
    # negative control: agreeing calls pass, on every rank
    assert run_ranks(_pending_checked, 2, -1, agree.FIRST_CALLS + 5) == [("ok", None)] * 2


def _megatron_lm_save(rank, p, odd, calls):
    """Megatron-LM's ``save_checkpoint`` as megatron_metp.megatron_lm.last_seen wraps it, after
    ``calls`` checked METP calls (rank 1 changes ``causal`` at call ``odd`` unless -1)."""
    from types import SimpleNamespace

    from megatron_metp.megatron_lm import last_seen

    agree.enable_agreement_checks(True)
    grp = METPGroup.from_process_group(dist.group.WORLD, name="agree-mlm-save", timeout_s=10.0)
    last_seen.remember_groups(SimpleNamespace(metp=grp))
    x = torch.zeros(4, 1, H)
    for i in range(calls):
        agree.check_group_agrees(grp, f"metp_mlp 'layer {i % 3} mlp'", x=x, activation="gelu",
                                 causal=not (rank == 1 and i == odd))
    saved = []
    save = last_seen._save(lambda iteration, *a, **k: saved.append(iteration))
    try:
        save(3, "model", "optimizer")
    except GroupDisagreementError as exc:
        return "raised", str(exc), saved
    return "ok", None, saved


def test_megatron_lm_save_runs_the_pre_save_agreement_check_first():
    """The disagreement sits between scheduled exchanges (as in the test above): only the
    pre-save check can find it, and Megatron-LM's save_checkpoint is then never called."""
    odd = agree.FIRST_CALLS + 2
    out = run_ranks(_megatron_lm_save, 2, odd, agree.FIRST_CALLS + 5, timeout=60)
    for kind, msg, saved in out:
        assert kind == "raised" and "causal differs" in msg, msg
        assert saved == [], saved  # refused before Megatron-LM writes anything
    # negative control: agreeing calls: Megatron-LM's save runs, on every rank
    assert run_ranks(_megatron_lm_save, 2, -1, agree.FIRST_CALLS + 5) == [("ok", None, [3])] * 2
