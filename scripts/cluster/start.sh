#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for testing the job scripts:
# munged + slurmctld + two slurmd (`slurmd -N NAME`, NodeHostname = this host, one port each).
# Everything lives in one state folder that this script owns; scripts/cluster/stop.sh stops
# exactly what this script started and removes that folder. Run as root.
#
#   sudo scripts/cluster/start.sh            # then: source "$CLUSTER_DIR/env"; sinfo; sbatch ...
#   sudo scripts/cluster/stop.sh
#
# Settings (environment): CLUSTER_DIR (state folder, default /tmp/unet3d-slurm),
# CLUSTER_PORT (slurmctld's port; the nodes take the next two; default 16817),
# CLUSTER_NODES (two or more node names, default "unet3d-n1 unet3d-n2"), CLUSTER_CPUS (CPUs
# each node declares, default this host's count). Missing packages (slurm-wlm, munge) are
# installed with apt-get. Node names that do not resolve get a line in /etc/hosts (loopback),
# which stop.sh removes.
set -euo pipefail

CLUSTER_DIR=${CLUSTER_DIR:-/tmp/unet3d-slurm}
CLUSTER_PORT=${CLUSTER_PORT:-16817}
CLUSTER_NODES=${CLUSTER_NODES:-unet3d-n1 unet3d-n2}
CLUSTER_CPUS=${CLUSTER_CPUS:-$(nproc)}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/cluster/common.sh
source "$here/common.sh"

