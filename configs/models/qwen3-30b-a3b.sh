# shellcheck shell=bash disable=SC2034  # sourced by the qwen3-30b-a3b-*.sh configs
# Qwen3-30B-A3B geometry (its config.json): 48 layers, hidden 2048, 32 heads of 128 with 4 K/V
# groups (GQA), per-head RMSNorm of q and k (--qk-layernorm), RMSNorm, RoPE base 1000000, no
# linear biases, untied embeddings, vocabulary 151936; every layer a Mixture-of-Experts layer
# (decoder_sparse_step 1, no mlp_only_layers): 128 experts of FFN 768 (SwiGLU), top-8 with the
# chosen probabilities renormalised (Megatron's softmax over the top-k logits, no
# --moe-router-pre-softmax), router aux loss 0.001. FFN_HIDDEN_SIZE is the dense width of the HF
# config (no dense layer uses it). MOE_ARGS are appended to pretrain_gpt.py's arguments by the
# configs that source this file (scripts/pretrain_gpt.sh has no MoE variables of its own).
: "${NUM_LAYERS:=48}" "${HIDDEN_SIZE:=2048}" "${FFN_HIDDEN_SIZE:=6144}" "${NUM_ATTENTION_HEADS:=32}"
: "${NUM_QUERY_GROUPS:=4}" "${KV_CHANNELS:=128}" "${QK_LAYERNORM:=1}" "${ROTARY_BASE:=1000000}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=151936}"
: "${NUM_EXPERTS:=128}" "${MOE_ROUTER_TOPK:=8}" "${MOE_FFN_HIDDEN_SIZE:=768}" "${MOE_LAYER_FREQ:=1}"
: "${MOE_TOKEN_DISPATCHER:=alltoall}"
MOE_ARGS=(--num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK"
          --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --moe-layer-freq "$MOE_LAYER_FREQ"
          --moe-token-dispatcher-type "$MOE_TOKEN_DISPATCHER"
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001)
