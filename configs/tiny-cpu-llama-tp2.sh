# shellcheck shell=bash disable=SC2034  # sourced by scripts/pretrain_gpt.sh, which reads these
# Tiny Llama (configs/models/tiny-llama.sh) on 2 CPU ranks with stock TP 2, the layout of
# tiny-cpu-tp2.sh (no sequence parallelism).
# Twin for scripts/compare_tp.sh: tiny-cpu-llama-metp2.sh
# Values here are defaults: anything already set in the environment wins.
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/models/tiny-llama.sh"
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/tiny-cpu-tp2.sh"  # its tiny.sh defaults no longer apply
TWIN_CONFIG=tiny-cpu-llama-metp2.sh
