"""The streaming METP layer (``ops/layer.py``) against the same layer made of the separate METP
ops (norm → metp_attention → residual → norm → metp_mlp → residual) and against a single-device
reference from the full weights."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_metp import METPGroup
from megatron_metp.ops import metp_attention, metp_mlp, shard_sequence, unshard_sequence
from megatron_metp.ops.layer import metp_layer
from megatron_metp.runtime import host_stash
from tests.harness import run_ranks
from tests.megatron_ref import _rope, full_attention_params
from tests.mlp_cases import fc1_rows
from tests.numerics import rel_err

S, B, H = 24, 2, 12


def _norm(kind, h, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "RMSNorm":
        m = torch.nn.RMSNorm(h, eps=1e-5)
    else:
        m = torch.nn.LayerNorm(h, eps=1e-5)
        with torch.no_grad():
            m.bias.copy_(torch.randn(h, generator=gen) * 0.1)
    with torch.no_grad():
        m.weight.copy_(1 + torch.randn(h, generator=gen) * 0.2)
    return m


def _full(case):
    A, G, d = case["A"], case["G"], case["d"]
    full = full_attention_params(S, B, H, A, G, d, qkv_bias=case["bias"],
                                 proj_bias=case["bias"], rope=case["rope"], seed=case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 7)
    k = 2 if case["act"] == "swiglu" else 1
    F_ = case["ffn"]
    full["w1"] = torch.randn(k * F_, H, generator=gen) * H ** -0.5
    full["w2"] = torch.randn(H, F_, generator=gen) * F_ ** -0.5
    full["b1"] = torch.randn(k * F_, generator=gen) * 0.1 if case["bias"] else None
    full["b2"] = torch.randn(H, generator=gen) * 0.1 if case["bias"] else None
    if case.get("qk"):
        full["qn"] = 1 + torch.randn(d, generator=gen) * 0.2
        full["kn"] = 1 + torch.randn(d, generator=gen) * 0.2
    return full


def _shards(full, case, r, p):
    A, G, d = case["A"], case["G"], case["d"]
    rows = (G // p) * (A // G + 2) * d
    cols = (A // p) * d
    sl = slice(r * rows, (r + 1) * rows)
    f = case["ffn"] // p
    fr = fc1_rows(case["ffn"], case["act"], r, p)
    get = lambda t, idx: None if t is None else t[idx].clone()  # noqa: E731
    return {"qkv_weight": full["qkv_weight"][sl].clone(), "qkv_bias": get(full["qkv_bias"], sl),
            "proj_weight": full["proj_weight"][:, r * cols:(r + 1) * cols].clone(),
            "proj_bias": get(full["proj_bias"], slice(None)),
            "fc1_weight": full["w1"][fr].clone(), "fc1_bias": get(full["b1"], fr),
            "fc2_weight": full["w2"][:, r * f:(r + 1) * f].clone(),
            "fc2_bias": get(full["b2"], slice(None))}


def _leaf_inputs(full, case, rank, p):
    """Rank ``rank``'s weight shards (leaves), the two norms and the q/k-norm arguments of
    ``case``: ``(params, norm1, norm2, qk kwargs)``."""
    params = {k: None if v is None else v.requires_grad_() for k, v in
              _shards(full, case, rank, p).items()}
    n1, n2 = _norm(case["norm"], H, 1), _norm(case["norm"], H, 2)
    qk = {}
    if case.get("qk"):
        qk = {"qk_norm": "RMSNorm", "qk_norm_eps": 1e-6,
              "q_norm_weight": full["qn"].clone().requires_grad_(),
              "k_norm_weight": full["kn"].clone().requires_grad_()}
    return params, n1, n2, qk


def _layer_rank(rank, p, case, mode, host=False, in_place=False, tiles=None, corrupt=False):
    torch.manual_seed(0)
    full = _full(case)
    lay = case["layout"]
    grp = METPGroup.from_process_group(dist.group.WORLD if p > 1 else None, name="layer")
    params, n1, n2, qk = _leaf_inputs(full, case, rank, p)
    x_leaf = shard_sequence(full["x"], rank, p, layout=lay).clone().requires_grad_()
    x = x_leaf * 1.0 if in_place else x_leaf  # in place: not on a leaf
    attn_kw = dict(group=grp, num_heads=case["A"], num_query_groups=case["G"], causal=True,
                   layout=lay, rotary_pos_emb=full["rotary_pos_emb"],
                   cu_seqlens=case.get("cu"), **qk)
    if corrupt:  # negative control: one stash tile read back perturbed on every rank
        read = host_stash.Stash.read

        def bad_read(self, rows):
            t = read(self, rows)
            return t + 0.5 if self.host and rows.start == 0 else t
        host_stash.Stash.read = bad_read
    if mode == "ops":
        a = metp_attention(n1(x), params["qkv_weight"], params["proj_weight"],
                           qkv_bias=params["qkv_bias"], proj_bias=params["proj_bias"], **attn_kw)
        h1 = x + a
        y = h1 + metp_mlp(n2(h1), params["fc1_weight"], params["fc2_weight"], group=grp,
                          activation=case["act"], fc1_bias=params["fc1_bias"],
                          fc2_bias=params["fc2_bias"])
    else:
        y = metp_layer(x, qkv_weight=params["qkv_weight"], proj_weight=params["proj_weight"],
                       fc1_weight=params["fc1_weight"], fc2_weight=params["fc2_weight"],
                       activation=case["act"], norm1=n1, norm2=n2, qkv_bias=params["qkv_bias"],
                       proj_bias=params["proj_bias"], fc1_bias=params["fc1_bias"],
                       fc2_bias=params["fc2_bias"], host=host, in_place=in_place,
                       token_tile=tiles, **attn_kw)
        # in place only where x went to the host first (else x is saved on the device)
        assert (y.data_ptr() == x.data_ptr()) == (in_place and host)
    y.backward(shard_sequence(full["gy"], rank, p, layout=lay))
    out = {"y": y.detach().clone(), "dx": x_leaf.grad}
    out.update({"d" + k: v.grad for k, v in params.items() if v is not None})
    out.update({f"dn1.{k}": v.grad for k, v in n1.named_parameters()})
    out.update({f"dn2.{k}": v.grad for k, v in n2.named_parameters()})
    for k in ("q_norm_weight", "k_norm_weight"):
        if k in qk:
            out["d" + k] = qk[k].grad
    return out


def _compare(a, b):
    return {k: rel_err(a[k], b[k]) for k in a}


BASE = dict(A=4, G=2, d=4, bias=False, rope=True, act="swiglu", ffn=24, norm="RMSNorm",
            layout="dual_chunk", seed=0)
CASES = [  # (p, case overrides, host, in_place, tiles)
    (1, {}, False, False, 5),
    (2, {}, False, False, 2),
    (2, {}, True, True, {"rows": 5, "q": 2, "kv": 4, "keys": 3}),
    (3, dict(A=6, G=3, d=2, bias=True, act="gelu", norm="LayerNorm"), True, False,
     {"rows": 3, "q": 2, "kv": 3, "keys": 2}),
    (3, dict(A=6, G=3, d=2, qk=True, layout="contiguous"), False, True, 3),
    (2, dict(A=4, G=2, d=4, bias=True, qk=True), True, True,
     {"rows": 4, "q": 3, "kv": 5, "keys": 4}),
    (2, dict(cu=(0, 5, 13, 24)), True, True, {"rows": 4, "q": 3, "kv": 4, "keys": 3}),
    (2, dict(A=4, G=4, d=2, rope=False), False, False, 0),  # one tile: the whole rows
]


@pytest.mark.parametrize("p,over,host,in_place,tiles", CASES)
def test_streaming_layer_equals_the_separate_ops(p, over, host, in_place, tiles):
    case = dict(BASE, **over)
    ops = run_ranks(_layer_rank, p, case, "ops")
    got = run_ranks(_layer_rank, p, case, "stream", host, in_place, tiles)
    for r in range(p):
        errs = _compare(got[r], ops[r])
        assert len(errs) >= 8, errs
        # the [d] q/k norm weights' gradients are sums over every token and head with
        # cancellation, added in another order (per tile): fp32 rounding reaches ~1e-6 there
        loose = {k: errs.pop(k) for k in ("dq_norm_weight", "dk_norm_weight") if k in errs}
        assert max(errs.values()) <= 1e-6, (r, errs)
        assert max(loose.values(), default=0) <= 1e-5, (r, loose)


def test_streaming_layer_negative_control_corrupt_stash():
    case = dict(BASE)
    ops = run_ranks(_layer_rank, 2, case, "ops")
    got = run_ranks(_layer_rank, 2, case, "stream", True, False, 3, True)
    assert max(_compare(got[0], ops[0]).values()) > 1e-2


def _reference(case):
    """Single-device layer from the full weights, by autograd in fp64 (RMSNorm, SwiGLU, no
    biases: the case the test uses)."""
    full = {k: (None if v is None else v.double()) for k, v in _full(case).items()}
    A, G, d = case["A"], case["G"], case["d"]
    npg = A // G
    x = full["x"].clone().requires_grad_()
    n1, n2 = _norm(case["norm"], H, 1).double(), _norm(case["norm"], H, 2).double()
    w = {k: full[k].clone().requires_grad_() for k in ("qkv_weight", "proj_weight", "w1", "w2")}
    s, b = x.shape[:2]
    qkv = F.linear(n1(x), w["qkv_weight"]).view(s, b, G, (npg + 2) * d)
    q, k, v = torch.split(qkv, [npg * d, d, d], dim=-1)
    q = _rope(q.reshape(s, b, A, d), full["rotary_pos_emb"])
    k = _rope(k, full["rotary_pos_emb"]).repeat_interleave(npg, dim=2)
    v = v.repeat_interleave(npg, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores, -1), v).reshape(s, b, A * d)
    h1 = x + F.linear(ctx, w["proj_weight"])
    zg, zu = torch.chunk(F.linear(n2(h1), w["w1"]), 2, dim=-1)
    y = h1 + F.linear(F.silu(zg) * zu, w["w2"])
    y.backward(full["gy"])
    return {"y": y.detach(), "dx": x.grad, "dfc2_weight": w["w2"].grad}


@pytest.mark.parametrize("p", [2, 3])
def test_streaming_layer_matches_a_single_device_reference(p):
    case = dict(BASE, A=6, G=3, d=2) if p == 3 else dict(BASE)
    got = run_ranks(_layer_rank, p, case, "stream", True, True,
                    {"rows": 5, "q": 3, "kv": 3, "keys": 2})
    ref = _reference(case)
    lay = case["layout"]
    y = unshard_sequence([g["y"] for g in got], layout=lay)
    dx = unshard_sequence([g["dx"] for g in got], layout=lay)
    f = case["ffn"] // p
    dw2 = torch.cat([g["dfc2_weight"] for g in got], dim=1)
    assert rel_err(y, ref["y"]) <= 1e-5
    assert rel_err(dx, ref["dx"]) <= 1e-5
    assert rel_err(dw2, ref["dfc2_weight"]) <= 1e-5 and dw2.shape[1] == p * f


@pytest.mark.parametrize("kind,host,in_place", [("RMSNorm", True, True),
                                                ("LayerNorm", False, True),
                                                ("LayerNorm", True, False)])
def test_streaming_norm_equals_the_module(kind, host, in_place):
    """The streaming block's final norm (``streaming_norm``): tiles of 5 tokens, its input on
    the host or saved, its output over its input where safe: output, input gradient and the
    norm's parameter gradients equal the module's own (fp32); a perturbed tile is caught."""
    from megatron_metp.ops.layer_rows import streaming_norm

    torch.manual_seed(0)
    x0, gy = torch.randn(12, 2, H), torch.randn(12, 2, H)
    ref_norm, norm = _norm(kind, H, 3), _norm(kind, H, 3)
    xr = x0.clone().requires_grad_()
    yr = ref_norm(xr)
    yr.backward(gy)
    xl = x0.clone().requires_grad_()
    x = xl * 1.0
    y = streaming_norm(x, norm, host=host, in_place=in_place, tile_rows=5)
    assert (y.data_ptr() == x.data_ptr()) == (in_place and host)
    y.backward(gy.clone())
    assert rel_err(y.detach(), yr.detach()) <= 1e-6 and rel_err(xl.grad, xr.grad) <= 1e-6
    for a, b in zip(norm.parameters(), ref_norm.parameters()):
        assert rel_err(a.grad, b.grad) <= 1e-6
    # negative control: a tile read back perturbed (features reversed: norms are shift and
    # scale invariant)
    read = host_stash.Stash.read
    try:
        host_stash.Stash.read = (lambda self, rows: read(self, rows).flip(-1)
                                 if rows.start == 0 else read(self, rows))
        xl2 = x0.clone().requires_grad_()
        streaming_norm(xl2 * 1.0, norm, host=host, in_place=in_place, tile_rows=5).backward(gy)
    finally:
        host_stash.Stash.read = read
    assert rel_err(xl2.grad, xr.grad) > 1e-2


def _host_reads_rank(rank, p, case, tiles):
    """The rows of the layer input's host stash read and prefetched by one rank (forward and
    backward of one layer with ``host=True``), in order."""
    reads, fetched = [], []
    read, prefetch = host_stash.Stash.read, host_stash.Stash.prefetch

    def is_x(stash):
        return stash.host and stash.width == H  # the only host stash [·, h] of the layer

    def counting_read(self, rows):
        if is_x(self):
            reads.append((rows.start, rows.stop))
        return read(self, rows)

    def counting_prefetch(self, rows):
        if is_x(self):
            fetched.append((len(reads), (rows.start, rows.stop)))
        return prefetch(self, rows)
    host_stash.Stash.read, host_stash.Stash.prefetch = counting_read, counting_prefetch
    try:
        out = _layer_rank(rank, p, case, "stream", True, False, tiles)
    finally:
        host_stash.Stash.read, host_stash.Stash.prefetch = read, prefetch
    return out, reads, fetched


@pytest.mark.parametrize("p", [2, 3])
def test_host_reads_of_the_layer_input_per_backward(p):
    """With the input on the host, one layer's backward reads it ``2p + 3`` times
    (``layer_reads.host_reads``: the recompute's first K/V pass and its p query-tile passes,
    which also form the next group's K/V, the MLP's, the attention backward's p dWq passes,
    which also reduce the previous group's d(kv) and form the next group's K/V, ``dx`` with
    the last group's d(kv); the backward's q come from the recompute's kept projections),
    every host copy started ahead is read (none is left holding a device tile), and passes run
    two chunks ahead; the results are the same as the separate ops'."""
    from megatron_metp.ops.layer_reads import host_reads

    case = dict(BASE, A=6, G=3, d=2) if p == 3 else dict(BASE)
    tiles = {"rows": 3, "q": 4, "kv": 5, "keys": 3}
    ops = run_ranks(_layer_rank, p, case, "ops")
    for r, (out, reads, fetched) in enumerate(run_ranks(_host_reads_rank, p, case, tiles)):
        assert max(_compare(out, ops[r]).values()) <= 1e-5
        N = S // p * B
        passes = sum(b - a for a, b in reads) / N
        assert passes == sum(host_reads(p).values()) == 2 * p + 3, passes
        assert passes < 4 * p + 2  # negative control: what the backward read before
        ahead = 0
        for i, (at, rows) in enumerate(fetched):
            assert rows in reads[at:], (i, at, rows)  # read after it was started
            waiting = {x for a, x in fetched[:i + 1] if a == at} - set(reads[:at])
            ahead = max(ahead, len(waiting))
        assert ahead >= 2
