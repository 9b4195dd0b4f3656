# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Stock twin of tiny-cpu-metp2-ep4-moe.sh: the tiny MoE model on 4 CPU ranks, DP 4 with
# expert-model-parallel 4 (one of the 4 experts per rank, as the METP run places them).
# Values here are defaults: anything already set in the environment wins.
: "${GPUS_PER_NODE:=4}" "${GLOBAL_BATCH_SIZE:=4}" "${EP:=4}"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-ep2-moe.sh"
TWIN_CONFIG=tiny-cpu-metp2-ep4-moe.sh
