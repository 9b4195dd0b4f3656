#!/usr/bin/env bash
# Run a METP config and its stock-TP twin (same model, same GPUs, TP of the same degree) one after
# the other on this node, then tabulate and plot both (python -m megatron_metp.compare).
#
#   scripts/compare_tp.sh [--config configs/gpt-1.3b-32k-metp8.sh] [--twin FILE] [--iters 20]
#                         [--out DIR] [--parse-only] [-- extra pretrain_gpt.py args]
#
#   --config FILE   the METP config (also $CONFIG; default configs/gpt-1.3b-32k-metp8.sh)
#   --twin FILE     the baseline config (default: TWIN_CONFIG named in the METP config)
#   --iters N       training iterations per run (default 20; the first 2 are left out of the
#                   time and throughput means)
#   --out DIR       where the logs and compare.md / iterations.csv / summary.csv / compare.png
#                   go (default compare-<config>-<date>)
#   --parse-only    do not train: tabulate the logs already in --out (metp.log, tp.log)
#
# Both runs use scripts/pretrain_gpt.sh, so every environment variable it reads applies to both
# (MEGATRON_LM_DIR, NNODES, GPUS_PER_NODE, DATA_PATH, ...); both configs' settings are checked
# (pretrain_gpt.sh --print-cmd) before the first run starts. For multi-node configs run the two
# Slurm jobs (scripts/slurm/pretrain_gpt.sbatch) and then
#   python -m megatron_metp.compare --log metp=<job1 node0 log> --log tp=<job2 node0 log> --out DIR
# (Megatron prints the iteration lines on the last rank: the last node's log).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
METP_DIR="${METP_DIR:-$(cd "$SCRIPT_DIR/.." && pwd)}"
PYTHON="${PYTHON:-python}"

die() {
    echo "compare_tp.sh: error: $*" >&2
    exit 1
}

CONFIG="${CONFIG:-configs/gpt-1.3b-32k-metp8.sh}"
TWIN=""
ITERS=20
OUT=""
PARSE_ONLY=0
PASS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) [[ $# -ge 2 ]] || die "--config needs a file"; CONFIG=$2; shift ;;
        --twin) [[ $# -ge 2 ]] || die "--twin needs a file"; TWIN=$2; shift ;;
        --iters) [[ $# -ge 2 ]] || die "--iters needs a number"; ITERS=$2; shift ;;
        --out) [[ $# -ge 2 ]] || die "--out needs a directory"; OUT=$2; shift ;;
        --parse-only) PARSE_ONLY=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        --) shift; PASS=("$@"); break ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

resolve() {  # a config path as given, or relative to the repository / its configs/
    local c=$1
    for cand in "$c" "$METP_DIR/$c" "$METP_DIR/configs/$c"; do
        if [[ -f "$cand" ]]; then
            echo "$(cd "$(dirname "$cand")" && pwd)/$(basename "$cand")"
            return 0
        fi
    done
    die "config '$c' not found"
}

CONFIG="$(resolve "$CONFIG")"
if [[ -z "$TWIN" ]]; then
    # shellcheck disable=SC2016  # expanded by the inner shell
    TWIN="$(bash -c 'source "$1" >/dev/null; echo "${TWIN_CONFIG:-}"' _ "$CONFIG")"
    [[ -n "$TWIN" ]] || die "$(basename "$CONFIG") names no TWIN_CONFIG; pass --twin FILE"
fi
TWIN="$(resolve "$TWIN")"
name="$(basename "$CONFIG" .sh)"
OUT="${OUT:-compare-$name-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

run_one() {  # label config
    local label=$1 config=$2
    echo "=== $label: $(basename "$config") ($ITERS iterations) -> $OUT/$label.log" >&2
    TRAIN_ITERS="$ITERS" bash "$SCRIPT_DIR/pretrain_gpt.sh" --config "$config" \
        ${PASS[@]+-- "${PASS[@]}"} 2>&1 | tee "$OUT/$label.log"
}

if [[ "$PARSE_ONLY" == 0 ]]; then
    for c in "$CONFIG" "$TWIN"; do  # both runs' settings, before the first one starts
        TRAIN_ITERS="$ITERS" bash "$SCRIPT_DIR/pretrain_gpt.sh" --config "$c" --print-cmd \
            ${PASS[@]+-- "${PASS[@]}"} >/dev/null ||
            die "the launcher refused the settings of $(basename "$c") (above); nothing was run"
    done
    run_one metp "$CONFIG" || die "the METP run failed; see $OUT/metp.log"
    run_one tp "$TWIN" || die "the TP run failed; see $OUT/tp.log"
fi
for f in metp tp; do
    [[ -f "$OUT/$f.log" ]] || die "$OUT/$f.log is missing"
done
PYTHONPATH="$METP_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m megatron_metp.compare --log "metp=$OUT/metp.log" --log "tp=$OUT/tp.log" --out "$OUT"
