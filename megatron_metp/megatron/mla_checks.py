"""What METP's multi-latent attention layer (:mod:`.mla`) refuses, by flag, before any rank
starts: :func:`mla_problems` reads attributes only (a megatron-core config or Megatron-LM's
``args``) and imports neither Megatron nor megatron-core, so the launcher's preflight
(:func:`megatron_metp.megatron_lm.checks.metp_arg_problems`), the build
(:func:`.build.layer_spec`) and the module itself give the same answers.

Supported: ``--multi-latent-attention`` with ``--qk-layernorm`` and ``--normalization RMSNorm``
(DeepSeek's latent RMSNorms), with or without ``--q-lora-rank``, plain RoPE or YaRN
(``--rope-type``), METP alone or METP × CP, full recompute (Megatron's checkpoint re-runs the
layer, rings included), METP's activation offload (``--metp-offload-activations``: the saved
tensors of the MLA layers go to the host like any layer's), packed documents from the EOD tokens
(``--reset-attention-mask``). Refused, each with its alternative: TP > 1 inside METP, the ring
baseline (``--metp-disable-weight-ring``), selective recompute of ``core_attn``, kept attention
outputs.
"""

from __future__ import annotations

from typing import List

__all__ = ["mla_problems"]


def mla_problems(cfg, *, tp: int = 1, weight_ring: bool = True,
                 keep_attention=None) -> List[str]:
    """Why a METP job with ``cfg`` (config or ``args``: ``multi_latent_attention``,
    ``qk_layernorm``, ``normalization``, ``recompute_granularity``, ``recompute_modules``)
    cannot run its MLA layers; ``[]`` when it can or when the model has no MLA. ``tp``: the
    tensor-parallel size; ``weight_ring``: METP (``False``: the ring baseline);
    ``keep_attention``: ``--metp-keep-attention-output`` as given."""
    if not getattr(cfg, "multi_latent_attention", False):
        return []
    out = []
    flag = "--multi-latent-attention with --metp-parallel-size"
    if not weight_ring:
        out.append(f"{flag} --metp-disable-weight-ring (the ring baseline runs Megatron's own "
                   f"attention, whose MLA core attention has no K/V ring here): drop "
                   f"--metp-disable-weight-ring (METP's MLA passes the latent on its ring)")
    if (tp or 1) > 1:
        out.append(f"{flag} and --tensor-model-parallel-size {tp} (the down-projections are "
                   f"replicated over the METP group, Megatron's local spec would shard them "
                   f"over TP): use --tensor-model-parallel-size 1 and a METP size of TP x METP")
    if not getattr(cfg, "qk_layernorm", False):
        out.append(f"{flag} without --qk-layernorm (METP's MLA applies DeepSeek's latent "
                   f"RMSNorms, q_layernorm/kv_layernorm): pass --qk-layernorm")
    norm = getattr(cfg, "normalization", "LayerNorm")
    if norm != "RMSNorm":
        out.append(f"{flag} and --normalization {norm} (the latent norms are RMSNorm): pass "
                   f"--normalization RMSNorm")
    if getattr(cfg, "recompute_granularity", None) == "selective":
        modules = getattr(cfg, "recompute_modules", None)
        if modules is None or "core_attn" in modules:  # Megatron's default list is core_attn
            out.append(f"{flag} and --recompute-granularity selective with core_attn in "
                       f"--recompute-modules (METP's MLA does not re-run its latent ring "
                       f"selectively): use --recompute-granularity full, or list other "
                       f"--recompute-modules (e.g. layernorm)")
    if keep_attention:
        out.append(f"{flag} and --metp-keep-attention-output (MLA layers do not keep their "
                   f"attention outputs yet): drop --metp-keep-attention-output (full recompute "
                   f"re-runs the latent ring)")
    return out
