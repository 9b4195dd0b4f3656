"""Exact RoPE angles inside METP models (issue 29): the angles a METP × CP rank's model forms
for its own tokens, past 2^24 through the model's own RoPE module; per-document angles; the
recipe switch; the 2^24 guard of the tiny builder and of Megatron-LM's argument validation."""

from types import SimpleNamespace

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout
from megatron_metp.ops.rope import megatron_angles
from megatron_metp.ops.rope_recipe import FP32_EXACT_POSITIONS
from tests.gpt_cases import SIZE
from tests.harness import run_ranks, unset_env
from tests.test_rope_angles import _err, _exact_cos_sin

#: head dim 8: four frequencies (1 rad per position down to 1e-3)
ROPE_SIZE = GPTSize(**{**SIZE.__dict__, "num_attention_heads": 4, "num_query_groups": 4,
                       "hidden_size": 32})
OFFSET = FP32_EXACT_POSITIONS + 12_345


def _rank_angles(rank, world, layout):
    """This rank's angles as its METP × CP model forms them: recorded during one forward (the
    call GPTModel makes, offset 0), and the same module called with positions past 2^24."""
    from megatron.core import parallel_state as ps

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank
    from megatron_metp.megatron.training import build_model, global_batch, init_parallel

    cpu.enable()
    groups = init_parallel(layout, ROPE_SIZE.seq_length)
    model = build_model(ROPE_SIZE, layout, groups)
    rotary = model.rotary_pos_emb
    seen = []
    rotary.register_forward_hook(lambda mod, args, out: seen.append(out.clone()))
    tokens, labels = global_batch(ROPE_SIZE, 0, 1)
    s = ROPE_SIZE.seq_length
    batch = {"tokens": tokens, "labels": labels, "position_ids": torch.arange(s)[None]}
    cp = ps.get_context_parallel_group()
    batch = get_batch_on_this_cp_rank(batch, cp_group=cp)
    model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum().backward()
    return {"kind": type(rotary).__name__, "rank": cp.rank(), "size": cp.size(),
            "forward": list(seen), "past": rotary(s, offset=OFFSET), "inv_freq": rotary.inv_freq}


def _dual_chunk(rank, size, s, offset=0):
    c = s // (2 * size)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)]) + offset


