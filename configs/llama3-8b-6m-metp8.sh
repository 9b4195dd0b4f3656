# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Llama-3-8B at 6M tokens (6,291,456) on one node of 8 GPUs: METP 8 with the vocabulary on the ring,
# full activation recompute, the layer inputs offloaded to pinned host memory and brought back
# when each layer's backward starts (METP_OFFLOAD_PREFETCH=0: one layer input on the GPU), the
# METP MLP in token tiles (auto: ~24K token rows per pass of its weight ring). Each rank: 1/8 of
# every weight, 768K tokens; 198 GiB of pinned host memory per rank, 1,587 GiB per node.
# Twin for scripts/compare_tp.sh: llama3-8b-6m-cp8.sh (stock Megatron context parallelism).
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"
: "${SEQ_LENGTH:=6291456}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}" "${METP_OFFLOAD_PREFETCH:=0}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
TWIN_CONFIG=llama3-8b-6m-cp8.sh
