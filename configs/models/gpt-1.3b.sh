# shellcheck shell=bash
# GPT ~1.3B (GPT-3 XL shape): 24 layers, hidden 2048, 16 heads, FFN 8192 (GeLU), LayerNorm, RoPE.
# About 1.27e9 parameters with a 32000-token vocabulary (tied embeddings).
# Sourced by the layout files in configs/; every value is a default that the environment overrides.
: "${NUM_LAYERS:=24}" "${HIDDEN_SIZE:=2048}" "${FFN_HIDDEN_SIZE:=8192}" "${NUM_ATTENTION_HEADS:=16}"
: "${SWIGLU:=0}" "${NORMALIZATION:=LayerNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${VOCAB_SIZE:=32000}"
