"""Packed sequences with METP: document boundaries of a micro-batch, derived once per forward.

Megatron-LM pre-training packs documents into each sample, separated by EOD tokens. With
``--reset-attention-mask`` a token attends only to earlier tokens of its own document: a document
ends with (and includes) an EOD token (``GPTDataset``'s ``_get_ltor_masks_and_position_ids`` at
core_v0.16.1 masks ``[i+1:, :i+1]`` for every EOD at ``i``). Stock Megatron carries that as a
dense ``[b, 1, s, s]`` mask built by the dataloader (``--create-attention-mask-in-dataloader``,
Megatron's default); METP never materialises it. Instead, per micro-batch:

1. each METP rank marks the EOD tokens of its own ``s/p`` tokens (Megatron's dual-chunk CP order,
   ``get_batch_on_this_cp_rank``), one byte per token;
2. one all-gather over the METP ring gives every rank the marks of the whole sequence, put back in
   natural order (:func:`megatron_metp.ops.sequence.unshard_sequence`);
3. ``cu_seqlens = [0, e₁+1, e₂+1, …, s]`` (1-D int32, on the CPU: the ops read it on the host),
   the same on every rank of the ring.

:class:`DocumentBoundaries` attaches that to a ``GPTModel`` as a forward pre-hook: it passes the
boundaries down as ``packed_seq_params`` (a :class:`METPDocuments`), which megatron-core hands
through the decoder (also into Megatron's full-recompute re-runs) to every layer's attention,
where the METP modules give them to the ops as ``cu_seqlens=``. With the weight ring and
Megatron's plain RoPE, the hook also computes this rank's per-document RoPE angles
``[s/p, 1, 1, r]`` once (:func:`document_rope`; positions restart at each document) and every
layer's ``metp_attention`` takes them as they are (``rope_per_document=True``): no per-layer copy,
and no whole-sequence table. For other position embeddings the ``METPDocuments`` say
``qkv_format='thd'``, so ``GPTModel`` builds the whole sequence's table ``[s, 1, 1, r]`` and each
layer selects its rows. The ring self-attention baseline applies RoPE in Megatron's stock ``SelfAttention``,
so there they say ``'sbhd'`` (this rank's slice, global positions: RoPE is relative, and no
score crosses a document, so the attention is the same).

Micro-batches of more than one sample would need boundaries per sample: refused at argument
validation (``--micro-batch-size 1``); :func:`boundaries_from_eod` refuses differing rows too.

``layout='balanced'`` (``--metp-packed-layout balanced``): the hook also moves the model's token
inputs (ids, position ids, labels) from Megatron's dual-chunk split into the ops' balanced
layout (:mod:`megatron_metp.ops.documents`: long documents dual-chunked over the ring on their
own) with one all-gather each, and a forward hook moves the per-token loss back to dual-chunk
order (:func:`relayout_autograd`), where Megatron's loss mask is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from ..ops.documents import (PACKED_LAYOUTS, check_cu_seqlens, document_position_runs,
                             shard_documents, unshard_documents)
from ..ops.sequence import unshard_sequence
from .packing_checks import mock_document_length_problems, packing_problems  # noqa: F401
from .exact_rope import ExactRotaryEmbedding, angles_of


@dataclass
class METPDocuments(PackedSeqParams):
    """``PackedSeqParams`` carrying a METP micro-batch's global document boundaries.

    ``cu_seqlens_q`` (= ``cu_seqlens_kv``): ``[0, …, s]`` int32 on the CPU, natural token order;
    ``max_seqlen_q`` (= ``max_seqlen_kv``): the whole sequence length ``s`` (``GPTModel`` sizes its
    RoPE table with it). The tokens themselves stay in METP's ``[s/p, b, h]`` dual-chunk layout.
    """

    layout: str = "dual_chunk"
    #: this rank's per-document RoPE angles ``[s/p, 1, 1, r]`` (:func:`document_rope`), computed
    #: once per micro-batch for every layer; ``None``: the layers select them per call from the
    #: whole-sequence table (``qkv_format='thd'``)
    rope: Optional[torch.Tensor] = None

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.cu_seqlens_q

    @property
    def num_documents(self) -> int:
        return int(self.cu_seqlens_q.numel()) - 1


def documents(cu_seqlens, seq_length: int, *, full_rope: bool = True,
              layout: str = "dual_chunk") -> METPDocuments:
    """:class:`METPDocuments` for ``cu_seqlens`` (a sequence of ints or a 1-D tensor)."""
    cu = torch.as_tensor(list(cu_seqlens) if not torch.is_tensor(cu_seqlens) else
                         cu_seqlens.tolist(), dtype=torch.int32)
    _check(cu, seq_length)
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"--metp-packed-layout must be one of {PACKED_LAYOUTS}, got {layout!r}")
    if layout == "balanced" and not full_rope:
        raise ValueError("--metp-packed-layout balanced needs the weight ring (METP's attention "
                         "applies RoPE per document); drop --metp-disable-weight-ring")
    return METPDocuments(qkv_format="thd" if full_rope else "sbhd", cu_seqlens_q=cu,
                         cu_seqlens_kv=cu, max_seqlen_q=int(seq_length),
                         max_seqlen_kv=int(seq_length), layout=layout)


def _check(cu: torch.Tensor, s: int) -> None:
    """The ops' own check (:func:`~megatron_metp.ops.documents.check_cu_seqlens`), its message
    prefixed with what the boundaries are here."""
    try:
        check_cu_seqlens(cu, s)
    except ValueError as exc:
        v = cu.tolist()
        raise ValueError(f"document boundaries must be a 1-D, strictly increasing [0, ..., {s}], "
                         f"got {v[:8]}{' ...' if len(v) > 8 else ''}: {exc}") from None


def boundaries_from_eod(eod: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int32, CPU) of EOD marks ``eod [b, s]`` (bool) in natural order.

    A document ends after each EOD token; an EOD on the last token closes the last document.
    Every sample of the micro-batch must have the same boundaries (the METP attention takes one
    ``cu_seqlens`` per micro-batch)."""
    if eod.dim() != 2:
        raise ValueError(f"EOD marks must be [b, s], got shape {tuple(eod.shape)}")
    eod = eod.to("cpu", torch.bool)
    b, s = eod.shape
    if b > 1 and not bool((eod == eod[:1]).all()):
        raise ValueError(f"packed sequences (--reset-attention-mask) with METP: the {b} samples "
                         f"of this micro-batch have different document boundaries; pass "
                         f"--micro-batch-size 1 (and raise --global-batch-size for more samples "
                         f"per step)")
    ends = (torch.nonzero(eod[0]).flatten() + 1).tolist()
    cu = [0] + [e for e in ends if e < s] + [s]
    return torch.tensor(cu, dtype=torch.int32)


