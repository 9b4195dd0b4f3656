#!/usr/bin/env bash
# CI leg for the Slurm launcher (`make test-slurm`, run by .ci/run after `make test`; as root: the
# cluster's daemons run as root). A two-node Slurm cluster on this machine
# (scripts/slurm/local_cluster.sh; Slurm and munge installed with apt-get when absent), then
# scripts/slurm/pretrain_gpt.sbatch with --nodes=2 (CPU ranks, METP_CPU=1):
#
#   refusal   tiny-cpu-metp2.sh with 1 rank per node: its METP ring would span the two nodes;
#             the job's preflight refuses it before any rank starts, naming the fix
#   twins     tiny-cpu-metp2.sh (2 ranks per node: one METP ring per node, DP 2) for ITERS
#             iterations, tiny-cpu-metp2-cp2.sh (METP 2 x CP 2, the K/V ring across the nodes)
#             stopped by --exit-interval, and their stock twin tiny-cpu-tp2.sh (1 rank per node):
#             lm loss within 1e-5 of the twin's at every iteration
#   sigkill   tiny-cpu-metp2.sh saving every SAVE iterations; once a checkpoint is published,
#             every process of node n2 gets SIGKILL: the job must end (FAILED) within the job
#             timeout with a rank naming ranks 2, 3 (those of n2)
#   sigterm   the same command submitted again: it resumes from the last published checkpoint;
#             at its first iteration, `scancel --signal=TERM`: the ranks save a checkpoint and
#             the job ends COMPLETED (exit 0)
#   requeue   `scontrol requeue` of that job: it resumes from the SIGTERM checkpoint (verified
#             against its manifest) and trains to ITERS; every printed lm loss and grad norm of
#             the resumed runs equals the uninterrupted twins run's as strings (Megatron's log
#             quirk aside: scripts/slurm/ci_compare.py), and the final checkpoints are identical
#
# Each sub-leg prints its wall time; any mismatch ends the leg non-zero. The daemons started
# here (and only those, by pid) are stopped on exit, also on failure.
#
#   scripts/slurm/ci_test.sh
#
# Settings: MEGATRON_LM_DIR [unset: the session's release unpacked from
#   ../shared/megatron-lm/ and patched, as the tests do (tests/megatron_lm_checkout.py)];
#   PYTHON: the Python for the ranks and the comparisons (scripts/pretrain_gpt.sh's default when
#   unset); CI_ITERS [12] iterations; CI_SAVE [3] save interval of the preemption jobs;
#   CI_DIR [mktemp -d]: the cluster, checkouts, logs and checkpoints (kept when given; a mktemp
#   one is removed after a pass); CI_JOB_TIMEOUT [300] seconds per job; LOCAL_SLURM_PORT
#   [16817] (scripts/slurm/local_cluster.sh).
set -euo pipefail

die() {
    echo "ci_test.sh: FAIL: $*" >&2
    exit 1
}
say() { echo "ci_test.sh: $*" >&2; }

METP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ITERS="${CI_ITERS:-12}"
SAVE="${CI_SAVE:-3}"
JOB_TIMEOUT="${CI_JOB_TIMEOUT:-300}"
if [[ -n "${CI_DIR:-}" ]]; then
    DIR="$CI_DIR"; KEEP=1
    mkdir -p "$DIR"
    DIR="$(cd "$DIR" && pwd)"
else
    DIR="$(mktemp -d /tmp/metp-slurm-ci.XXXXXX)"; KEEP=0
fi
CLUSTER="$METP_DIR/scripts/slurm/local_cluster.sh"
PY="${PYTHON:-python}"
export PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}"

