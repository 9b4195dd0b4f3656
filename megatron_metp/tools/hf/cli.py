"""The command line of the Hugging Face converter: ``import``, ``export`` and ``flags``
(:func:`main`; ``python -m megatron_metp.tools.hf`` and ``metp hf`` run it). The work is
:mod:`.convert`'s (:func:`.convert.import_hf`, :func:`.convert.export_hf`) and
:mod:`.config`'s (the flags)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..helptext import HF_DESCRIPTION
from .config import geometry_from_hf, megatron_args, read_hf_config
from .convert import export_hf, import_hf


def _add_padding_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                    help="as the run's Megatron flag (default 128)")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1,
                    help="TP of the run (default 1)")
    ap.add_argument("--metp-parallel-size", type=int, default=1,
                    help="METP size of the run (default 1). Megatron pads the vocabulary to a "
                         "multiple of divisible-by x TP x METP; heads, K/V groups and FFN must "
                         "divide by TP x METP")
    ap.add_argument("--seq-length", type=int, default=None,
                    help="the longest sequence the run trains on; needed only for a model with "
                         "a sliding window shorter than max_position_embeddings (then at most "
                         "the window; the run's --max-position-embeddings becomes the window)")


def main(argv: Optional[List[str]] = None, prog: str = "python -m megatron_metp.tools.hf") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=HF_DESCRIPTION)  # plain text (helptext)
    sub = ap.add_subparsers(dest="cmd", required=True)
    im = sub.add_parser("import", help="Hugging Face checkpoint -> Megatron torch_dist checkpoint")
    im.add_argument("--hf-dir", required=True, help="config.json + *.safetensors")
    im.add_argument("--out", required=True, help="checkpoint directory to write (pretrain_gpt.py --load)")
    im.add_argument("--force", action="store_true", help="replace a non-empty --out")
    _add_padding_args(im)
    ex = sub.add_parser("export", help="Megatron torch_dist checkpoint -> Hugging Face checkpoint")
    ex.add_argument("--load", required=True, help="checkpoint directory (as pretrain_gpt.py --load/--save)")
    ex.add_argument("--out", required=True, help="directory for model.safetensors + config.json "
                                                "(+ the tokenizer files)")
    ex.add_argument("--hf-config", help="config.json (or its directory) of the model; default "
                                        "LOAD/hf/ written by import, else one written from the "
                                        "checkpoint's saved Megatron-LM arguments")
    ex.add_argument("--iteration", type=int, help="iteration to export (default: the tracker's)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the written tensors (default: the checkpoint's embedding's)")
    ex.add_argument("--tokenizer", help="Hugging Face tokenizer folder to write beside the "
                                        "weights; default the run's --tokenizer-model (a "
                                        "HuggingFaceTokenizer folder), else LOAD/hf/'s")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ex.add_argument("--transformers-layout", type=int, choices=[4, 5],
                    help="write config.json as transformers 4.x (rope_theta, rope_scaling) or "
                         "5.x (rope_parameters) writes it (default: the installed "
                         "transformers' major version)")
    fl = sub.add_parser("flags", help="print the Megatron-LM flags of a Hugging Face config")
    fl.add_argument("--hf-dir", required=True)
    _add_padding_args(fl)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            import_hf(args.hf_dir, args.out,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      tensor_model_parallel_size=args.tensor_model_parallel_size,
                      metp_parallel_size=args.metp_parallel_size, force=args.force,
                      seq_length=args.seq_length)
        elif args.cmd == "export":
            export_hf(args.load, args.out, hf_config=args.hf_config, iteration=args.iteration,
                      dtype=args.dtype, tokenizer=args.tokenizer, force=args.force,
                      transformers_layout=args.transformers_layout)
        else:
            g = geometry_from_hf(read_hf_config(args.hf_dir),
                                 make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                 tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 metp_parallel_size=args.metp_parallel_size,
                                 seq_length=args.seq_length)
            print(" ".join(megatron_args(g)))
    except ValueError as exc:
        print(f"{prog} {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["main"]
