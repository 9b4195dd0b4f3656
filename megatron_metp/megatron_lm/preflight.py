"""The launcher's preflight: one process that checks a Megatron-LM job in seconds, before
torchrun or srun starts any rank, and lists every problem at once.

    python -m megatron_metp.megatron_lm.preflight [--world-size N] [--cpu] -- PRETRAIN_GPT_ARGS...

``scripts/pretrain_gpt.sh`` (and so the Slurm scripts) runs it from the Megatron-LM checkout
(relative paths resolve as the ranks will resolve them) with the exact ``pretrain_gpt.py``
arguments. It checks:

* the METP/Megatron flag combinations the hooks refuse inside the ranks
  (:func:`megatron_metp.megatron_lm.checks.metp_arg_problems`, the same code), the CPU-run
  refusals with ``--cpu`` (:func:`megatron_metp.megatron_lm.cpu_checks.cpu_arg_problems`), and
  Megatron's batch arithmetic (``--global-batch-size`` a multiple of micro-batch × DP);
* the data: each ``--data-path`` prefix has its ``.bin`` and ``.idx``, and ``--split`` leaves
  no built split of any prefix empty (:mod:`.indexed_data`; Megatron-LM's builder would loop
  forever on it), nor the train split out while ``--train-iters`` trains;
* the tokenizer's files (an HF folder needs ``tokenizer.json`` and ``tokenizer_config.json``;
  GPT2BPE its vocab and merge files; SentencePiece/TikToken their model file);
* the checkpoint to ``--load``: its tracker names an iteration that exists, and its optimizer
  state fits this run (METP against stock, distributed against plain optimizer); the iteration
  it resumes from (or ``--ckpt-step``'s) matches the checksums of its manifest, file by file
  (:mod:`.ckpt_manifest`; one without a manifest passes with a line saying it is unverified);
* the placement: no METP ring across two nodes (``--ranks-per-node``, default
  ``$GPUS_PER_NODE``: :mod:`megatron_metp.runtime.ring_nodes`);
* flags the checkout's release lacks (YaRN on core_v0.16.1:
  :func:`megatron_metp.megatron_lm.launch_checks.release_problems`), from the settings or
  after ``--`` alike.

Nothing is built, no process group made, Megatron not imported: the flags are read by a small
parser that knows only the flags checked, with Megatron-LM's defaults (the same in core_v0.16.1
and core_v0.19.0); everything else on the command line is ignored here. A good job prints one
``preflight: OK`` line on stderr and exits 0; a bad one prints each problem (the flag and the
fix) and exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import List, Optional, Sequence

from .indexed_data import SPLIT_NAMES, parse_blend, parse_split, read_index_header, split_ranges

__all__ = ["megatron_parser", "parse_megatron_args", "job_problems", "data_problems",
           "tokenizer_problems", "checkpoint_problems", "batch_problems", "main"]

_INT_NONE = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
             "--num-layers", "--decoder-first-pipeline-num-layers",
             "--decoder-last-pipeline-num-layers", "--recompute-num-layers", "--seq-length",
             "--num-experts", "--expert-tensor-parallel-size", "--mtp-num-layers",
             "--num-attention-heads", "--ffn-hidden-size", "--hidden-size", "--micro-batch-size",
             "--global-batch-size", "--train-iters", "--train-samples", "--eval-interval",
             "--vocab-size", "--ckpt-step", "--exit-duration-in-mins")
_INT_DEFAULT = {"--pipeline-model-parallel-size": 1, "--tensor-model-parallel-size": 1,
                "--context-parallel-size": 1, "--expert-model-parallel-size": 1,
                "--num-query-groups": 1, "--distributed-timeout-minutes": 10,
                "--eval-iters": 100, "--cpu-offloading-num-layers": 0}
_STR = {"--load": None, "--save": None, "--recompute-granularity": None,
        "--recompute-method": None, "--experimental-attention-variant": None,
        "--heterogeneous-layers-config-path": None, "--split": None, "--data-args-path": None,
        "--per-split-data-args-path": None, "--tokenizer-type": None, "--tokenizer-model": None,
        "--vocab-file": None, "--merge-file": None, "--window-size": None,
        "--normalization": "LayerNorm", "--distributed-backend": "nccl",
        "--transformer-impl": "transformer_engine", "--ckpt-format": "torch_dist",
        "--position-embedding-type": "learned_absolute"}
_TRUE = ("--finetune", "--mock-data", "--sequence-parallel", "--use-legacy-models",
         "--hybrid-context-parallel", "--multi-latent-attention", "--qk-l2-norm",
         "--rotary-interleaved", "--squared-relu", "--no-persist-layer-norm",
         "--group-query-attention", "--swiglu", "--recompute-activations",
         "--distribute-saved-activations", "--fine-grained-activation-offloading",
         "--tp-comm-overlap", "--use-flash-attn", "--sft", "--reset-attention-mask",
         "--eod-mask-loss", "--calculate-per-token-loss", "--use-distributed-optimizer",
         "--skip-train", "--full-validation", "--qk-layernorm", "--decrease-batch-size-if-needed")
_LISTS = ("--spec", "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


class _Parser(argparse.ArgumentParser):
    """Raises ``ValueError(message)`` instead of printing the usage and exiting."""

    def error(self, message):
        raise ValueError(message)


def megatron_parser() -> argparse.ArgumentParser:
    """A parser for the ``pretrain_gpt.py`` flags the preflight checks (Megatron-LM's names,
    destinations and defaults, read from both supported releases' parsers) and the METP flags
    (:func:`megatron_metp.megatron_lm.flags.add_metp_args`)."""
    from .flags import add_metp_args

    ap = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    for opt in _INT_NONE:
        ap.add_argument(opt, type=int, default=None)
    for opt, default in _INT_DEFAULT.items():
        ap.add_argument(opt, type=int, default=default)
    for opt, default in _STR.items():
        ap.add_argument(opt, default=default)
    for opt in _TRUE:
        ap.add_argument(opt, action="store_true")
    for opt in _LISTS:
        ap.add_argument(opt, nargs="*", default=None)
    ap.add_argument("--no-load-optim", action="store_true", default=None)
    ap.add_argument("--attention-dropout", type=float, default=0.1)
    ap.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--recompute-modules", nargs="+", default=None)
    ap.add_argument("--rampup-batch-size", nargs=3, default=None)
    ap.add_argument("--fp8-format", dest="fp8", default=None)
    ap.add_argument("--fp4-format", dest="fp4", default=None)
    ap.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                    action="store_false")
    ap.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                    dest="create_attention_mask_in_dataloader")
    from .moe_args import add_moe_preflight_flags

    add_moe_preflight_flags(ap)
    from ..megatron.variant_checks import add_variant_preflight_flags

    add_variant_preflight_flags(ap)  # attention sinks, window patterns, GLU offset / clamp
    return add_metp_args(ap)


def parse_megatron_args(argv: Sequence[str], world_size: int) -> argparse.Namespace:
    """The checked flags of a ``pretrain_gpt.py`` command line (the others ignored) with
    Megatron's derived defaults the checks need (``--ffn-hidden-size``, ``world_size``)."""
    args, _ = megatron_parser().parse_known_args(list(argv))
    args.world_size = world_size
    args.rank = 0
    if args.ffn_hidden_size is None and args.hidden_size is not None:  # as Megatron fills it in
        h = args.hidden_size
        args.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
    return args


# ------------------------------------------------------------------------------------ data

def _sequences(prefix: str, flag: str, out: List[str]) -> Optional[int]:
    """The sequence count of ``prefix`` (``None`` after appending the problem to ``out``)."""
    missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        files = " and ".join(prefix + ext for ext in missing)
        out.append(f"{flag}: {files} not found (a prefix names PREFIX.bin and PREFIX.idx, as "
                   f"Megatron-LM's tools/preprocess_data.py writes them, without the extension: "
                   f"e.g. /data/corpus_text_document; relative paths are taken from the "
                   f"Megatron-LM checkout, {os.getcwd()})")
        return None
    try:
        return read_index_header(prefix + ".idx").sequences
    except (OSError, ValueError) as exc:
        out.append(f"{flag}: {exc} (write it again with tools/preprocess_data.py)")
        return None


def data_problems(args) -> List[str]:
    """``--data-path`` / ``--split`` / per-split paths that would fail or hang Megatron-LM's
    dataset builder: missing or unreadable files, a built split of a prefix left empty, the
    train split left out of a run that trains."""
    out: List[str] = []
    if args.mock_data:
        return out
    for flag in ("--data-args-path", "--per-split-data-args-path"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path and not os.path.isfile(path):
            out.append(f"{flag} {path}: no such file")
    for name in SPLIT_NAMES:
        words = getattr(args, f"{name}_data_path")
        for _, prefix in parse_blend(words or []):
            n = _sequences(prefix, f"--{name}-data-path", out)
            if n == 0:
                out.append(f"--{name}-data-path: {prefix} holds no document (Megatron-LM's "
                           f"dataset builder would wait forever on it); give a non-empty one")
    if not args.data_path:
        return out
    split_text = args.split or "969, 30, 1"  # Megatron's legacy default
    try:
        fractions = parse_split(split_text)
    except ValueError as exc:
        return out + [f"{exc} (SPLIT in scripts/pretrain_gpt.sh)"]
    trains = not args.skip_train and bool(args.train_iters or args.train_samples)
    if fractions[0] <= 0 and trains:
        steps = (f"--train-iters {args.train_iters}" if args.train_iters else
                 f"--train-samples {args.train_samples}")
        out.append(f"--split {split_text} gives the train split no share, but the run trains "
                   f"({steps}); give train a positive weight, e.g. "
                   f"--split 98,1,1 (SPLIT in scripts/pretrain_gpt.sh)")
    for _, prefix in parse_blend(args.data_path):
        n = _sequences(prefix, "--data-path", out)
        if n is None:
            continue
        ranges = split_ranges(fractions, n)
        empty = [SPLIT_NAMES[i] for i, r in enumerate(ranges) if r is not None and r[1] <= r[0]]
        if not empty:
            continue
        got = ", ".join(f"{SPLIT_NAMES[i]} {'-' if r is None else r[1] - r[0]}"
                        for i, r in enumerate(ranges))
        weights = [float(w) for w in re.findall(r"[.0-9]+", split_text)] + [0.0, 0.0]
        zeroed = ",".join("0" if SPLIT_NAMES[i] in empty else f"{weights[i]:g}"
                          for i in range(3))
        need = 100.0 / n if n else 100.0
        out.append(f"--split {split_text} leaves the {' and '.join(empty)} split of {prefix} "
                   f"empty: it holds {n} documents ({got}), and Megatron-LM's dataset builder "
                   f"waits forever on an empty split. Give each built split at least one "
                   f"document (a share of {need:.2g} % is enough here) or weight 0 to leave it "
                   f"out, e.g. --split {zeroed} (SPLIT in scripts/pretrain_gpt.sh)")
    return out


# ------------------------------------------------------------------------------- tokenizer

#: an HF folder's files: one of the first group (what the tokenizer is) and one of the second
#: (its vocabulary)
_HF_CONFIG = ("tokenizer_config.json", "config.json")
_HF_VOCAB = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _looks_local(path: str) -> bool:
    """Whether a ``--tokenizer-model`` that does not exist was meant as a local path (not a
    Hugging Face hub name such as ``meta-llama/Llama-3.1-8B``)."""
    if path.startswith(("/", "./", "../", "~")):
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent)


def tokenizer_problems(args) -> List[str]:
    """Tokenizer flags whose files are missing (each naming the flag and what it needs)."""
    kind = args.tokenizer_type
    out: List[str] = []

    def need_file(flag: str, value: Optional[str], what: str) -> None:
        if not value:
            out.append(f"--tokenizer-type {kind} needs {flag} ({what})")
        elif not os.path.isfile(value):
            out.append(f"{flag} {value}: no such file ({what} for --tokenizer-type {kind})")

    if kind == "NullTokenizer":
        if args.vocab_size is None:
            out.append("--tokenizer-type NullTokenizer needs --vocab-size (VOCAB_SIZE in "
                       "scripts/pretrain_gpt.sh)")
    elif kind == "GPT2BPETokenizer":
        need_file("--vocab-file", args.vocab_file, "the GPT-2 vocab.json")
        need_file("--merge-file", args.merge_file, "the GPT-2 merges.txt")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        need_file("--vocab-file", args.vocab_file, "the WordPiece vocab.txt")
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                  "TikTokenizer"):
        need_file("--tokenizer-model", args.tokenizer_model, "the tokenizer model file")
    elif kind == "HuggingFaceTokenizer":
        path = args.tokenizer_model
        if not path:
            out.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a folder "
                       "written by tokenizer.save_pretrained, or a hub name; TOKENIZER_MODEL in "
                       "scripts/pretrain_gpt.sh)")
        elif os.path.isdir(path):
            files = set(os.listdir(path))
            if not files & set(_HF_CONFIG) or not files & set(_HF_VOCAB):
                lacks = [f for f in ("tokenizer.json", "tokenizer_config.json") if f not in files]
                out.append(f"--tokenizer-model {path}: the folder lacks {' and '.join(lacks)} "
                           f"(a Hugging Face tokenizer folder needs tokenizer.json and "
                           f"tokenizer_config.json, as tokenizer.save_pretrained(folder) writes "
                           f"them; it holds {', '.join(sorted(files)) or 'nothing'})")
        elif os.path.exists(path):
            out.append(f"--tokenizer-model {path}: a file; HuggingFaceTokenizer takes the folder "
                       f"holding tokenizer.json and tokenizer_config.json (or a hub name)")
        elif _looks_local(path):
            out.append(f"--tokenizer-model {path}: no such folder (relative paths are taken "
                       f"from the Megatron-LM checkout, {os.getcwd()})")
    return out


