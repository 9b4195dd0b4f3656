#!/usr/bin/env bash
# Start scripts/pretrain_gpt.sh on every node of a Slurm allocation: one srun task per node, each
# running one torchrun for that node's GPUs. Called by pretrain_gpt.sbatch (or inside salloc).
#
#   srun_pretrain_gpt.sh [--print-only] [-- extra pretrain_gpt.py args]
#
# From Slurm: SLURM_JOB_NODELIST, SLURM_NNODES (or SLURM_JOB_NUM_NODES), SLURM_JOB_ID,
#   SLURM_JOB_NAME, SLURM_GPUS_ON_NODE. Without `scontrol` (or to override it) set
#   METP_HOSTNAMES="host1 host2 ..." (spaces or commas).
# Settings (defaults in brackets):
#   MASTER_ADDR [first host of the job]  MASTER_PORT [10000 + job id mod 50000]
#   GPUS_PER_NODE [$SLURM_GPUS_ON_NODE or 8]  CONFIG [configs/tiny-cpu-metp2.sh]
#   LOG_DIR [$METP_DIR/logs/<job name>-<job id>]: one log per node plus commands.txt; a
#     requeued job (SLURM_RESTART_COUNT=k) writes node<N>-<host>.restart<k>.log
#   CONTAINER_IMAGE [unset]: run each task in this pyxis/enroot image (srun --container-image);
#     CONTAINER_MOUNTS [unset] is passed as --container-mounts (include LOG_DIR and data paths);
#     CONTAINER_METP_DIR [/opt/megatron-metp] and MEGATRON_LM_DIR [/opt/Megatron-LM] are paths
#     inside the image (the Dockerfile's layout)
#   MEGATRON_LM_DIR: without a container, the patched checkout on a shared file system
#   SRUN_EXTRA_ARGS [unset]: more srun options, e.g. "--mpi=pmix --account=abc"
#   EXIT_SIGNAL_HANDLER [1]: pass --exit-signal-handler (a SIGTERM saves a checkpoint, then the
#     ranks exit 0; scripts/pretrain_gpt.sh runs torchrun through
#     megatron_metp.megatron_lm.torchrun under Slurm, so the job ends COMPLETED); 0: leave it out
# Everything else (DATA_PATH, CHECKPOINT_PATH, TP, METP, ...) reaches scripts/pretrain_gpt.sh
# through the environment.
# Before srun starts any task, the job is checked once here (scripts/pretrain_gpt.sh --preflight:
# flags, data, tokenizer, checkpoint, every problem at once, in seconds); with CONTAINER_IMAGE
# the check runs inside each node's task instead, before its torchrun. PREFLIGHT=0 skips it.
# Then this node is checked (scripts/pretrain_gpt.sh --check-node): the Python environment the
# ranks use is named, and refused when its torch has no CUDA on a node with NVIDIA GPUs (a
# CPU-only venv made on a login node), or sees no GPU without METP_CPU=1; the rendezvous port
# must be free. Each node's task checks its own node again before its torchrun.
set -euo pipefail

die() {
    echo "srun_pretrain_gpt.sh: error: $*" >&2
    exit 1
}

PRINT_ONLY=0
PASS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --print-only) PRINT_ONLY=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        --) shift; PASS=("$@"); break ;;
        *) die "unknown option '$1' (pretrain_gpt.py arguments go after '--')" ;;
    esac
    shift
done

# Slurm's SIGTERM (the time limit with #SBATCH --signal=TERM@N, scancel --signal=TERM, a
# preemption) makes the ranks save a checkpoint at the end of the iteration and exit 0
# (Megatron-LM's --exit-signal-handler; the job resumes from it when requeued or resubmitted).
# EXIT_SIGNAL_HANDLER=0 leaves the flag out.
if [[ "${EXIT_SIGNAL_HANDLER:-1}" == 1 && " ${PASS[*]-} " != *" --exit-signal-handler "* ]]; then
    PASS+=(--exit-signal-handler)
fi

METP_DIR="${METP_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
JOB_ID="${SLURM_JOB_ID:?not inside a Slurm job (SLURM_JOB_ID unset); use sbatch or salloc}"
JOB_NAME="${SLURM_JOB_NAME:-metp-gpt}"
NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:?SLURM_NNODES is not set}}"

if [[ -n "${METP_HOSTNAMES:-}" ]]; then
    read -r -a HOSTS <<< "${METP_HOSTNAMES//,/ }"
elif command -v scontrol >/dev/null 2>&1; then
    mapfile -t HOSTS < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
else
    die "scontrol is not available to expand SLURM_JOB_NODELIST; set METP_HOSTNAMES=\"host1 host2 ...\""
