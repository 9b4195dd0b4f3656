"""Multi-latent attention (``--multi-latent-attention``) in METP's megatron-core GPT model
(:mod:`megatron_metp.megatron.mla`): a tiny GPTModel with MLA layers built with METP 2 and 3
gives the loss and every parameter's gradient of single-rank stock megatron-core
``MLASelfAttention`` layers with the same full weights (fp32, 1e-5); a negative control; the
state dict and checkpoint layout are stock's; refused combinations are named."""

import argparse
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from tests.gpt_cases import assemble, one_step_grads
from tests.harness import run_ranks
from tests.numerics import rel_err

#: 6 heads (divisible by 2 and 3), 12 tokens (2·p chunks for p = 2 and 3), RMSNorm
SIZE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=6, ffn_hidden_size=48,
               vocab_size=64, seq_length=12, normalization="RMSNorm")
MLA = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=10, kv_lora_rank=8,
           qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope")
#: YaRN (cos/sin factor and softmax scale with mscale ≠ 1), SwiGLU
YARN = dict(MLA, rope_type="yarn", rotary_scaling_factor=4.0,
            original_max_position_embeddings=4, mscale=1.0, mscale_all_dim=0.8)
KV_UP = (6 * (4 + 6), 8)
CASES = {"rope": (SIZE, MLA), "yarn": (dataclasses.replace(SIZE, swiglu=True), YARN)}


class _MaskedCoreAttention(torch.nn.Module):
    """Stock MLA's core attention in plain PyTorch (megatron-core's local
    ``DotProductAttention`` takes no separate k/v head dims; tests/mla_stock.py): causal, or
    Megatron's dense ``attention_mask`` (True = masked, packed documents) when given."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                packed_seq_params=None, **_):
        s = query.shape[0]
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.scale
        masked = ~torch.ones(s, s, dtype=torch.bool).tril() if attention_mask is None \
            else attention_mask.bool()
        scores = scores.masked_fill(masked, float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)
        return out.reshape(s, out.shape[1], -1)


def _stock_core_attention(spec):
    """Every MLA layer of a stock layer or block spec with :class:`_MaskedCoreAttention`."""
    layers = getattr(spec, "layer_specs", None)
    for layer in (layers if layers is not None else [spec]):
        layer.submodules.self_attention.submodules.core_attention = _MaskedCoreAttention
    return spec


def _patch_stock(layout):
    """In a stock (``mode="tp"``) rank: the core attention above, and this venv's Transformer
    Engine stand-in off for stock's MLA (tests/mla_stock.py)."""
    if layout.mode != "tp":
        return
    from megatron.core.transformer import multi_latent_attention as stock

    from megatron_metp.megatron import build

    stock.HAVE_TE = False
    layer_spec = build.layer_spec
    build.layer_spec = lambda *a, **k: _stock_core_attention(layer_spec(*a, **k))


def _rank(rank, world, size, layout, wrong_kv_shard=False):
    """:func:`tests.gpt_cases.one_step_grads` plus the model's state dict (keys, full shapes)
    and checkpoint view (key → global shape). ``wrong_kv_shard``: every rank loads the next
    rank's ``linear_kv_up_proj`` head group (the negative control)."""
    from megatron_metp.megatron import training

    _patch_stock(layout)
    build_model, shard_for = training.build_model, training.shard_for
    built = []

    def keep(*args, **kwargs):
        built.append(build_model(*args, **kwargs))
        return built[-1]

    def wrong(param, full, groups, gated):
        if wrong_kv_shard and getattr(param, "metp_sharded", False) and \
                tuple(full.shape) == KV_UP:  # linear_kv_up_proj [A·(dn+dv), kv_lora_rank]
            n = groups.shards
            return full.chunk(n, dim=0)[(groups.shard_index + 1) % n]
        return shard_for(param, full, groups, gated)

    training.build_model, training.shard_for = keep, wrong
    import tests.gpt_cases as gc

    gc.build_model = keep
    out = one_step_grads(rank, world, size, layout)
    model = built[0]
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out["state"] = sorted(k for k in model.state_dict())
    out["sharded"] = {v.key: tuple(v.global_shape) for v in model.sharded_state_dict().values()
                      if isinstance(v, ShardedTensor)}  # the checkpoint's keys
    out["attention"] = type(model.decoder.layers[0].self_attention).__name__
    out["rope"] = type(model.decoder.layers[0].self_attention.rotary_pos_emb).__name__
    return out


