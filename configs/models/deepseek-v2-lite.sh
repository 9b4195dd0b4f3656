# shellcheck shell=bash disable=SC2034  # sourced by the deepseek-v2-lite-*.sh configs
# DeepSeek-V2-Lite geometry (its config.json; metp plan --preset deepseek-v2-lite, docs/mla.md):
# 27 layers, hidden 2048, 16 heads, multi-latent attention without a query latent (kv_lora_rank
# 512, qk 128 + 64 rotated, v 128; DeepSeek's latent RMSNorms: --qk-layernorm), RMSNorm, no
# linear biases, untied embeddings, vocabulary 102400; the first layer dense (FFN 10944), the
# other 26 DeepSeekMoE layers: 64 routed experts of FFN 1408 (SwiGLU), top-6, and 2 shared
# experts (one shared MLP of 2 x 1408). RoPE: Megatron's MLA default (YaRN with factor 1: plain
# angles); DeepSeek's long-context YaRN settings are not set here (no byte the plan counts
# depends on them). MOE_ARGS and MLA_ARGS are appended to pretrain_gpt.py's arguments by the
# configs that source this file (scripts/pretrain_gpt.sh has no MoE or MLA variables of its own).
: "${NUM_LAYERS:=27}" "${HIDDEN_SIZE:=2048}" "${FFN_HIDDEN_SIZE:=10944}" "${NUM_ATTENTION_HEADS:=16}"
: "${QK_LAYERNORM:=1}" "${SWIGLU:=1}" "${NORMALIZATION:=RMSNorm}" "${POSITION_EMBEDDING_TYPE:=rope}"
: "${DISABLE_BIAS_LINEAR:=1}" "${UNTIE_EMBEDDINGS:=1}" "${VOCAB_SIZE:=102400}"
: "${KV_LORA_RANK:=512}" "${QK_HEAD_DIM:=128}" "${QK_POS_EMB_HEAD_DIM:=64}" "${V_HEAD_DIM:=128}"
: "${NUM_EXPERTS:=64}" "${MOE_ROUTER_TOPK:=6}" "${MOE_FFN_HIDDEN_SIZE:=1408}"
: "${MOE_SHARED_EXPERT_INTERMEDIATE_SIZE:=2816}" "${MOE_LAYER_FREQ:=[0]*1+[1]*26}"
: "${MOE_TOKEN_DISPATCHER:=alltoall}"
MLA_ARGS=(--multi-latent-attention --kv-lora-rank "$KV_LORA_RANK" --qk-head-dim "$QK_HEAD_DIM"
          --qk-pos-emb-head-dim "$QK_POS_EMB_HEAD_DIM" --v-head-dim "$V_HEAD_DIM")
MOE_ARGS=(--num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK"
          --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --moe-layer-freq "$MOE_LAYER_FREQ"
          --moe-shared-expert-intermediate-size "$MOE_SHARED_EXPERT_INTERMEDIATE_SIZE"
          --moe-token-dispatcher-type "$MOE_TOKEN_DISPATCHER"
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001)
