# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny GPT for CPU dry runs and tests: METP 2 on 2 ranks (python -m megatron_metp.dry_run runs it in seconds).
# Twin for scripts/compare_tp.sh: tiny-cpu-tp2.sh
# Values here are defaults: anything already set in the environment wins (e.g. NNODES=2 TP=2).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=2}"
: "${METP:=2}" "${TP:=1}" "${PP:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
TWIN_CONFIG=tiny-cpu-tp2.sh