# ------------------------------------------------------------------------------ checkpoint

def checkpoint_problems(args, notes: Optional[List[str]] = None) -> List[str]:
    """A ``--load`` that names nothing loadable where a checkpoint is expected: a missing path
    other than ``--save`` (a first run's empty ``--save`` directory is fine), a tracker whose
    iteration directory is gone, an iteration whose files do not match its manifest
    (:func:`.ckpt_manifest.load_problems`; the line of one without a manifest goes to
    ``notes``). Optimizer-layout mismatches are
    :func:`megatron_metp.megatron_lm.resume.resume_layout_problems` (in the METP checks)."""
    from .resume import checkpoint_dir

    load = args.load
    if not load:
        return []
    same_as_save = args.save is not None and os.path.abspath(args.save) == os.path.abspath(load)
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isdir(load):
        if os.path.exists(load):
            return [f"--load {load}: a file, not a checkpoint directory"]
        if same_as_save:
            return []
        return [f"--load {load}: no such directory (give the directory --save wrote, the one "
                f"holding latest_checkpointed_iteration.txt; or drop --load to start from "
                f"scratch)"]
    if not os.path.isfile(tracker):
        if same_as_save:
            return []
        return [f"--load {load}: no latest_checkpointed_iteration.txt there, so Megatron-LM "
                f"would start from scratch; give the directory --save wrote (or drop --load)"]
    if checkpoint_dir(load) is None:
        with open(tracker) as fh:
            text = fh.read().strip()
        return [f"--load {load}: latest_checkpointed_iteration.txt names iteration {text!r}, "
                f"whose directory is missing (an interrupted save?); point the tracker at an "
                f"iteration directory that is there, or give another --load"]
    from .ckpt_manifest import load_problems

    return load_problems(load, getattr(args, "ckpt_step", None), notes=notes)


