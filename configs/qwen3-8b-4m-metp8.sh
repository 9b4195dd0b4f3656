# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Qwen3-8B at 4M tokens (4,194,304) on one node of 8 GPUs: METP 8 with the vocabulary on the ring,
# full activation recompute and the layer inputs offloaded to pinned host memory, as
# llama3-8b-4m-metp8.sh. The length is metp plan's: on 8 x H100-80GB the longest sequence this
# job fits is 4,745K tokens (69.7 GiB per rank planned at 4,194,304). Start from the Hugging Face
# checkpoint with `python -m megatron_metp.tools.hf import --hf-dir Qwen3-8B --out CKPT
# --metp-parallel-size 8` and pass --pretrained-checkpoint CKPT (the import's model.sh has the
# same geometry). Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3-8b.sh"
: "${SEQ_LENGTH:=4194304}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
TWIN_CONFIG=qwen3-8b-4m-cp8.sh
