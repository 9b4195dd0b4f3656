# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Qwen3-30B-A3B at 1M tokens (1,048,576) on one node of 8 x H100-80GB: METP 4 x CP 2 (METP's
# group is capped by the 4 K/V groups; the sequence over all 8 ranks, attention and the
# vocabulary ring over METP's 4, the 128 experts sharded over the METP group: EP = 4, expert-DP =
# CP 2), the vocabulary on the ring, MoE token tiles (auto: the routed part of each MoE layer in
# tiles of the 1 GiB METP_TILE_BUDGET_MIB), full activation recompute, the layer inputs offloaded
# to pinned host memory and Megatron's optimizer on the host, as the dense long-context configs
# do. metp plan --config this file: 51.2 GiB per rank, 651 GiB of host memory per node; the
# longest sequence this layout fits is 4,295.75K tokens (the same with EP 8,
# qwen3-30b-a3b-1m-metp4-cp2-ep8.sh, is metp plan --reach --preset qwen3-30b-a3b --gpus 8's
# best: 6,766.25K). Stock Megatron's best layout on the same GPUs (the twin) needs
# 139.2 GiB per rank here. Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3-30b-a3b.sh"
: "${SEQ_LENGTH:=1048576}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=4}" "${CP:=2}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
EXTRA_ARGS=("${MOE_ARGS[@]}" --optimizer-cpu-offload --optimizer-offload-fraction 1.0
            --use-precision-aware-optimizer
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=qwen3-30b-a3b-1m-tp4-cp2-ep8.sh