# ------------------------------------------------------------------------------ batch size

def batch_problems(args) -> List[str]:
    """Megatron's batch arithmetic: the global batch a multiple of micro-batch × DP (unless
    Megatron adjusts it itself: ``--decrease-batch-size-if-needed``, ``--rampup-batch-size``)."""
    if args.decrease_batch_size_if_needed or args.rampup_batch_size:
        return []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size * max(args.metp_parallel_size or 1, 1)
    model = tp * pp * cp
    if model < 1 or args.world_size % model:
        return []  # the layout problem is reported by the METP/Megatron checks
    dp = args.world_size // model
    mbs, gbs = args.micro_batch_size or 1, args.global_batch_size
    if gbs is not None and gbs % (mbs * dp):
        return [f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
                f"data-parallel size {dp} = {mbs * dp} (DP = {args.world_size} ranks / "
                f"(TP {tp} x METP x CP {cp} x PP {pp})); change GLOBAL_BATCH_SIZE or "
                f"MICRO_BATCH_SIZE"]
    return []


def _layout_problems(args) -> List[str]:
    """Megatron's own world-size check, for a job without METP (METP's is in the hooks)."""
    if (args.metp_parallel_size or 1) > 1:
        return []
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * \
        args.context_parallel_size
    if model >= 1 and args.world_size % model:
        return [f"world size {args.world_size} is not divisible by TP x PP x CP = {model}; "
                f"change --tensor-model-parallel-size / --pipeline-model-parallel-size / "
                f"--context-parallel-size or the number of ranks"]
    return []


