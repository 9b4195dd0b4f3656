"""Multi-latent attention (DeepSeek-V2/V3 MLA) in the plan: parameters, FLOPs, the K/V ring's
bytes and the activation memory of an MLA layer under METP (:mod:`megatron_metp.ops.mla`) and
under stock Megatron (megatron-core's ``MLASelfAttention``), issue 43.

Names (:mod:`megatron_metp.ops.mla_latent`): ``A`` heads, ``h`` hidden, ``ql`` =
``q_lora_rank`` (none: the queries are projected from ``x``), ``kvr`` = ``kv_lora_rank``,
``dn`` = ``qk_head_dim``, ``dr`` = ``qk_pos_emb_head_dim``, ``dv`` = ``v_head_dim``,
``dq = dn + dr`` (a query/key head's width), ``C = kvr + dr`` (the latent of one token).

**Parameters** of one layer's attention: head-sharded (over METP's group, or stock TP)
``q_up [A·dq, ql]`` (``linear_q_proj [A·dq, h]`` without ``ql``), ``kv_up [A·(dn+dv), kvr]``,
``proj [h, A·dv]``; replicated (METP and stock TP alike, ``parallel_mode="duplicated"``):
``q_down [ql, h]``, ``kv_down [C, h]`` and the latent RMSNorms ``[ql]``, ``[kvr]``.

**The ring.** METP's K/V ring carries the latent ``L = [c ‖ k_pe]``: ``C`` values per token per
ring step (576 for DeepSeek's shapes); each head group's pass of the ring is one latent ring
(``head_block`` 1, what the Megatron layer runs): ``p`` passes per layer. Stock context
parallelism runs the core attention on the up-projected heads: megatron-core 0.16.1's
``MLASelfAttention.get_query_key_value_tensors`` (``transformer/multi_latent_attention.py``)
builds ``key = [k_nope ‖ k_pe expanded to every head]`` ``[n, A/t, dq]`` and ``value``
``[n, A/t, dv]`` and hands them to the core attention, whose CP ring (Transformer Engine's
``AttnFuncWithCPAndKVP2P``) passes K and V of every head: ``A/t·(dq + dv)`` values per token per
step (40,960 for DeepSeek-V3's 128 heads).

**FLOPs** (causal): the core attention ``n·s·A·(dq + dv)`` per rank and layer forward (``QKᵀ``
over ``dq``, ``PV`` over ``dv``); METP up-projects each received latent block for its head
group: ``2·m·kvr·(A/p)·(dn+dv)`` per block of ``m`` key rows, over the ring's ``P`` blocks and
the ``p`` head groups, causal dual-chunk halving the blocks below the diagonal:
``n·(P+1)·kvr·A·(dn+dv)`` per rank and layer forward (stock: ``2·n·kvr·A·(dn+dv)/t``, once);
the backward re-forms K/V and forms ``dW_kv`` and ``dc``: three times that.
"""

from __future__ import annotations

from typing import Dict, Tuple

from .model import BF16, FP32, Model


def dims(model: Model) -> Tuple[int, int, int, int, int, int]:
    """``(kvr, dn, dr, dv, ql, C)``; ``ql`` 0 without a query latent."""
    kvr, dn, dr, dv = (model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim,
                       model.v_head_dim)
    return kvr, dn, dr, dv, model.q_lora_rank or 0, kvr + dr


def attention_elements(model: Model) -> Tuple[int, int]:
    """``(head-sharded, replicated)`` elements of one MLA layer's attention (module
    docstring); the replicated part includes the two latent RMSNorms."""
    kvr, dn, dr, dv, ql, C = dims(model)
    A, h = model.heads, model.hidden
    sharded = A * (dn + dr) * (ql or h) + A * (dn + dv) * kvr + h * A * dv
    replicated = (ql * h + ql if ql else 0) + C * h + kvr
    return sharded, replicated


def ring_values_per_token_step(model: Model, mode: str, t: int = 1) -> int:
    """Values one token puts on the K/V ring per step: METP the latent ``C``; stock CP (and
    the ring modes) the up-projected K and V of this TP rank's heads, ``A/t·(dq + dv)``."""
    kvr, dn, dr, dv, _, C = dims(model)
    if mode in ("metp", "metp+vocab"):
        return C
    return model.heads // t * (dn + dr + dv)


