"""A planner job as :class:`megatron_metp.megatron.settings.METPSettings`: what ``metp plan``
prices and what ``metp measure`` builds (through :func:`megatron_metp.megatron.build.build_metp_gpt`)
are the same settings, checked by the same rules."""

from __future__ import annotations

from typing import Optional, Union

from ...megatron.settings import METPSettings
from .model import KEEP_AUTO, Job, Model, canonical, layout

#: the planner flag behind each settings field (what a refusal names)
PLANNER_FLAGS = {"metp": "--metp", "context": "--cp", "tp": "--tp", "pp": "--pp",
                 "mode": "--modes", "kernel": "--kernel", "vocab_parallel": "--modes metp+vocab",
                 "keep_intermediate": "--keep-intermediate",
                 "mlp_token_tile": "--metp-mlp-token-tile",
                 "moe_token_tiles": "--metp-moe-token-tiles",
                 "offload_activations": "--offload-layers", "offload_prefetch": "--no-prefetch",
                 "keep_attention_output": "--keep-attention-output",
                 "full_recompute": "--recompute full", "rope_recipe": "METP_ROPE_RECIPE"}

#: the planner's modes as settings modes (``tp-sp``: stock TP + SP; ``cp``: TP × the K/V ring
#: with replicated weights, the ring baseline's settings at TP > 1)
SETTINGS_MODE = {"tp": "tp", "tp-sp": "tp", "cp": "ring", "ring": "ring", "metp": "metp"}


def kept_setting(model: Model, job: Job, mode: str) -> Union[None, bool, int]:
    """``METPSettings.keep_attention_output`` of ``job``'s ``--keep-attention-output [N]`` in
    planner mode ``mode``: the count the plan prices (:data:`.model.KEEP_AUTO` resolved by
    :func:`.partial.resolve_keep` after :func:`.partial.resolve_offload`), ``True`` when it
    covers a whole pipeline stage of ``model.layers / pp`` layers (Megatron-LM's bare
    ``--metp-keep-attention-output``), ``None`` when 0 layers keep it or the mode is not METP."""
    from .partial import resolve_keep, resolve_offload

    if job.keep_attention_output is None or canonical(mode, job)[0] != "metp":
        return None
    n = job.keep_attention_output
    if n == KEEP_AUTO:
        n = resolve_keep(model, resolve_offload(model, job, mode), mode).keep_attention_output
    if n <= 0:
        return None
    return True if n >= model.layers // job.pp else int(n)


def settings_for(mode: str, job: Job, *, kernel=None,
                 model: Optional[Model] = None) -> METPSettings:
    """The settings of planner mode ``mode`` (``metp+vocab`` included) for ``job``.

    ``kernel``: the K/V ring's block kernel (``None``: chosen by the device). ``model``: needed
    when ``job`` keeps attention (:func:`kept_setting`: the layers of a stage, the host and the
    device that decide how many keep it). Peer modes (``alst``) have no METP settings
    (``ValueError``).
    """
    from ...ops.rope_recipe import rope_recipe

    keep = None
    if job.keep_attention_output is not None:
        if model is None:
            raise ValueError("settings_for: a job with --keep-attention-output needs the model "
                             "(the layers of a stage; the host and the device for no N)")
        keep = kept_setting(model, job, mode)
    mode, job = canonical(mode, job)
    if mode not in SETTINGS_MODE:
        raise ValueError(f"mode {mode!r} is not built with METP settings (modes: "
                         f"{', '.join(SETTINGS_MODE)}, metp+vocab)")
    lay = layout(mode, job)
    kind = SETTINGS_MODE[mode]
    metp = lay.p if kind == "metp" else (lay.c if kind == "ring" else 1)
    rows, tiles = job.mlp_token_tile, job.moe_tile_count
    if kind == "metp" and not job.moe_token_tiles:
        tiles = 1  # --no-moe-token-tiles: the routed part whole
    offload = (job.offload_layers or True) if job.offload else False
    settings = METPSettings(
        mode=kind, metp=metp, context=lay.cp if kind == "metp" else 1, tp=lay.t, pp=job.pp,
        kernel=kernel, vocab_parallel=lay.vocab, keep_intermediate=job.keep_intermediate,
        mlp_token_tile=rows if kind == "metp" else None,
        moe_token_tiles=tiles if kind == "metp" else None,
        offload_activations=offload, offload_prefetch=job.offload_prefetch if job.offload else None,
        keep_attention_output=keep,
        rope_recipe=rope_recipe(), rope_recipe_source="METP_ROPE_RECIPE=megatron")
    settings.check(names=PLANNER_FLAGS, full_recompute=job.recompute == "full")
    return settings
