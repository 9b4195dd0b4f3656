# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny MoE GPT (configs/models/tiny-moe.sh) on 4 CPU ranks with METP 2 x CP 2, the layout of
# tiny-cpu-metp2-cp2.sh: each sample split over 4 ranks, the 4 experts over each METP ring of 2
# (expert-model-parallel size 2, expert data parallelism over the 2 rings).
# Twin for scripts/compare_tp.sh: tiny-cpu-ep2-moe.sh (stock DP 2 x EP 2 on 2 ranks: the same
# experts per expert-parallel rank, the same global batch).
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-moe.sh"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-metp2-cp2.sh"  # its tiny.sh defaults no longer apply
EXTRA_ARGS=("${MOE_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=tiny-cpu-ep2-moe.sh