def ring_bytes(model: Model, mode: str, n: int, ring: int, p: int = 1, t: int = 1) -> float:
    """Bytes one rank sends on the K/V ring per layer, forward + backward (the plan's
    convention, :func:`.traffic.traffic_per_layer`: the blocks forward and again in the
    backward in bf16, their gradients in fp32): ``4·(ring−1)·n·values·2`` per pass, ``p``
    passes under METP (one per head group)."""
    passes = p if mode in ("metp", "metp+vocab") else 1
    return passes * 4 * (ring - 1) * n * ring_values_per_token_step(model, mode, t) * BF16


def up_projection_flops(model: Model, n: int, ring: int) -> float:
    """METP's K/V up-projection of the received latent blocks, one rank, one layer forward
    (module docstring): ``n·(P+1)·kvr·A·(dn+dv)`` (``P = ring``; one rank: ``2·n·kvr·…``)."""
    kvr, dn, dr, dv, _, _ = dims(model)
    blocks = (ring + 1) / 2 if ring > 1 else 1
    return 2 * n * blocks * kvr * model.heads * (dn + dv)


def layer_flops(model: Model, n: int, s: int, t: int, metp_ring: int = 0) -> Dict[str, float]:
    """Forward GEMM and core-attention FLOPs of one MLA layer's attention on one rank (``n``
    own tokens of ``s``; ``t`` stock TP). ``metp_ring``: METP's sequence ring (its K/V
    up-projection over the received blocks); 0 for stock (the up-projection once)."""
    kvr, dn, dr, dv, ql, C = dims(model)
    A, h = model.heads, model.hidden
    local = 2 * n * ((ql * h if ql else 0) + C * h)  # replicated down-projections
    heads = 2 * n * (A * (dn + dr) * (ql or h) + h * A * dv) / t
    up = up_projection_flops(model, n, metp_ring) if metp_ring else 2 * n * kvr * A * (dn + dv) / t
    core = n * s * A * (dn + dr + dv) / t
    return {"gemm": local + heads, "up": up, "core": core,
            "q up-projection (re-formed per head group in backward)":
                2 * n * A * (dn + dr) * (ql or h) / t}


def metp_stored(model: Model, n: int, S: Dict[str, float], recompute: str) -> None:
    """What a METP MLA layer's attention keeps for its backward (``S``, in place): the op's
    ``q_in`` (and the query latent before its norm), the kv down-projection's output (kept by
    the latent norm), the latent ``L``, every head group's output and fp32 log-sum-exp."""
    kvr, dn, dr, dv, ql, C = dims(model)
    A = model.heads
    if ql:
        S["MLA query latent before and after its RMSNorm [n, ql] (bf16)"] = 2 * BF16 * n * ql
        S["MLA query latent norm statistics (fp32)"] = FP32 * n
    S["MLA kv down-projection output [n, C] (bf16, kept by the latent norm)"] = BF16 * n * C
    S["MLA latent norm statistics (fp32)"] = FP32 * n
    S["MLA latent L = [c ‖ k_pe] [n, C] (bf16)"] = BF16 * n * C
    S["MLA outputs, every head group [n, A·dv] (bf16)"] = BF16 * n * A * dv
    S["MLA log-sum-exp, every head (fp32)"] = FP32 * n * A


def stock_stored(model: Model, n: int, t: int, S: Dict[str, float]) -> None:
    """What megatron-core's ``MLASelfAttention`` keeps (``n`` tokens through the attention,
    ``t`` TP): the latents and their norms' inputs as METP's, the up-projected ``q``
    ``[n, A/t·dq]``, the kv up-projection's output ``[n, A/t·(dn+dv)]``, the core attention's
    contiguous ``query``, ``key`` ``[n, A/t, dq]`` and ``value`` ``[n, A/t, dv]``, its output
    (the projection's input) and fp32 log-sum-exp."""
    kvr, dn, dr, dv, ql, C = dims(model)
    At = model.heads // t
    if ql:
        S["MLA query latent before and after its RMSNorm [n, ql] (bf16)"] = 2 * BF16 * n * ql
        S["MLA query latent norm statistics (fp32)"] = FP32 * n
    S["MLA kv down-projection output [n, C] (bf16, kept by the latent norm)"] = BF16 * n * C
    S["MLA latent norm output [n, kvr] (bf16)"] = BF16 * n * kvr
    S["MLA latent norm statistics (fp32)"] = FP32 * n
    S["MLA q up-projection output [n, A/t·dq] (bf16)"] = BF16 * n * At * (dn + dr)
    S["MLA kv up-projection output [n, A/t·(dn+dv)] (bf16)"] = BF16 * n * At * (dn + dv)
    S["MLA core query, key [n, A/t, dq] and value [n, A/t, dv] (bf16)"] = \
        BF16 * n * At * (2 * (dn + dr) + dv)
    S["MLA core output = proj input [n, A/t·dv] (bf16)"] = BF16 * n * At * dv
    S["MLA core log-sum-exp (fp32)"] = FP32 * n * At


