# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Llama-3-8B at 4M tokens (4,194,304) on one node of 8 GPUs: METP 8 with the vocabulary on the ring,
# full activation recompute of one layer per checkpoint, which METP runs as its streaming layer op
# (megatron_metp/megatron/streaming.py: every layer keeps only its input, on pinned host memory,
# and re-forms one head group and one tile of tokens at a time). Each rank: 1/8 of every weight,
# 512K tokens. Every layer keeps its attention output O and log-sum-exp for the backward
# (--metp-keep-attention-output: no attention forward runs twice); the first 28 layers of the 32
# keep their input, O and log-sum-exp on the host (METP_OFFLOAD_LAYERS=28: 1,854 GiB per node
# planned, of the node's 2 TB), the last 4 on the GPU (61.2 GiB per rank planned).
# Twin for scripts/compare_tp.sh: llama3-8b-4m-cp8.sh (stock Megatron context parallelism).
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"
: "${SEQ_LENGTH:=4194304}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}" "${METP_OFFLOAD_LAYERS:=28}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
EXTRA_ARGS=(--metp-keep-attention-output ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=llama3-8b-4m-cp8.sh
