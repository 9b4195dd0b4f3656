#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py (patched with patches/; Megatron-LM core_v0.19.0 or
# core_v0.16.1) on this node, with or without METP.
#
#   CONFIG=configs/gpt-7b-128k-metp8.sh MEGATRON_LM_DIR=/path/Megatron-LM scripts/pretrain_gpt.sh
#   scripts/pretrain_gpt.sh --config configs/gpt-7b-128k-tp8.sh --dry-run --gpu-memory-gib 141
#   scripts/pretrain_gpt.sh --config configs/tiny-cpu-metp2.sh --print-cmd -- --train-iters 5
#
# Modes:
#   (default)          check the job first (the preflight below), then run torchrun ...
#                      pretrain_gpt.py on this node
#   --preflight        only check the job, in one process within seconds, and exit: the METP and
#                      Megatron flag combinations the ranks would refuse, the data (each DATA_PATH
#                      prefix's .bin/.idx, and that SPLIT leaves no split of it empty), the
#                      tokenizer's files, the checkpoint to load (python -m
#                      megatron_metp.megatron_lm.preflight); every problem is listed at once
#   --print-cmd        print the environment and the exact torchrun command, run nothing
#   --check-node       only check this node (the port, the ranks' Python environment: below)
#   --dry-run          on a CPU (login node): parse and validate the exact same arguments with the
#                      real Megatron-LM parser, build rank 0's model (or --rank N) under a fake
#                      process group and fake tensors, run one micro-batch forward+backward and
#                      print that rank's parameters and peak memory (python -m megatron_metp.dry_run)
#     --rank N           rank to measure (default 0)
#     --gpu-memory-gib G check the total against G GiB per GPU (also $GPU_MEMORY_GIB)
#     --json FILE        also write the dry run's report as JSON
#     --cpu-kernels      account as the CPU kernels do, not as CUDA's (to see the difference)
#     --measure-tiles M  sampled (default: the first two and last pass of each tile loop of the
#                        streaming METP layer, one step of each run of like K/V ring steps) or
#                        full (every pass and step; slower, the same bytes)
# Other options:
#   --config FILE      model/layout file (also $CONFIG; default configs/tiny-cpu-metp2.sh)
#   -- ARGS...         append ARGS to pretrain_gpt.py's arguments (they win over the config)
#
# Every setting is an environment variable; a config file only fills in those not set, and this
# script the rest. The main ones (defaults in brackets):
#   NNODES [1] GPUS_PER_NODE [8] NODE_RANK [$SLURM_NODEID or 0] MASTER_ADDR [localhost]
#   MASTER_PORT [one node: a port free here; several: 6000]   torchrun rendezvous (one torchrun
#                                           per node); a taken one is refused, naming a free one
#   MEGATRON_LM_DIR [/opt/Megatron-LM]      patched checkout at core_v0.19.0 or core_v0.16.1
#   TP PP METP [1 1 1] SEQUENCE_PARALLEL [1 when TP>1 and METP=1]   model parallelism
#   CP [1] VPP [unset]                      Megatron context parallelism (with METP > 1: the outer
#                                           factor c, world = TP x METP x CP x PP x DP),
#                                           layers per virtual pipeline stage
#   NUM_LAYERS HIDDEN_SIZE FFN_HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS SEQ_LENGTH
#   SWIGLU [0] NORMALIZATION [LayerNorm] UNTIE_EMBEDDINGS [0] DISABLE_BIAS_LINEAR [0]
#   KV_CHANNELS [hidden/heads] QK_LAYERNORM [0] ADD_QKV_BIAS [0]   head width, per-head q/k norms
#                                           (Qwen3), bias on q/k/v only (Qwen2.5)
#   MICRO_BATCH_SIZE [1] GLOBAL_BATCH_SIZE [8] TRAIN_ITERS [100] LR [3e-4] PRECISION [bf16; or fp16, fp32]
#   DISTRIBUTED_OPTIMIZER [1]               Megatron's distributed optimizer (0: the plain one)
#   DATA_PATH [unset: --mock-data]          Megatron indexed data prefix(es), e.g. "1.0 /d/x_text_document"
#   SPLIT [949,50,1]                        --split: train,valid,test weights over each prefix's
#                                           documents; a small corpus needs larger valid/test
#                                           shares (or 0 to leave one out): the preflight names
#                                           a split left empty
#   TOKENIZER_TYPE [NullTokenizer with mock data, else HuggingFaceTokenizer] TOKENIZER_MODEL
#   VOCAB_FILE MERGE_FILE VOCAB_SIZE [32000] tokenizer arguments (TOKENIZER_MODEL for
#                                           HuggingFaceTokenizer: a hub name, or a folder holding
#                                           tokenizer.json and tokenizer_config.json, as
#                                           tokenizer.save_pretrained writes them)
#   CHECKPOINT_PATH [unset: no checkpoints] SAVE_INTERVAL [1000] TENSORBOARD_DIR [unset]
#   TRANSFORMER_IMPL [auto: transformer_engine when importable here, else local;
#                     --dry-run assumes the training nodes have it]
#   METP_ATTENTION_KERNEL [auto] METP_DISABLE_WEIGHT_RING [0] METP_KEEP_INTERMEDIATE [0]
#   METP_VOCAB_PARALLEL [0]
#   METP_RING_TIMEOUT [unset]               METP flags
#   RECOMPUTE_GRANULARITY [unset; full] RECOMPUTE_METHOD [uniform] RECOMPUTE_NUM_LAYERS [1]
#                                           Megatron's activation recompute
#   METP_OFFLOAD_ACTIVATIONS [0]            1: saved activations to host memory (also without METP)
#   METP_OFFLOAD_LAYERS [unset: every layer] with METP_OFFLOAD_ACTIVATIONS=1: offload only the first
#                                           N layers of each pipeline stage, keep the rest on the
#                                           GPU (--metp-offload-activations N; metp plan says how
#                                           many the node's host memory holds)
#   METP_OFFLOAD_PREFETCH [1]               0: bring each layer back when its backward starts
#                                           (one layer input on the GPU instead of two)
#   METP_MLP_TOKEN_TILE [unset: auto]       --metp-mlp-token-tile (token rows per MLP ring pass)
#   METP_STREAMING_LAYER [1]                full recompute of one layer per checkpoint runs each
#                                           METP layer as the streaming layer op (keeps only its
#                                           input; docs/tiles.md); 0: Megatron's checkpoint
#   METP_TILE_BUDGET_MIB [1024]             the auto token tiles' budget (streaming layer, MLP,
#                                           loss); METP_LAYER_TOKEN_TILE [auto] forces the
#                                           streaming layer's row and query tiles (tokens)
#   PACKED_SEQUENCES [0]                    1: documents packed into each sample, separated by EOD
#                                           tokens: --reset-position-ids --reset-attention-mask
#                                           --eod-mask-loss (METP derives the document boundaries
#                                           from the EOD tokens)
#   DATALOADER_ATTENTION_MASK [0]           1: let the dataloader build Megatron's dense
#                                           [b, 1, s, s] mask (stock TP needs it to honour
#                                           --reset-attention-mask; METP never builds it)
#   MOCK_MAX_DOCUMENT_LENGTH [unset]        mock data: documents of 1..N-1 tokens (Megatron's
#                                           default 1..4095), --metp-mock-max-document-length
#   METP_PACKED_LAYOUT [dual_chunk]         with PACKED_SEQUENCES=1 and METP: balanced spreads
#                                           long documents over the ring on their own
#                                           (--metp-packed-layout)
#   EXTRA_ARGS                              more pretrain_gpt.py arguments (a bash array in the
#                                           config, or a string in the environment)
#   METP_CPU [0]                            1: train on CPU ranks with gloo (no GPU; CI, laptops):
#                                           torchrun starts python -m megatron_metp.megatron_lm.cpu,
#                                           which applies the CPU shims and runs pretrain_gpt.py;
#                                           refused where CUDA is available
#   NUM_WORKERS [Megatron's 2; 0 with METP_CPU=1]   --num-workers: DataLoader worker processes
#                                           per rank (CPU ranks load in the rank itself: a worker
#                                           forked from a rank whose gloo threads run can hang)
#   PREFLIGHT [1]                           0: skip the preflight (the ranks check the flags anyway)
#   PYTHON [the project's venv: .venv-019/bin/python when MEGATRON_LM_DIR is core_v0.19.0, else
#           .venv/bin/python, when there; else python on PATH]
#   TORCHRUN [the torchrun next to $PYTHON, else $PYTHON -m torch.distributed.run; under Slurm
#             $PYTHON -m megatron_metp.megatron_lm.torchrun: a SIGTERM ends the job as its
#             ranks end]
#
# Relative paths in CHECKPOINT_PATH, DATA_PATH, TOKENIZER_MODEL, VOCAB_FILE, MERGE_FILE,
# TENSORBOARD_DIR (and in --save, --load, --pretrained-checkpoint, --data-path, --data-cache-path,
# --tokenizer-model, --vocab-file, --merge-file, --tensorboard-dir after '--') are taken from the
# submit folder ($SLURM_SUBMIT_DIR under Slurm, else the current directory), not from the
# Megatron-LM checkout the ranks run in.
# Before the ranks start (default mode), every node checks that the ranks' Python sees a GPU
# (else METP_CPU=1 is named), that under Slurm it is not a CPU-only torch on a node with NVIDIA
# GPUs, and that the rendezvous port is free; its start line names the environment used.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
METP_DIR="${METP_DIR:-$(cd "$SCRIPT_DIR/.." && pwd)}"

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

