# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny Llama (configs/models/tiny-llama.sh: RMSNorm, SwiGLU, RoPE, GQA, untied, no biases) trained
# from scratch on 2 CPU ranks at METP 2; export the saved checkpoint to Hugging Face with
# `python -m megatron_metp.tools.hf export --load CHECKPOINT_PATH --out DIR` (docs/huggingface.md).
# Twin for scripts/compare_tp.sh: tiny-cpu-llama-tp2.sh
# Values here are defaults: anything already set in the environment wins (e.g. TRAIN_ITERS=50).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-llama.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=2}"
: "${METP:=2}" "${TP:=1}" "${PP:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
TWIN_CONFIG=tiny-cpu-llama-tp2.sh
