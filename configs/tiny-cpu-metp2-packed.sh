# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny GPT with packed documents on CPU: tiny-cpu-metp2.sh plus --reset-position-ids
# --reset-attention-mask --eod-mask-loss (PACKED_SEQUENCES=1). Mock documents of 1..63 tokens,
# so every 256-token sample holds several. METP derives each micro-batch's document boundaries
# from the EOD tokens (no [s, s] mask is built).
# Twin for scripts/compare_tp.sh: tiny-cpu-tp2-packed.sh (stock TP with the dataloader's mask)
: "${PACKED_SEQUENCES:=1}" "${MOCK_MAX_DOCUMENT_LENGTH:=64}"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-metp2.sh"
TWIN_CONFIG=tiny-cpu-tp2-packed.sh
