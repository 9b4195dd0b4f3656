"""Packed sequences with METP in Megatron: --reset-position-ids --reset-attention-mask
--eod-mask-loss (megatron_metp.megatron.packing, the flag checks, the mock documents).

The document boundaries METP derives from the EOD tokens are checked against Megatron's own
definition (GPTDataset's dense mask and reset position ids at core_v0.16.1).
"""

import argparse

import pytest
import torch

from megatron_metp import megatron_lm
from megatron_metp.megatron import packing
from megatron_metp.megatron.packing import (DocumentBoundaries, METPDocuments,
                                            boundaries_from_eod, documents_from_tokens)
from megatron_metp.ops.sequence import shard_sequence
from tests.harness import run_ranks

EOD = 99


def _tokens(s, ends, b=1, seed=0):
    """[b, s] token ids < EOD with an EOD at each position of ``ends``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, EOD, (b, s), generator=g)
    for e in ends:
        t[:, e] = EOD
    return t


def _megatron_masks(tokens):
    """Megatron's (GPTDataset) dense mask (True = masked) and position ids of one sample."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    mask, _, pos = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, True, True)
    return mask[0], pos


def _mask_of(cu, s):
    """The dense causal mask (True = masked) of block-diagonal documents ``cu``."""
    doc = torch.zeros(s, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = i
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    return ~(causal & (doc[:, None] == doc[None, :]))


# ------------------------------------------------------------------------------ boundaries

@pytest.mark.parametrize("ends", [[], [0], [5], [5, 6, 20], [31], [3, 17, 31], list(range(32))])
def test_boundaries_match_megatrons_mask_and_reset_positions(ends):
    s = 32
    tokens = _tokens(s, ends)
    cu = boundaries_from_eod(tokens == EOD)
    assert cu.dtype == torch.int32 and cu.device.type == "cpu"
    v = cu.tolist()
    assert v[0] == 0 and v[-1] == s and all(b > a for a, b in zip(v, v[1:]))
    mask, pos = _megatron_masks(tokens[0])
    assert torch.equal(_mask_of(v, s), mask)
    # Megatron's reset position ids restart at the same places
    starts = [i for i in range(s) if pos[i] == 0]
    assert starts == v[:-1]


def test_boundaries_of_a_micro_batch_of_several_samples():
    same = _tokens(16, [4, 9], b=3)
    assert boundaries_from_eod(same == EOD).tolist() == [0, 5, 10, 16]
    differ = _tokens(16, [4], b=2)
    differ[1, 9] = EOD
    with pytest.raises(ValueError, match="--micro-batch-size 1"):
        boundaries_from_eod(differ == EOD)
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        boundaries_from_eod(torch.zeros(16, dtype=torch.bool))


def test_documents_are_checked_and_say_where_rope_comes_from():
    d = packing.documents([0, 5, 16], 16)
    assert isinstance(d, METPDocuments) and d.qkv_format == "thd" and d.num_documents == 2
    assert d.max_seqlen_q == d.max_seqlen_kv == 16 and d.cu_seqlens.tolist() == [0, 5, 16]
    assert packing.documents(torch.tensor([0, 16]), 16, full_rope=False).qkv_format == "sbhd"
    for bad in ([0, 5], [1, 16], [0, 5, 5, 16], [0, 9, 5, 16]):
        with pytest.raises(ValueError, match="strictly increasing"):
            packing.documents(bad, 16)


def _derive_on_ring(rank, world, full, layout):
    local = shard_sequence(full, rank, world, layout=layout, seq_dim=1)
    group = torch.distributed.new_group(list(range(world)))
    d = documents_from_tokens(local, EOD, group, layout=layout)
    return d.cu_seqlens.tolist()


@pytest.mark.parametrize("world,ends", [(2, [3, 12, 13, 31]), (4, [0, 7, 8, 15, 24]),
                                        (2, [])])
def test_every_rank_derives_the_whole_sequences_boundaries(world, ends):
    full = _tokens(32, ends)
    want = boundaries_from_eod(full == EOD).tolist()
    for layout in ("dual_chunk", "contiguous"):
        got = run_ranks(_derive_on_ring, world, full, layout)
        assert got == [want] * world, layout


# ------------------------------------------------------------------------------ the model hook

class _Recorder(torch.nn.Module):
    """GPTModel.forward's positional signature; returns what it was called with."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None):
        return {"mask": attention_mask, "packed": packed_seq_params, "labels": labels}


def test_hook_passes_the_boundaries_as_packed_seq_params():
    model = _Recorder()
    hook = DocumentBoundaries(None, eod_token=EOD).attach(model)
    tokens = _tokens(16, [4, 9])
    out = model(tokens, None, torch.ones(1, 1, 16, 16, dtype=torch.bool), labels="L")
    assert out["mask"] is None and out["labels"] == "L"  # the dense mask is replaced
    assert out["packed"] is hook.last and out["packed"].cu_seqlens.tolist() == [0, 5, 10, 16]
    # positional packed_seq_params=None, as a caller may pass it
    out = model(tokens, None, None, None, None, None, None)
    assert out["packed"].cu_seqlens.tolist() == [0, 5, 10, 16]
    # boundaries given by the caller (the dry run) are used as they are
    given = packing.documents([0, 8, 16], 16)
    assert model(tokens, None, None, packed_seq_params=given)["packed"] is given
    # the ring self-attention baseline keeps RoPE in Megatron's SelfAttention
    ring = _Recorder()
    DocumentBoundaries(None, eod_token=EOD, full_rope=False).attach(ring)
    assert ring(tokens, None, None)["packed"].qkv_format == "sbhd"


def test_hook_refuses_thd_batches_and_missing_tokens():
    from megatron.core.packed_seq_params import PackedSeqParams

    model = _Recorder()
    DocumentBoundaries(None, eod_token=EOD).attach(model)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="--sft"):
        model(_tokens(16, []), None, None, packed_seq_params=thd)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1"):
        model(None, None, None)


def test_metp_modules_take_only_metp_documents():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_metp.megatron.modules import document_kwargs

    assert document_kwargs(None, "x") == {"layout": "dual_chunk"}
    d = packing.documents([0, 3, 8], 8)
    assert document_kwargs(d, "x")["cu_seqlens"] is d.cu_seqlens
    with pytest.raises(ValueError, match="METP attention takes packed documents only.*--sft"):
        document_kwargs(PackedSeqParams(qkv_format="thd"), "METP attention")


# ------------------------------------------------------------------------------ flags

def _args(**kw):
    from tests.test_megatron_lm import _args as base

    return base(**kw)


@pytest.mark.parametrize("kw,needles", [
    (dict(sft=True), ["--sft", "--reset-attention-mask"]),
    (dict(reset_attention_mask=True, micro_batch_size=2),
     ["--reset-attention-mask with --micro-batch-size 2", "--micro-batch-size 1"]),
    (dict(metp_packed_layout="balanced"),
     ["--metp-packed-layout balanced without --reset-attention-mask"]),
    (dict(metp_packed_layout="balanced", reset_attention_mask=True,
          metp_disable_weight_ring=True),
     ["--metp-packed-layout balanced with --metp-disable-weight-ring"]),
    (dict(eod_mask_loss=True, micro_batch_size=1),
     ["--eod-mask-loss without --calculate-per-token-loss", "add --calculate-per-token-loss"]),
    (dict(reset_attention_mask=True, micro_batch_size=1),
     ["--reset-attention-mask without --calculate-per-token-loss"]),
    (dict(reset_attention_mask=True, pipeline_model_parallel_size=2, world_size=16),
     ["--reset-attention-mask with --pipeline-model-parallel-size 2",
      "--pipeline-model-parallel-size 1"]),
])
def test_packing_flags_metp_cannot_honour_are_refused(kw, needles):
    args = _args(**{"metp_parallel_size": 8, **kw})
    with pytest.raises(ValueError) as err:
        megatron_lm.validate_metp_args(args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert args.context_parallel_size == 1


def test_packing_flags_work_and_the_dense_mask_is_switched_off(capsys):
    args = _args(metp_parallel_size=8, reset_attention_mask=True, reset_position_ids=True,
                 eod_mask_loss=True, micro_batch_size=1, create_attention_mask_in_dataloader=True,
                 calculate_per_token_loss=True)
    megatron_lm.validate_metp_args(args)
    out = capsys.readouterr().out
    assert args.context_parallel_size == 8
    assert args.reset_attention_mask and args.reset_position_ids and args.eod_mask_loss
    assert args.create_attention_mask_in_dataloader is False
    assert "dense [b, 1, s, s] attention mask is not built" in out and "EOD tokens" in out
    # METP without packing: the mask is not built either (its attention is causal)
    plain = _args(metp_parallel_size=8, create_attention_mask_in_dataloader=True)
    megatron_lm.validate_metp_args(plain)
    assert plain.create_attention_mask_in_dataloader is False
    assert "its attention is causal" in capsys.readouterr().out
    # stock Megatron keeps its mask (it needs it for --reset-attention-mask)
    stock = _args(reset_attention_mask=True, micro_batch_size=4, sft=True,
                  create_attention_mask_in_dataloader=True)
    megatron_lm.validate_metp_args(stock)
    assert stock.create_attention_mask_in_dataloader is True


def test_mock_document_length_flag(monkeypatch):
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    parser = megatron_lm.add_metp_args(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args([]).metp_mock_max_document_length is None
    assert parser.parse_args([]).metp_packed_layout == "dual_chunk"
    assert parser.parse_args(["--metp-packed-layout", "balanced"]).metp_packed_layout == "balanced"
    with pytest.raises(SystemExit):
        parser.parse_args(["--metp-packed-layout", "contiguous"])
    assert parser.parse_args(["--metp-mock-max-document-length", "64"]) \
        .metp_mock_max_document_length == 64
    monkeypatch.setattr(MockGPTLowLevelDataset, "max_sequence_length",
                        MockGPTLowLevelDataset.max_sequence_length)
    for p in (1, 8):  # the stock twin gets the same documents
        megatron_lm.validate_metp_args(_args(metp_parallel_size=p, mock_data=True,
                                             metp_mock_max_document_length=64))
    assert MockGPTLowLevelDataset.max_sequence_length == 64
    low = MockGPTLowLevelDataset(NullTokenizer(1024))
    lengths = [len(low[i]) for i in range(200)]
    # EOD: the vocabulary size at core_v0.16.1, the tokenizer's eod at core_v0.19.0
    eod = getattr(low, "eod_token", 1024)
    assert max(lengths) < 64 and all(low[i][-1] == eod for i in range(200))
    with pytest.raises(ValueError, match="add --mock-data"):
        megatron_lm.validate_metp_args(_args(metp_mock_max_document_length=64))
    with pytest.raises(ValueError, match="at least 2"):
        megatron_lm.validate_metp_args(_args(mock_data=True, metp_mock_max_document_length=1))


# ------------------------------------------------------------------------------ the model

def _packed_step(rank, world, size, layout, ends, eod_mask_loss, dense_mask=True,
                 packed_layout="dual_chunk", min_chunk=None):
    """Loss (as pretrain_gpt's loss_func: masked sum over tokens / their count) and full-weight
    gradients of one forward/backward of a packed sample: stock layouts get Megatron's dense
    document mask, METP layouts only the tokens (the hook derives the boundaries)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.linear import is_metp_sharded
    from megatron_metp.megatron.training import (_global_name, build_model, full_shape,
                                                 global_batch, init_parallel,
                                                 load_initial_weights)

    cpu.enable()
    if min_chunk is not None:  # so that the tiny documents get chunks of their own
        from megatron_metp.ops.documents import set_balanced_min_chunk

        set_balanced_min_chunk(min_chunk)
    groups = init_parallel(layout, size.seq_length)
    model = build_model(size, layout, groups)
    load_initial_weights(model, groups, size)
    eod = size.vocab_size - 1
    tokens, labels = global_batch(size, 0, 1)
    tokens[tokens == eod] = 0
    tokens[:, ends] = eod
    mask, loss_mask, pos = _get_ltor_masks_and_position_ids(tokens[0], eod, True, dense_mask,
                                                            eod_mask_loss, True)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask[None],
             "position_ids": pos[None]}
    attention_mask = mask[None]
    cp = ps.get_context_parallel_group() if layout.metp > 1 else None
    if layout.metp > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=cp)
        DocumentBoundaries(groups.metp, eod_token=eod, full_rope=layout.mode == "metp",
                           layout=packed_layout).attach(model)
        attention_mask = None
    per_token = model(batch["tokens"], batch["position_ids"], attention_mask,
                      labels=batch["labels"])
    lm = batch["loss_mask"].float()
    count = lm.sum()
    if cp is not None:
        dist.all_reduce(count, group=cp)
    loss = (per_token.float() * lm).sum() / count
    loss.backward()
    total = loss.detach().clone()
    if cp is not None:
        dist.all_reduce(total, group=cp)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if cp is not None and not is_metp_sharded(p):
            dist.all_reduce(g, group=cp)
        grads[_global_name(model, name)] = (g, getattr(p, "tensor_model_parallel", False),
                                            getattr(p, "partition_dim", 0), is_metp_sharded(p),
                                            full_shape(p, groups))
    hook = getattr(model, "_metp_document_boundaries", None)
    tokens_seen = None
    if hook is not None:
        from megatron_metp.ops.documents import layout_positions

        tokens_seen = layout_positions(groups.metp.rank, layout.metp,
                                       size.seq_length // layout.metp, packed_layout,
                                       tuple(hook.last.cu_seqlens.tolist())).tolist()
    return {"loss": total.item(), "grads": grads, "shard": groups.shard_index,
            "tp_rank": groups.tp_rank, "positions": tokens_seen, "metp_rank": groups.metp.rank,
            "cu": hook.last.cu_seqlens.tolist() if hook is not None else None}


