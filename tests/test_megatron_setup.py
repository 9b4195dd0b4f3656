"""METP process groups inside Megatron's parallel state, and the errors users get for bad setups."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp.megatron.parallel import initialize_model_parallel, validate_metp_config
from tests.harness import run_ranks


def _groups(rank, world, tp, metp, pp):
    from megatron.core import parallel_state as ps

    from megatron_metp.megatron import cpu

    cpu.enable()
    g = initialize_model_parallel(tp, pp, metp, create_gloo_process_groups=False)
    ranks = lambda pg: tuple(dist.get_process_group_ranks(pg))  # noqa: E731
    return {"metp": g.metp.ranks, "next": g.metp.next_rank, "prev": g.metp.prev_rank,
            "cp": ranks(ps.get_context_parallel_group()), "dp": ranks(g.dp),
            "expert_dp": ranks(ps.get_expert_data_parallel_group()),
            "dp_cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
            "tp": ranks(ps.get_tensor_model_parallel_group()), "shard": g.shard_index,
            "shards": g.shards}


@pytest.mark.parametrize("tp,metp,pp,world", [(1, 2, 1, 4), (2, 2, 1, 8), (1, 2, 2, 8), (2, 2, 2, 8),
                                              (1, 4, 1, 4)])
def test_metp_groups_compose_with_tp_pp_dp(tp, metp, pp, world):
    out = run_ranks(_groups, world, tp, metp, pp)
    dp = world // (tp * metp * pp)
    for rank, g in enumerate(out):
        assert g["metp"] == g["cp"] and len(g["metp"]) == metp
        # ring neighbours are adjacent right after TP: global ranks step by TP
        assert g["metp"] == tuple(g["metp"][0] + i * tp for i in range(metp))
        assert g["next"] == g["metp"][(g["metp"].index(rank) + 1) % metp]
        # METP-sharded weights reduce over pure DP (the expert-DP group after the fold) and
        # replicated ones over DP×METP
        assert g["expert_dp"] == g["dp"] and len(g["dp"]) == dp
        assert set(g["dp_cp"]) == {r for m in g["metp"] for r in out[m]["dp"]}
        assert g["shards"] == tp * metp and g["shard"] == g["tp"].index(rank) * metp + \
            g["metp"].index(rank)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=6, tensor_model_parallel_size=2, metp_parallel_size=2), "not divisible by TP×METP×CP×PP"),
    # METP × CP: c is the outer factor, the world needs TP × METP × CP × PP ranks
    (dict(world_size=6, metp_parallel_size=2, context_parallel_size=2), "--context-parallel-size"),
    (dict(world_size=4, metp_parallel_size=2, num_experts=7),
     "--num-experts 7 is not divisible by --metp-parallel-size 2"),
    (dict(world_size=4, metp_parallel_size=2, seq_length=18), "--seq-length 18 is not divisible by 2×METP = 4"),
    (dict(world_size=4, metp_parallel_size=2, sequence_parallel=True), "--sequence-parallel"),
    (dict(world_size=4, metp_parallel_size=0), "--metp-parallel-size must be >= 1"),
])
def test_bad_configurations_are_refused_with_the_flag_and_fix(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("×", "×")):
        validate_metp_config(**kwargs)


def test_good_configuration_returns_dp_size():
    assert validate_metp_config(world_size=16, tensor_model_parallel_size=2, metp_parallel_size=4,
                                seq_length=4096) == 2
    assert validate_metp_config(world_size=4, metp_parallel_size=1, num_experts=8,
                                context_parallel_size=2) == 2  # DP excludes CP, as Megatron's
    assert validate_metp_config(world_size=8, metp_parallel_size=2, context_parallel_size=2,
                                seq_length=16) == 2


def test_initialize_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="initialize torch.distributed first"):
        initialize_model_parallel(1, 1, 2)


def _bad_model(rank, world, what):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import GPTSize, Layout, build_model, init_parallel

    cpu.enable()
    size = GPTSize(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                   vocab_size=32, seq_length=8)
    layout = Layout(metp=2)
    if what == "ffn":
        size.ffn_hidden_size = 33
    elif what == "heads":
        size.num_attention_heads, size.num_query_groups = 6, 3
    elif what == "dropout":
        layout.extra = {"attention_dropout": 0.1}
    elif what == "activation":
        layout.extra = {"activation_func": torch.nn.functional.relu}
    groups = init_parallel(layout, size.seq_length)
    try:
        build_model(size, layout, groups)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what,needle", [("ffn", "--ffn-hidden-size (33) is not divisible by TP×METP = 2"),
                                         ("heads", "--num-query-groups (3) is not divisible"),
                                         ("dropout", "--attention-dropout"),
                                         ("activation", "GeLU")])
def test_model_settings_metp_cannot_honour_are_refused(what, needle):
    msgs = run_ranks(_bad_model, 2, what)
    assert all(m is not None and needle in m for m in msgs), msgs
