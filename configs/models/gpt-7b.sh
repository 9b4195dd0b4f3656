# shellcheck shell=bash
# GPT ~7B (Llama-2-7B shape): 32 layers, hidden 4096, 32 heads, FFN 11008 (SwiGLU), RMSNorm, RoPE,
# no linear biases, untied embeddings. About 6.7e9 parameters with a 32000-token vocabulary.
: "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=4096}" "${FFN_HIDDEN_SIZE:=11008}" "${NUM_ATTENTION_HEADS:=32}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=32000}"
