# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Llama-3-8B at 16M tokens (16,777,216) on 4 nodes of 8 GPUs (32 GPUs): METP 8 × CP 4. Megatron's
# context-parallel group has METP·CP = 32 ranks and the sequence is split over all of them (512K
# tokens per rank); every weight is sharded over the 8 ranks of one node's METP ring only (the
# weight ring and head-group broadcasts stay on NVLink), the K/V ring of each head group runs over
# all 32 ranks (4 hops of it on InfiniBand). CP=4 is the outer factor: world = TP × METP × CP × PP
# × DP = 1 × 8 × 4 × 1 × 1. Vocabulary on the ring, full activation recompute, layer inputs
# offloaded to pinned host memory; the first 23 layers also keep their attention output O and its
# log-sum-exp there (--metp-keep-attention-output 23: their attention forward runs once), as many
# as the node's 2 TB holds (231 GiB per rank, 1,851 GiB per node, planned).
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"
: "${SEQ_LENGTH:=16777216}"
: "${NNODES:=4}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${CP:=4}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
EXTRA_ARGS=(--metp-keep-attention-output 23 ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=llama3-8b-16m-cp32.sh