# ------------------------------------------------------------------------------------ main

def _output_discarding_recompute_problems(args) -> List[str]:
    """GPU ranks: selective ``layernorm`` recompute without Transformer Engine (megatron-core's
    ``CheckpointWithoutOutput`` calls TE's fp8 state whatever its ``fp8`` argument and stops at
    a ``NameError`` without TE; on CPU ranks a shim switches it off: megatron/cpu.py (k))."""
    import importlib.util

    from ..megatron.selective import selective_modules

    selective = getattr(args, "recompute_granularity", None) == "selective" or \
        getattr(args, "recompute_activations", False)
    if not selective or "layernorm" not in selective_modules(
            getattr(args, "recompute_modules", None)):
        return []
    if importlib.util.find_spec("transformer_engine") is not None:
        return []
    return ["--recompute-modules layernorm needs Transformer Engine on GPU ranks (Megatron's "
            "output-discarding checkpoint reads its fp8 state) and it is not installed here: "
            "install transformer-engine, or drop layernorm"]


def _node_problems(args, ranks_per_node: Optional[int]) -> List[str]:
    """A METP ring that would span two nodes of ``ranks_per_node`` ranks each
    (:func:`megatron_metp.runtime.ring_nodes.cross_node_problems`; the ranks check the real
    node names again at start-up)."""
    if not ranks_per_node:
        return []
    from ..runtime.ring_nodes import cross_node_problems

    return cross_node_problems(args.world_size, args.tensor_model_parallel_size,
                               args.metp_parallel_size or 1, ranks_per_node)


