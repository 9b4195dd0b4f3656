"""Megatron modules for the fake-rank measurements where this machine lacks the GPU stack.

* :func:`flash_core_attention_class`: a Megatron ``core_attention`` running PyTorch's fused causal
  attention (``scaled_dot_product_attention``; the flash op on CPU fake tensors), standing in for
  Transformer Engine's fused attention or flash-attn: ``[s, b, n, d]`` in, ``[s, b, n·d]`` out;
  it stores what a flash kernel stores (q, k, v, the output and the fp32 log-sum-exp, never an
  ``s×s`` score) and, like those kernels, reads grouped K/V heads without repeating them.
* :func:`sp_norm_class`: Megatron's norm signature over ``torch.nn.LayerNorm`` / ``RMSNorm``
  (chosen by ``normalization`` or the config) that, unlike ``WrappedTorchNorm``, accepts sequence
  parallelism; its parameters are tagged ``sequence_parallel`` as TE's and apex's norms are.
  Under :func:`megatron_metp.tools.cuda_accounting.cuda_kernels` its RMSNorm keeps what CUDA's
  fused kernel keeps. :func:`put_norms` puts it into a layer spec.
* :func:`stock_standins`: both, put where Megatron-LM's own builder takes a stock job's specs
  (the dry run of a stock job without Transformer Engine or apex).
"""

from __future__ import annotations

from typing import List


def flash_core_attention_class():
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class FlashCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None, **_unused):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **_unused):
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 scale=self.softmax_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            sq, b = query.shape[:2]
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return FlashCoreAttention


def sp_norm_class():
    import torch

    class SPNorm(torch.nn.Module):
        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                     zero_centered_gamma=False, normalization=None, **_unused):
            super().__init__()
            kind = normalization or config.normalization
            cls = torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm
            self.norm = cls(hidden_size, eps=eps, dtype=config.params_dtype)
            for prm in self.norm.parameters():
                prm.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            return self.norm(x)

    return SPNorm


def put_norms(spec, norm, qk_layernorm: bool) -> None:
    """Put ``norm`` (:func:`sp_norm_class`) in a transformer layer spec's input and pre-MLP norm
    slots, and in its q/k norm slots when ``qk_layernorm`` (the local spec's torch norms refuse
    sequence parallelism; GPU runs use TE's or apex's)."""
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    if qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = norm
        spec.submodules.self_attention.submodules.k_layernorm = norm


def stock_standins(args, te_absent: bool, notes: List[str]) -> None:
    """The CPU stand-ins of a stock (non-METP) job, put into Megatron-LM's own spec functions
    (``gpt_builders``: the stock model is Megatron-LM's builder, not METP's, so its specs are
    changed where that builder takes them): without Transformer Engine a flash-attention core
    and torch norms for TE's fused layers, without apex torch norms for its sequence-parallel
    FusedLayerNorm (the dry run's, :mod:`.dry_run`). A METP job's CPU stand-ins go to the one
    builder as its ``spec_transform``. ``args`` (Megatron-LM's) and ``notes`` (what the report
    says was substituted) are changed in place."""
    import importlib.util

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    import gpt_builders

    local_spec = gpt_builders.get_gpt_layer_local_spec
    sp_wanted = bool(getattr(args, "sequence_parallel", False)) and \
        args.tensor_model_parallel_size > 1
    no_apex = importlib.util.find_spec("apex") is None
    if not (te_absent or (sp_wanted and no_apex and args.transformer_impl == "local")):
        return
    flash = flash_core_attention_class() if te_absent else None
    norm = sp_norm_class()

    def substitute(spec):
        if flash is not None:
            spec.submodules.self_attention.submodules.core_attention = \
                ModuleSpec(module=flash)
        q_norm = getattr(spec.submodules.self_attention.submodules, "q_layernorm", None)
        put_norms(spec, norm, sp_wanted and q_norm not in (None, IdentityOp))
        return spec

    def local_substituted(*a, **k):
        return substitute(local_spec(*a, **k))

    block_spec = gpt_builders.get_gpt_decoder_block_spec

    def block_substituted(*a, **k):  # MoE models: a block of dense and MoE layer specs
        block = block_spec(*a, **k)
        for spec in block.layer_specs:
            substitute(spec)
        block.layer_norm = norm
        return block

    from megatron.core.transformer import transformer_block

    transformer_block.LayerNormImpl = norm  # the final norm
    gpt_builders.get_gpt_layer_local_spec = local_substituted
    gpt_builders.get_gpt_decoder_block_spec = block_substituted
    if te_absent:
        args.transformer_impl = "local"
        notes.append("Transformer Engine is not installed here: the TE layer spec is "
                     "approximated by Megatron's local spec with a flash-attention core "
                     "(PyTorch's fused causal kernel) and torch norms accounted as CUDA's "
                     "fused ones; they keep the tensors TE's fused layers keep, to within "
                     "the norm statistics (8 bytes per token and norm); TE's own "
                     "workspaces are not in the figure (not measurable without TE)")
    else:
        notes.append("apex is not installed here: its sequence-parallel FusedLayerNorm is "
                     "approximated by torch norms (Megatron's torch fallback refuses "
                     "sequence parallelism)")
