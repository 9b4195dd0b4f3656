"""``build_metp_gpt``: the one place a METP ``GPTModel`` is built.

Megatron-LM's hooks (``megatron_metp.megatron_lm``), the training loop (:mod:`.training`),
``metp measure``, the dry run and the Hugging Face tools all call it, so what the instruments
measure is what training runs. From a megatron-core ``TransformerConfig`` (what the model is),
the process groups and :class:`~.settings.METPSettings` (how METP runs it) it

1. chooses the layer spec: METP's (:func:`.spec.get_gpt_layer_metp_spec`, or the decoder block of
   :func:`.moe.get_gpt_decoder_block_metp_spec` when the config has experts) for modes ``metp``
   and ``ring``, Megatron's local spec for stock ``tp``; the settings' kernel, tiles and norms go
   into it as arguments;
2. lets the caller change the spec (``spec_transform(spec) -> spec``: the instruments' CPU
   stand-ins enter here, never as patches after the build);
3. chooses the class: :class:`.vocab.METPGPTModel` with ``vocab_parallel``, else ``GPTModel``;
4. gives the model its RoPE angles (exact for this rank's tokens unless the settings ask for
   Megatron's recipe; Megatron's recipe refused where positions reach 2^24), Megatron-like
   initialisation of the sharded weights (:func:`.init.initialize_like_tp`, where the config
   initialises), the kept attention outputs of ``keep_attention_output``
   (:func:`.keep_attention.attach_kept_attention`) and the streaming layer / freed recompute
   outputs under full recompute (:func:`.streaming.prepare_recompute`) for METP layers, the
   activation offloader (any mode)
   and the packed-document boundaries (METP and ring).
"""

from __future__ import annotations

from typing import Callable, Optional

from .groups import METPGroups
from .settings import METPSettings


def layer_spec(config, groups: Optional[METPGroups], settings: METPSettings, *,
               normalization: Optional[str] = None, vp_stage=None):
    """The transformer layer spec (dense) or decoder block spec (experts) of ``settings.mode``.

    ``normalization`` defaults to ``config.normalization``; ``qk_layernorm`` is the config's.
    Stock ``tp`` builds Megatron's local spec (block spec with experts); ``metp``/``ring`` METP's
    with the settings' kernel, tiles, ``keep_intermediate`` and the norm of
    ``settings.transformer_impl``.
    """
    normalization = normalization or getattr(config, "normalization", "LayerNorm")
    qk = bool(getattr(config, "qk_layernorm", False))
    mla = bool(getattr(config, "multi_latent_attention", False))
    if settings.mode == "tp":
        if config.num_moe_experts:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              normalization=normalization)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk,
                                        multi_latent_attention=mla)
    if groups is None:
        raise ValueError(f"mode {settings.mode!r} needs the METP groups (METPGroups)")
    if mla:  # multi-latent attention (.mla): refused combinations by flag, before the build
        from .mla_checks import mla_problems

        problems = mla_problems(config, tp=groups.tp_size, weight_ring=settings.weight_ring,
                                keep_attention=settings.keep_attention_output)
        if problems:
            raise ValueError("--metp-parallel-size does not support: " + "; ".join(problems))
    from .gpu_stack import select_norm

    kwargs = dict(settings.spec_kwargs(), normalization=normalization,
                  norm=select_norm(settings.transformer_impl, normalization).module)
    if config.num_moe_experts:  # Megatron's MoELayer, experts over the METP ring (EP = p)
        from .moe import get_gpt_decoder_block_metp_spec

        spec = get_gpt_decoder_block_metp_spec(config, groups, vp_stage=vp_stage, **kwargs)
    else:
        from .spec import get_gpt_layer_metp_spec

        spec = get_gpt_layer_metp_spec(groups, qk_layernorm=qk and not mla, **kwargs)
    if mla:  # every layer's attention: METP's MLA (.mla), the MLPs as built
        from .mla import use_mla_spec

        spec = use_mla_spec(spec, groups, config, settings.kernel, normalization)
    return spec


