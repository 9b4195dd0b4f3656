# shellcheck shell=bash disable=SC2034  # sourced by mixtral-8x7b-*.sh configs
# Mixtral-8x7B geometry (its config.json): 32 layers, hidden 4096, 32 heads of 128 with 8 K/V
# groups (GQA), RMSNorm, RoPE base 1000000, no linear biases, untied embeddings, vocabulary
# 32000; every layer a Mixture-of-Experts layer: 8 experts of FFN 14336 (SwiGLU), top-2 with the
# chosen probabilities renormalised, router aux loss 0.02. MOE_ARGS are appended to
# pretrain_gpt.py's arguments by the configs that source this file.
: "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=4096}" "${FFN_HIDDEN_SIZE:=14336}" "${NUM_ATTENTION_HEADS:=32}"
: "${NUM_QUERY_GROUPS:=8}" "${ROTARY_BASE:=1000000}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=32000}"
: "${NUM_EXPERTS:=8}" "${MOE_ROUTER_TOPK:=2}" "${MOE_FFN_HIDDEN_SIZE:=14336}" "${MOE_LAYER_FREQ:=1}"
: "${MOE_TOKEN_DISPATCHER:=alltoall}"
MOE_ARGS=(--num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK"
          --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --moe-layer-freq "$MOE_LAYER_FREQ"
          --moe-token-dispatcher-type "$MOE_TOKEN_DISPATCHER"
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.02)
