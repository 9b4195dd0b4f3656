# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny Llama (configs/models/tiny-llama.sh: RMSNorm, SwiGLU, RoPE, GQA, untied, no biases) trained
# from scratch on 2 CPU ranks at METP 2, the layout of tiny-cpu-metp2.sh; export the saved
# checkpoint to Hugging Face with
# `python -m megatron_metp.tools.hf export --load CHECKPOINT_PATH --out DIR` (docs/huggingface.md).
# Twin for scripts/compare_tp.sh: tiny-cpu-llama-tp2.sh
# Values here are defaults: anything already set in the environment wins (e.g. TRAIN_ITERS=50).
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-llama.sh"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-metp2.sh"  # its tiny.sh defaults no longer apply
TWIN_CONFIG=tiny-cpu-llama-tp2.sh