def _layout(mla, **kw):
    return Layout(extra=dict(mla), **kw)


@pytest.fixture(scope="module")
def stock():
    return {k: run_ranks(_rank, 1, size, _layout(mla, mode="tp"))[0]
            for k, (size, mla) in CASES.items()}


def _check(out, ref, size):
    assert out[0]["attention"] == "METPMLASelfAttention", out[0]["attention"]
    assert ref["attention"] == "MLASelfAttention", ref["attention"]
    assert abs(out[0]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (out[0]["loss"],
                                                                          ref["loss"])
    grads, full = assemble(out, size), assemble([ref], size)
    assert set(grads) == set(full), sorted(set(grads) ^ set(full))
    assert any("linear_kv_down_proj" in k for k in full) and \
        any("kv_layernorm" in k for k in full)
    errs = {k: rel_err(grads[k], full[k]) for k in full}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


@pytest.mark.parametrize("p,case,more", [
    (2, "rope", {}), (3, "yarn", {}),
    (2, "rope", {"recompute": "selective", "recompute_modules": ["layernorm"]}),
    (2, "yarn", {"rope_fp32_recipe": True})],
    ids=["metp2-rope", "metp3-yarn", "metp2-selective-layernorm", "metp2-yarn-fp32-recipe"])
def test_gpt_with_mla_matches_stock_single_rank(p, case, more, stock):
    """Loss and every gradient (sharded up-projections and output projection assembled from the
    shards; replicated down-projections, latent norms and biases summed over the METP group as
    DDP sums them) equal stock's within 1e-5; plain RoPE at METP 2 (also with Megatron's
    selective recompute of the layer norms), YaRN + SwiGLU at METP 3 (exact angles) and 2
    (Megatron's fp32 recipe, --metp-rope-fp32-recipe). The state dict keys and the checkpoint's
    keys and global shapes are stock's."""
    size, mla = CASES[case]
    out = run_ranks(_rank, p, size, _layout(mla, metp=p, **more))
    kind = "YarnRotaryEmbedding" if case == "yarn" else "RotaryEmbedding"
    assert out[0]["rope"] == (kind if more.get("rope_fp32_recipe") else f"Exact{kind}")
    ref = stock[case]
    _check(out, ref, size)
    for r in out:
        assert r["state"] == ref["state"], sorted(set(r["state"]) ^ set(ref["state"]))
        assert r["sharded"] == ref["sharded"], {k: (r["sharded"].get(k), v)
                                                for k, v in ref["sharded"].items()
                                                if r["sharded"].get(k) != v}


def test_negative_control_a_misplaced_kv_head_group_is_caught(stock):
    """The same check fails when each rank holds the next rank's ``linear_kv_up_proj`` head
    group (the latent up-projected with another head group's K/V weights)."""
    size, mla = CASES["rope"]
    out = run_ranks(_rank, 2, size, _layout(mla, metp=2), True)
    with pytest.raises(AssertionError):
        _check(out, stock["rope"], size)
    assert abs(out[0]["loss"] - stock["rope"]["loss"]) > 1e-4 * stock["rope"]["loss"]


def _rank_moe(rank, world, size, layout):
    _patch_stock(layout)
    from tests.test_moe import moe_one_step

    return moe_one_step(rank, world, size, layout)


#: MLA + MoE (layer 0: 4 experts top-2, layer 1 dense), no query latent at core_v0.16.1
MOE = GPTSize(num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=32,
              vocab_size=64, seq_length=16, normalization="RMSNorm", num_experts=4,
              moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[1, 0], bias=False)


def _moe_mla():
    from megatron.core.transformer import multi_latent_attention as stock

    fused_q_norm = hasattr(stock, "QKNormConfigResolver")  # core_v0.19: needs --q-lora-rank
    return dict(MLA, q_lora_rank=10 if fused_q_norm else None,
                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0), fused_q_norm


def test_mla_with_moe_at_metp_2_x_cp_2_matches_stock():
    """DeepSeek-shaped layers (MLA attention, a MoE layer and a dense one; without a query
    latent where the release builds one) at METP 2 × CP 2 (the latent ring over 4 ranks,
    weights and experts over 2, full recompute): loss and every gradient equal single-rank
    stock's."""
    from tests.test_moe import assemble as moe_assemble

    mla, _ = _moe_mla()
    ref = run_ranks(_rank_moe, 1, MOE, Layout(mode="tp", extra=mla))[0]
    full = moe_assemble([ref])
    assert any("linear_q_proj" in k for k in full) != (mla["q_lora_rank"] is not None)
    for world, layout in ((4, Layout(metp=2, cp=2, recompute="full", extra=mla)),):
        out = run_ranks(_rank_moe, world, MOE, layout)
        assert abs(out[0]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (world, out[0])
        kv_up = [v for r in out for k, v in r["grads"].items() if "linear_kv_up_proj" in k]
        assert kv_up and all(v[2] for v in kv_up)  # METP-sharded: the METP MLA module's
        got = moe_assemble(out)
        assert set(got) == set(full)
        errs = {k: rel_err(got[k], full[k]) for k in full}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-5, (world, worst, errs[worst])


def test_no_query_latent_is_refused_where_megatron_core_fuses_its_norm():
    """core_v0.19 builds the query norm without ``--q-lora-rank`` as Transformer Engine's fused
    norm + linear: METP refuses it by name there (core_v0.16.1 builds it: the test above)."""
    mla, fused_q_norm = _moe_mla()
    if not fused_q_norm:  # built and checked against stock by the MoE test above
        assert mla["q_lora_rank"] is None
        return
    with pytest.raises(Exception, match="without --q-lora-rank"):
        run_ranks(_rank_moe, 2, MOE, Layout(metp=2, extra=dict(MLA, q_lora_rank=None)))


def test_packed_documents_with_mla_match_stock_with_the_dense_mask():
    """Packed documents (EOD tokens, Megatron's --reset-attention-mask): METP 2 derives the
    boundaries and its latent ring attends within documents with per-document RoPE positions;
    stock gets Megatron's dense document mask and reset position ids."""
    from tests.test_packed_megatron import ENDS, _check_against, _packed_step

    size = dataclasses.replace(SIZE, seq_length=32)

    def run(world, layout):
        return run_ranks(_rank_packed, world, size, layout, ENDS)

    ref = run(1, _layout(MLA, mode="tp"))[0]
    out = run(2, _layout(MLA, metp=2))
    assert [r["cu"] for r in out] == [[0, 6, 7, 18, 23, 32]] * 2
    _check_against(out, ref, size, "METP 2 MLA, packed")


def _rank_packed(rank, world, size, layout, ends):
    from tests.test_packed_megatron import _packed_step

    _patch_stock(layout)
    return _packed_step(rank, world, size, layout, ends, True)


REFUSED = [
    (dict(tp=2), "--tensor-model-parallel-size 2"),
    (dict(weight_ring=False), "--metp-disable-weight-ring"),
    (dict(keep_attention=True), "--metp-keep-attention-output"),
    (dict(cfg=dict(qk_layernorm=False)), "without --qk-layernorm"),
    (dict(cfg=dict(normalization="LayerNorm")), "--normalization LayerNorm"),
    (dict(cfg=dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
     "core_attn"),
]


@pytest.mark.parametrize("kw,needle", REFUSED)
def test_unsupported_mla_combinations_are_refused_by_flag(kw, needle):
    """Each refused combination names its flag and the alternative, in the launcher's checks
    (Megatron-LM args) and in the build (before any module is constructed)."""
    from megatron_metp.megatron.build import layer_spec
    from megatron_metp.megatron.mla_checks import mla_problems
    from megatron_metp.megatron_lm.checks import metp_flag_problems

    kw = dict(kw)
    cfg = {"multi_latent_attention": True, "qk_layernorm": True, "normalization": "RMSNorm",
           **kw.pop("cfg", {})}
    problems = mla_problems(SimpleNamespace(**cfg), **kw)
    assert len(problems) == 1 and needle in problems[0], problems
    assert "--multi-latent-attention" in problems[0] and ":" in problems[0]  # the fix follows
    args = argparse.Namespace(
        **cfg, metp_parallel_size=2, tensor_model_parallel_size=kw.get("tp", 1),
        metp_disable_weight_ring=not kw.get("weight_ring", True),
        metp_keep_attention_output=kw.get("keep_attention"))
    assert any(needle in p for p in metp_flag_problems(args, 2, kw.get("tp", 1))), needle
    assert not mla_problems(SimpleNamespace(**dict(cfg, multi_latent_attention=False)), **kw)
    if set(kw) <= {"keep_attention", "weight_ring"}:  # METPSettings' own fields
        from megatron_metp.megatron.settings import METPSettings

        settings = METPSettings(metp=2, keep_attention_output=kw.get("keep_attention"),
                                mode="metp" if kw.get("weight_ring", True) else "ring")
        config = SimpleNamespace(**cfg, num_moe_experts=None)
        with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
            layer_spec(config, SimpleNamespace(tp_size=1), settings)


def test_a_supported_mla_job_passes_the_launcher_checks():
    from megatron_metp.megatron_lm.checks import metp_flag_problems

    args = argparse.Namespace(multi_latent_attention=True, qk_layernorm=True,
                              normalization="RMSNorm", metp_parallel_size=2,
                              tensor_model_parallel_size=1, attention_dropout=0.0)
    assert not [p for p in metp_flag_problems(args, 2, 1) if "latent" in p], \
        metp_flag_problems(args, 2, 1)


def _train_rank(rank, world, size, layout):
    """Three Adam steps through Megatron's DDP, optimizer and schedule (the training loop of
    :mod:`megatron_metp.megatron.training`): (loss, grad norm) per step."""
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import init_parallel, train

    _patch_stock(layout)
    cpu.enable()
    attached = []
    if layout.offload_activations:  # every saved tensor (the tiny model's are < 1 MiB)
        from megatron_metp.runtime import offload

        offload.DEFAULT_MIN_BYTES = 0
        attach = offload.ActivationOffloader.attach

        def recording(self, block):
            attached.append(self)
            return attach(self, block)

        offload.ActivationOffloader.attach = recording
    init_parallel(layout, size.seq_length)
    steps = [(r.lm_loss, r.grad_norm) for r in train(size, layout, 3)]
    return steps, [(o.stats.offloaded, o.stats.offloaded_bytes, o.stats.fetched_bytes,
                    o.stats.host_bytes, o.pending()) for o in attached]


@pytest.fixture(scope="module")
def stock_training():
    size, mla = CASES["rope"]
    return run_ranks(_train_rank, 1, size, _layout(mla, mode="tp"))[0][0]


@pytest.mark.parametrize("world,layout", [(2, dict(metp=2, offload_activations=True)),
                                          (4, dict(metp=2, distributed_optimizer=True)),
                                          (4, dict(metp=2, pp=2))],
                         ids=["metp2-offload", "metp2xdp2-distopt", "metp2xpp2"])
def test_three_adam_steps_match_single_rank_stock(world, layout, stock_training):
    """Megatron's DDP reduces the replicated MLA parameters (down-projections, latent norms)
    over DP × METP and the METP shards over pure DP: three Adam steps give single-rank stock's
    losses and gradient norms within 1e-5 (METP 2; METP 2 × DP 2 with the distributed
    optimizer; METP 2 × PP 2, one MLA layer per stage); with METP's activation offload the MLA layers' saved tensors went to the host
    and every one came back."""
    size, mla = CASES["rope"]
    ref = stock_training
    got, stats = run_ranks(_train_rank, world, size, _layout(mla, **layout), timeout=300)[0]
    if layout.get("offload_activations"):
        assert stats and all(n > 0 and sent == back and held == 0 and pending == 0
                             for n, sent, back, held, pending in stats), stats
    assert ref[-1][0] < ref[0][0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, ref)):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)


def _save_rank(rank, world, size, layout, directory):
    from tests.test_checkpoint import _save_and_continue

    return _save_and_continue(rank, world, layout, directory, size)[0]


def _resume_rank(rank, world, size, layout, directory):
    from tests.test_checkpoint import _resume

    _patch_stock(layout)
    return _resume(rank, world, layout, directory, size, False)


def test_stock_resumes_a_metp_mla_checkpoint(tmp_path):
    """METP 2 saves (Megatron's dist_checkpointing, torch_dist) after 2 Adam steps and trains on
    to step 5; single-rank stock megatron-core MLA layers load the checkpoint (weights and Adam
    state) into a model drawn from another seed and continue with the same losses (1e-6)."""
    from tests.test_checkpoint import SAVE_AT, TOTAL

    size, mla = CASES["rope"]
    directory = str(tmp_path / "save")
    uninterrupted = run_ranks(_save_rank, 2, size, _layout(mla, metp=2), directory)[0]
    resumed = run_ranks(_resume_rank, 1, size, _layout(mla, mode="tp"), directory)[0]
    assert isinstance(resumed, list) and len(resumed) == TOTAL - SAVE_AT, resumed
    for got, ref in zip(resumed, uninterrupted[SAVE_AT:]):
        assert abs(got - ref) <= 1e-6 * ref, (resumed, uninterrupted)
