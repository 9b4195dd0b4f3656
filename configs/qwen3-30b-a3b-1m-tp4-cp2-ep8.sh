# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Twin of qwen3-30b-a3b-1m-metp4-cp2.sh with stock Megatron's best layout on the same 8 GPUs
# (metp plan --reach --preset qwen3-30b-a3b --gpus 8: TP 4 + SP x CP 2 with the 128 experts over
# all 8 ranks, EP 8 by parallel folding, expert TP 1), the same full recompute, host offload of
# the layer inputs and optimizer on the host. It does not fit at this length: metp plan says
# 139.2 GiB per rank, 75 GiB of it the fp32 logits of the loss [131,072 tokens, 37,984 rows]
# and one MoE layer's routed tokens (1,048,576 rows per rank) in its backward; its longest
# sequence is ~498K tokens. It needs Transformer Engine (Megatron's CP attention).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3-30b-a3b.sh"
: "${SEQ_LENGTH:=1048576}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=1}" "${TP:=4}" "${CP:=2}" "${PP:=1}" "${EP:=8}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
# EP 8 over TP 4 × CP 2 = 8 GPUs: each expert whole on one rank (expert TP 1; Megatron's default
# expert TP is TP = 4, and 4 × 8 does not fit 8 GPUs), as metp plan counts the stock experts
EXTRA_ARGS=("${MOE_ARGS[@]}" --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
            --optimizer-cpu-offload
            --optimizer-offload-fraction 1.0 --use-precision-aware-optimizer
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=qwen3-30b-a3b-1m-metp4-cp2.sh
