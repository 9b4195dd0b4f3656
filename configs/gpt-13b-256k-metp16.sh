# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# GPT 13B at 256K tokens on 2 nodes of 8 GPUs: one METP ring of 16 across both nodes (16K tokens per rank).
# Twin for scripts/compare_tp.sh: gpt-13b-256k-tp16.sh
# Values here are defaults: anything already set in the environment wins (e.g. NNODES=2 TP=2).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/gpt-13b.sh"
: "${SEQ_LENGTH:=262144}"
: "${NNODES:=2}" "${GPUS_PER_NODE:=8}"
: "${METP:=16}" "${TP:=1}" "${PP:=1}"
# METP 16 spans the two nodes on purpose (it predates METP × CP; METP 8 × --context-parallel-size 2
# keeps each ring in a node): the ranks' start-up placement check accepts it only with this
export METP_ALLOW_CROSS_NODE_RING="${METP_ALLOW_CROSS_NODE_RING:-1}"
: "${METP_VOCAB_PARALLEL:=1}"  # embedding and output layer + loss on the ring too (no full logits)
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}"
TWIN_CONFIG=gpt-13b-256k-tp16.sh