die() {
    echo "pretrain_gpt.sh: error: $*" >&2
    exit 1
}

# Whether the Megatron-LM checkout $1 is core_v0.19.0: its HEAD is the tag's commit (as
# scripts/apply_patches.sh checks), or, without git, its megatron-core version is 0.19.
megatron_lm_is_019() {
    local head
    head=$(git -C "$1" rev-parse HEAD 2>/dev/null || true)
    [[ "$head" == 5be9626709af2722333bf54797c954c09edeada3 ]] && return 0
    [[ -z "$head" ]] && grep -qs '^MINOR = 19$' "$1/megatron/core/package_info.py"
}

MODE=run
DRY_RUN_OPTS=()
USER_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) MODE=dry-run ;;
        --print-cmd) MODE=print ;;
        --preflight) MODE=preflight ;;
        --check-node) MODE=check-node ;;
        --rank) [[ $# -ge 2 ]] || die "--rank needs a value"; DRY_RUN_OPTS+=(--rank "$2"); shift ;;
        --json) [[ $# -ge 2 ]] || die "--json needs a file"; DRY_RUN_OPTS+=(--json "$2"); shift ;;
        --cpu-kernels) DRY_RUN_OPTS+=(--cpu-kernels) ;;
        --measure-tiles) [[ $# -ge 2 ]] || die "--measure-tiles needs sampled or full"; DRY_RUN_OPTS+=(--measure-tiles "$2"); shift ;;
        --gpu-memory-gib) [[ $# -ge 2 ]] || die "--gpu-memory-gib needs a value"; GPU_MEMORY_GIB=$2; shift ;;
        --config) [[ $# -ge 2 ]] || die "--config needs a file"; CONFIG=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; USER_ARGS+=("$@"); break ;;
        *) die "unknown option '$1' (pretrain_gpt.py arguments go after '--'; see --help)" ;;
    esac
    shift
done

# ---------------------------------------------------------------- configuration
CONFIG="${CONFIG:-$METP_DIR/configs/tiny-cpu-metp2.sh}"
for cand in "$METP_DIR/$CONFIG" "$METP_DIR/configs/$CONFIG"; do  # relative to the repository
    if [[ ! -f "$CONFIG" && -f "$cand" ]]; then CONFIG=$cand; fi
done
[[ -f "$CONFIG" ]] || die "config file '$CONFIG' not found (see $METP_DIR/configs/)"
if [[ -n "${EXTRA_ARGS:-}" && "$(declare -p EXTRA_ARGS 2>/dev/null)" != "declare -a"* ]]; then
    read -r -a EXTRA_ARGS <<< "$EXTRA_ARGS"  # a string from the environment
fi
# shellcheck source=/dev/null
source "$CONFIG"

: "${NNODES:=1}" "${GPUS_PER_NODE:=8}" "${NODE_RANK:=${SLURM_NODEID:-0}}"
: "${MASTER_ADDR:=localhost}"
: "${MEGATRON_LM_DIR:=/opt/Megatron-LM}" "${METP_CPU:=0}"
if [[ -z "${PYTHON:-}" ]]; then  # the project's venv (make venv / make venv-019), else PATH's
    PYTHON=python
    if [[ -x "$METP_DIR/.venv-019/bin/python" ]] && megatron_lm_is_019 "$MEGATRON_LM_DIR"; then
        PYTHON="$METP_DIR/.venv-019/bin/python"
    elif [[ -x "$METP_DIR/.venv/bin/python" ]]; then
        PYTHON="$METP_DIR/.venv/bin/python"
    fi
fi
: "${TP:=1}" "${PP:=1}" "${METP:=1}" "${CP:=1}" "${VPP:=}"
if [[ "$PYTHON" == */* && "$PYTHON" != /* ]]; then  # a relative path: absolute (we cd below)
    PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"
fi
if [[ -d "$MEGATRON_LM_DIR" ]]; then MEGATRON_LM_DIR="$(cd "$MEGATRON_LM_DIR" && pwd)"; fi
MISSING=()
for v in NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH; do
    [[ -n "${!v:-}" ]] || MISSING+=("$v")
done
[[ ${#MISSING[@]} -eq 0 ]] ||
    die "not set: ${MISSING[*]} (neither the config $CONFIG nor the environment sets it); give each in the environment (e.g. ${MISSING[0]}=<value> scripts/pretrain_gpt.sh ...) or in the config (: \"\${${MISSING[0]}:=<value>}\")"
BAD=()  # numbers the script computes with (bash arithmetic would fail on them, unnamed)
for v in NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH NNODES GPUS_PER_NODE NODE_RANK TP \
         PP METP CP FFN_HIDDEN_SIZE MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS; do
    [[ -z "${!v:-}" || "${!v}" =~ ^[0-9]+$ ]] || BAD+=("$v=${!v}")
done
[[ ${#BAD[@]} -eq 0 ]] || die "not a whole number: ${BAD[*]} (give each as digits, e.g. SEQ_LENGTH=131072 for 128K)"
if [[ -z "${SEQUENCE_PARALLEL:-}" ]]; then
    if [[ "$TP" -gt 1 && "$METP" -eq 1 ]]; then SEQUENCE_PARALLEL=1; else SEQUENCE_PARALLEL=0; fi
fi
: "${FFN_HIDDEN_SIZE:=$((4 * HIDDEN_SIZE))}" "${NUM_QUERY_GROUPS:=}"
: "${MAX_POSITION_EMBEDDINGS:=$SEQ_LENGTH}" "${POSITION_EMBEDDING_TYPE:=rope}" "${ROTARY_BASE:=10000}"
: "${SWIGLU:=0}" "${NORMALIZATION:=LayerNorm}" "${UNTIE_EMBEDDINGS:=0}" "${DISABLE_BIAS_LINEAR:=0}"
: "${KV_CHANNELS:=}" "${QK_LAYERNORM:=0}" "${ADD_QKV_BIAS:=0}"
: "${ATTENTION_DROPOUT:=0}" "${HIDDEN_DROPOUT:=0}"
: "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=8}" "${TRAIN_ITERS:=100}" "${LR:=3e-4}"
: "${MIN_LR:=3e-5}" "${LR_WARMUP_ITERS:=$((TRAIN_ITERS / 10))}" "${WEIGHT_DECAY:=0.1}" "${CLIP_GRAD:=1.0}"
: "${PRECISION:=bf16}" "${SEED:=1234}" "${DISTRIBUTED_OPTIMIZER:=1}"
: "${VOCAB_SIZE:=32000}" "${SAVE_INTERVAL:=1000}" "${LOG_INTERVAL:=1}"
: "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}"
: "${TRANSFORMER_IMPL:=auto}" "${METP_ATTENTION_KERNEL:=auto}"
: "${METP_DISABLE_WEIGHT_RING:=0}" "${METP_KEEP_INTERMEDIATE:=0}" "${METP_VOCAB_PARALLEL:=0}"
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
# The node's checks (no package import: in milliseconds, torch only for `node`)
CHECK_PYTHON="$PYTHON"
if ! command -v "$PYTHON" >/dev/null 2>&1; then  # --print-cmd only prints it: any python3 checks
    [[ "$MODE" == print ]] ||
        die "PYTHON=$PYTHON not found: make venv (or make venv-019), or set PYTHON to the interpreter that has megatron-metp and torch"
    CHECK_PYTHON=python3
fi
LAUNCH_CHECKS=("$CHECK_PYTHON" "$SCRIPT_DIR/../megatron_metp/megatron_lm/launch_checks.py")
if [[ "$MODE" == dry-run ]]; then
    : "${MASTER_PORT:=6000}"  # no rendezvous
else  # one node: a free port when unset; a taken one refused here, naming a free one
    MASTER_PORT="$("${LAUNCH_CHECKS[@]}" port --nnodes "$NNODES" --node-rank "$NODE_RANK" \
                   --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-}")" || exit 1
fi
# YaRN: Megatron-LM core_v0.19.0 has the flags; core_v0.16.1's pretrain_gpt.py rejects the choice
# while parsing, before any METP hook can name the release, so refuse it here
if [[ "$POSITION_EMBEDDING_TYPE" == yarn && -f "$MEGATRON_LM_DIR/megatron/training/arguments.py" ]] &&
        ! grep -q -- "--yarn-beta-fast" "$MEGATRON_LM_DIR/megatron/training/arguments.py"; then
    die "POSITION_EMBEDDING_TYPE=yarn (--position-embedding-type yarn) needs Megatron-LM core_v0.19.0: $MEGATRON_LM_DIR has no --yarn-* flags (core_v0.16.1); point MEGATRON_LM_DIR at a core_v0.19.0 checkout patched by scripts/apply_patches.sh (its environment: make venv-019). Another position embedding (rope) would train a different model, with positions a YaRN checkpoint was not trained on"
fi

# Relative paths: from the submit folder (the ranks run in the Megatron-LM checkout)
SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"
from_submit_dir() {  # a path as given when absolute (or empty), else under $SUBMIT_DIR
    if [[ -z "$1" || "$1" == /* ]]; then echo "$1"; else echo "$SUBMIT_DIR/${1#./}"; fi
}
local_tokenizer() {  # a --tokenizer-model that is a path here (not a hub name such as org/name)
    [[ "$1" == ./* || "$1" == ../* || -e "$SUBMIT_DIR/$1" ]]
}
for v in CHECKPOINT_PATH VOCAB_FILE MERGE_FILE TENSORBOARD_DIR; do
    [[ -n "${!v:-}" ]] && printf -v "$v" '%s' "$(from_submit_dir "${!v}")"
done
if [[ -n "${TOKENIZER_MODEL:-}" ]] && local_tokenizer "$TOKENIZER_MODEL"; then
    TOKENIZER_MODEL="$(from_submit_dir "$TOKENIZER_MODEL")"
fi
if [[ -n "${DATA_PATH:-}" ]]; then  # "[weight] prefix ..." : the prefixes
    read -r -a DATA_PATH_WORDS <<< "$DATA_PATH"
    for i in "${!DATA_PATH_WORDS[@]}"; do
        [[ "${DATA_PATH_WORDS[$i]}" =~ ^[0-9.eE+-]+$ ]] ||
            DATA_PATH_WORDS[i]="$(from_submit_dir "${DATA_PATH_WORDS[$i]}")"
    done
    DATA_PATH="${DATA_PATH_WORDS[*]}"
fi
PATH_FLAG=""
for i in "${!USER_ARGS[@]}"; do  # the same for the path flags after '--'
    a="${USER_ARGS[$i]}"
    case "$a" in
        --save|--load|--pretrained-checkpoint|--tokenizer-model|--vocab-file|--merge-file|\
        --tensorboard-dir|--data-cache-path|--data-path)
            PATH_FLAG=$a; continue ;;
        --*) PATH_FLAG=""; continue ;;
    esac
    case "$PATH_FLAG" in
        "") ;;
        --tokenizer-model) local_tokenizer "$a" && USER_ARGS[i]="$(from_submit_dir "$a")" ;;
        --data-path) [[ "$a" =~ ^[0-9.eE+-]+$ ]] || USER_ARGS[i]="$(from_submit_dir "$a")" ;;
        *) USER_ARGS[i]="$(from_submit_dir "$a")" ;;
    esac
    [[ "$PATH_FLAG" == --data-path ]] || PATH_FLAG=""
done

IMPL_NOTE=""
if [[ "$TRANSFORMER_IMPL" == auto ]]; then
    if [[ "$MODE" == dry-run ]]; then
        TRANSFORMER_IMPL=transformer_engine  # what the GPU nodes (NGC image) will use
    elif "$PYTHON" -c "import transformer_engine" >/dev/null 2>&1; then
        TRANSFORMER_IMPL=transformer_engine
    else
        TRANSFORMER_IMPL=local
        IMPL_NOTE="Transformer Engine is not importable by $PYTHON here"
    fi
    IMPL_NOTE="TRANSFORMER_IMPL=auto chose $TRANSFORMER_IMPL on $(hostname)${IMPL_NOTE:+ ($IMPL_NOTE)}; set TRANSFORMER_IMPL to pin it"
fi

# ---------------------------------------------------------------- argument groups
DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$MAX_POSITION_EMBEDDINGS"
    --position-embedding-type "$POSITION_EMBEDDING_TYPE"
    --normalization "$NORMALIZATION"
    --attention-dropout "$ATTENTION_DROPOUT"
    --hidden-dropout "$HIDDEN_DROPOUT"
    --no-persist-layer-norm
    --transformer-impl "$TRANSFORMER_IMPL"
)
[[ "$POSITION_EMBEDDING_TYPE" == rope || "$POSITION_EMBEDDING_TYPE" == yarn ]] && GPT_MODEL_ARGS+=(--rotary-base "$ROTARY_BASE")
[[ -n "$NUM_QUERY_GROUPS" ]] && GPT_MODEL_ARGS+=(--group-query-attention --num-query-groups "$NUM_QUERY_GROUPS")
[[ "$SWIGLU" == 1 ]] && GPT_MODEL_ARGS+=(--swiglu)
[[ "$UNTIE_EMBEDDINGS" == 1 ]] && GPT_MODEL_ARGS+=(--untie-embeddings-and-output-weights)
[[ "$DISABLE_BIAS_LINEAR" == 1 ]] && GPT_MODEL_ARGS+=(--disable-bias-linear)
[[ -n "$KV_CHANNELS" ]] && GPT_MODEL_ARGS+=(--kv-channels "$KV_CHANNELS")
[[ "$QK_LAYERNORM" == 1 ]] && GPT_MODEL_ARGS+=(--qk-layernorm)
[[ "$ADD_QKV_BIAS" == 1 ]] && GPT_MODEL_ARGS+=(--add-qkv-bias)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --metp-parallel-size "$METP"
)
[[ "$CP" -gt 1 ]] && MODEL_PARALLEL_ARGS+=(--context-parallel-size "$CP")
[[ -n "$VPP" ]] && MODEL_PARALLEL_ARGS+=(--num-layers-per-virtual-pipeline-stage "$VPP")
[[ "$SEQUENCE_PARALLEL" == 1 ]] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
if [[ "$METP" -gt 1 ]]; then
    MODEL_PARALLEL_ARGS+=(--metp-attention-kernel "$METP_ATTENTION_KERNEL")
    [[ "$METP_DISABLE_WEIGHT_RING" == 1 ]] && MODEL_PARALLEL_ARGS+=(--metp-disable-weight-ring)
    [[ "$METP_KEEP_INTERMEDIATE" == 1 ]] && MODEL_PARALLEL_ARGS+=(--metp-keep-intermediate)
    [[ "$METP_VOCAB_PARALLEL" == 1 ]] && MODEL_PARALLEL_ARGS+=(--metp-vocab-parallel)
    [[ -n "${METP_RING_TIMEOUT:-}" ]] && MODEL_PARALLEL_ARGS+=(--metp-ring-timeout "$METP_RING_TIMEOUT")
    [[ -n "${METP_PACKED_LAYOUT:-}" ]] && MODEL_PARALLEL_ARGS+=(--metp-packed-layout "$METP_PACKED_LAYOUT")
fi
if [[ -n "${RECOMPUTE_GRANULARITY:-}" ]]; then
    MODEL_PARALLEL_ARGS+=(--recompute-granularity "$RECOMPUTE_GRANULARITY")
    if [[ "$RECOMPUTE_GRANULARITY" == full ]]; then
        MODEL_PARALLEL_ARGS+=(--recompute-method "${RECOMPUTE_METHOD:-uniform}"
                              --recompute-num-layers "${RECOMPUTE_NUM_LAYERS:-1}")
    fi
fi
case "${METP_OFFLOAD_ACTIVATIONS:-0}" in
    0) [[ -z "${METP_OFFLOAD_LAYERS:-}" ]] ||
           die "METP_OFFLOAD_LAYERS=$METP_OFFLOAD_LAYERS needs METP_OFFLOAD_ACTIVATIONS=1 (or drop it)" ;;
    1) MODEL_PARALLEL_ARGS+=(--metp-offload-activations ${METP_OFFLOAD_LAYERS:+"$METP_OFFLOAD_LAYERS"}) ;;
    *) die "METP_OFFLOAD_ACTIVATIONS=$METP_OFFLOAD_ACTIVATIONS: use 0 or 1 (every layer); to offload N layers per pipeline stage set METP_OFFLOAD_ACTIVATIONS=1 METP_OFFLOAD_LAYERS=N" ;;
esac
[[ -n "${METP_OFFLOAD_PREFETCH:-}" ]] && export METP_OFFLOAD_PREFETCH
[[ -n "${METP_MLP_TOKEN_TILE:-}" ]] && MODEL_PARALLEL_ARGS+=(--metp-mlp-token-tile "$METP_MLP_TOKEN_TILE")

TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE"
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS"
    --weight-decay "$WEIGHT_DECAY"
    --clip-grad "$CLIP_GRAD"
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --seed "$SEED"
    --calculate-per-token-loss
)
[[ "$DISTRIBUTED_OPTIMIZER" == 1 ]] && TRAINING_ARGS+=(--use-distributed-optimizer)

case "$PRECISION" in
    bf16|fp16) TRAINING_ARGS+=(--"$PRECISION") ;;
    fp32) ;;
    *) die "PRECISION=$PRECISION: use bf16, fp16 or fp32" ;;
esac

if [[ -n "${DATA_PATH:-}" ]]; then
    read -r -a DATA_PATH_WORDS <<< "$DATA_PATH"
    DATA_ARGS=(--data-path "${DATA_PATH_WORDS[@]}" --split "${SPLIT:-949,50,1}")
    : "${TOKENIZER_TYPE:=HuggingFaceTokenizer}"
else
    DATA_ARGS=(--mock-data)
    : "${TOKENIZER_TYPE:=NullTokenizer}"
fi
DATA_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE")
[[ "${DATALOADER_ATTENTION_MASK:-0}" == 1 ]] || DATA_ARGS+=(--no-create-attention-mask-in-dataloader)
[[ "${PACKED_SEQUENCES:-0}" == 1 ]] &&
    DATA_ARGS+=(--reset-position-ids --reset-attention-mask --eod-mask-loss)
[[ -n "${MOCK_MAX_DOCUMENT_LENGTH:-}" ]] &&
    DATA_ARGS+=(--metp-mock-max-document-length "$MOCK_MAX_DOCUMENT_LENGTH")
case "$TOKENIZER_TYPE" in
    NullTokenizer) DATA_ARGS+=(--vocab-size "$VOCAB_SIZE") ;;
    GPT2BPETokenizer)
        [[ "$MODE" == print || ( -n "${VOCAB_FILE:-}" && -n "${MERGE_FILE:-}" ) ]] ||
            die "TOKENIZER_TYPE=GPT2BPETokenizer needs VOCAB_FILE and MERGE_FILE"
        DATA_ARGS+=(--vocab-file "${VOCAB_FILE:-}" --merge-file "${MERGE_FILE:-}") ;;
    *)
        [[ "$MODE" == print || -n "${TOKENIZER_MODEL:-}" ]] ||
            die "TOKENIZER_TYPE=$TOKENIZER_TYPE needs TOKENIZER_MODEL (a path or hub name)"
        DATA_ARGS+=(--tokenizer-model "${TOKENIZER_MODEL:-}") ;;
esac

CHECKPOINT_ARGS=()
if [[ -n "${CHECKPOINT_PATH:-}" ]]; then
    CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
                     --save-interval "$SAVE_INTERVAL" --ckpt-format torch_dist)
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL"
    --log-throughput
    --eval-interval "$EVAL_INTERVAL"
    --eval-iters "$EVAL_ITERS"
)
if [[ -n "${TENSORBOARD_DIR:-}" ]]; then
    EVAL_AND_LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR" --log-memory-to-tensorboard
                            --log-timers-to-tensorboard)
fi

CPU_ARGS=()
if [[ "$METP_CPU" == 1 ]]; then  # gloo, and Megatron's CUDA-only fusions off
    CPU_ARGS=(--distributed-backend gloo --no-gradient-accumulation-fusion
              --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
              --no-bias-dropout-fusion --no-rope-fusion)
    : "${NUM_WORKERS:=0}"
fi
[[ -n "${NUM_WORKERS:-}" ]] && DATA_ARGS+=(--num-workers "$NUM_WORKERS")

[[ -n "${EXTRA_ARGS+x}" ]] || EXTRA_ARGS=()
MEGATRON_ARGS=(
    "${GPT_MODEL_ARGS[@]}"
    "${MODEL_PARALLEL_ARGS[@]}"
    "${TRAINING_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${CHECKPOINT_ARGS[@]}"
    "${EVAL_AND_LOGGING_ARGS[@]}"
    "${CPU_ARGS[@]}"
    "${EXTRA_ARGS[@]}"
    "${USER_ARGS[@]}"
)

# ---------------------------------------------------------------- run
export CUDA_DEVICE_MAX_CONNECTIONS=1
# NCCL: a timed-out op's communicators are aborted and the error is left to the main thread, which
# names the stalled rank (megatron_metp/megatron_lm/last_seen.py); a value set by the user wins
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}"

if [[ "$MODE" == dry-run ]]; then
    DRY=("$PYTHON" -m megatron_metp.dry_run --megatron-lm-dir "$MEGATRON_LM_DIR"
         --nnodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" "${DRY_RUN_OPTS[@]}")
    [[ -n "${GPU_MEMORY_GIB:-}" ]] && DRY+=(--gpu-memory-gib "$GPU_MEMORY_GIB")
    echo "dry run of $(basename "$CONFIG") for $WORLD_SIZE ranks ($NNODES x $GPUS_PER_NODE GPUs), transformer-impl $TRANSFORMER_IMPL" >&2
    export PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}"
    exec "${DRY[@]}" -- "${MEGATRON_ARGS[@]}"
fi

if [[ -n "${TORCHRUN:-}" ]]; then
    read -r -a TORCHRUN_CMD <<< "$TORCHRUN"
elif [[ -n "${SLURM_JOB_ID:-}" ]]; then  # a SIGTERM (time limit, preemption) ends as the ranks do
    TORCHRUN_CMD=("$PYTHON" -m megatron_metp.megatron_lm.torchrun)
else  # the torchrun of $PYTHON's environment (a venv's bin/), whatever is on PATH
    PYTHON_BIN="$(command -v "$PYTHON" || true)"
    if [[ -n "$PYTHON_BIN" && -x "$(dirname "$PYTHON_BIN")/torchrun" ]]; then
        TORCHRUN_CMD=("$(dirname "$PYTHON_BIN")/torchrun")
    else
        TORCHRUN_CMD=("$PYTHON" -m torch.distributed.run)
    fi
fi
if [[ "$METP_CPU" == 1 ]]; then
    export PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    CMD=("${TORCHRUN_CMD[@]}" "${DISTRIBUTED_ARGS[@]}" -m megatron_metp.megatron_lm.cpu
         "$MEGATRON_LM_DIR/pretrain_gpt.py" "${MEGATRON_ARGS[@]}")
else
    CMD=("${TORCHRUN_CMD[@]}" "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_LM_DIR/pretrain_gpt.py"
         "${MEGATRON_ARGS[@]}")
fi
if [[ "$MODE" == print ]]; then
    [[ -n "$IMPL_NOTE" ]] && echo "# $IMPL_NOTE"
    echo "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    echo "cd $(printf '%q' "$MEGATRON_LM_DIR")"
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

# The ranks' Python environment on this node (which one; a GPU, or METP_CPU=1; under Slurm no
# CPU-only torch on a GPU node)
check_node() {
    local cmd=("${LAUNCH_CHECKS[@]}" node)
    [[ "$METP_CPU" == 1 ]] && cmd+=(--cpu)
    ENVIRONMENT="$("${cmd[@]}")" || exit 1
}
if [[ "$MODE" == check-node ]]; then
    check_node
    echo "pretrain_gpt.sh: node $NODE_RANK of $NNODES ($(hostname)): $ENVIRONMENT; rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
    exit 0
fi

[[ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ]] ||
    die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not a Megatron-LM checkout"
# patched by this version of patches/ (an older patch lacks calls the plugin relies on)
"$PYTHON" -m megatron_metp.megatron_lm.patch_markers "$MEGATRON_LM_DIR" || exit 1
cd "$MEGATRON_LM_DIR"  # relative paths in the arguments are taken from here, by the ranks too
if [[ "$MODE" == preflight || "${PREFLIGHT:-1}" != 0 ]]; then
    PRE=("$PYTHON" -m megatron_metp.megatron_lm.preflight --world-size "$WORLD_SIZE")
    [[ "$METP_CPU" == 1 ]] && PRE+=(--cpu)
    PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}" "${PRE[@]}" -- "${MEGATRON_ARGS[@]}" ||
        die "the preflight refused this job (above; PREFLIGHT=0 skips it)"
    [[ "$MODE" == preflight ]] && exit 0
fi
check_node
if [[ "$METP_CPU" == 1 ]]; then RANKS="$GPUS_PER_NODE CPU ranks"; else RANKS="$GPUS_PER_NODE GPUs"; fi
echo "pretrain_gpt.sh: node $NODE_RANK of $NNODES, $RANKS, config $(basename "$CONFIG"), $ENVIRONMENT, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
exec "${CMD[@]}"
