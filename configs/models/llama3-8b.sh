# shellcheck shell=bash
# Llama-3-8B geometry: 32 layers, hidden 4096, 32 heads with 8 K/V groups (GQA), FFN 14336
# (SwiGLU), RMSNorm, RoPE base 500000, no linear biases, untied embeddings, vocabulary 128256.
: "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=4096}" "${FFN_HIDDEN_SIZE:=14336}" "${NUM_ATTENTION_HEADS:=32}"
: "${NUM_QUERY_GROUPS:=8}" "${ROTARY_BASE:=500000}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=128256}"
