"""Megatron's selective recompute (``--recompute-granularity selective``, ``--recompute-modules``)
with METP layers: which module runs, which is refused, and why.

One table serves the megatron-core builders (a ``TransformerConfig``:
:func:`megatron_metp.megatron.modules.recompute_problems`) and Megatron-LM's ``args`` (the ranks'
``validate_metp_args`` and the launcher's preflight: :mod:`megatron_metp.megatron_lm.checks`); it
imports neither Megatron nor megatron-core. ``recompute_modules=None`` is Megatron's default,
``["core_attn"]`` (``--recompute-activations`` too).

What runs (the recompute happens inside the METP layer; losses equal stock TP's, tests
``tests/test_recompute.py`` and ``tests/test_megatron_lm_train.py``):

* ``core_attn``: stock checkpoints the attention core ``softmax(Q·Kᵀ)·V`` (keeps Q, K, V; re-runs
  the core in backward). A METP attention never keeps Q, K, V (it re-forms them from its input
  ``x`` per head group in backward) but keeps each head group's output ``O_g`` (together
  ``[s/p, b, A·d/t]`` in the activation dtype, the size of the layer input) and its fp32
  log-sum-exp ``[b, A/t, s/p]``. With ``core_attn`` it keeps neither: its backward re-runs the
  K/V ring forward of each head-group block (the attention kernel's forward over all ``p``
  blocks, the same ring traffic as the forward) to re-form ``O_g`` and the LSE before that
  block's attention backward (:func:`megatron_metp.ops.metp_attention`, ``recompute_core``).
  The opposite trade is ``--metp-keep-attention-output`` under full recompute (keep ``O`` and
  the LSE, recompute the rest of the layer).
* ``layernorm``: Megatron's output-discarding checkpoint of ``input_layernorm`` and
  ``pre_mlp_layernorm``: the two norm outputs (``[s/p, b, h]`` each, which the METP attention
  and MLP keep as their ``x``) are freed after use and re-formed from the norm inputs when the
  backward reaches them.

What is refused (each with the alternative):

* ``mlp``: the METP MLP keeps only its input ``x`` (the ``pre_mlp_layernorm`` output) and
  re-forms ``x·W1_j`` per weight shard in backward; Megatron's checkpoint would keep the same
  ``x`` and re-run the whole weight ring: time for nothing. With ``--metp-keep-intermediate``
  the intermediate it would free is the one that flag keeps: drop the flag instead.
* ``moe``: METP's MoE layers (:mod:`.moe_tiles`) already keep only the layer input and the
  routing and re-run dispatch, experts and combine in backward once they run in token tiles
  (``--metp-moe-token-tiles N``, ``N ≥ 2``); with several tiles Megatron's ``moe`` checkpoint
  would not apply, so it is refused rather than honoured for one tile count only.
* ``moe_act``: needs ``--moe-grouped-gemm`` (Megatron's rule), whose experts run on GPU only,
  inside METP's token tiles (not verified there): use ``--metp-moe-token-tiles``.
* ``shared_experts``, ``mla_up_proj``, ``gdn_norm_out`` (core_v0.19.0): the shared expert and
  METP's MLA keep nothing such a checkpoint would free (:mod:`.mla` re-forms K/V from the latent
  in its ring); Gated DeltaNet is not supported with METP.
* every module with the ring self-attention baseline (``--metp-disable-weight-ring``), and
  ``layernorm`` with ``--metp-offload-activations`` (the offloaded layers send the norm outputs
  to the host at once; the combination is not verified).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

__all__ = ["RUNS", "REFUSED", "DEFAULT_MODULES", "selective_modules", "selective_problems"]

#: Megatron's default ``recompute_modules`` (both releases)
DEFAULT_MODULES = ("core_attn",)

#: the modules that run with METP layers: name -> what it recomputes there
RUNS = {
    "core_attn": "the attention core: each head group's output O and log-sum-exp are not kept; "
                 "the backward re-runs the K/V ring forward to re-form them",
    "layernorm": "input_layernorm and pre_mlp_layernorm: their outputs are freed after use and "
                 "re-formed in backward",
}

_FULL = "--recompute-granularity full"

#: the modules refused with METP layers: name -> why, and what to use instead
REFUSED = {
    "mlp": "the METP MLP keeps only its input and re-forms x·W1 per weight shard in backward "
           "already, so Megatron's checkpoint would re-run its weight ring and free nothing "
           "(with --metp-keep-intermediate, drop that flag instead); drop mlp, or use "
           f"{_FULL}",
    "moe": "METP's MoE layers keep only the layer input and the routing and re-run the routed "
           "part in backward once they run in token tiles: use --metp-moe-token-tiles N "
           f"(N >= 2) instead, or {_FULL}",
    "moe_act": "it needs --moe-grouped-gemm, whose experts run on GPU only and inside METP's "
               "MoE token tiles are not verified with it: use --metp-moe-token-tiles N "
               f"(N >= 2) instead, or {_FULL}",
    "shared_experts": "the shared expert runs as METP's MLP, which keeps only its input and "
                      "re-forms x·W1 per weight shard in backward: a checkpoint would re-run "
                      "its weight ring and free nothing; drop it",
    "mla_up_proj": "METP's multi-latent attention keeps only the latent and re-forms each "
                   "head group's K/V from it inside its ring, forward and backward: there is "
                   "no up-projection output to free; drop it",
    "gdn_norm_out": "Gated DeltaNet (--experimental-attention-variant gated_delta_net) is not "
                    "supported with METP: drop it",
}


def selective_modules(modules: Optional[Sequence[str]]) -> List[str]:
    """The modules Megatron recomputes for ``recompute_modules`` (``None``: its default)."""
    return list(DEFAULT_MODULES if modules is None else modules)


def selective_problems(modules: Optional[Sequence[str]], *, weight_ring: bool = True,
                       offload: bool = False, given: str = "--recompute-granularity selective"
                       ) -> List[str]:
    """One line per module of ``recompute_modules`` that METP layers refuse, naming the module,
    why and the alternative (empty: every module runs).

    ``weight_ring``: False for the ring self-attention baseline (every module refused);
    ``offload``: ``--metp-offload-activations`` is on; ``given``: how the job asked for
    selective recompute (named in each line)."""
    mods = selective_modules(modules)
    flag = f"{given} --recompute-modules {' '.join(mods)}"
    if not weight_ring:
        return [f"{flag} with --metp-disable-weight-ring (the ring self-attention baseline runs "
                f"full recompute only): use {_FULL}"]
    out = []
    for m in mods:
        if m in REFUSED:
            out.append(f"{flag}: module {m!r} is refused with METP layers ({REFUSED[m]})")
        elif m not in RUNS:
            known = ", ".join(sorted({*RUNS, *REFUSED}))
            out.append(f"{flag}: {m!r} is not a Megatron-LM recompute module ({known})")
        elif m == "layernorm" and offload:
            out.append(f"{flag}: module 'layernorm' with --metp-offload-activations (the "
                       f"offloaded layers send the norm outputs to the host already; not "
                       f"verified together): drop one of them")
    return out