def gather_sequence(local: torch.Tensor, group, *, layout: str = "dual_chunk") -> torch.Tensor:
    """``local [b, s/p]`` of every rank of METP ``group`` → ``[b, s]`` in natural order (one
    all-gather; ``group`` a :class:`~megatron_metp.runtime.groups.METPGroup`, a process group or
    ``None`` for one rank)."""
    pg = getattr(group, "group", group)
    size = 1 if pg is None else dist.get_world_size(pg)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=pg)
    return unshard_sequence(parts, layout=layout, seq_dim=1)


def documents_from_tokens(tokens: torch.Tensor, eod_token: int, group, *,
                          full_rope: bool = True, layout: str = "dual_chunk") -> METPDocuments:
    """:class:`METPDocuments` of this METP rank's token ids ``tokens [b, s/p]`` (every rank of
    ``group`` calls it with its own tokens, in ``layout`` order; the result is the same on all
    of them)."""
    marks = gather_sequence((tokens == eod_token).to(torch.uint8), group, layout=layout)
    cu = boundaries_from_eod(marks.bool())
    return documents(cu, marks.shape[1], full_rope=full_rope)


def document_rope(rotary, cu, rank: int, p: int, n: int, layout: str) -> torch.Tensor:
    """Rank ``rank``'s per-document RoPE angles ``[n, 1, 1, r]`` from Megatron's
    ``RotaryEmbedding`` ``rotary``: row ``i`` holds the angles of local token ``i``'s position
    within its document (:func:`megatron_metp.ops.documents.document_positions`).

    With exact angles (:class:`~.rope.ExactRotaryEmbedding`, the default for METP) these
    positions' rows of :func:`~megatron_metp.ops.rope.rope_angles`; with Megatron's recipe
    ``rotary.get_emb(m, offset=a)`` once per run of consecutive positions (a few per document on
    this rank), so the rows are bit-identical to those of the whole-sequence table (positions
    below 2^24 are exact in fp32). Neither forms the whole table: at 4M tokens it is 2 GiB, and
    Megatron's ``RotaryEmbedding.forward`` would keep it in its ``lru_cache``."""
    runs = document_position_runs(cu, rank, p, n, layout)  # plain ints (fake tensors too)
    if isinstance(rotary, ExactRotaryEmbedding):  # exact angles (.rope), one call for the rank
        pos = torch.cat([torch.arange(start, start + length) for _, start, length in runs])
        return angles_of(rotary, pos, (0, max(start + length - 1 for _, start, length in runs)))
    pieces = [rotary.get_emb(length, offset=start) for _, start, length in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _plain_rotary(module):
    """The model's Megatron ``RotaryEmbedding`` (plain RoPE: ``get_emb(len, offset)``), else
    ``None`` (no RoPE, or another kind: those keep the per-layer selection)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = getattr(module, "rotary_pos_emb", None)
    return rotary if type(rotary) in (RotaryEmbedding, ExactRotaryEmbedding) else None


def _rank_size(group):
    pg = getattr(group, "group", group)
    return (0, 1) if pg is None else (dist.get_rank(pg), dist.get_world_size(pg))


def relayout(x: torch.Tensor, group, cu, src: str, dst: str, *, seq_dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (``src`` order along ``seq_dim``) in ``dst`` order: one
    all-gather over the METP ``group``, no autograd (:func:`relayout_autograd` for that)."""
    if src == dst:
        return x
    pg = getattr(group, "group", group)
    rank, size = _rank_size(group)
    parts = [x]
    if size > 1:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=pg)
    full = unshard_documents(parts, cu, layout=src, seq_dim=seq_dim)
    return shard_documents(full, cu, rank, size, layout=dst, seq_dim=seq_dim)