def metp_phases(model: Model, n: int, ring: int, p: int, S: Dict[str, float],
                kernel: str) -> Dict[str, Dict[str, float]]:
    """The attention forward and backward transients of the last METP MLA layer at the op's
    largest step (``ops/mla.py``, ``ops/mla_ring.py``): one head group (``H = A/p`` heads),
    the diagonal block (all ``n`` rows against all ``n`` keys). Fused kernels get ``v``
    zero-padded to ``dq`` (``dvk``). Alive in the head-group loop: the group's weights (own and
    received), its queries heads-first; forward: the fp32 ``y``, output and log-sum-exp
    accumulators, the latent ring's own and received blocks, the block's up-projected K/V and
    the kernel's output; backward: the fp32 ``dq_in`` and ``dL`` sums, the group's fp32 weight
    gradients (filling, in flight, kept), ``d(o_g)`` and the padded ``o_g``, ``d(o_g)``
    heads-first, the ring's fp32 ``dq`` (and the previous group's, whose name is rebound only
    when the ring returns; so are the previous group's ``dL`` and the previous ring step's
    block ``dL``) and its two travelling ``dL`` sums beside the held and
    spare latent blocks, and in the block the up-projected K/V, the kernel's ``dq``, ``dk``,
    ``dv``, their fp32 copies and ``latent_grads``' reshaped ``[dk_nope ‖ dv]`` (fp32) with,
    at its larger moment, the joined tensor it was copied from, or the fp32 latent ``c``, the
    product ``dc`` and the block's ``dL``."""
    kvr, dn, dr, dv, ql, C = dims(model)
    A, h = model.heads, model.hidden
    H = A // p
    dq = dn + dr
    dvk = dq if kernel == "flash" else dv
    Wg = H * dq * (ql or h) + H * (dn + dv) * kvr + h * H * dv
    held = 2 if ring > 1 else 1
    group = {"MLA head-group weights: own + received (bf16)": (2 if p > 1 else 1) * BF16 * Wg,
             "MLA head group's queries heads-first (bf16)": BF16 * n * H * dq}
    block = {"MLA block's K and V up-projected, heads-first (bf16)": BF16 * n * H * (dq + dvk)}
    fwd = dict(group, **block, **{
        "MLA latent ring: own copy + received block [n, C] (bf16)": held * BF16 * n * C,
        "MLA y accumulator (fp32)": FP32 * n * h,
        "MLA output and log-sum-exp accumulators (fp32)": FP32 * n * H * (dvk + 1),
        "MLA block kernel output (bf16) + lse (fp32)": BF16 * n * H * dvk + FP32 * n * H})
    later = sum(v for k_, v in S.items() if k_.startswith(("MLA outputs", "MLA log-sum-exp")))
    fwd["(the last head group's output not stored yet)"] = -later / p
    bwd = dict(group, **block, **{
        "MLA dq_in accumulator (fp32)": FP32 * n * (ql or h),
        "MLA dL sum over the head groups (fp32)": (FP32 * n * C if p > 1 else 0),
        "MLA head-group weight gradients: filling, in flight, kept (fp32)":
            min(p, 3) * FP32 * Wg,
        "MLA d(o_g) (bf16)": BF16 * n * H * dv,
        "MLA d(o_g) and o_g heads-first, padded (bf16)": 2 * BF16 * n * H * dvk,
        "MLA ring dq (fp32)": FP32 * n * H * dq,
        "MLA previous head group's dq, RoPE-transposed (fp32, alive until reassigned)":
            (FP32 * n * H * dq if p > 1 else 0),
        "MLA ring: held + spare latent blocks (bf16), travelling dL sums (fp32)":
            (held * BF16 + held * FP32) * n * C,
        "MLA previous ring step's dL block and previous head group's dL (fp32, alive until "
        "reassigned)": ((1 if ring > 1 else 0) + (1 if p > 2 else 0)) * FP32 * n * C,
        "MLA block kernel dq, dk, dv (bf16) and dk, dv in fp32":
            BF16 * n * H * (2 * dq + dvk) + FP32 * n * H * (dq + dvk),
        "MLA latent_grads: joined [dk_nope ‖ dv] reshaped, with the cat or with c, dc and dL "
        "(fp32)": FP32 * n * H * (dn + dv) + max(FP32 * n * H * (dn + dv),
                                                  2 * FP32 * n * kvr + FP32 * n * C)})
    return {"attention forward (last layer)": fwd, "attention backward (last layer)": bwd}


