# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny DeepSeek-shaped MoE GPT with multi-latent attention (configs/models/tiny-mla-moe.sh) on 2
# CPU ranks with METP 2: METP's MLA (the latent on the K/V ring), the shared expert as METP's MLP,
# the 4 routed experts sharded over the METP ring (EP 2), DP 1.
# Twin for scripts/compare_tp.sh: tiny-cpu-ep2-mla-moe.sh (stock Megatron MLA, DP 2, EP 2), as
# tiny-cpu-metp2-moe.sh and tiny-cpu-ep2-moe.sh pair: the same experts on the same ranks, the same
# global batch, the same weights, the same losses from iteration 1.
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-mla-moe.sh"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-metp2.sh"  # its tiny.sh defaults no longer apply
EXTRA_ARGS=("${MLA_MOE_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=tiny-cpu-ep2-mla-moe.sh