class _Relayout(torch.autograd.Function):
    """:func:`relayout` whose backward relays the gradient back (one all-gather each way, on
    the single path from the model's output: no other backward communication can interleave)."""

    @staticmethod
    def forward(ctx, x, group, cu, src, dst, seq_dim):
        ctx.args = (group, cu, src, dst, seq_dim)
        return relayout(x, group, cu, src, dst, seq_dim=seq_dim)

    @staticmethod
    def backward(ctx, grad):
        group, cu, src, dst, seq_dim = ctx.args
        return relayout(grad, group, cu, dst, src, seq_dim=seq_dim), None, None, None, None, None


def relayout_autograd(x, group, cu, src: str, dst: str, *, seq_dim: int = 1):
    return x if src == dst else _Relayout.apply(x, group, cu, src, dst, seq_dim)


class DocumentBoundaries:
    """Forward pre-hook on a METP ``GPTModel``: derive :class:`METPDocuments` from the input
    token ids (``--reset-attention-mask``) and pass them as ``packed_seq_params``.

    ``eod_token``: the tokenizer's EOD id (``None``: Megatron-LM's global tokenizer's, read at
    the first forward). ``full_rope``: ``True`` for METP layers (weight ring), ``False`` for the
    ring self-attention baseline. ``layout``: ``"dual_chunk"`` (Megatron's split, as the batch
    arrives) or ``"balanced"`` (the token inputs move there; the per-token loss comes back).
    A caller may pass its own ``METPDocuments`` (the dry run does; its inputs must then be in
    the documents' layout already); any other ``packed_seq_params`` (Megatron's THD batches of
    ``--sft``) is refused.
    A dense ``attention_mask`` is dropped: the boundaries replace it (with METP
    :func:`megatron_metp.megatron_lm.validate_metp_args` switches the dataloader's off anyway).
    """

    def __init__(self, group, *, eod_token: Optional[int] = None, full_rope: bool = True,
                 layout: str = "dual_chunk"):
        if layout not in PACKED_LAYOUTS:
            raise ValueError(f"--metp-packed-layout must be one of {PACKED_LAYOUTS}, got "
                             f"{layout!r}")
        self.group, self.eod_token, self.full_rope = group, eod_token, full_rope
        self.layout = layout
        self.last: Optional[METPDocuments] = None

    def attach(self, model: torch.nn.Module) -> "DocumentBoundaries":
        model.register_forward_pre_hook(self._hook, with_kwargs=True)
        if self.layout != "dual_chunk":
            model.register_forward_hook(self._output_hook, with_kwargs=True)
        model._metp_document_boundaries = self
        return self

    def _output_hook(self, module, args, kwargs, output):
        """The per-token loss ``[b, s/p]`` back in Megatron's dual-chunk order (where
        ``pretrain_gpt.py``'s loss mask is)."""
        docs = self.last
        if docs is None or docs.layout == "dual_chunk":
            return output
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        if labels is None:
            raise ValueError(f"--metp-packed-layout {docs.layout}: the model returns logits in "
                             f"that layout's token order without labels; METP supports it for "
                             f"training and evaluation with labels only (use "
                             f"--metp-packed-layout dual_chunk)")
        return relayout_autograd(output, self.group, docs.cu_seqlens.tolist(), docs.layout,
                                 "dual_chunk", seq_dim=1)

    def _eod(self) -> int:
        if self.eod_token is None:
            from megatron.training import get_tokenizer

            self.eod_token = int(get_tokenizer().eod)
        return self.eod_token

    def _hook(self, module, args, kwargs):
        args = list(args)

        def get(name, index):
            if name in kwargs:
                return kwargs[name]
            return args[index] if len(args) > index else None

        def put(name, index, value):
            if name in kwargs or len(args) <= index:
                kwargs[name] = value
            else:
                args[index] = value

        # GPTModel.forward(input_ids, position_ids, attention_mask, decoder_input, labels,
        #                  inference_context, packed_seq_params, ...)
        given = get("packed_seq_params", 6)
        if isinstance(given, METPDocuments):
            self.last = given
        elif given is not None:
            raise ValueError(
                "METP with --reset-attention-mask derives the document boundaries from the EOD "
                "tokens itself; it cannot take Megatron's packed THD batches (packed_seq_params "
                f"with qkv_format={getattr(given, 'qkv_format', None)!r}, e.g. from --sft): "
                "use pre-training data (GPTDataset, --mock-data) without --sft")
        else:
            tokens = get("input_ids", 0)
            if tokens is None:
                raise ValueError(
                    "METP with --reset-attention-mask needs the token ids of the micro-batch in "
                    "GPTModel.forward (Megatron gives them only to the first pipeline stage); "
                    "use --pipeline-model-parallel-size 1")
            if self.layout == "dual_chunk":
                docs = documents_from_tokens(tokens, self._eod(), self.group,
                                             full_rope=self.full_rope)
            else:  # the whole sequence's tokens once: the boundaries, then this rank's share
                full = gather_sequence(tokens, self.group)
                cu = boundaries_from_eod(full == self._eod())
                docs = documents(cu, full.shape[1], full_rope=self.full_rope, layout=self.layout)
                cu = cu.tolist()
                rank, p = _rank_size(self.group)
                put("input_ids", 0, shard_documents(full, cu, rank, p, layout=self.layout,
                                                    seq_dim=1))
                # Megatron sliced the micro-batch dual-chunk; the other token inputs move too
                for name, index in (("position_ids", 1), ("labels", 4)):
                    value = get(name, index)
                    if value is not None:
                        put(name, index, relayout(value, self.group, cu, "dual_chunk",
                                                  self.layout, seq_dim=1))
            self.last = docs
            put("packed_seq_params", 6, self.last)
        docs = self.last
        rotary = _plain_rotary(module) if docs.qkv_format == "thd" else None
        if rotary is not None and docs.rope is None:
            # per-document angles once for every layer; Megatron then builds (and caches) only
            # this rank's usual slice, not the whole sequence's table
            tokens = get("input_ids", 0)
            rank, p = _rank_size(self.group)
            n = tokens.shape[1] if tokens is not None else docs.max_seqlen_q // p
            rope = document_rope(rotary, docs.cu_seqlens.tolist(), rank, p, n, docs.layout)
            # a copy: a caller's METPDocuments (the dry run reuses one) stays as given
            self.last = dataclasses.replace(docs, rope=rope, qkv_format="sbhd")
            put("packed_seq_params", 6, self.last)
        if get("attention_mask", 2) is not None:
            put("attention_mask", 2, None)
        return tuple(args), kwargs


