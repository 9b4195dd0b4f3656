# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny GPT for CPU runs, dry runs and tests: stock TP 2 on 2 CPU ranks. Without sequence
# parallelism: Megatron's local layers need apex's norms for it (torch's LayerNorm refuses it),
# and the losses are the same either way (TP+SP is the twin of the GPU configs).
# Twin for scripts/compare_tp.sh: tiny-cpu-metp2.sh
# Values here are defaults: anything already set in the environment wins (e.g. NNODES=2 TP=2).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=2}"
: "${METP:=1}" "${TP:=2}" "${PP:=1}" "${SEQUENCE_PARALLEL:=0}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
TWIN_CONFIG=tiny-cpu-metp2.sh
