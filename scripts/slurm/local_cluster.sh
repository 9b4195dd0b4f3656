#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for CI: slurmctld plus two slurmd (n1, n2, both
# 127.0.0.1 on their own ports) and a private munged, everything (config, key, state, spool,
# logs, pid files) inside DIR. Run as root (SlurmUser=root).
#
#   scripts/slurm/local_cluster.sh start DIR    # install the Debian packages when absent, start
#   scripts/slurm/local_cluster.sh status DIR   # sinfo of the cluster
#   scripts/slurm/local_cluster.sh stop DIR     # kill the daemons started by `start` (DIR/pids)
#   export SLURM_CONF=DIR/slurm.conf            # for sbatch/srun/sinfo/scontrol
#
# Settings: LOCAL_SLURM_PORT [16817]: slurmctld's port; the slurmd of n1 and n2 use the next two.
#   LOCAL_SLURM_CPUS [nproc]: CPUs each node offers (one task per node; torchrun starts the ranks).
#   LOCAL_SLURM_WAIT [60]: seconds to wait for both nodes to be idle.
set -euo pipefail

die() {
    echo "local_cluster.sh: error: $*" >&2
    exit 1
}

[[ $# -eq 2 ]] || die "usage: local_cluster.sh {start|stop|status} DIR"
ACTION=$1
mkdir -p "$2"
DIR="$(cd "$2" && pwd)"
CONF="$DIR/slurm.conf"
PORT="${LOCAL_SLURM_PORT:-16817}"
CPUS="${LOCAL_SLURM_CPUS:-$(nproc)}"
WAIT="${LOCAL_SLURM_WAIT:-60}"
NODES=(n1 n2)

install_packages() {  # only what is missing
    local need=()
    command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
    command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
    command -v munged >/dev/null 2>&1 || need+=(munge)
    command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
    [[ ${#need[@]} -eq 0 ]] && return 0
    [[ $(id -u) -eq 0 ]] || die "missing ${need[*]} and not root (cannot apt-get install)"
    echo "local_cluster.sh: installing ${need[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2 ||
        { DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2; } ||
        die "apt-get could not install ${need[*]}"
}

write_conf() {
    local ctl_host node_lines="" i
    ctl_host="$(hostname -s)"
    for i in "${!NODES[@]}"; do
        node_lines+="NodeName=${NODES[$i]} NodeAddr=127.0.0.1 NodeHostname=$ctl_host Port=$((PORT + 1 + i)) CPUs=$CPUS State=UNKNOWN"$'\n'
    done
    cat > "$CONF" <<EOF
# written by scripts/slurm/local_cluster.sh: two nodes on 127.0.0.1, state and logs in $DIR
ClusterName=metpci
SlurmctldHost=$ctl_host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
$node_lines
PartitionName=ci Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
}

record() {  # name pidfile: wait (bounded) for a daemon's pid file, add the pid to DIR/pids
    local name=$1 pidfile=$2 t
    for ((t = 0; t < 100; t++)); do
        [[ -s "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null && break
        sleep 0.1
    done
    [[ -s "$pidfile" ]] || die "timed out after 10 s waiting for $name's pid file $pidfile (log in $DIR/log)"
    echo "$name $(cat "$pidfile")" >> "$DIR/pids"
}

running() {  # any pid of DIR/pids alive?
    local name pid
    [[ -f "$DIR/pids" ]] || return 1
    while read -r name pid; do
        kill -0 "$pid" 2>/dev/null && return 0
    done < "$DIR/pids"
    return 1
}

start() {
    running && die "a cluster is already running from $DIR (stop it first)"
    install_packages
    rm -f "$DIR/pids"
    mkdir -p "$DIR/munge" "$DIR/state" "$DIR/log" "${NODES[@]/#/$DIR/spool/}"
    chmod 700 "$DIR/munge"
    [[ -f "$DIR/munge/munge.key" ]] || { head -c 1024 /dev/urandom > "$DIR/munge/munge.key"; }
    chmod 600 "$DIR/munge/munge.key"
    write_conf
    export SLURM_CONF="$CONF"
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" ||
        die "munged did not start (see $DIR/log/munged.log)"
    record munged "$DIR/munge/munged.pid"
    slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
    record slurmctld "$DIR/slurmctld.pid"
    local n
    for n in "${NODES[@]}"; do
        slurmd -f "$CONF" -N "$n" || die "slurmd -N $n did not start (see $DIR/log/slurmd-$n.log)"
        record "slurmd-$n" "$DIR/slurmd-$n.pid"
    done
    local t idle=0
    for ((t = 0; t < WAIT; t++)); do
        idle="$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)"
        [[ "$idle" -eq ${#NODES[@]} ]] && break
        sleep 1
    done
    if [[ "$idle" -ne ${#NODES[@]} ]]; then
        sinfo -N -l >&2 || true
        die "timed out after $WAIT s waiting for nodes ${NODES[*]} to be idle in sinfo (logs in $DIR/log)"
    fi
    echo "local_cluster.sh: nodes ${NODES[*]} idle; export SLURM_CONF=$CONF" >&2
}

stop() {
    [[ -f "$DIR/pids" ]] || { echo "local_cluster.sh: nothing to stop in $DIR" >&2; return 0; }
    local name pid t left
    # the slurmd first, munged last (the others talk to it while shutting down)
    tac "$DIR/pids" | while read -r name pid; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for ((t = 0; t < 300; t++)); do
        left=""
        while read -r name pid; do
            kill -0 "$pid" 2>/dev/null && left+=" $name($pid)"
        done < "$DIR/pids"
        [[ -z "$left" ]] && break
        sleep 0.1
    done
    if [[ -n "$left" ]]; then
        echo "local_cluster.sh: timed out after 30 s waiting for$left to exit; sending SIGKILL" >&2
        while read -r name pid; do
            kill -KILL "$pid" 2>/dev/null || true
        done < "$DIR/pids"
    fi
    rm -f "$DIR/pids"
    echo "local_cluster.sh: stopped the cluster in $DIR" >&2
}

case "$ACTION" in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF="$CONF" sinfo -N -l ;;
    *) die "unknown action '$ACTION' (start, stop or status)" ;;
esac