def job_problems(argv: Sequence[str], world_size: int, cpu: bool = False,
                 notes: Optional[List[str]] = None,
                 ranks_per_node: Optional[int] = None) -> List[str]:
    """Every problem of the job ``pretrain_gpt.py argv`` on ``world_size`` ranks
    (``ranks_per_node`` on each node, numbered node by node; ``None``: one node; ``cpu``: on CPU
    ranks), each naming the flag and the fix; empty for a good job. Lines worth saying that are
    no problem (a checkpoint loaded unverified) go to ``notes``."""
    from .checks import metp_arg_problems

    try:
        args = parse_megatron_args(argv, world_size)
    except ValueError as exc:  # a checked flag with a value Megatron's parser would refuse too
        return [f"{exc}"]
    out = metp_arg_problems(args) + _layout_problems(args) + batch_problems(args)
    out += _node_problems(args, ranks_per_node)
    if cpu:
        from .cpu_checks import cpu_arg_problems

        out += [f"on CPU ranks (METP_CPU=1): {p}" for p in cpu_arg_problems(args)]
    else:
        out += _output_discarding_recompute_problems(args)
    out += data_problems(args) + tokenizer_problems(args) + checkpoint_problems(args, notes)
    from .launch_checks import release_problems  # flags this checkout's release lacks (YaRN)

    out += release_problems(argv)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        own, megatron = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    else:  # only pretrain_gpt.py arguments, or only -h/--help
        own, megatron = ([], argv) if argv[:1] not in (["-h"], ["--help"]) else (argv, [])
    ap = argparse.ArgumentParser(
        prog="python -m megatron_metp.megatron_lm.preflight",
        description="Check a pretrain_gpt.py job in one process before any rank starts: every "
                    "problem at once, each with its fix. Options first, then -- and the exact "
                    "pretrain_gpt.py arguments.")
    ap.add_argument("--world-size", type=int,
                    default=int(os.environ.get("WORLD_SIZE", "1") or 1),
                    help="ranks of the job (default $WORLD_SIZE, else 1)")
    ap.add_argument("--cpu", action="store_true", help="the job runs on CPU ranks (METP_CPU=1)")
    per_node = os.environ.get("GPUS_PER_NODE", "").strip()
    ap.add_argument("--ranks-per-node", type=int,
                    default=int(per_node) if per_node.isdigit() else None,
                    help="ranks on each node (default $GPUS_PER_NODE, which the Slurm scripts "
                         "export; unset: one node): a METP ring across two nodes is refused")
    opts = ap.parse_args(own)
    start = time.perf_counter()
    notes: List[str] = []
    try:
        problems = job_problems(megatron, opts.world_size, cpu=opts.cpu, notes=notes,
                                ranks_per_node=opts.ranks_per_node)
    except Exception as exc:  # noqa: BLE001 - a bug here must not stop a job the ranks check
        print(f"preflight: warning: the check itself failed ({type(exc).__name__}: {exc}); "
              f"going on, the ranks check the flags again", file=sys.stderr)
        return 0
    took = time.perf_counter() - start
    for note in notes:
        print(f"preflight: {note}", file=sys.stderr)
    if not problems:
        ranks = f"{opts.world_size} rank{'s' if opts.world_size != 1 else ''}"
        print(f"preflight: OK ({ranks}; checked in {took:.1f} s)",
              file=sys.stderr)
        return 0
    print(f"preflight: {len(problems)} problem{'s' if len(problems) > 1 else ''} in this job; "
          f"no rank was started:", file=sys.stderr)
    for i, problem in enumerate(problems, 1):
        print(f"  {i}. {problem}", file=sys.stderr)
    print("Fix them and launch again (the same checks run inside the ranks when pretrain_gpt.py "
          "is started directly).", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