def build_metp_gpt(config, groups: Optional[METPGroups], settings: METPSettings, *,
                   vocab_size: int, max_sequence_length: int, seq_length: Optional[int] = None,
                   pre_process: bool = True, post_process: bool = True,
                   share_embeddings_and_output_weights: bool = True,
                   position_embedding_type: str = "rope", normalization: Optional[str] = None,
                   spec_transform: Optional[Callable] = None, vp_stage=None,
                   log: Optional[Callable[[str], None]] = None, **model_kwargs):
    """One pipeline stage's ``GPTModel`` (or ``METPGPTModel``) as ``settings`` say.

    Args:
        config: megatron-core ``TransformerConfig`` (sizes, experts, recompute, dtypes).
        groups: :class:`~.groups.METPGroups` (``None`` only for stock ``tp``).
        settings: :class:`~.settings.METPSettings`; refused here if it has problems.
        vocab_size, max_sequence_length, pre_process, post_process,
            share_embeddings_and_output_weights, position_embedding_type, vp_stage,
            model_kwargs: ``GPTModel``'s arguments (``rotary_base``, ``rotary_percent``,
            ``rope_scaling``, ``fp16_lm_cross_entropy``, ``parallel_output``, ``pg_collection``…).
        seq_length: the job's sequence length, for the 2^24 reach check of Megatron's RoPE
            recipe (default ``max_sequence_length``).
        normalization: the spec's norm (default ``config.normalization``).
        spec_transform: ``spec -> spec`` applied to the chosen spec before the model is built.
        log: where the one "building GPT model with …" line goes (``None``: nowhere).
    """
    from megatron.core.models.gpt import GPTModel

    settings.check()
    spec = layer_spec(config, groups, settings, normalization=normalization, vp_stage=vp_stage)
    if spec_transform is not None:
        spec = spec_transform(spec)
    if log is not None and settings.mode != "tp":
        log(f"building GPT model with {settings.describe()}")
        if getattr(config, "recompute_granularity", None) == "selective":
            from .selective import RUNS, selective_modules

            log("selective recompute in the METP layers: " + "; ".join(
                f"{m}: {RUNS.get(m, '?')}" for m in selective_modules(config.recompute_modules)))
    cls, extra = GPTModel, {}
    if settings.vocab_parallel:
        from .vocab import METPGPTModel

        cls, extra = METPGPTModel, {"metp_groups": groups}
    if vp_stage is not None:
        extra["vp_stage"] = vp_stage
    model = cls(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                max_sequence_length=max_sequence_length, pre_process=pre_process,
                post_process=post_process,
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type=position_embedding_type, **model_kwargs, **extra)
    finish(model, groups, settings, seq_length=seq_length or max_sequence_length, log=log)
    if log is not None and settings.mode != "tp":
        log(f"METP model: {model_tree_summary(model)}")
    return model


def model_tree(model) -> list:
    """The module tree and parameter shapes of ``model``, one line each: ``"name Class"`` for
    every module, ``"name [d0, d1, …]"`` for every parameter (names as ``named_modules`` /
    ``named_parameters`` give them; dtypes and devices left out: fake and real tensors, bf16 and
    fp32 builds of the same model agree)."""
    lines = [f"{name or '.'} {type(mod).__name__}" for name, mod in model.named_modules()]
    lines += [f"{name} {list(prm.shape)}" for name, prm in model.named_parameters()]
    return lines


def model_tree_summary(model) -> str:
    """One line naming :func:`model_tree`'s size and digest (what ``metp measure``, the dry run
    and a Megatron-LM training log print, to be compared)."""
    import hashlib

    n_mod = sum(1 for _ in model.named_modules())
    params = list(model.parameters())
    digest = hashlib.sha256("\n".join(model_tree(model)).encode()).hexdigest()[:16]
    return (f"{n_mod} modules, {len(params)} parameter tensors, "
            f"{sum(p.numel() for p in params):,} parameters, tree {digest}")


def attach_offloader(model, settings: METPSettings) -> None:
    """The host offloader of ``settings.offload_activations`` on ``model``'s decoder (nothing
    when off): every layer's saved tensors, or the first N layers' of the stage."""
    n = settings.offload_activations
    if not n:
        return
    from ..runtime.offload import ActivationOffloader

    kwargs = {} if settings.offload_prefetch is None else {"prefetch": settings.offload_prefetch}
    ActivationOffloader(layers=None if n is True else n, **kwargs).attach(model.decoder)


def finish(model, groups: Optional[METPGroups], settings: METPSettings, *, seq_length: int,
           log: Optional[Callable[[str], None]] = None) -> None:
    """What a built METP model gets after construction (see the module docstring, step 4)."""
    from .rope import check_reach, use_exact_angles

    recipe = "megatron" if settings.mode == "tp" else settings.rope_recipe
    asked = "stock TP" if settings.mode == "tp" else settings.rope_recipe_source
    angles = use_exact_angles(model, recipe)  # this rank's angles, not the whole table
    check_reach(model, angles, seq_length, asked)
    if angles == "none" and getattr(model.config, "multi_latent_attention", False):
        from .mla import use_mla_angles  # MLA layers own their RoPE module

        angles = use_mla_angles(model, recipe, seq_length, asked)
    if log is not None and settings.mode != "tp":
        log(f"RoPE angles: {angles}" + (" (int64 positions, reduced mod 2 pi, this rank's "
                                        "tokens only)" if angles == "exact" else ""))
    if settings.weight_ring:
        from .init import initialize_like_tp
        from .streaming import prepare_recompute

        if settings.init_like_tp:  # the same global weights as stock TP of size TP x METP
            initialize_like_tp(model, groups)
        if settings.keep_attention_output:  # before the recompute set-up reads it
            from .keep_attention import attach_kept_attention

            attach_kept_attention(model.decoder, settings.keep_attention_output)
        # full recompute: the streaming layer op, else freed re-formed chunk outputs (METP layers
        # only: stock and ring layers keep Megatron's checkpoint as it is, as metp plan prices)
        prepare_recompute(model.decoder)
    attach_offloader(model, settings)  # stock TP too (the baseline of the same job)
    if settings.packed and settings.mode != "tp":  # packed documents: boundaries from the EOD tokens
        from .packing import DocumentBoundaries

        DocumentBoundaries(groups.metp.sequence_ring, eod_token=settings.packed_eod,
                           full_rope=settings.weight_ring,
                           layout=settings.packed_layout).attach(model)
