# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny GPT for CPU runs and tests: METP 2 x CP 2 on 4 CPU ranks (--context-parallel-size is the
# outer factor: Megatron's CP group has METP x CP = 4 ranks, the sequence is split over all 4,
# the weights over each METP ring of 2; world = TP x METP x CP x PP x DP = 1 x 2 x 2 x 1 x 1).
# Twin for scripts/compare_tp.sh: tiny-cpu-tp2.sh (stock TP 2 on 2 ranks: METP draws its shards
# as stock TP of size TP x METP = 2 does, and both have DP 1, so Megatron's sampler feeds both
# the same global batches in the same order).
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny.sh"
: "${SEQ_LENGTH:=256}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=4}"
: "${METP:=2}" "${CP:=2}" "${TP:=1}" "${PP:=1}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=2}" "${TRAIN_ITERS:=10}" "${TRANSFORMER_IMPL:=local}"
: "${METP_CPU:=1}" "${PRECISION:=fp32}"  # CPU ranks with gloo (scripts/pretrain_gpt.sh)
# core_v0.16.1's distributed optimizer resumes only with Apex/TE's Adam (not on CPU ranks)
: "${DISTRIBUTED_OPTIMIZER:=0}"
TWIN_CONFIG=tiny-cpu-tp2.sh
