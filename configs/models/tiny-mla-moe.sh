# shellcheck shell=bash disable=SC2034  # sourced by the tiny-cpu-*-mla-moe.sh configs
# A tiny DeepSeek-shaped GPT for CPU runs and tests: the tiny MoE GPT (configs/models/tiny-moe.sh:
# 2 layers, hidden 64, 4 heads, 256 tokens; layer 1 MoE with 4 experts of FFN 128, top-2; layer 2
# dense) with multi-latent attention (q latent 32, kv latent 16, per head a 16-wide no-RoPE part,
# an 8-wide RoPE key shared by the heads and a 24-wide value; q/kv latent RMSNorms), RMSNorm,
# a gated shared expert of width 64 beside the routed ones and DeepSeek-V3's router (sigmoid
# scores, expert bias, top-k weights renormalised). The value width equals the query/key width
# (16 + 8) and --kv-channels: the width megatron-core's local core attention computes every head
# at, so the stock twin builds on CPU ranks (megatron_metp/megatron/cpu_mla.py).
# MLA_MOE_ARGS are appended to pretrain_gpt.py's arguments by the configs that source this file.
: "${NORMALIZATION:=RMSNorm}" "${DISABLE_BIAS_LINEAR:=1}"  # DeepSeek: no linear biases
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-moe.sh"
MLA_MOE_ARGS=("${MOE_ARGS[@]}" --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16
              --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 24 --kv-channels 24
              --qk-layernorm --moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate
              --moe-router-score-function sigmoid --moe-router-enable-expert-bias
              --moe-router-topk-scaling-factor 2.5)