def _size(**kw):
    from megatron_metp.megatron.training import GPTSize

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                ffn_hidden_size=48, vocab_size=72, seq_length=32)
    base.update(kw)
    return GPTSize(**base)


#: EOD positions of the packed sample: documents of 6, 1, 11, 5 and 9 tokens
ENDS = [5, 6, 17, 22]


def _check_against(out, ref, size, what, tol=1e-5):
    from tests.gpt_cases import assemble
    from tests.numerics import rel_err

    assert abs(out[0]["loss"] - ref["loss"]) <= tol * abs(ref["loss"]), (what, out[0]["loss"],
                                                                          ref["loss"])
    full, grads = assemble([ref], size), assemble(out, size)
    assert set(full) == set(grads)
    errs = {k: rel_err(grads[k], full[k]) for k in full}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, (what, worst, errs[worst])


@pytest.fixture(scope="module")
def stock_reference():
    """Single-rank stock GPTModel with Megatron's dense document mask, for two geometries."""
    from megatron_metp.megatron.training import Layout

    out = {}
    for pe in ("rope", "learned_absolute"):
        for eml in (False, True):
            out[pe, eml] = run_ranks(_packed_step, 1, _size(position_embedding_type=pe),
                                     Layout(mode="tp"), ENDS, eml)[0]
    return out


