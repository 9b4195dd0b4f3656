# shellcheck shell=bash
# GPT ~13B: 28 layers, hidden 6144, 48 heads of 128, FFN 16384 (SwiGLU), RMSNorm, RoPE, no linear
# biases, untied embeddings: about 1.31e10 parameters with a 32000-token vocabulary. (48 heads,
# not Llama-13B's 40, so that TP x METP = 16 divides them.)
: "${NUM_LAYERS:=28}" "${HIDDEN_SIZE:=6144}" "${FFN_HIDDEN_SIZE:=16384}" "${NUM_ATTENTION_HEADS:=48}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=32000}"
