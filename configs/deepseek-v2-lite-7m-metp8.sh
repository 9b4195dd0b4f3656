# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# DeepSeek-V2-Lite at 7M tokens (7,340,032) on one node of 8 x H100-80GB: METP 8 (the 16 heads in
# 8 head groups; the latent ring passes 576 values per token per step, docs/mla.md), the 64
# experts sharded over the METP group (EP 8), the vocabulary on the ring, MoE token tiles, full
# activation recompute, the layer inputs offloaded to pinned host memory and Megatron's optimizer
# on the host. The longest sequence this layout fits is 7,928K tokens (metp plan --reach --preset
# deepseek-v2-lite --gpus 8); stock Megatron's best on the same GPUs (TP 4 + SP x CP 2 x EP 8)
# reaches 860K. Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/deepseek-v2-lite.sh"
: "${SEQ_LENGTH:=7340032}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
EXTRA_ARGS=("${MLA_ARGS[@]}" "${MOE_ARGS[@]}" --optimizer-cpu-offload
            --optimizer-offload-fraction 1.0 --use-precision-aware-optimizer
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=deepseek-v2-lite-7m-tp4-cp2-ep8.sh
