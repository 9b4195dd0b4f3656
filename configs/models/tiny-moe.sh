# shellcheck shell=bash disable=SC2034  # sourced by the tiny-cpu-*-moe.sh configs
# A tiny MoE GPT for CPU runs and tests: the tiny GPT (configs/models/tiny.sh: 2 layers, hidden
# 64, 4 heads, 256 tokens) with layer 1 a Mixture-of-Experts layer (Megatron's MoELayer: 4
# experts of FFN 128, top-2 routing, dropless) and layer 2 dense (--moe-layer-freq 2).
# MOE_ARGS are appended to pretrain_gpt.py's arguments by the configs that source this file.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny.sh"
: "${NUM_EXPERTS:=4}" "${MOE_ROUTER_TOPK:=2}" "${MOE_FFN_HIDDEN_SIZE:=128}" "${MOE_LAYER_FREQ:=2}"
: "${MOE_TOKEN_DISPATCHER:=allgather}"
MOE_ARGS=(--num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK"
          --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --moe-layer-freq "$MOE_LAYER_FREQ"
          --moe-token-dispatcher-type "$MOE_TOKEN_DISPATCHER" --use-cpu-initialization)