def test_metp_x_cp_rank_angles_are_exact_past_2_24():
    """METP 2 × CP 2: each rank's model forms only its own s/4 rows (dual-chunk over the 4-rank
    sequence ring), and through the same module with its tokens past 2^24 they are exact;
    Megatron's fp32 recipe at the same positions is not (negative control)."""
    out = run_ranks(_rank_angles, 4, Layout(metp=2, cp=2))
    s = ROPE_SIZE.seq_length
    assert sorted(o["rank"] for o in out) == [0, 1, 2, 3]
    for o in out:
        assert o["kind"] == "ExactRotaryEmbedding" and o["size"] == 4
        inv = o["inv_freq"]
        assert inv.shape == (4,)
        pos = _dual_chunk(o["rank"], 4, s)
        # the forward called it once, for this rank's tokens only, rows at its positions
        assert len(o["forward"]) == 1 and o["forward"][0].shape == (s // 4, 1, 1, 8)
        assert _err(o["forward"][0], _exact_cos_sin(pos, inv)) <= 1e-6
        past = pos + OFFSET
        ref = _exact_cos_sin(past, inv)
        assert o["past"].shape == (s // 4, 1, 1, 8)
        assert _err(o["past"], ref) <= 1e-6
        stock = megatron_angles(s, OFFSET, inv).index_select(0, pos)  # Megatron's table rows
        assert _err(stock, ref) > 1e-2


def test_fp32_recipe_layout_keeps_megatrons_angles():
    """Layout.rope_fp32_recipe (Megatron-LM: --metp-rope-fp32-recipe): METP's model keeps
    Megatron's module and its whole-sequence table (bit-compatible with a stock run)."""
    out = run_ranks(_rank_angles, 2, Layout(metp=2, rope_fp32_recipe=True))
    for o in out:
        assert o["kind"] == "RotaryEmbedding"
        pos = _dual_chunk(o["rank"], 2, ROPE_SIZE.seq_length)
        want = megatron_angles(ROPE_SIZE.seq_length, 0, o["inv_freq"]).index_select(0, pos)
        assert torch.equal(o["forward"][0], want)


def test_recipe_env_and_bad_value(monkeypatch):
    from megatron_metp.megatron.rope import rope_recipe

    unset_env(monkeypatch, "METP_ROPE_RECIPE")
    assert rope_recipe() == "exact" and rope_recipe(True) == "megatron"
    monkeypatch.setenv("METP_ROPE_RECIPE", "megatron")
    assert rope_recipe() == "megatron"
    monkeypatch.setenv("METP_ROPE_RECIPE", "fp16")
    with pytest.raises(ValueError, match="METP_ROPE_RECIPE='fp16'"):
        rope_recipe()


@pytest.mark.parametrize("layout", ["dual_chunk", "balanced"])
def test_per_document_exact_angles(layout):
    """Packed documents: document_rope with exact angles gives rope_angles at each local token's
    position within its document (no whole-sequence table)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_metp.megatron.packing import document_rope
    from megatron_metp.megatron.rope import use_exact_angles
    from megatron_metp.ops.documents import document_positions
    from megatron_metp.ops.rope import rope_angles

    model = torch.nn.Module()
    model.rotary_pos_emb = RotaryEmbedding(kv_channels=16, rotary_percent=1.0,
                                           rotary_base=10000, use_cpu_initialization=True)
    assert use_exact_angles(model, "exact") == "exact"
    cu, p, n = [0, 5, 6, 40, 41, 90, 96], 3, 32
    for rank in range(p):
        pos = document_positions(cu, rank, p, n, layout)
        got = document_rope(model.rotary_pos_emb, cu, rank, p, n, layout)
        assert torch.equal(got, rope_angles(pos, model.rotary_pos_emb.inv_freq))
    assert not torch.equal(document_rope(model.rotary_pos_emb, cu, 1, p, n, layout),
                           rope_angles(torch.arange(n, 2 * n), model.rotary_pos_emb.inv_freq))


def _args(**kw):
    base = dict(position_embedding_type="rope", metp_parallel_size=4, seq_length=1 << 25,
                metp_rope_fp32_recipe=False)
    return SimpleNamespace(**{**base, **kw})


def test_megatron_lm_guard_refuses_fp32_recipe_past_2_24(monkeypatch):
    from megatron_metp.megatron.rope import check_args_reach

    unset_env(monkeypatch, "METP_ROPE_RECIPE")
    check_args_reach(_args())  # METP, exact angles: accepted at 32M
    check_args_reach(_args(metp_parallel_size=1, seq_length=FP32_EXACT_POSITIONS))  # below
    check_args_reach(_args(metp_parallel_size=1, position_embedding_type="learned_absolute"))
    for args, why, fix in (
            (_args(metp_parallel_size=1), "METP is off", "--metp-parallel-size > 1"),
            (_args(metp_rope_fp32_recipe=True), "--metp-rope-fp32-recipe", "drop"),
            (_args(position_embedding_type="mrope"), "mrope is not covered", "rope")):
        with pytest.raises(ValueError, match="positions reach 2\\^24") as exc:
            check_args_reach(args)
        assert why in str(exc.value) and fix in str(exc.value) and "33,554,432" in str(exc.value)
    monkeypatch.setenv("METP_ROPE_RECIPE", "megatron")
    with pytest.raises(ValueError, match="METP_ROPE_RECIPE"):
        check_args_reach(_args())
    with pytest.raises(ValueError, match="--metp-rope-fp32-recipe needs --metp-parallel-size"):
        check_args_reach(_args(metp_parallel_size=1, metp_rope_fp32_recipe=True,
                               seq_length=4096))


def _build_long(rank, world, layout):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import build_model, init_parallel

    cpu.enable()
    size = GPTSize(**{**ROPE_SIZE.__dict__, "seq_length": FP32_EXACT_POSITIONS + 2 * world})
    groups = init_parallel(layout, size.seq_length)
    try:
        build_model(size, layout, groups)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_tiny_builder_refuses_stock_past_2_24_and_builds_metp():
    """The tiny builder's guard: stock TP past 2^24 is refused before any step, METP (exact
    angles) builds."""
    stock, = run_ranks(_build_long, 1, Layout(mode="tp"))
    assert "positions reach 2^24" in stock and "stock TP" in stock
    metp = run_ranks(_build_long, 2, Layout(metp=2))
    assert metp == ["built", "built"]


def test_exact_angles_under_fake_tensors():
    """The dry run builds and runs the model under FakeTensorMode: the exact angles need no
    data (shapes only), for the plain rows and per-document ones."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from megatron_metp.megatron.packing import document_rope
    from megatron_metp.megatron.rope import use_exact_angles

    model = torch.nn.Module()
    with FakeTensorMode():
        model.rotary_pos_emb = RotaryEmbedding(kv_channels=128, rotary_percent=1.0,
                                               rotary_base=500000, use_cpu_initialization=True)
        assert use_exact_angles(model) == "exact"
        emb = model.rotary_pos_emb(1 << 20)
        docs = document_rope(model.rotary_pos_emb, [0, 100, 4096], 1, 2, 2048, "dual_chunk")
    assert isinstance(emb, FakeTensor) and emb.shape == (1 << 20, 1, 1, 128)
    assert isinstance(docs, FakeTensor) and docs.shape == (2048, 1, 1, 128)


@pytest.mark.parametrize("config,extra,why", [
    ("tiny-cpu-tp2.sh", [], "METP is off"),
    ("tiny-cpu-metp2.sh", ["--metp-rope-fp32-recipe"], "--metp-rope-fp32-recipe")],
    ids=["stock", "metp-fp32-recipe"])
def test_pretrain_gpt_dry_run_refuses_fp32_recipe_past_2_24(patched_megatron_lm, config, extra,
                                                            why):
    """scripts/pretrain_gpt.sh --dry-run: validate_args refuses the job before any work."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "PYTHON": sys.executable, "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "MEGATRON_LM_DIR": patched_megatron_lm, "SEQ_LENGTH": str(FP32_EXACT_POSITIONS + 4)}
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config", config, "--dry-run",
                           "--", *extra], cwd=repo, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "positions reach 2^24" in proc.stderr and why in proc.stderr, proc.stderr[-3000:]
