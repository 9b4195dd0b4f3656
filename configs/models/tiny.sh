# shellcheck shell=bash
# A tiny GPT for CPU dry runs and tests: 2 layers, hidden 64, 4 heads, FFN 256 (GeLU), 256 tokens.
: "${NUM_LAYERS:=2}" "${HIDDEN_SIZE:=64}" "${FFN_HIDDEN_SIZE:=256}" "${NUM_ATTENTION_HEADS:=4}"
: "${SWIGLU:=0}" "${NORMALIZATION:=LayerNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${VOCAB_SIZE:=1024}"