@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
def test_packed_metp_matches_stock_with_the_dense_document_mask(pe, stock_reference):
    from megatron_metp.megatron.training import Layout

    size = _size(position_embedding_type=pe)
    ref = stock_reference[pe, True]
    metp = run_ranks(_packed_step, 2, size, Layout(metp=2), ENDS, True)
    assert [r["cu"] for r in metp] == [[0, 6, 7, 18, 23, 32]] * 2
    _check_against(metp, ref, size, f"METP 2, {pe}")
    stock_tp = run_ranks(_packed_step, 2, size, Layout(tp=2, mode="tp"), ENDS, True)
    _check_against(stock_tp, ref, size, f"stock TP 2, {pe}")


def test_packed_compositions_match_stock(stock_reference):
    """Ring self-attention, the vocabulary ring, METP 4, TP 2 x METP 2, full recompute, host
    offload of the saved activations."""
    from megatron_metp.megatron.training import Layout

    size = _size()
    ref = stock_reference["rope", True]
    for layout in (Layout(metp=2, mode="ring"), Layout(metp=2, vocab_parallel=True),
                   Layout(metp=4), Layout(metp=2, tp=2), Layout(metp=2, recompute="full"),
                   Layout(metp=2, offload_activations=True)):
        world = layout.metp * layout.tp
        _check_against(run_ranks(_packed_step, world, size, layout, ENDS, True), ref, size,
                       layout.describe())