def stock_phases(model: Model, job, lay, n: int, nl: int, S: Dict[str, float], generic):
    """The last stock MLA layer's transients: the MLP's as the dense layer's (``generic``:
    :func:`.stock.stock_phases`), the attention's from megatron-core's core attention on the
    up-projected heads: its backward's ``dq``, ``dk``, ``dv`` (and, under CP, the K/V ring's
    buffers, :mod:`.ring`, sized for ``A/t`` heads of ``dq`` query and ``dq + dv`` K/V
    channels), or ``linear_proj``'s backward, whichever is larger."""
    from dataclasses import replace

    from .ring import ring_backward_buffers, ring_forward_buffers

    kvr, dn, dr, dv, ql, C = dims(model)
    t, At, h = lay.t, model.heads // lay.t, model.hidden
    dq = dn + dr
    ph = generic(model, replace(job, kernel="flash"), lay, n, nl, S, True)
    base = {k_: v for k_, v in ph["attention backward (last layer)"].items() if k_.startswith("(")}
    gather = {"SP gradient all-gather (bf16)": BF16 * n * h} if lay.sp else {}
    proj = dict({"d(proj input) (bf16)": BF16 * n * At * dv, "dW_proj (bf16)": BF16 * h * At * dv},
                **gather)
    core = {"d(proj input) (bf16)": BF16 * n * At * dv,
            "core backward dq, dk, dv (bf16)": BF16 * n * At * (2 * dq + dv)}
    hq, hkv = At * dq, At * (dq + dv) // 2  # the ring's "K/V" width: 2·hkv = A/t·(dq + dv)
    if lay.c > 1:
        core.update(ring_backward_buffers(n, hq, hkv, At, lay.c, job))
        fwd = {"(rest of the last layer not formed yet)":
               -sum(v for k_, v in S.items() if k_.startswith(("MLP", "MLA core output",
                                                              "MLA core log-sum-exp")))}
        fwd.update(ring_forward_buffers(n, hq, hkv, At, lay.c, job))
        ph["attention forward (last layer)"] = fwd
    ph["attention backward (last layer)"] = dict(base, **max([proj, core],
                                                            key=lambda d_: sum(d_.values())))
    return ph


#: ``pretrain_gpt.py``'s MLA flags with a value → :class:`~.model.Model` fields
FLAGS = {"--kv-lora-rank": "kv_lora_rank", "--q-lora-rank": "q_lora_rank",
         "--qk-head-dim": "qk_head_dim", "--qk-pos-emb-head-dim": "qk_pos_emb_head_dim",
         "--v-head-dim": "v_head_dim",
         "--moe-shared-expert-intermediate-size": "moe_shared_ffn"}


def mla_flags(model: Model) -> list:
    """The MLA flags of ``pretrain_gpt.py`` (``EXTRA_ARGS``): ``--multi-latent-attention``, the
    ranks and head widths, and the RMSNorm the latent norms need."""
    if not model.mla:
        return []
    out = ["--multi-latent-attention", "--kv-lora-rank", str(model.kv_lora_rank)]
    if model.q_lora_rank:
        out += ["--q-lora-rank", str(model.q_lora_rank)]
    return out + ["--qk-head-dim", str(model.qk_head_dim), "--qk-pos-emb-head-dim",
                  str(model.qk_pos_emb_head_dim), "--v-head-dim", str(model.v_head_dim),
                  "--normalization", "RMSNorm"]


def layer_freq(value) -> Dict[str, int]:
    """Model fields of a ``--moe-layer-freq`` value: ``N`` (every N-th layer MoE), or leading
    dense layers ``[0]*k+[1]*m`` (Megatron's list form, with or without the parentheses);
    ``ValueError`` naming the flag for a form the plan does not read."""
    import re

    value = str(value).strip("'\"")
    m = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", value)
    if m:
        return {"moe_first_dense": int(m.group(1)), "moe_layer_freq": 1}
    if value.isdigit():
        return {"moe_layer_freq": int(value)}
    raise ValueError(f"--moe-layer-freq {value} in the config: the plan reads N or leading "
                     f"dense layers [0]*k+[1]*m; give one of those")


