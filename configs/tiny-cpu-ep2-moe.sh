# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny MoE GPT (configs/models/tiny-moe.sh) on 2 CPU ranks, stock Megatron: data parallel 2 with
# the experts sharded over both ranks (expert-model-parallel size 2, TP 1). The vocabulary is
# padded as METP 2 pads it (to a multiple of 128 x 2; NullTokenizer's 1024 + EOD -> 1280 rows).
# Twin for scripts/compare_tp.sh: tiny-cpu-metp2-moe.sh
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-moe.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=2}"
: "${METP:=1}" "${TP:=1}" "${PP:=1}" "${EP:=2}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
EXTRA_ARGS=("${MOE_ARGS[@]}" --expert-model-parallel-size "$EP" --make-vocab-size-divisible-by 256
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=tiny-cpu-metp2-moe.sh
