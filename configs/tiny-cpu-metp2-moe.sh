# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny MoE GPT (configs/models/tiny-moe.sh) on 2 CPU ranks with METP 2: METP attention and dense
# MLP, Megatron's MoELayer with its 4 experts sharded over the METP ring (expert-model-parallel
# size 2, set by the METP hooks), DP 1.
# Twin for scripts/compare_tp.sh: tiny-cpu-ep2-moe.sh (stock Megatron, TP 1, DP 2 with the
# experts over the same 2 ranks, EP 2). Both hold the same experts on the same rank and see the
# same global batch of 2 samples (METP: 2 micro-batches of one sample split over the ring; stock:
# one sample per DP rank); --calculate-per-token-loss sums the same tokens, and both draw their
# weights with --use-cpu-initialization from the same default CPU generator, so the losses agree
# from iteration 1.
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-moe.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=2}"
: "${METP:=2}" "${TP:=1}" "${PP:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
EXTRA_ARGS=("${MOE_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=tiny-cpu-ep2-moe.sh