(( EUID == 0 )) || die "start.sh must run as root (it starts munged, slurmctld and slurmd and edits /etc/hosts)"
[[ $CLUSTER_PORT =~ ^[0-9]+$ ]] || die "CLUSTER_PORT must be a port number, got '$CLUSTER_PORT'"
read -r -a nodes <<< "$CLUSTER_NODES"
(( ${#nodes[@]} >= 1 )) || die "CLUSTER_NODES is empty"
if [[ -e $CLUSTER_DIR/$MARKER ]]; then
    die "a cluster is already set up in $CLUSTER_DIR: stop it first (scripts/cluster/stop.sh)"
fi
if [[ -e $CLUSTER_DIR ]] && [[ -n $(ls -A "$CLUSTER_DIR") ]]; then
    die "CLUSTER_DIR=$CLUSTER_DIR exists and is not empty: choose another folder"
fi

# --- packages -------------------------------------------------------------------------------
install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    for program in slurmctld slurmd sbatch; do
        command -v "$program" >/dev/null || { missing+=(slurm-wlm); break; }
    done
    (( ${#missing[@]} == 0 )) && return 0
    command -v apt-get >/dev/null || die "${missing[*]} missing and no apt-get to install them: install SLURM and MUNGE"
    echo "installing ${missing[*]} with apt-get" >&2
    # The packages' init scripts would start system-wide daemons: forbid that while installing
    # (only when no policy is in place already; ours is removed right after).
    local policy=/usr/sbin/policy-rc.d ours=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && ours=1
    fi
    local log=/tmp/unet3d-cluster-apt.log attempt ok=0
    for attempt in 1 2 3; do
        if apt-get update > "$log" 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >> "$log" 2>&1; then
            ok=1
            break
        fi
        sleep $(( attempt * 5 ))
    done
    (( ours )) && rm -f "$policy"
    (( ok )) || die "could not install ${missing[*]} with apt-get after 3 tries (see $log)"
}
install_packages

# --- state folder ---------------------------------------------------------------------------
mkdir -p "$CLUSTER_DIR"
: > "$CLUSTER_DIR/$MARKER"
# From here on, a failure stops whatever was started already.
trap 'status=$?; if (( status != 0 )); then echo "start.sh: failed, stopping what was started" >&2; CLUSTER_DIR=$CLUSTER_DIR bash "$here/stop.sh" >&2 || true; fi' EXIT
# munged insists: socket folder traversable by all, key folder private.
chmod 755 "$CLUSTER_DIR"
mkdir -p "$CLUSTER_DIR"/{run,log,etc,ctld,spool,munge}
chmod 755 "$CLUSTER_DIR/run"
chmod 700 "$CLUSTER_DIR/munge"

for port in $(seq "$CLUSTER_PORT" $(( CLUSTER_PORT + ${#nodes[@]} ))); do
    port_free "$port" || die "port $port is in use: set CLUSTER_PORT to a free range"
done

# --- node names -> loopback -----------------------------------------------------------------
unresolved=()
for node in "${nodes[@]}"; do
    getent hosts "$node" >/dev/null || unresolved+=("$node")
done
if (( ${#unresolved[@]} )); then
    line="127.0.0.1 ${unresolved[*]} $(hosts_tag "$CLUSTER_DIR")"
    # Append in place (the file may be a bind mount: never replace it).
    printf '%s\n' "$line" >> /etc/hosts
    printf '%s\n' "$line" > "$CLUSTER_DIR/hosts-line"
fi

# --- munge ----------------------------------------------------------------------------------
dd if=/dev/urandom of="$CLUSTER_DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$CLUSTER_DIR/munge/munge.key"
munged --key-file="$CLUSTER_DIR/munge/munge.key" --socket="$CLUSTER_DIR/run/munge.socket" \
    --pid-file="$CLUSTER_DIR/run/munged.pid" --seed-file="$CLUSTER_DIR/munge/munged.seed" \
    --log-file="$CLUSTER_DIR/log/munged.log" ||
    die "munged did not start (see $CLUSTER_DIR/log/munged.log)"

# --- slurm.conf -----------------------------------------------------------------------------
host=$(hostname -s)
conf=$CLUSTER_DIR/etc/slurm.conf
{
    cat <<EOF
# Written by scripts/cluster/start.sh: a test cluster on one host ($host).
ClusterName=unet3dtest
SlurmctldHost=$host
SlurmctldPort=$CLUSTER_PORT
AuthType=auth/munge
AuthInfo=socket=$CLUSTER_DIR/run/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$CLUSTER_DIR/ctld
SlurmctldPidFile=$CLUSTER_DIR/run/slurmctld.pid
SlurmctldLogFile=$CLUSTER_DIR/log/slurmctld.log
# %n: one spool, pid and log per node (several slurmd on one host)
SlurmdSpoolDir=$CLUSTER_DIR/spool/%n
SlurmdPidFile=$CLUSTER_DIR/run/slurmd-%n.pid
SlurmdLogFile=$CLUSTER_DIR/log/slurmd-%n.log
# No cgroups: processes are tracked by parent pid, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=3600
KillWait=30
InactiveLimit=0
EOF
    port=$CLUSTER_PORT
    for node in "${nodes[@]}"; do
        port=$(( port + 1 ))
        echo "NodeName=$node NodeHostname=$host Port=$port CPUs=$CLUSTER_CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
} > "$conf"
printf 'export SLURM_CONF=%q\n' "$conf" > "$CLUSTER_DIR/env"
export SLURM_CONF=$conf

# --- daemons --------------------------------------------------------------------------------
slurmctld -f "$conf" || die "slurmctld did not start (see $CLUSTER_DIR/log/slurmctld.log)"
for node in "${nodes[@]}"; do
    slurmd -f "$conf" -N "$node" || die "slurmd -N $node did not start (see $CLUSTER_DIR/log/slurmd-$node.log)"
done

# Ready when every node is idle.
for _ in $(seq 60); do
    idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    (( idle == ${#nodes[@]} )) && break
    sleep 0.5
done
(( idle == ${#nodes[@]} )) || die "the nodes did not become idle within 30 s (see $CLUSTER_DIR/log)"
trap - EXIT
echo "cluster up: ${nodes[*]} on $host (slurmctld port $CLUSTER_PORT); use it with: source $CLUSTER_DIR/env"