# ------------------------------------------------------------------------------ Megatron flags

# packing_problems and mock_document_length_problems live in .packing_checks (no megatron-core:
# the launcher's preflight imports them) and are re-exported here

def map_packing_flags(args) -> List[str]:
    """Switch the dataloader's dense attention mask off (METP never reads it); return notes."""
    notes = []
    if flag_on(args, "create_attention_mask_in_dataloader"):
        args.create_attention_mask_in_dataloader = False
        what = ("the document boundaries come from the EOD tokens (--reset-attention-mask)"
                if flag_on(args, "reset_attention_mask") else "its attention is causal")
        notes.append(f"the dataloader's dense [b, 1, s, s] attention mask is not built "
                     f"(as with --no-create-attention-mask-in-dataloader): METP never reads it, "
                     f"{what}")
    return notes


def flag_on(args, name: str) -> bool:
    return bool(getattr(args, name, False))


def apply_mock_document_length(args) -> Optional[str]:
    """``--metp-mock-max-document-length N``: Megatron's ``MockGPTLowLevelDataset`` draws its
    document lengths uniformly from ``[1, N)`` instead of ``[1, 4096)`` (so that short mock
    sequences hold several documents); returns a note, or ``None`` when the flag is not given.
    Works with METP on or off (the stock twin gets the same data)."""
    n = getattr(args, "metp_mock_max_document_length", None)
    if n is None:
        return None
    problems = mock_document_length_problems(args)
    if problems:
        raise ValueError(problems[0])
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    MockGPTLowLevelDataset.max_sequence_length = int(n)
    return (f"mock data: documents of 1 to {n - 1} tokens (MockGPTLowLevelDataset."
            f"max_sequence_length = {n}), each ending with an EOD token")
