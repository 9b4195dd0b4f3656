# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Llama-3-8B at 6M tokens (6,291,456) on one node of 8 GPUs: METP 8 with the vocabulary on the ring,
# full activation recompute of one layer per checkpoint, which METP runs as its streaming layer op
# (megatron_metp/megatron/streaming.py): each layer keeps only its input, on pinned host memory,
# and re-forms one head group and one tile of tokens at a time (auto tiles: 17 query tiles of
# 46K tokens, 70 row tiles of 11K, K/V sub-blocks of 157K keys). Each rank: 1/8 of every weight, 768K
# tokens. The first 4 layers also keep their attention output O and its log-sum-exp on the host
# (--metp-keep-attention-output 4: their attention forward runs once), as many as the node's 2 TB
# holds: 231 GiB of pinned host memory per rank, 1,851 GiB per node (planned).
# Twin for scripts/compare_tp.sh: llama3-8b-6m-cp8.sh (stock Megatron context parallelism).
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"
: "${SEQ_LENGTH:=6291456}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
EXTRA_ARGS=(--metp-keep-attention-output 4 ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=llama3-8b-6m-cp8.sh
