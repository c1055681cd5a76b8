#!/usr/bin/env bash
# Stop the test cluster that scripts/cluster/start.sh started in CLUSTER_DIR (default
# /tmp/unet3d-slurm): its jobs, its slurmd, slurmctld and munged (by the pids in its own pid
# files, nothing else), its /etc/hosts line; then remove the state folder. Safe to run twice.
set -euo pipefail

CLUSTER_DIR=${CLUSTER_DIR:-/tmp/unet3d-slurm}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/cluster/common.sh
source "$here/common.sh"

if [[ ! -e $CLUSTER_DIR/$MARKER ]]; then
    echo "no cluster in $CLUSTER_DIR: nothing to stop"
    exit 0
fi
(( EUID == 0 )) || die "stop.sh must run as root (it stops the daemons that start.sh started)"
run=$CLUSTER_DIR/run

# The pid in file $1 if that process is alive and runs program $2 (a reused pid is left alone).
live_pid() {
    local pid
    [[ -f $1 ]] || return 1
    pid=$(tr -dc 0-9 < "$1")
    [[ -n $pid && -r /proc/$pid/comm && $(cat "/proc/$pid/comm") == "$2"* ]] || return 1
    echo "$pid"
}

# stop_daemon PIDFILE PROGRAM: SIGTERM, wait up to 10 s, then SIGKILL.
stop_daemon() {
    local pid
    pid=$(live_pid "$1" "$2") || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    echo "warning: $2 (pid $pid) ignored SIGTERM for 10 s: killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
}

# Cancel what still runs, so that slurmd ends its jobs' processes before it goes.
if [[ -f $CLUSTER_DIR/etc/slurm.conf ]] && live_pid "$run/slurmctld.pid" slurmctld >/dev/null; then
    export SLURM_CONF=$CLUSTER_DIR/etc/slurm.conf
    mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
    if (( ${#jobs[@]} )); then
        scancel --full --signal=KILL "${jobs[@]}" 2>/dev/null || true
        scancel "${jobs[@]}" 2>/dev/null || true
        for _ in $(seq 100); do
            [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
fi
for pidfile in "$run"/slurmd-*.pid; do
    [[ -e $pidfile ]] && stop_daemon "$pidfile" slurmd
done
stop_daemon "$run/slurmctld.pid" slurmctld
stop_daemon "$run/munged.pid" munged

# The /etc/hosts line start.sh added, exactly that one, edited in place.
if [[ -f $CLUSTER_DIR/hosts-line ]]; then
    line=$(cat "$CLUSTER_DIR/hosts-line")
    kept=$(grep -vxF -- "$line" /etc/hosts || true)
    printf '%s\n' "$kept" > /etc/hosts
fi
rm -rf "$CLUSTER_DIR"
echo "cluster in $CLUSTER_DIR stopped"
