"""``metp plan`` / ``metp measure`` of multi-latent attention (issue 43, Deliver 4): the
DeepSeek presets' parameters against their published totals, the ring's values per token per
step (METP's latent against stock CP's up-projected K/V), MLA's FLOPs, the plan within 3 % of
the measured megatron-core model of rank 0 on a shrunk DeepSeek-V2-Lite twin (METP 2 and
METP 2 × CP 2), the fake-rank counters showing the latent on the ring (576 values per token per
step, with a negative control), ``--reach`` of the MLA presets, flags and refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from megatron_metp.tools.plan import mla as PM

V2, MOON, V3 = (P.PRESETS[k] for k in ("deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-v3"))
#: DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, qk 128 + 64, v 128, no query
#: latent) with 2 dense layers of hidden 2048, FFN 1024, 8K tokens: the shrunk twin
TWIN = replace(V2, name="v2-lite-twin", layers=2, vocab=4096, seq=8192, ffn=1024, experts=0,
               topk=0, moe_ffn=None, moe_shared_ffn=0, moe_first_dense=0)


def test_presets_have_their_published_sizes():
    """DeepSeek-V2-Lite 15.7B, DeepSeek-V3 671B (without its 14B multi-token-prediction
    module), Moonlight-16B-A3B 15.29B without its two 163,840-row embedding tables (model cards;
    the presets' numbers are their config.json's, docs/mla.md#presets). Negative control: the
    shared experts or the leading dense layers left out miss by more than the tolerance."""
    def total(m):
        return P.params(m, P.Job(tp=1, metp=1), "tp-sp").total

    # within half a unit of the published figure's last digit
    assert abs(total(V2) - 15.7e9) <= 0.05e9, total(V2)
    assert abs(total(V3) - 671e9) <= 0.5e9, total(V3)
    assert abs(total(MOON) - 2 * 163840 * 2048 - 15.29e9) <= 0.005e9, total(MOON)
    for wrong, published, half in ((replace(V3, moe_shared_ffn=0), 671e9, 0.5e9),
                                   (replace(V3, moe_first_dense=0), 671e9, 0.5e9),
                                   (replace(V2, moe_shared_ffn=0), 15.7e9, 0.05e9),
                                   (replace(V2, moe_first_dense=0), 15.7e9, 0.05e9)):
        assert abs(total(wrong) - published) > half, wrong.name


def test_the_ring_moves_the_latent_not_the_heads_k_v():
    """576 values per token per step on METP's ring for DeepSeek's shapes; stock CP moves
    A·(dq + dv) = 128 × 320 = 40,960 for DeepSeek-V3 (71× more), 5,120 for 16 heads; the
    planned bytes per layer follow (METP: one latent pass per head group)."""
    for m in (V2, MOON, V3):
        assert PM.ring_values_per_token_step(m, "metp") == 576
    assert PM.ring_values_per_token_step(V3, "cp") == 40960
    assert PM.ring_values_per_token_step(V3, "cp", t=8) == 5120
    assert PM.ring_values_per_token_step(MOON, "cp") == 5120
    m = V3.with_seq(1 << 20)
    metp = P.traffic_per_layer(m, P.Job(tp=1, metp=8), "metp")
    stock = P.traffic_per_layer(m, P.Job(tp=1, metp=8), "cp")
    n = (1 << 20) // 8
    assert metp["attention K/V ring (every head group)"] == 8 * 4 * 7 * n * 576 * 2
    assert stock["K/V ring: fwd K/V, bwd K/V + fp32 dK/dV"] == 4 * 7 * n * 40960 * 2


def test_attention_flops_use_the_mla_widths_and_the_up_projection_is_small():
    """Core attention ``n·s·A·(dq + dv)`` (192 and 128, not a head_dim); METP's K/V
    up-projection of the received latent blocks costs ``kvr·(dn+dv)/(n·(dq+dv))`` of a block's
    attention (``n`` rows per rank): DeepSeek-V3 on METP 8, 2.8 % at 128K tokens, 0.35 % at 1M
    (the issue's "fraction of a percent" at long context); stock up-projects once."""
    for s, bound in ((131072, 0.03), (1 << 20, 0.004)):
        n = s // 8
        f = PM.layer_flops(V3, n, s, 1, metp_ring=8)
        assert f["core"] == n * s * 128 * (128 + 64 + 128)
        assert f["up"] == n * 9 * 512 * 128 * 256
        print(f"{s:,} tokens: up-projection / core attention {f['up'] / f['core']:.2%}")
        assert f["up"] / f["core"] < bound
    stock = PM.layer_flops(V3, n, s, 1)
    assert stock["up"] == 2 * n * 512 * 128 * 256 and f["up"] > stock["up"]


@pytest.fixture(scope="module")
def measured():
    """Rank 0 of the twin measured under the fake group: METP 2, and METP 2 × CP 2 with full
    recompute and the vocabulary ring (forked children, ~2 s each)."""
    from megatron_metp.tools import measure as M

    jobs = {"metp2": P.Job(tp=1, metp=2),
            "metp2xcp2": P.Job(tp=1, metp=2, cp=2, recompute="full", vocab_parallel=True)}
    out = {}
    for key, job in jobs.items():
        res = M.measure(TWIN, job, "metp", timeout=300)[0]
        assert "error" not in res, res["error"]
        out[key] = (job, res, P.memory(TWIN, job, "metp"))
    return out


@pytest.mark.parametrize("key", ["metp2", "metp2xcp2"])
def test_plan_matches_the_measured_mla_twin(key, measured, monkeypatch):
    """The plan within 3 % of the measured peak (parameters, gradient buffer, activations) and
    of what the forward stores (measured: -0.13 % and -0.22 %). Negative control: a plan that
    counts the latent blocks but not what each ring step re-forms from them (the head group's
    up-projected K/V and the kernel's gradients of them) misses by more than 3 %."""
    job, res, plan = measured[key]
    assert res["params"] == plan.static["params"]
    err = plan.measured_part / res["peak"] - 1
    print(f"{key}: measured {res['peak']:,} plan {plan.measured_part:,.0f} ({err:+.2%}); "
          f"stored {res['stored']:,} plan {plan.act.stored:,.0f}")
    assert abs(err) <= 0.03, err
    assert abs(plan.act.stored / res["stored"] - 1) <= 0.03
    phases = PM.metp_phases

    def latent_only(*args):
        return {name: {k: (0 if ("K and V up-projected" in k or "kernel dq, dk, dv" in k) else v)
                       for k, v in items.items()} for name, items in phases(*args).items()}

    monkeypatch.setattr(PM, "metp_phases", latent_only)
    wrong = P.memory(TWIN, job, "metp")
    assert wrong.measured_part / res["peak"] - 1 < -0.03


def _latent_values(res, job, model=TWIN) -> float:
    """Values per token per ring step the fake-rank counters saw on the latent ring: the
    point-to-point bytes sent (the latent ring's and the MLP weight ring's) less the MLP ring's
    planned bytes, over the plan's count of latent blocks (one pass per head group, ``P − 1``
    steps, forward bf16 + backward bf16 + fp32 dL)."""
    lay = P.layout("metp", job)
    n = model.seq // lay.c
    traffic = P.traffic_per_layer(model, job, "metp")
    mlp = traffic["MLP weight ring fwd+bwd, fp32 gradient ring"] * model.layers
    return (res["comm_bytes"]["send"] - mlp) / (model.layers * lay.p * (lay.c - 1) * n *
                                                (2 + 2 + 4))


def test_fake_rank_counters_show_the_latent_on_the_ring(measured, monkeypatch):
    """The sends counted under the fake group are the latent's: 576 values per token per step
    (kv_lora_rank 512 + the 64-value RoPE key), not the heads' K/V (16 × 320 = 5,120).
    Negative control: a ring that carries the head group's K/V width instead (the latent padded
    to it before it circulates) is counted as such and fails the same check."""
    from megatron_metp.ops import mla_ring
    from megatron_metp.tools import measure as M

    job, res, _ = measured["metp2"]
    assert _latent_values(res, job) == 576, _latent_values(res, job)
    cp = P.Job(tp=1, metp=2, cp=2)  # the sequence ring over 4 ranks (no recompute: one forward)
    res = M.measure(TWIN, cp, "metp", timeout=300)[0]
    assert "error" not in res, res["error"]
    assert _latent_values(res, cp) == 576, _latent_values(res, cp)
    heads_kv = TWIN.heads // job.metp * (128 + 64 + 128)

    class Padded(mla_ring.RingExchanger):
        def circulate(self, t, steps):
            wide = t.new_zeros(t.shape[:-1] + (heads_kv,))
            wide[..., :t.shape[-1]] = t
            return [(i, b[..., :t.shape[-1]]) for i, b in super().circulate(wide, steps)]

    monkeypatch.setattr(mla_ring, "RingExchanger", Padded)
    wrong = M.measure(TWIN, job, "metp", timeout=300)[0]
    assert "error" not in wrong, wrong["error"]
    got = _latent_values(wrong, job)
    print(f"latent ring: 576 values per token per step; padded to K/V: {got:,.0f}")
    assert got != 576 and got > 576


def test_reach_searches_mla_presets_at_256_gpus():
    """``--reach`` of DeepSeek-V3 on 256 GPUs (32 nodes): METP's best layout reaches further
    than stock Megatron's best (CP × EP × PP searched), METP's group bounded by the heads."""
    from megatron_metp.tools.plan import search as R

    res = R.reach(V3, 256, recompute=("full + offload",), optimizer_offload=(True,))
    metp, stock = (next(c for c in res[f] if c.seq) for f in ("metp", "stock"))
    print(f"METP {metp.describe()} {metp.seq:,}; stock {stock.describe()} {stock.seq:,}")
    assert metp.seq > stock.seq and 128 % metp.job.metp == 0 and metp.job.tp == 1
    assert stock.job.ep > 1


def test_flags_config_round_trip_and_refusals(tmp_path):
    """The MLA presets' Megatron-LM flags (``--multi-latent-attention`` with its ranks and
    widths, the leading dense layers as ``--moe-layer-freq``, the shared experts), read back from
    a written config as the same model; refused by flag: TP inside METP, the ring baseline, an
    MLA flag without ``--multi-latent-attention``, and ``metp measure`` of a stock MLA mode
    (megatron-core's MLA needs Transformer Engine)."""
    job = P.Job(tp=1, metp=8, recompute="full", offload=True)
    flags = P.megatron_flags(V3, job, "metp")
    for f in ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank",
              "--qk-pos-emb-head-dim", "--moe-shared-expert-intermediate-size"):
        assert f in flags, f
    assert flags[flags.index("--moe-layer-freq") + 1] == "([0]*3+[1]*58)"
    path = tmp_path / "v3.sh"
    path.write_text(P.config_text(V3, job, "metp", "test"))
    m2, _, _ = cli.build_from_argv(["--config", str(path), "--modes", "metp"])
    assert replace(m2, name=V3.name, vocab=V3.vocab) == V3
    with pytest.raises(ValueError, match="--tp 2"):
        cli.build_from_argv(["--preset", "deepseek-v3", "--tp", "2", "--metp", "4",
                             "--modes", "metp"])
    with pytest.raises(ValueError, match="--modes ring"):
        cli.build_from_argv(["--preset", "moonlight-16b-a3b", "--metp", "8", "--modes", "ring"])
    with pytest.raises(ValueError, match="without --multi-latent-attention"):
        PM.config_fields(["--kv-lora-rank", "512"])
    from megatron_metp.tools import measure as M

    with pytest.raises(ValueError, match="mode tp-sp with multi-latent attention"):
        M.measure_here(TWIN, P.Job(tp=2, metp=1), "tp-sp")  # refused before any fake rank


#: configs/deepseek-v2-lite-7m-metp8.sh shrunk through the environment (which wins over its
#: defaults): 3 layers (the first dense), hidden 512, DeepSeek-V2-Lite's attention (16 heads,
#: kv_lora_rank 512, qk 128 + 64, v 128), 8 experts of 256 top-2 + a shared expert of 512, 16K
#: tokens on METP 2 (2 ranks); the vocabulary ring, full recompute, host offload, MoE token tiles
#: and the host optimizer kept
SMALL_V2_LITE = dict(NUM_LAYERS="3", HIDDEN_SIZE="512", FFN_HIDDEN_SIZE="1024", NUM_EXPERTS="8",
                     MOE_FFN_HIDDEN_SIZE="256", MOE_SHARED_EXPERT_INTERMEDIATE_SIZE="512",
                     MOE_ROUTER_TOPK="2", MOE_LAYER_FREQ="([0]*1+[1]*2)", VOCAB_SIZE="4095",
                     SEQ_LENGTH="16384", PRECISION="bf16", METP="2", GPUS_PER_NODE="2",
                     METP_MOE_TOKEN_TILES="2")


def test_deepseek_v2_lite_config_dry_run_plan_and_measure_agree(patched_megatron_lm,
                                                                 monkeypatch):
    """configs/deepseek-v2-lite-7m-metp8.sh (shrunk): Megatron-LM's dry run (its parser with
    the MLA and DeepSeekMoE flags, validate_args, the METP MLA + MoE model provider), metp
    measure and metp plan within 3 % (measured: measure -0.00 %, plan -0.9 %); the plan reads
    the config's MLA_ARGS / MOE_ARGS as the model the dry run builds."""
    import os

    from megatron_metp.tools import agreement as A

    for k, v in SMALL_V2_LITE.items():
        monkeypatch.setenv(k, v)
    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                       "deepseek-v2-lite-7m-metp8.sh")
    model, job = A.model_job(cfg)
    assert (model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim,
            model.q_lora_rank, model.moe_shared_ffn, model.moe_first_dense) == \
        (512, 128, 64, 128, None, 512, 1), model
    row = A.compare(cfg, patched_megatron_lm)
    print(A.table([row]))
    assert row["mode"] == "metp" and row["world"]["ep"] == 2, row["world"]
    assert abs(row["measure_vs_dry_run"]) <= 0.03, row
    assert abs(row["plan_vs_dry_run"]) <= 0.03, row
