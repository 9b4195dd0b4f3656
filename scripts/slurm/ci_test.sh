#!/usr/bin/env bash
# CI leg for the Slurm launcher: a two-node Slurm cluster on this machine
# (scripts/slurm/local_cluster.sh), then scripts/slurm/pretrain_gpt.sbatch on 2 nodes for a tiny
# CPU config (METP_CPU=1) and for its stock-TP twin, and the two runs' lm loss per iteration
# must agree (relative 1e-5, as tests/test_megatron_lm_train.py asks of scripts/compare_tp.sh).
# Run as root (the cluster's daemons run as root); `make test-slurm` runs it.
#
#   MEGATRON_LM_DIR=/path/to/patched/Megatron-LM scripts/slurm/ci_test.sh
#
# Settings: CI_CONFIG [configs/tiny-cpu-metp2-cp2.sh] and its TWIN_CONFIG, run with
#   CI_GPUS_PER_NODE [2] and CI_TWIN_GPUS_PER_NODE [1] CPU ranks per node (world 4 and 2);
#   CI_ITERS [3] training iterations; CI_DIR [mktemp -d]: the cluster, logs and compare.md (kept
#   when given; a mktemp one is removed after a pass); PYTHON: the Python for the ranks and the
#   comparison (scripts/pretrain_gpt.sh's default when unset); CI_JOB_TIMEOUT [600] seconds per job.
set -euo pipefail

die() {
    echo "ci_test.sh: error: $*" >&2
    exit 1
}

METP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to the patched Megatron-LM checkout}"
export MEGATRON_LM_DIR
CONFIG="${CI_CONFIG:-configs/tiny-cpu-metp2-cp2.sh}"
ITERS="${CI_ITERS:-3}"
JOB_TIMEOUT="${CI_JOB_TIMEOUT:-600}"
[[ -f "$METP_DIR/$CONFIG" ]] || die "config $CONFIG not found in $METP_DIR"
# shellcheck disable=SC2016  # expanded by the inner shell
TWIN="$(bash -c 'source "$1" >/dev/null; echo "${TWIN_CONFIG:-}"' _ "$METP_DIR/$CONFIG")"
[[ -n "$TWIN" ]] || die "$CONFIG names no TWIN_CONFIG"
TWIN="configs/$TWIN"
if [[ -n "${CI_DIR:-}" ]]; then
    DIR="$CI_DIR"; KEEP=1
    mkdir -p "$DIR"
else
    DIR="$(mktemp -d /tmp/metp-slurm-ci.XXXXXX)"; KEEP=0
fi
CLUSTER="$METP_DIR/scripts/slurm/local_cluster.sh"
PY="${PYTHON:-python}"

T0=$(date +%s)
cleanup() {
    local rc=$?
    bash "$CLUSTER" stop "$DIR/cluster" || true
    if [[ $rc -eq 0 && $KEEP == 0 ]]; then
        rm -rf "$DIR"
    else
        echo "ci_test.sh: logs kept in $DIR" >&2
    fi
    echo "ci_test.sh: leg wall time $(( $(date +%s) - T0 )) s (exit $rc)" >&2
}
trap cleanup EXIT

t=$(date +%s)
bash "$CLUSTER" start "$DIR/cluster"
export SLURM_CONF="$DIR/cluster/slurm.conf"
echo "ci_test.sh: cluster started in $(( $(date +%s) - t )) s" >&2

run_job() {  # label config ranks-per-node: sbatch --wait, from the checkout's root
    local label=$1 config=$2 per_node=$3 t rc=0
    t=$(date +%s)
    echo "ci_test.sh: sbatch $label: $config, 2 nodes x $per_node CPU ranks, $ITERS iterations" >&2
    # the #SBATCH GPU line is overridden; --exclusive and --mem=0 hold on these nodes
    (cd "$METP_DIR" && env -u METP_DIR CONFIG="$config" GPUS_PER_NODE="$per_node" \
        TRAIN_ITERS="$ITERS" METP_CPU=1 MASTER_ADDR=127.0.0.1 LOG_DIR="$DIR/logs/$label" \
        timeout "$JOB_TIMEOUT" sbatch --wait --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 \
            --time=00:15:00 --job-name="metp-ci-$label" --output="$DIR/$label-%j.out" \
            scripts/slurm/pretrain_gpt.sbatch) || rc=$?
    echo "ci_test.sh: sbatch $label: exit $rc in $(( $(date +%s) - t )) s" >&2
    if [[ $rc -ne 0 ]]; then
        [[ $rc -eq 124 ]] && echo "ci_test.sh: timed out after $JOB_TIMEOUT s waiting for job $label" >&2
        tail -n 40 "$DIR/$label"-*.out "$DIR/logs/$label"/node*.log >&2 2>/dev/null || true
        die "the $label job failed (exit $rc)"
    fi
}

run_job metp "$CONFIG" "${CI_GPUS_PER_NODE:-2}"
run_job tp "$TWIN" "${CI_TWIN_GPUS_PER_NODE:-1}"

# Megatron prints the iteration lines on the last rank: the last node's log
last_log() {
    local f=("$DIR/logs/$1"/node1-*.log)
    if [[ -f "${f[0]}" ]]; then echo "${f[0]}"; fi
}
METP_LOG="$(last_log metp)"; TP_LOG="$(last_log tp)"
[[ -n "$METP_LOG" && -n "$TP_LOG" ]] || die "no node-1 log in $DIR/logs/metp or $DIR/logs/tp"
PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m megatron_metp.compare \
    --log "metp=$METP_LOG" --log "tp=$TP_LOG" --out "$DIR/compare" >/dev/null ||
    die "python -m megatron_metp.compare failed"
PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$METP_LOG" "$TP_LOG" "$ITERS" <<'EOF'
import sys
from megatron_metp.tools.compare import loss_rel_diffs, parse_log
metp_log, tp_log, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = {n: parse_log(open(p, errors="replace").read()) for n, p in (("metp", metp_log), ("tp", tp_log))}
for n, r in runs.items():
    got = sorted(i.iteration for i in r.iterations if i.lm_loss is not None)
    if got != list(range(1, iters + 1)):
        sys.exit(f"ci_test.sh: {n}: lm loss at iterations {got}, expected 1..{iters}")
diffs = loss_rel_diffs(runs)
for k, d in sorted(diffs.items()):
    a, b = (next(i.lm_loss for i in r.iterations if i.iteration == k) for r in runs.values())
    print(f"ci_test.sh: iteration {k}: lm loss metp {a:.6E} tp {b:.6E} rel. diff {d:.1e}")
bad = {k: d for k, d in diffs.items() if d > 1e-5}
if bad:
    sys.exit(f"ci_test.sh: lm loss differs by more than 1e-5 at iterations {sorted(bad)}")
print(f"ci_test.sh: PASS: the METP job's lm loss equals its stock-TP twin's at {len(diffs)} iterations")
EOF
