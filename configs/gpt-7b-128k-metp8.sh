# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# GPT 7B at 128K tokens, METP 8 on one node of 8 GPUs (each rank: 1/8 of every layer weight, 16K tokens).
# Twin for scripts/compare_tp.sh: gpt-7b-128k-tp8.sh
# Values here are defaults: anything already set in the environment wins (e.g. NNODES=2 TP=2).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/gpt-7b.sh"
: "${SEQ_LENGTH:=131072}"
: "${NNODES:=1}" "${GPUS_PER_NODE:=8}"
: "${METP:=8}" "${TP:=1}" "${PP:=1}"
: "${METP_VOCAB_PARALLEL:=1}"  # embedding and output layer + loss on the ring too (no full logits)
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
TWIN_CONFIG=gpt-7b-128k-tp8.sh