def test_balanced_layout_matches_stock(stock_reference):
    """--metp-packed-layout balanced: the model's token inputs move to the balanced layout
    (long documents dual-chunked on their own) and the per-token loss comes back dual-chunk."""
    from megatron_metp.megatron.training import Layout

    size = _size()
    ref = stock_reference["rope", True]
    for layout in (Layout(metp=2), Layout(metp=2, vocab_parallel=True), Layout(metp=4),
                   Layout(metp=2, tp=2, recompute="full")):
        world = layout.metp * layout.tp
        out = run_ranks(_packed_step, world, size, layout, ENDS, True, True, "balanced", 1)
        assert any(r["positions"] != shard_sequence(torch.arange(32), r["metp_rank"],
                                                    layout.metp).tolist()
                   for r in out)  # the tokens did move
        _check_against(out, ref, size, f"balanced, {layout.describe()}")


def test_eod_mask_loss_changes_metp_loss_as_it_changes_stock(stock_reference):
    """--eod-mask-loss drops the EOD tokens from the loss: the same change for METP and stock."""
    from megatron_metp.megatron.training import Layout

    size = _size()
    plain = run_ranks(_packed_step, 2, size, Layout(metp=2), ENDS, False)
    _check_against(plain, stock_reference["rope", False], size, "METP 2 without --eod-mask-loss")
    masked = stock_reference["rope", True]["loss"]
    assert abs(masked - stock_reference["rope", False]["loss"]) > 1e-3 * masked


