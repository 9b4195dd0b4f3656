# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# The tiny MoE model on 4 CPU ranks: METP 2 x DP 2 with expert parallelism wider than the METP
# group, EP 4 = 2p (megatron/wide_ep.py): each rank holds one of the 4 experts, the experts
# reduce over expert-DP (1 rank), the METP-sharded weights over METP-DP (the 2 METP rings).
# Its stock twin: tiny-cpu-ep4-moe.sh (DP 4, EP 4: the same expert on each rank).
# Values here are defaults: anything already set in the environment wins.
: "${GPUS_PER_NODE:=4}" "${GLOBAL_BATCH_SIZE:=4}" "${EP:=4}"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-metp2-moe.sh"
EXTRA_ARGS=("${EXTRA_ARGS[@]}" --expert-model-parallel-size "$EP")
TWIN_CONFIG=tiny-cpu-ep4-moe.sh
