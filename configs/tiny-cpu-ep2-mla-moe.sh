# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny DeepSeek-shaped MoE GPT with multi-latent attention (configs/models/tiny-mla-moe.sh) on 2
# CPU ranks, stock Megatron: data parallel 2, the experts over both ranks (EP 2, TP 1), the
# vocabulary padded as METP 2 pads it.
# Twin for scripts/compare_tp.sh: tiny-cpu-metp2-mla-moe.sh
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-mla-moe.sh"
: "${TP:=1}" "${EP:=2}"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-tp2.sh"  # its layout with TP 1: DP 2
EXTRA_ARGS=("${MLA_MOE_ARGS[@]}" --expert-model-parallel-size "$EP" --make-vocab-size-divisible-by 256
            ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TWIN_CONFIG=tiny-cpu-metp2-mla-moe.sh
