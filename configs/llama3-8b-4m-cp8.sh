# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Twin of llama3-8b-4m-metp8.sh with what a Megatron user picks instead on the same 8 GPUs: stock
# context parallelism CP 8 (TP 1: every rank holds the whole model), the same full recompute and
# the same host offload of the layer inputs. It needs Transformer Engine (Megatron's CP attention).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"
: "${SEQ_LENGTH:=4194304}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=1}" "${TP:=1}" "${PP:=1}" "${CP:=8}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}" "${METP_OFFLOAD_LAYERS:=28}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
TWIN_CONFIG=llama3-8b-4m-metp8.sh