def config_fields(argv: list, variables: Dict[str, object] = None) -> Dict[str, object]:
    """Model fields of the MLA and DeepSeekMoE flags in a config's ``EXTRA_ARGS`` (``argv``
    split; ``$NAME`` values are read from ``variables``, the config's own): the ranks and widths
    (:data:`FLAGS`, integers; MLA only with ``--multi-latent-attention``, which also means the
    latent norms' RMSNorm and ``--qk-layernorm``), the shared experts' FFN, and
    ``--moe-layer-freq`` (:func:`layer_freq`); ``ValueError`` naming the flag for a value that
    is not an integer or a list the plan does not read."""
    from .config_flags import flag_values

    variables = variables or {}
    words = [w.strip("'\"") for w in argv]
    argv = [str(variables.get(w.strip("${}").lower(), w)) if w.startswith("$") else w
            for w in words]
    out: Dict[str, object] = dict(flag_values(argv, FLAGS))
    if "--multi-latent-attention" not in argv:
        for k in ("kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim"):
            if k in out:
                flag = next(f for f, v in FLAGS.items() if v == k)
                raise ValueError(f"{flag} in the config's EXTRA_ARGS without "
                                 f"--multi-latent-attention: add --multi-latent-attention "
                                 f"or drop {flag}")
    else:  # the latent norms are RMSNorm, with --qk-layernorm (megatron/mla_checks.py)
        out.setdefault("kv_lora_rank", 32)  # Megatron-LM's default --kv-lora-rank
        out.update(normalization="RMSNorm", qk_layernorm=True)
    if "--moe-layer-freq" in argv:
        i = len(argv) - 1 - argv[::-1].index("--moe-layer-freq")
        out.update(layer_freq(argv[i + 1] if i + 1 < len(argv) else ""))
    return out


def check(model: Model, job, mode: str, lay) -> None:
    """``ValueError`` naming the flag for an MLA job the plan (and METP's MLA layer,
    :func:`megatron_metp.megatron.mla_checks.mla_problems`) cannot lay out: TP inside METP (the
    down-projections are replicated over the METP group; use a METP size of TP × METP), the
    ring baseline and ALST (their attention is not MLA here), widths that are not positive, an
    odd RoPE width, and FFNs the METP group does not divide (shared experts run as METP's MLP).
    The METP group's size is bounded by the heads (head groups), not by K/V groups: one latent
    serves every head."""
    if not model.mla:
        return
    for flag, v in (("--kv-lora-rank", model.kv_lora_rank), ("--qk-head-dim", model.qk_head_dim),
                    ("--qk-pos-emb-head-dim", model.qk_pos_emb_head_dim),
                    ("--v-head-dim", model.v_head_dim)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if model.q_lora_rank is not None and (not isinstance(model.q_lora_rank, int) or
                                          model.q_lora_rank < 1):
        raise ValueError(f"--q-lora-rank must be a positive integer, got {model.q_lora_rank!r}")
    if model.qk_pos_emb_head_dim % 2:
        raise ValueError(f"--qk-pos-emb-head-dim {model.qk_pos_emb_head_dim} must be even "
                         f"(RoPE rotates pairs)")
    if mode in ("ring", "alst"):
        raise ValueError(f"--modes {mode} with --multi-latent-attention: the ring baseline and "
                         f"ALST's recipe run no MLA here; plan metp (the latent ring) or the "
                         f"stock modes tp, tp-sp, cp")
    if mode in ("metp", "metp+vocab"):
        if lay.t > 1:
            raise ValueError(f"--tp {lay.t} with --multi-latent-attention and METP: the "
                             f"down-projections are replicated over the METP group; use --tp 1 "
                             f"and --metp {lay.t * lay.p}")
        for flag, v in (("--moe-ffn-hidden-size", model.moe_ffn if model.moe else None),
                        ("--moe-shared-expert-intermediate-size", model.moe_shared_ffn or None)):
            if v and v % lay.p:
                raise ValueError(f"{flag} {v} is not divisible by --metp {lay.p}")


def describe(model: Model, job, modes) -> str:
    """One line for the plan's header: the latent's widths and what each mode's K/V ring
    carries per token per step."""
    from .model import canonical, layout

    kvr, dn, dr, dv, ql, C = dims(model)
    rings = []
    for m in modes:
        mode, j = canonical(m, job)
        lay = layout(mode, j)
        if lay.c > 1:
            rings.append(f"{m} {ring_values_per_token_step(model, mode, lay.t):,}")
    return (f"MLA: kv_lora_rank {kvr}, q_lora_rank {ql or 'none'}, q/k {dn} + {dr} rotated, "
            f"v {dv}; values per token per K/V ring step: "
            + (", ".join(rings) if rings else "no K/V ring")
            + " (METP: the latent, once per head group; stock CP: every head's K and V)")
