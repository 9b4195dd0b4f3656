# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Stock TP 2 twin of tiny-cpu-metp2-packed.sh: the same packed mock documents; Megatron honours
# --reset-attention-mask only through the dataloader's dense [b, 1, s, s] mask
# (DATALOADER_ATTENTION_MASK=1), which its local attention applies.
# Twin for scripts/compare_tp.sh: tiny-cpu-metp2-packed.sh
: "${PACKED_SEQUENCES:=1}" "${MOCK_MAX_DOCUMENT_LENGTH:=64}" "${DATALOADER_ATTENTION_MASK:=1}"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-tp2.sh"
TWIN_CONFIG=tiny-cpu-metp2-packed.sh