T0=$(date +%s)
TIMES=()
cleanup() {
    local rc=$? t
    if [[ -n "${SLURM_CONF:-}" ]] && [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
        scancel --partition=ci || true  # a job still running (a failed sub-leg): its ranks too
        for ((t = 0; t < 150; t++)); do
            [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
            sleep 0.2
        done
    fi
    bash "$CLUSTER" stop "$DIR/cluster" || true
    if [[ $rc -eq 0 && $KEEP == 0 ]]; then
        rm -rf "$DIR"
    else
        echo "ci_test.sh: logs kept in $DIR" >&2
    fi
    echo "ci_test.sh: sub-leg times: ${TIMES[*]-none}" >&2
    echo "ci_test.sh: leg wall time $(( $(date +%s) - T0 )) s (exit $rc)" >&2
}
trap cleanup EXIT

LEG_T=$(date +%s)
leg_done() {  # name: record the sub-leg's wall time
    local t
    t=$(( $(date +%s) - LEG_T ))
    TIMES+=("$1=${t}s")
    say "$1: done in $t s"
    LEG_T=$(date +%s)
}

if [[ -z "${MEGATRON_LM_DIR:-}" ]]; then
    MEGATRON_LM_DIR="$("$PY" -m tests.megatron_lm_checkout "$DIR/megatron-lm")" ||
        die "no Megatron-LM checkout (set MEGATRON_LM_DIR to a patched one)"
    leg_done checkout
fi
export MEGATRON_LM_DIR

bash "$CLUSTER" start "$DIR/cluster"
export SLURM_CONF="$DIR/cluster/slurm.conf"
leg_done cluster

# ------------------------------------------------------------------------------ jobs

submit() {  # label config ranks-per-node [VAR=value ...] [-- pretrain_gpt.py args]: the job id
    local label=$1 config=$2 per_node=$3 envs=()
    shift 3
    while [[ $# -gt 0 && "$1" != -- ]]; do envs+=("$1"); shift; done
    mkdir -p "$DIR/logs"
    # the #SBATCH GPU line is overridden; --exclusive and --mem=0 hold on these nodes
    (cd "$METP_DIR" && env -u METP_DIR CONFIG="$config" GPUS_PER_NODE="$per_node" \
        TRAIN_ITERS="$ITERS" EVAL_ITERS=0 METP_CPU=1 MASTER_ADDR=127.0.0.1 \
        LOG_DIR="$DIR/logs/$label" ${envs[@]+"${envs[@]}"} \
        sbatch --parsable --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --time=00:15:00 \
            --job-name="metp-ci-$label" --output="$DIR/logs/$label.out" \
            scripts/slurm/pretrain_gpt.sbatch "$@") || die "sbatch of the $label job failed"
}

state() {  # job id: "STATE EXITCODE RESTARTS"
    scontrol show job -o "$1" | awk '{ for (i = 1; i <= NF; i++) { split($i, kv, "=");
        if (kv[1] == "JobState" || kv[1] == "ExitCode" || kv[1] == "Restarts") v[kv[1]] = kv[2] }
        print v["JobState"], v["ExitCode"], v["Restarts"] }'
}

wait_job() {  # job id label [restarts]: wait (bounded) for the end of the job's start; its state
    local jid=$1 label=$2 restarts=${3:-0} t s
    for ((t = 0; t < JOB_TIMEOUT * 5; t++)); do
        read -r -a s <<< "$(state "$jid")"
        case "${s[0]}" in
            COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)
                [[ "${s[2]}" == "$restarts" ]] && { echo "${s[0]} ${s[1]}"; return 0; } ;;
        esac
        sleep 0.2
    done
    scancel "$jid" || true
    tail -n 30 "$DIR/logs/$label.out" "$DIR/logs/$label"/node*.log >&2 2>/dev/null || true
    die "timed out after $JOB_TIMEOUT s waiting for job $jid ($label)"
}

expect() {  # label "STATE EXIT" wanted got
    [[ "$3" == "$2" ]] && return 0
    tail -n 40 "$DIR/logs/$1.out" "$DIR/logs/$1"/node*.log >&2 2>/dev/null || true
    die "the $1 job ended $3, expected $2 (logs above)"
}

wait_for() {  # description seconds command...: poll (0.1 s) until the command succeeds
    local what=$1 limit=$2 t
    shift 2
    for ((t = 0; t < limit * 10; t++)); do
        "$@" && return 0
        sleep 0.1
    done
    die "timed out after $limit s waiting for $what"
}

last_log() {  # label [restart]: the last node's log (Megatron prints iterations on the last rank)
    local f=("$DIR/logs/$1"/node1-*"${2:+.restart$2}".log)
    [[ -f "${f[0]}" ]] || die "no node-1 log in $DIR/logs/$1${2:+ (restart $2)}"
    echo "${f[0]}"
}

compare() { "$PY" "$METP_DIR/scripts/slurm/ci_compare.py" "$@"; }  # callers: || die

# --------------------------------------------------------- refusal: a METP ring across nodes
jid=$(submit refusal configs/tiny-cpu-metp2.sh 1)
expect refusal "FAILED 1:0" "$(wait_job "$jid" refusal)"
if ! grep -q "the METP group of global ranks \[0, 1\] would span nodes 0, 1" "$DIR/logs/refusal.out" ||
   ! grep -q "Fix: keep TP x METP a divisor of the GPUs per node (1)" "$DIR/logs/refusal.out"; then
    cat "$DIR/logs/refusal.out" >&2
    die "the refusal does not name the METP ring and the fix"
fi
[[ ! -e "$DIR/logs/refusal/commands.txt" ]] || die "the refused job started srun"
say "refusal: $(grep -o 'the METP group of global ranks.*would span nodes 0, 1' "$DIR/logs/refusal.out")"
leg_done refusal

# ------------------------------------------------------------------- twins (and --exit-interval)
EXIT_AT=$((ITERS / 2))
jid=$(submit metp configs/tiny-cpu-metp2.sh 2 CHECKPOINT_PATH="$DIR/ckpt-metp" \
    SAVE_INTERVAL="$ITERS" -- --num-workers 0)
expect metp "COMPLETED 0:0" "$(wait_job "$jid" metp)"
jid=$(submit cp2 configs/tiny-cpu-metp2-cp2.sh 2 CHECKPOINT_PATH="$DIR/ckpt-cp2" \
    SAVE_INTERVAL=1000 -- --num-workers 0 --exit-interval "$EXIT_AT")
expect cp2 "COMPLETED 0:0" "$(wait_job "$jid" cp2)"
jid=$(submit tp configs/tiny-cpu-tp2.sh 1 -- --num-workers 0)
expect tp "COMPLETED 0:0" "$(wait_job "$jid" tp)"
METP_LOG=$(last_log metp); TP_LOG=$(last_log tp)
# each node says which Python environment its ranks use (a CPU-only one is refused on GPU nodes)
grep -qE "pretrain_gpt.sh: node 0 of 2 \(.*\): [^ ]+ \(torch " "$DIR/logs/metp.out" ||
    die "the batch host did not name the ranks' Python environment"
r=$(compare twins "$METP_LOG" "$TP_LOG" "$ITERS") || die "tiny-cpu-metp2.sh against its twin"
say "twins: tiny-cpu-metp2.sh (2 nodes x 2 ranks) against tiny-cpu-tp2.sh (2 x 1): $r"
if ! grep -q "exiting program at iteration *$EXIT_AT" "$DIR/logs/cp2"/node0-*.log ||
   [[ "$(cat "$DIR/ckpt-cp2/latest_checkpointed_iteration.txt")" != "$EXIT_AT" ]]; then
    die "the cp2 job did not stop at --exit-interval $EXIT_AT with a checkpoint"
fi
sed -n "1,/iteration *$EXIT_AT\//p" "$TP_LOG" > "$DIR/logs/tp-first-$EXIT_AT.log"
r=$(compare twins "$(last_log cp2)" "$DIR/logs/tp-first-$EXIT_AT.log" "$EXIT_AT") ||
    die "tiny-cpu-metp2-cp2.sh against its twin"
say "twins: tiny-cpu-metp2-cp2.sh (stopped by --exit-interval $EXIT_AT, saved) against" \
    "tiny-cpu-tp2.sh: $r"
leg_done twins

# ------------------------------------------ sigkill: one node's processes die; the job ends
CK="$DIR/ckpt-preempt"
PREEMPT=(configs/tiny-cpu-metp2.sh 2 CHECKPOINT_PATH="$CK" SAVE_INTERVAL="$SAVE" --
         --num-workers 0)
jid=$(submit sigkill "${PREEMPT[@]}")
published() { [[ -s "$CK/latest_checkpointed_iteration.txt" ]]; }
wait_for "a published checkpoint of the sigkill job" "$JOB_TIMEOUT" published
node_pids() {  # job id node: the processes of the job's step on that node (their environment)
    local p e
    for p in /proc/[0-9]*; do
        e="$(tr '\0' '\n' 2>/dev/null < "$p/environ")" || continue
        [[ $'\n'"$e"$'\n' == *$'\n'"SLURM_JOB_ID=$1"$'\n'* &&
           $'\n'"$e"$'\n' == *$'\n'"SLURMD_NODENAME=$2"$'\n'* ]] && echo "${p#/proc/}"
    done
}
mapfile -t victims < <(node_pids "$jid" n2)
[[ ${#victims[@]} -gt 0 ]] || die "no process of job $jid found on n2"
kill -KILL "${victims[@]}" 2>/dev/null || true
killed_at=$(date +%s.%N)
got=$(wait_job "$jid" sigkill)
took=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
expect sigkill "FAILED" "${got% *}"
S=$(cat "$CK/latest_checkpointed_iteration.txt")
named=$(grep -ho "StalledRankError: METP: ranks 2, 3 stalled or died[^(]*" \
    "$DIR/logs/sigkill"/node0-*.log | head -n 1)
[[ -n "$named" ]] || { tail -n 30 "$DIR/logs/sigkill"/node0-*.log >&2; die "no rank named ranks 2, 3"; }
# the job timeout: --distributed-timeout-minutes (10 min, Megatron's default) = METP's
awk -v t="$took" 'BEGIN { exit !(t < 600) }' || die "the job took $took s to end after the kill"
say "sigkill: SIGKILL of n2's ${#victims[@]} processes (pids ${victims[*]}); the job ended" \
    "$got ${took} s later; $named; last published checkpoint: iteration $S"
leg_done sigkill

# ------------------------------------------- sigterm: resubmitted, resumes, saves on SIGTERM
jid=$(submit sigterm "${PREEMPT[@]}")
started() { grep -q "iteration *$((S + 1))/" "$DIR/logs/sigterm"/node1-*.log 2>/dev/null; }
wait_for "iteration $((S + 1)) of the resubmitted job" "$JOB_TIMEOUT" started
scancel --signal=TERM "$jid"
expect sigterm "COMPLETED 0:0" "$(wait_job "$jid" sigterm)"
verified() {  # label iteration: its preflight or ranks verified iteration's manifest at --load
    grep -qF -- "--load $CK: iter_$(printf %07d "$2") verified against its manifest" \
        "$DIR/logs/$1.out" "$DIR/logs/$1"/node0-*.log
}
verified sigterm "$S" || die "the resubmitted job did not resume from iteration $S"
grep -q "exiting program after receiving SIGTERM" "$DIR/logs/sigterm"/node0-*.log ||
    die "the sigterm job did not exit on the signal"
J=$(cat "$CK/latest_checkpointed_iteration.txt")
[[ "$J" -gt "$S" && "$J" -lt "$ITERS" ]] || die "the SIGTERM checkpoint is iteration $J"
say "sigterm: resumed from iteration $S, saved iteration $J on SIGTERM, exit 0; against the" \
    "uninterrupted run:"
compare resumed "$METP_LOG" "$(last_log sigterm)" "$((S + 1))" "$J" >&2 ||
    die "the resubmitted job's losses differ from the uninterrupted run's"
leg_done sigterm

# ------------------------------------------------ requeue: resumes from the SIGTERM checkpoint
# a requeued job waits ~2 min for its begin time: start it now, but not within 2 s of its end
# (a start in the second of the last one's end finds its credential revoked: "Killing
# non-startable batch job"); the update has the scheduler start it at once
sleep 2
scontrol requeue "$jid"
scontrol update JobId="$jid" StartTime=now
expect requeue "COMPLETED 0:0" "$(wait_job "$jid" sigterm 1)"
verified sigterm "$J" || die "the requeued job did not resume from iteration $J"
say "requeue: resumed from the verified iteration $J, trained to $ITERS; against the" \
    "uninterrupted run:"
compare resumed "$METP_LOG" "$(last_log sigterm 1)" "$((J + 1))" "$ITERS" >&2 ||
    die "the requeued job's losses differ from the uninterrupted run's"
r=$(compare checkpoints "$DIR/ckpt-metp/iter_$(printf %07d "$ITERS")" \
    "$CK/iter_$(printf %07d "$ITERS")") || die "the final checkpoints differ"
say "requeue: final checkpoints (iteration $ITERS): $r"
leg_done requeue
say "PASS"
