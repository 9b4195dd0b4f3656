# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Qwen3-30B-A3B at 1M tokens (1,048,576) on one node of 8 x H100-80GB as
# qwen3-30b-a3b-1m-metp4-cp2.sh (METP 4 x CP 2, the vocabulary ring, MoE token tiles, full
# activation recompute, the layer inputs offloaded to pinned host memory and Megatron's optimizer
# on the host), with the 128 experts sharded over both METP rings of a CP group: EP 8, wider than
# METP (megatron/wide_ep.py; 16 experts per rank, expert-DP 1, the METP-sharded gradients summed
# over their 2 replicas). metp plan --config this file: 30.93 GiB per rank (EP 4: 51.18), 674 GiB
# of host memory per node; the longest sequence this layout fits is 6,766.25K tokens (EP 4:
# 4,295.75K). Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3-30b-a3b.sh"
: "${SEQ_LENGTH:=1048576}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=4}" "${CP:=2}" "${TP:=1}" "${PP:=1}" "${EP:=8}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
EXTRA_ARGS=("${MOE_ARGS[@]}" --expert-model-parallel-size "$EP" --optimizer-cpu-offload
            --optimizer-offload-fraction 1.0 --use-precision-aware-optimizer
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=qwen3-30b-a3b-1m-tp4-cp2-ep8.sh
