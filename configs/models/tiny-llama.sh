# shellcheck shell=bash
# A tiny Llama for CPU runs and tests, trained from scratch: 2 layers, hidden 64, 4 heads of 16
# with 2 K/V groups (GQA), FFN 128 (SwiGLU), RMSNorm, RoPE base 500000, no linear biases,
# untied embeddings. NullTokenizer (mock data): 1000 tokens + end-of-document, padded by Megatron
# to 1024 rows at METP 2 or TP 2. `python -m megatron_metp.tools.hf export` writes its
# config.json (LlamaForCausalLM) from the checkpoint's saved arguments.
: "${NUM_LAYERS:=2}" "${HIDDEN_SIZE:=64}" "${FFN_HIDDEN_SIZE:=128}" "${NUM_ATTENTION_HEADS:=4}"
: "${NUM_QUERY_GROUPS:=2}" "${ROTARY_BASE:=500000}"
: "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=1000}"
