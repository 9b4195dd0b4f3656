"""Megatron modules for the METP vocabulary: word embedding and output layer + loss on the ring.

With ``vocab_parallel=True`` a METP ``GPTModel`` (:class:`METPGPTModel`) splits the word
embedding and the output layer by vocabulary rows over TP × METP, TP-major — the split Megatron's
``VocabParallelEmbedding`` / ``ColumnParallelLinear`` use over TP of size ``t·p`` — so checkpoints
keep Megatron's keys and global shapes. The embedding looks its tokens up while the shards pass
around the ring (:func:`megatron_metp.ops.metp_embedding`); the output layer never materialises
logits: ``compute_language_model_loss`` runs :func:`megatron_metp.ops.metp_output_cross_entropy`
on the final hidden states, so no rank holds more than ``[s/p·b, V/(t·p)]`` logits. Without
labels (evaluation, generation) the output layer returns Megatron's ``parallel_output`` logits
``[s/p, b, V/t]`` for this rank's tokens (:func:`megatron_metp.ops.metp_output_logits`).

Gradients: both tables are METP-sharded parameters (``allreduce=False``: the ops already sum
over the METP group's tokens; Megatron reduces them over pure DP). Tied embeddings use one
parameter for both ops (PP=1) or Megatron's embedding-group copy on the last stage (PP>1).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from torch.nn import Parameter

from ..ops import metp_embedding, metp_output_cross_entropy, metp_output_logits
from ..ops.vocab import loss_grad_into_hidden_env
from .groups import METPGroups
from .linear import divide, init_cpu_shard, init_shard, mark_sharded


def _vocab_sharded_tensor(key, param, groups: METPGroups, sharded_offsets, replica_first=0):
    """``param`` as shard ``τ·p + r`` of ``t·p`` along the vocabulary axis (padding-tolerant, as
    Megatron's vocab-parallel tensors: a checkpoint written with another padding still loads)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dp_rank = dist.get_rank(groups.dp) if groups.dp is not None else 0
    return ShardedTensor.from_rank_offsets(
        key, param, *sharded_offsets, (len(sharded_offsets), groups.shard_index, groups.shards),
        replica_id=(replica_first, 0, dp_rank), prepend_axis_num=len(sharded_offsets),
        allow_shape_mismatch=True)


class VocabShard(torch.nn.Module):
    """Holds this rank's ``[V/(t·p), h]`` rows of a vocabulary table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config, init_method,
                 groups: METPGroups, name: str, allocate: bool = True):
        super().__init__()
        self.groups, self.config = groups, config
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows = divide(num_embeddings, groups.shards, "padded vocabulary size",
                            "--make-vocab-size-divisible-by (Megatron pads the vocabulary to a "
                            "multiple of it x TP x METP)")
        #: first row of this METP group's contiguous range (TP rank τ holds rows τ·p·v onwards)
        self.vocab_start = groups.tp_rank * groups.metp.size * self.rows
        self.sequence_parallel = False
        if not allocate:
            self.register_parameter("weight", None)
            return
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = Parameter(torch.empty(self.rows, embedding_dim, dtype=config.params_dtype,
                                            device=device))
        self.init_method = init_method
        if config.perform_initialization:
            if config.use_cpu_initialization:  # the full table, as stock TP draws it
                init_cpu_shard(self.weight.data, init_method, output_size=num_embeddings,
                               input_size=embedding_dim, partition_dim=0, stride=1,
                               rank=groups.shard_index, world_size=groups.shards)
            else:  # re-drawn as stock TP of size t·p draws it by init.initialize_like_tp
                init_shard(self.weight.data, init_method, groups, name)
        mark_sharded(self.weight, partition_dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        if self.weight is None:
            return {}
        key = f"{prefix}weight"
        return {key: _vocab_sharded_tensor(key, self.weight, self.groups, sharded_offsets)}

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, h={self.embedding_dim}, rows {self.rows} "
                f"(shard {self.groups.shard_index} of {self.groups.shards})")


class METPVocabEmbedding(VocabShard):
    """Drop-in for Megatron's ``VocabParallelEmbedding`` inside ``LanguageModelEmbedding``.

    ``input_ids [b, s/p]`` → ``[b, s/p, h]`` (summed over TP like ``VocabParallelEmbedding``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config, groups: METPGroups):
        super().__init__(num_embeddings, embedding_dim, config=config,
                         init_method=config.embedding_init_method, groups=groups,
                         name="word_embeddings")
        self.reduce_scatter_embeddings = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        g = self.groups
        out = metp_embedding(input_ids, self.weight, group=g.metp, vocab_start=self.vocab_start,
                             vocab_size=self.num_embeddings, label="word embeddings")
        if g.tp_size > 1:
            out = reduce_from_tensor_model_parallel_region(out, group=g.tp)
        return out


class METPOutputLayer(VocabShard):
    """Drop-in for the ``GPTModel``'s output ``ColumnParallelLinear``.

    While the model computes a loss (:class:`METPGPTModel` sets :attr:`defer_to_loss`), the
    forward returns its input unchanged and remembers the weight to use: the loss op computes
    the logits one shard at a time. Otherwise it returns ``parallel_output`` logits
    ``[s/p, b, V/t]`` (gathered over TP if ``runtime_gather_output``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config, groups: METPGroups,
                 skip_weight_param_allocation: bool = False):
        super().__init__(num_embeddings, embedding_dim, config=config,
                         init_method=config.init_method, groups=groups, name="output_layer",
                         allocate=not skip_weight_param_allocation)
        self.defer_to_loss = False
        self._pending_weight = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError("METP output layer: no weight (tied embeddings need the weight "
                               "passed in, as GPTModel does)")
        if self.defer_to_loss:
            self._pending_weight = weight
            return input_, None
        g = self.groups
        logits = metp_output_logits(input_, weight, group=g.metp, label="output layer")
        if runtime_gather_output and g.tp_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits, group=g.tp)
        return logits, None

    def take_pending_weight(self) -> torch.Tensor:
        w, self._pending_weight = self._pending_weight, None
        if w is None:
            raise RuntimeError("METP output layer: the loss was asked for without a forward "
                               "through the output layer")
        return w


class METPGPTModel(GPTModel):
    """megatron-core ``GPTModel`` whose word embedding and output layer + loss are METP-sharded.

    Same constructor as ``GPTModel`` plus ``metp_groups``; the transformer layers come from the
    spec as usual (normally :func:`get_gpt_layer_metp_spec`). ``forward(..., labels=...)``
    returns the per-token loss ``[b, s/p]`` as ``GPTModel`` does, computed without logits.
    """

    def __init__(self, *args, metp_groups: METPGroups, **kwargs):
        self.__dict__["_metp_groups"] = metp_groups  # before nn.Module init: read in setup below
        super().__init__(*args, **kwargs)
        if getattr(self.config, "mtp_num_layers", None):
            raise ValueError("METP vocabulary parallelism does not support --mtp-num-layers")

    def setup_embeddings_and_output_layer(self) -> None:
        """Swap Megatron's vocabulary-parallel modules for METP ones, then let Megatron set up
        tying and the embedding group on them (called from ``GPTModel.__init__``)."""
        groups = self._metp_groups
        h = self.config.hidden_size
        if self.pre_process:
            self.embedding.word_embeddings = METPVocabEmbedding(
                self.vocab_size, h, config=self.config, groups=groups)
        if self.post_process:
            self.output_layer = METPOutputLayer(
                self.vocab_size, h, config=self.config, groups=groups,
                skip_weight_param_allocation=self.pre_process and
                self.share_embeddings_and_output_weights)
        super().setup_embeddings_and_output_layer()

    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        if not self.post_process:
            return super().forward(*args, **kwargs)
        self.output_layer.defer_to_loss = labels is not None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.output_layer.defer_to_loss = False

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor):
        """``logits`` is the final hidden state ``[s/p, b, h]`` here (the output layer deferred
        to the loss); returns the per-token loss ``[b, s/p]`` in fp32. The loss's backward
        writes the hidden states' gradient into their own storage where
        :meth:`_loss_grad_into_hidden` allows it."""
        g = self._metp_groups
        layer = self.output_layer
        return metp_output_cross_entropy(
            logits, layer.take_pending_weight(), labels, group=g.metp,
            tp_group=g.tp if g.tp_size > 1 else None, vocab_start=layer.vocab_start,
            vocab_size=self.vocab_size, label="output layer + cross-entropy",
            grad_into_hidden=self._loss_grad_into_hidden(logits))

    def _loss_grad_into_hidden(self, hidden: torch.Tensor) -> bool:
        """Whether the loss may overwrite ``hidden`` (the final norm's output) with its gradient
        in backward (``grad_into_hidden`` of :func:`metp_output_cross_entropy`: saves
        ``[s/p·b, h]`` at the loss's backward).

        Safe because nothing reads ``hidden`` after the loss's backward: ``GPTModel`` keeps it
        in locals of ``forward`` only (MTP, which would reuse it, is refused above; the output
        layer returns it unchanged); the final norm's autograd node saves its *input* (torch's
        and Transformer Engine's LayerNorm/RMSNorm, apex's unless ``memory_efficient``); the
        loss itself saves it and reads each tile's rows for the last time in that tile's pass.
        Any other autograd node that saved it would fail loudly on its version counter. Off
        with ``METP_LOSS_GRAD_INTO_HIDDEN=0`` (e.g. a forward hook that keeps the final hidden
        states), with ``--memory-efficient-layer-norm`` (apex's norm then saves its output),
        without a final norm on this stage, or for a leaf / view / non-contiguous ``hidden``."""
        if not loss_grad_into_hidden_env() or not hidden.requires_grad:
            return False
        if getattr(self.config, "memory_efficient_layer_norm", False):
            return False
        if getattr(self.decoder, "final_layernorm", None) is None:
            return False
        return hidden.grad_fn is not None and hidden._base is None and hidden.is_contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}output_layer.weight"
        if self.post_process and self.share_embeddings_and_output_weights and \
                not self.pre_process and key in sd:
            # Megatron ties the last stage's copy as a TP-only shard; it is a TP×METP shard here
            sd[key] = _vocab_sharded_tensor(f"{prefix}embedding.word_embeddings.weight",
                                            self.shared_embedding_or_output_weight(),
                                            self._metp_groups, (), replica_first=1)
        return sd
