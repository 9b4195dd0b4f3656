# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Twin of deepseek-v2-lite-7m-metp8.sh with stock Megatron's best layout on the same 8 GPUs
# (metp plan --reach --preset deepseek-v2-lite --gpus 8: TP 4 + SP x CP 2 with the 64 experts over
# all 8 ranks, EP 8 by parallel folding, expert TP 1), the same full recompute, host offload of
# the layer inputs and optimizer on the host. Its context-parallel ring passes every head's
# up-projected K and V (4 heads x (192 + 128) = 1,280 values per token per step at TP 4, against
# METP's 576-value latent). It does not fit at this length: metp plan --config this file says
# 564 GiB per rank, most of it the loss's fp32 logits [3.7M tokens per rank, 25,600 rows];
# its longest sequence is about 860K tokens. It needs Transformer Engine (Megatron's CP
# attention, and its MLA core attention).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/deepseek-v2-lite.sh"
: "${SEQ_LENGTH:=7340032}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=1}" "${TP:=4}" "${CP:=2}" "${PP:=1}" "${EP:=8}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
# EP 8 over TP 4 × CP 2 = 8 GPUs: each expert whole on one rank (expert TP 1), as metp plan
# counts the stock experts
EXTRA_ARGS=("${MLA_ARGS[@]}" "${MOE_ARGS[@]}" --expert-model-parallel-size "$EP"
            --expert-tensor-parallel-size 1 --optimizer-cpu-offload
            --optimizer-offload-fraction 1.0 --use-precision-aware-optimizer
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=deepseek-v2-lite-7m-metp8.sh
