# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny Llama (configs/models/tiny-llama.sh) on 2 CPU ranks with stock TP 2, without sequence
# parallelism (Megatron's local layers need apex's norms for it on CPU).
# Twin for scripts/compare_tp.sh: tiny-cpu-llama-metp2.sh
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-llama.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=2}"
: "${METP:=1}" "${TP:=2}" "${PP:=1}" "${SEQUENCE_PARALLEL:=0}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
TWIN_CONFIG=tiny-cpu-llama-metp2.sh
