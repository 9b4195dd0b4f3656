# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Twin of llama3-8b-16m-metp8-cp4.sh with what a Megatron user picks instead on the same 32 GPUs
# (4 nodes of 8): stock context parallelism CP 32 (TP 1: every rank holds the whole model), the
# same full recompute and host offload of the layer inputs. It needs Transformer Engine
# (Megatron's CP attention). `metp plan --reach --gpus 32 --preset llama3-8b` says how far stock
# Megatron's best layout reaches (it does not fit 16M: the point of the comparison).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/llama3-8b.sh"
: "${SEQ_LENGTH:=16777216}"
: "${NNODES:=4}" "${GPUS_PER_NODE:=8}"
: "${METP:=1}" "${TP:=1}" "${PP:=1}" "${CP:=32}"
: "${RECOMPUTE_GRANULARITY:=full}" "${RECOMPUTE_METHOD:=uniform}" "${RECOMPUTE_NUM_LAYERS:=1}"
: "${METP_OFFLOAD_ACTIVATIONS:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
TWIN_CONFIG=llama3-8b-16m-metp8-cp4.sh
