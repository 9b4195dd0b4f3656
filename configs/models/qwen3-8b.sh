# shellcheck shell=bash
# Qwen3-8B geometry: 36 layers, hidden 4096, 32 heads of 128 with 8 K/V groups (GQA), per-head
# RMSNorm of q and k before RoPE (--qk-layernorm), FFN 12288 (SwiGLU), RMSNorm, RoPE base
# 1000000, no linear biases, untied embeddings, vocabulary 151936.
: "${NUM_LAYERS:=36}" "${HIDDEN_SIZE:=4096}" "${FFN_HIDDEN_SIZE:=12288}" "${NUM_ATTENTION_HEADS:=32}"
: "${NUM_QUERY_GROUPS:=8}" "${KV_CHANNELS:=128}" "${QK_LAYERNORM:=1}" "${ROTARY_BASE:=1000000}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=151936}"
