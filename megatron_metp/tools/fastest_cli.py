"""``metp plan --fastest --gpus N --seq S``: the checks of its arguments, the search
(:mod:`megatron_metp.tools.plan.fastest`), its text, ``--json`` and ``--write-config``."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from typing import Optional

#: flags --fastest searches over itself (refused next to it: each would be ignored)
SEARCHED = ("tp", "metp", "cp", "pp", "dp", "recompute", "recompute_method",
            "recompute_num_layers", "offload_activations", "optimizer_cpu_offload",
            "vocab_parallel", "modes", "keep_intermediate", "ep")


def check_args(args) -> None:
    """``ValueError`` naming the flag for what ``--fastest`` does not take, before any work."""
    if args.reach:
        raise ValueError("--fastest and --reach are two searches (the fastest layout at --seq; "
                         "the longest sequence): pass one of them")
    if args.png:
        raise ValueError("--png draws a single plan's charts; --fastest prints its table (and "
                         "--json): drop --png, or plan one layout without --fastest")
    given = [f for f in SEARCHED if getattr(args, f, None) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag}: --fastest searches every layout and option itself (TP, METP, "
                         f"CP, PP, DP, EP, recompute, offload, optimizer CPU offload, the METP "
                         f"MLP intermediate); drop {flag}, or plan that one layout without "
                         f"--fastest")
    if not args.gpus:
        raise ValueError("--fastest needs --gpus N (the GPUs of the job)")
    if not args.seq:
        raise ValueError("--fastest needs --seq S (the sequence length to train)")
    if args.kernel == "unfused" or args.micro_batch not in (None, 1) or \
            args.precision != "bf16" or args.microbatches:
        raise ValueError("--fastest plans micro-batch 1, bf16 and flash kernels; drop --kernel "
                         "unfused / --micro-batch / --microbatches / --precision")
    for flag in ("metp_mlp_token_tile", "metp_moe_token_tiles"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}: --fastest plans each layout with the "
                             f"auto tiles (they follow its tokens per rank); drop it")


def model_name(config: str) -> Optional[str]:
    """The repository model a config sources (``source .../models/<name>.sh``), or the model
    file itself: its name, so that a launch line sources that file (norm, RoPE base, biases)."""
    from .plan.launch import MODELS_DIR

    with open(config, encoding="utf-8") as fh:
        text = fh.read()
    names = re.findall(r"^\s*(?:source|\.)\s+.*models/([\w.-]+)\.sh", text, re.M)
    stem = os.path.basename(config)[:-3] if config.endswith(".sh") else None
    for name in names[-1:] + [stem]:
        if name and os.path.isfile(os.path.join(MODELS_DIR, f"{name}.sh")):
            return name
    return None


def tokenizer_adds(config: str) -> int:
    """Tokens the launcher's tokenizer adds to a ``configs/*.sh``'s ``VOCAB_SIZE`` (Megatron's
    NullTokenizer: its end-of-document token at core_v0.16.1), which ``--config`` planned."""
    from .plan import read_config

    kv = read_config(config)
    if not config.endswith(".sh"):
        return 0
    tokenizer = kv.get("tokenizer_type") or ("HuggingFaceTokenizer" if kv.get("data_path")
                                             else "NullTokenizer")
    if tokenizer != "NullTokenizer":
        return 0
    from ..megatron_lm.releases import for_megatron_core

    return int(for_megatron_core().null_tokenizer_adds_eod)


def moe_settings(args, model) -> dict:
    """The MoE settings a search (``--reach``, ``--fastest``) plans every layout with, from
    the flags given (``{Job field: value}``); refused for a model without experts."""
    given = [(flag, k, v) for flag, k, v in (
        ("--moe-token-dispatcher-type", "moe_dispatcher", args.moe_token_dispatcher_type),
        ("--moe-imbalance", "moe_imbalance", args.moe_imbalance),
        ("--no-moe-token-tiles", "moe_token_tiles", False if args.no_moe_token_tiles else None),
        ("--moe-grouped-gemm", "moe_grouped_gemm", True if args.moe_grouped_gemm else None))
        if v is not None]
    if given and not model.moe:
        raise ValueError(f"{given[0][0]}: a MoE setting, and the model has no experts "
                         f"(--num-experts, or --preset qwen3-30b-a3b)")
    return {k: v for _, k, v in given}


def cmd_fastest(args, model, width: Optional[int]) -> int:
    """Run ``metp plan --fastest`` for ``model`` (``--preset`` / ``--config`` / the geometry
    flags; a config's layout and options are what the search replaces), after
    :func:`check_args`; ``width``: the text's columns, None for ``--wide``."""
    from . import plan as P

    if args.config and not args.preset and model_name(args.config):
        model = replace(model, name=model_name(args.config))
    moe = moe_settings(args, model)
    kernel = args.kernel if args.kernel not in (None, "flash") else None
    host = args.host_memory_gib if args.host_memory_gib is not None else \
        P.search.DEFAULT_HOST_GIB_PER_NODE
    if not host > 0:
        raise ValueError(f"--host-memory-gib must be a positive number of GiB, got {host!r}")
    if kernel is not None or args.rates:
        P.rates.resolve_rates(args.hardware, kernel, args.rates)  # names the bad kernel / file
    res = P.fastest.fastest(model, args.gpus, args.hardware, args.reserve_gib, host,
                            moe=moe, kernel=kernel,
                            rates_file=args.rates)
    if args.config:  # the launch names the tokenizer's vocabulary, as the config does
        res["launch_model"] = replace(model, vocab=model.vocab - tokenizer_adds(args.config))
    print(P.fastest.fastest_report(model, args.gpus, res, args.hardware, args.reserve_gib, host,
                                   top=args.reach_top, width=width))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(P.fastest.fastest_json(model, args.gpus, res), fh, indent=1)
        print(f"wrote {args.json}")
    if args.write_config:
        c = P.fastest.best_overall(res)
        if c is None:
            raise ValueError(f"--write-config {args.write_config}: no layout of METP or stock "
                             f"Megatron fits {model.name} at {model.seq:,} tokens on "
                             f"{args.gpus} GPUs; nothing written")
        job = replace(c.job, host_memory_gib=None)
        model = res.get("launch_model") or model
        title = (f"{model.name} at {model.seq:,} tokens on {args.gpus} × {args.hardware}: "
                 f"{c.describe()}; {c.time_s:,.2f} s per sequence, {P.fmt_bytes(c.total)} per "
                 f"rank planned (written by metp plan --fastest: the fastest layout)")
        with open(args.write_config, "w") as fh:
            fh.write(P.config_text(model, job, c.mode, title))
        print(f"\nwrote {args.write_config}: scripts/pretrain_gpt.sh --config "
              f"{args.write_config}")
    return 0
