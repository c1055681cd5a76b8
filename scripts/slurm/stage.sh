#!/usr/bin/env bash
# The dataset on a node's fast scratch for the time of one command: copy, run, remove.
# Runs once on each node of a job (the job scripts start it with srun on several nodes).
#
#   stage.sh around SRC DEST -- COMMAND...   copy SRC to DEST, run COMMAND, remove DEST
#   stage.sh copy SRC DEST  |  stage.sh remove DEST
#
# Safe whether DEST is node-local or on a filesystem that several nodes share: the nodes take
# a lock (flock on DEST.lock), the first one copies into DEST.partial and renames it to DEST
# when complete, the others find DEST complete (every file with SRC's size) and use it. Each
# node signs in under DEST.users; the last one to leave removes the copy. The removal runs
# when COMMAND ends in any way, scancel and requeue included (SLURM signals every process of a
# step, and no new step can start in a job being cancelled, so it has to happen here).
# SIGUSR1 is passed on to COMMAND (the job's warning before its time limit); SIGTERM reaches
# COMMAND from SLURM itself, so here it only waits for COMMAND to finish.
# The time-limit warning may come before COMMAND has started (during the copy): remember it.
trap 'USR1_PENDING=1' USR1
set -euo pipefail
# shellcheck source=scripts/lib/forward.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/forward.sh"

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

NODE=${SLURMD_NODENAME:-$(hostname -s)}
# One attempt of one job: a requeued job's new attempt does not count its old attempt's nodes.
ATTEMPT=${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}

# "relative/path size" of every file under $1, sorted (the check that a copy is complete).
listing() {
    (cd "$1" && find . -type f ! -name .staged -printf '%P %s\n' | LC_ALL=C sort)
}

# Hold DEST's lock for the rest of this shell (fd 9) or die saying why.
lock() {
    exec 9>>"$DEST.lock"
    flock -w "${STAGE_LOCK_TIMEOUT:-3600}" 9 ||
        die "$NODE: could not lock $DEST.lock (another node still copying after ${STAGE_LOCK_TIMEOUT:-3600} s?)"
}

copy() {
    [[ -d $SRC ]] || die "DATA_DIR=$SRC is not a folder: set it to the preprocessed dataset"
    mkdir -p "$(dirname "$DEST")" || die "cannot create $(dirname "$DEST") (SCRATCH) on $NODE"
    lock
    local expected
    expected=$(listing "$SRC") || die "cannot read DATA_DIR=$SRC"
    [[ -n $expected ]] || die "DATA_DIR=$SRC holds no file: set it to the preprocessed dataset"
    if [[ -f $DEST/.staged ]] && [[ $(listing "$DEST") == "$expected" ]]; then
        echo "$NODE: $DEST already staged (a node sharing this scratch copied it)"
    else
        rm -rf "$DEST" "$DEST.partial"
        if command -v rsync >/dev/null 2>&1; then
            rsync -a "$SRC/" "$DEST.partial/" || die "copy of $SRC to $DEST.partial failed on $NODE"
        else
            mkdir -p "$DEST.partial"
            cp -a "$SRC/." "$DEST.partial/" || die "copy of $SRC to $DEST.partial failed on $NODE"
        fi
        [[ $(listing "$DEST.partial") == "$expected" ]] ||
            die "the copy in $DEST.partial differs from $SRC (names or sizes) on $NODE"
        : > "$DEST.partial/.staged"
        mv -T "$DEST.partial" "$DEST"
        echo "$NODE: copied $SRC to $DEST"
    fi
    mkdir -p "$DEST.users"
    # Sign-ins of an earlier attempt (a node killed before it could leave) no longer count.
    find "$DEST.users" -mindepth 1 ! -name "$ATTEMPT.*" -delete
    : > "$DEST.users/$ATTEMPT.$NODE"
    flock -u 9
    exec 9>&-
}

# Never fails: a cleanup problem is a warning, the job keeps the status of its work.
remove() {
    (
        lock
        rm -f "$DEST.users/$ATTEMPT.$NODE"
        if [[ -z $(ls -A "$DEST.users" 2>/dev/null) ]]; then
            rm -rf "$DEST" "$DEST.partial" "$DEST.users"
            rm -f "$DEST.lock"
        fi
    ) || printf 'warning: could not clean %s on %s\n' "$DEST" "$NODE" >&2
}

around() {
    copy
    local child='' status=0
    # Forward the time-limit warning (once COMMAND can take it); note SIGTERM/SIGINT and keep
    # waiting for COMMAND, which got them too and is saving its checkpoint.
    trap 'if [[ -n $child ]]; then forward_usr1 "$child" & else USR1_PENDING=1; fi' USR1
    trap ':' TERM INT
    "$@" &
    child=$!
    if [[ ${USR1_PENDING:-0} == 1 ]]; then
        forward_usr1 "$child" &
    fi
    # `wait` returns early (> 128) when a trapped signal arrives: wait again until COMMAND ends.
    while true; do
        status=0
        wait "$child" || status=$?
        kill -0 "$child" 2>/dev/null || break
    done
    remove
    return "$status"
}

action=${1:-}
case $action in
    around)
        [[ $# -ge 5 && $4 == -- ]] || die "usage: stage.sh around SRC DEST -- COMMAND..."
        SRC=$2 DEST=$3
        shift 4
        around "$@"
        ;;
    copy)
        [[ $# -eq 3 ]] || die "usage: stage.sh copy SRC DEST"
        SRC=$2 DEST=$3
        copy
        ;;
    remove)
        [[ $# -eq 2 ]] || die "usage: stage.sh remove DEST"
        DEST=$2
        remove
        ;;
    *) die "usage: stage.sh around|copy|remove ... (see the comment at the top)" ;;
esac