fi
[[ ${#HOSTS[@]} -eq "$NNODES" ]] ||
    die "the job has $NNODES nodes but ${#HOSTS[@]} host names were found: ${HOSTS[*]}"

export NNODES
export MASTER_ADDR="${MASTER_ADDR:-${HOSTS[0]}}"
export MASTER_PORT="${MASTER_PORT:-$((10000 + JOB_ID % 50000))}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
export CONFIG="${CONFIG:-configs/tiny-cpu-metp2.sh}"
LOG_DIR="${LOG_DIR:-$METP_DIR/logs/$JOB_NAME-$JOB_ID}"

# a requeued job (scontrol requeue, preemption with --requeue) keeps its id: its node logs get
# the restart count, so that each start keeps its own
RESTART="${SLURM_RESTART_COUNT:-0}"
[[ "$RESTART" =~ ^[0-9]+$ ]] || RESTART=0
NODE_LOG="node%n-%N.log"
[[ "$RESTART" -gt 0 ]] && NODE_LOG="node%n-%N.restart$RESTART.log"
SRUN=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --cpu-bind=none
      --export=ALL --output="$LOG_DIR/$NODE_LOG")
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    TASK_METP_DIR="${CONTAINER_METP_DIR:-/opt/megatron-metp}"
    export MEGATRON_LM_DIR="${MEGATRON_LM_DIR:-/opt/Megatron-LM}"
    # the image (Dockerfile) has Transformer Engine; pin it so that the printed commands are exact
    export TRANSFORMER_IMPL="${TRANSFORMER_IMPL:-transformer_engine}"
    SRUN+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$TASK_METP_DIR")
    [[ -n "${CONTAINER_MOUNTS:-}" ]] && SRUN+=(--container-mounts="$CONTAINER_MOUNTS")
else
    TASK_METP_DIR="$METP_DIR"
    export MEGATRON_LM_DIR="${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to the patched Megatron-LM checkout (shared file system), or use CONTAINER_IMAGE}"
fi
# A config of this repository travels by name (each task finds it in its own configs/); another
# file by absolute path, which must then be visible on the nodes (shared file system or mount).
if [[ "$CONFIG" != /* ]]; then
    if [[ ( "$CONFIG" != */* || "$CONFIG" == configs/* ) && -f "$METP_DIR/configs/$(basename "$CONFIG")" ]]; then
        CONFIG="$(basename "$CONFIG")"
    elif [[ -f "$CONFIG" ]]; then
        CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
    else
        die "config '$CONFIG' not found (neither in $METP_DIR/configs/ nor as a file)"
    fi
fi
export CONFIG
if [[ -n "${SRUN_EXTRA_ARGS:-}" ]]; then
    read -r -a SRUN_EXTRA <<< "$SRUN_EXTRA_ARGS"
    SRUN+=("${SRUN_EXTRA[@]}")
fi
# METP_DIR is exported for this host; each task gets the directory it sees (the image's one).
TASK=(env "METP_DIR=$TASK_METP_DIR" bash "$TASK_METP_DIR/scripts/pretrain_gpt.sh")
[[ ${#PASS[@]} -gt 0 ]] && TASK+=(-- "${PASS[@]}")

describe() {
    echo "# Slurm job $JOB_ID ($JOB_NAME): $NNODES nodes (${HOSTS[*]}), $GPUS_PER_NODE GPUs each," \
         "world size $((NNODES * GPUS_PER_NODE)), rendezvous $MASTER_ADDR:$MASTER_PORT"
    echo "# logs: $LOG_DIR/${NODE_LOG/node%n-%N/node<N>-<host>}${CONTAINER_IMAGE:+; container $CONTAINER_IMAGE}"
    printf 'export'
    for v in NNODES GPUS_PER_NODE MASTER_ADDR MASTER_PORT CONFIG MEGATRON_LM_DIR TRANSFORMER_IMPL; do
        [[ -n "${!v:-}" ]] && printf ' %s=%q' "$v" "${!v}"
    done
    echo
    printf '%q ' "${SRUN[@]}" "${TASK[@]}"
    echo
    local i
    for i in "${!HOSTS[@]}"; do
        echo "# node $i (${HOSTS[$i]}) runs:"
        NODE_RANK=$i SLURM_NODEID=$i METP_DIR="$TASK_METP_DIR" \
            bash "$HOST_SCRIPTS/pretrain_gpt.sh" --config "$CONFIG_ON_HOST" --print-cmd \
            ${PASS[@]+-- "${PASS[@]}"} | grep -v '^export CUDA_DEVICE_MAX_CONNECTIONS'
    done
}

# The config file and scripts as seen from this host, to print each node's command.
HOST_SCRIPTS="$METP_DIR/scripts"
if [[ "$CONFIG" == /* && -f "$CONFIG" ]]; then
    CONFIG_ON_HOST="$CONFIG"
else
    CONFIG_ON_HOST="$METP_DIR/configs/$(basename "$CONFIG")"
fi
[[ -f "$CONFIG_ON_HOST" ]] || die "config '$CONFIG' not found (looked for $CONFIG_ON_HOST)"

if [[ "$PRINT_ONLY" == 1 ]]; then
    describe
    exit 0
fi
if [[ -z "${CONTAINER_IMAGE:-}" && "${PREFLIGHT:-1}" != 0 ]]; then
    NODE_RANK=0 SLURM_NODEID=0 bash "$HOST_SCRIPTS/pretrain_gpt.sh" --config "$CONFIG_ON_HOST" \
        --preflight ${PASS[@]+-- "${PASS[@]}"} ||
        die "the preflight refused this job (above); nothing was started (PREFLIGHT=0 skips it)"
    export PREFLIGHT=0  # checked once for every node (the same files on the shared file system)
fi
if [[ -z "${CONTAINER_IMAGE:-}" ]]; then  # the ranks' environment, on this node (node 0)
    NODE_RANK=0 SLURM_NODEID=0 bash "$HOST_SCRIPTS/pretrain_gpt.sh" --config "$CONFIG_ON_HOST" \
        --check-node || die "this node refused the job (above); nothing was started"
fi
mkdir -p "$LOG_DIR"
describe | tee "$LOG_DIR/commands.txt"
exec "${SRUN[@]}" "${TASK[@]}"
