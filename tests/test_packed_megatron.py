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

    from megatron_metp.megatron.modules import _document_kwargs

    assert _document_kwargs(None, "x") == {}
    d = packing.documents([0, 3, 8], 8)
    assert _document_kwargs(d, "x")["cu_seqlens"] is d.cu_seqlens
    with pytest.raises(ValueError, match="METP attention takes packed documents only.*--sft"):
        _document_kwargs(PackedSeqParams(qkv_format="thd"), "METP attention")


# ------------------------------------------------------------------------------ flags

def _args(**kw):
    from tests.test_megatron_lm import _args as base

    return base(**kw)


@pytest.mark.parametrize("kw,needles", [
    (dict(sft=True), ["--sft", "--reset-attention-mask"]),
    (dict(reset_attention_mask=True, micro_batch_size=2),
     ["--reset-attention-mask with --micro-batch-size 2", "--micro-batch-size 1"]),
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
                 eod_mask_loss=True, micro_batch_size=1, create_attention_mask_in_dataloader=True)
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
    assert max(lengths) < 64 and all(low[i][-1] == 1024 for i in range(200))  # EOD = vocab
    with pytest.raises(ValueError, match="add --mock-data"):
        megatron_lm.validate_metp_args(_args(metp_mock_max_document_length=64))
    with pytest.raises(ValueError, match="at least 2"):
        megatron_lm.validate_metp_args(_args(mock_data=True, metp_mock_max_document_length=1))
