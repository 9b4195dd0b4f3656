# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny MoE GPT (configs/models/tiny-moe.sh) on 2 CPU ranks with METP 2, the layout of
# tiny-cpu-metp2.sh: METP attention and dense MLP, Megatron's MoELayer with its 4 experts sharded
# over the METP ring (expert-model-parallel size 2, set by the METP hooks), DP 1.
# Twin for scripts/compare_tp.sh: tiny-cpu-ep2-moe.sh (stock Megatron, TP 1, DP 2 with the
# experts over the same 2 ranks, EP 2). Both hold the same experts on the same rank and see the
# same global batch of 2 samples (METP: 2 micro-batches of one sample split over the ring; stock:
# one sample per DP rank); --calculate-per-token-loss sums the same tokens, and both draw their
# weights with --use-cpu-initialization from the same default CPU generator, so the losses agree
# from iteration 1.
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-moe.sh"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-metp2.sh"  # its tiny.sh defaults no longer apply
EXTRA_ARGS=("${MOE_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=tiny-cpu-ep2-moe.sh