def test_the_document_mask_matters_negative_control(stock_reference):
    """Plain causal attention over the packed sample gives another loss: the comparison above
    sees whether the boundaries reach the attention."""
    from megatron_metp.megatron.training import Layout

    causal = run_ranks(_packed_step, 1, _size(), Layout(mode="tp"), ENDS, True, False)[0]
    ref = stock_reference["rope", True]["loss"]
    assert abs(causal["loss"] - ref) > 1e-3 * ref


# ------------------------------------------------------------------------------ dry run

def test_dry_run_of_the_packed_config(patched_megatron_lm):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "PYTHON": sys.executable, "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "MEGATRON_LM_DIR": patched_megatron_lm}
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config",
                           "tiny-cpu-metp2-packed.sh", "--dry-run", "--gpu-memory-gib", "80"],
                          cwd=repo, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = proc.stdout
    command = out.split("command: ", 1)[1].splitlines()[0]
    for flag in ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
                 "--metp-mock-max-document-length 64", "--no-create-attention-mask-in-dataloader"):
        assert flag in command, flag
    assert "2 of 2 layers (METPSelfAttention + METPMLP)" in out and "fits in 80 GiB" in out
    assert "the micro-batch holds 8 documents of 32 tokens" in out
    # a packed micro-batch of two samples is refused by validate_args, naming the fix
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config",
                           "tiny-cpu-metp2-packed.sh", "--dry-run", "--", "--micro-batch-size",
                           "2"], cwd=repo, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1 and "--micro-batch-size 1" in proc.stderr, proc.stderr[-3000:]


# ------------------------------------------------------------------------------ RoPE per document

@pytest.mark.parametrize("layout", ["dual_chunk", "balanced", "contiguous"])
def test_per_document_rope_equals_the_rows_of_the_whole_table(layout, cpu_shims):
    """packing.document_rope builds this rank's per-document angles from Megatron's own
    RotaryEmbedding without the whole-sequence table: bit-identical to selecting its rows."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_metp.megatron.packing import document_rope
    from megatron_metp.ops.documents import document_position_runs, document_positions

    # (cpu_shims: get_emb moves inv_freq to the "current CUDA device")
    rotary = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)
    s, p = 96, 3
    n = s // p
    cu = [0, 5, 6, 40, 41, 90, 96]
    full = rotary.get_emb(s)
    for rank in range(p):
        pos = document_positions(cu, rank, p, n, layout)
        runs = document_position_runs(cu, rank, p, n, layout)
        assert torch.equal(torch.cat([torch.arange(a, a + m) for _, a, m in runs]), pos)
        got = document_rope(rotary, cu, rank, p, n, layout)
        assert got.shape == (n, 1, 1, 16) and torch.equal(got, full.index_select(0, pos))
    # negative control: global positions are not the per-document ones
    assert not torch.equal(document_rope(rotary, cu, 1, p, n, layout),
                           full.index_select(0, torch.arange(n, 2 * n)))


# ------------------------------------------------------------------------------ the training loop

def _train_packed(rank, world, layout, steps):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import init_parallel, setup, train
    from megatron_metp.tools.demo import DemoConfig, packed_walk_batch

    cpu.enable()
    size = DemoConfig(layers=2, hidden=32, seq=64).size()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout)
    return [r.lm_loss for r in train(size, layout, steps, state=state,
                                     batch_fn=packed_walk_batch)]


def test_the_training_loop_trains_packed_documents_as_stock_tp_does():
    """megatron_metp.megatron.training with Layout(packed_eod=...) (the demo's --packed): METP
    derives the boundaries, stock TP gets Megatron's dense mask, both the loss mask and
    per-token loss scaling; Adam at lr 3e-3 keeps the curves together."""
    from megatron_metp.megatron.training import Layout

    common = dict(micro_batch_size=2, global_batch_size=4, lr=3e-3, packed_eod=127)
    tp = run_ranks(_train_packed, 2, Layout(tp=2, mode="tp", **common), 4)[0]
    metp = run_ranks(_train_packed, 2, Layout(metp=2, vocab_parallel=True, **common), 4)[0]
    assert max(abs(a - b) / a for a, b in zip(tp, metp)) <= 1e-5, (tp, metp)
    assert tp[-1] < tp[0]
    # negative control: each METP rank's own token mean, averaged over the ring (what Megatron
    # does without --calculate-per-token-loss), is not the global mean once EOD tokens are
    # masked out
    off = run_ranks(_train_packed, 2, Layout(metp=2, vocab_parallel=True,
                                             extra={"calculate_per_token_loss": False},
                                             **common), 4)[0]
    assert max(abs(a - b) / a for a, b in zip(tp, off)) > 1e-5, (tp, off)
