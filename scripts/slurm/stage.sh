#!/usr/bin/env bash
# The dataset on a node's fast scratch for the time of one command: copy, run, remove.
# Runs once on each node of a job (the job scripts start it with srun on several nodes).
#
#   stage.sh around SRC STAGE_DIR -- COMMAND...   copy SRC to STAGE_DIR/kits19, run COMMAND,
#                                                 remove STAGE_DIR
#   stage.sh in-place SRC -- COMMAND...           run COMMAND on SRC where it is (no copy)
#   stage.sh copy SRC STAGE_DIR  |  stage.sh remove STAGE_DIR
#
# STAGE_DIR is this job's own folder (the job scripts name it $SCRATCH/unet3d-job-<job id>):
# created by the job, marked as its own (.unet3d-stage holds the folder's name, the job id and
# the user), and the only thing it ever removes. A folder of that name that the job did not
# create (no marker, or another job's) is refused with one line and left untouched; nothing
# outside STAGE_DIR is touched but its lock file STAGE_DIR.lock. So several jobs of one user
# on one $SCRATCH (a sweep) each have their copy, and a dataset kept on $SCRATCH is only read.
#
# Safe whether STAGE_DIR is node-local or on a filesystem that several nodes share: the nodes
# take a lock (flock on STAGE_DIR.lock), the first one copies into kits19.partial and renames
# it to kits19 when complete, the others find it complete (every file with SRC's size) and use
# it. Each node signs in under STAGE_DIR/.users; the last one to leave removes STAGE_DIR. A
# requeued attempt of the job (same job id) reuses a complete copy its earlier attempt left, and
# that attempt's sign-ins no longer count. The removal runs when COMMAND ends in any way,
# scancel and requeue included (SLURM signals every process of a step, and no new step can
# start in a job being cancelled, so it has to happen here).
#
# Before COMMAND starts, after the copy, the node's page cache is dropped (CLEAR_CACHES=1, the
# default, as NVIDIA's MLPerf jobs do; root, or `sudo -n sysctl`), so the timed run reads its data
# cold; COMMAND gets UNET3D_CACHE_CLEARED=1 when the data it reads (the copy, or SRC in place) is
# cold and 0 when not, with one line saying why (scripts/lib/drop_page_cache.sh: a SLURM prolog's
# drop, made before the copy, does not count for a copy; a copy on tmpfs is in RAM), and the
# MLPerf log's cache_clear says the same.
# SIGUSR1 is passed on to COMMAND (the job's warning before its time limit); SIGTERM reaches
# COMMAND from SLURM itself, so here it only waits for COMMAND to finish.
# The time-limit warning may come before COMMAND has started (during the copy): main traps it
# first thing and remembers it. Bash (5.2) fails to parse a trap's action when the signal
# arrives while it is expanding a command substitution ("trap: line 2: unexpected EOF while
# looking for matching `)'", and with set -e the script ends): so once the trap is set, this
# shell itself runs no $(...) and sources no file. The copy, full of them, runs in a child
# process that this shell waits for (the trap runs between waits), the removal in a subshell.

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}


# "relative/path size" of every file under $1, sorted (the check that a copy is complete).
listing() {
    (cd "$1" && find . -type f ! -name .staged -printf '%P %s\n' | LC_ALL=C sort)
}

# What marks STAGE_DIR as this job's: the same for every node and attempt of the job.
owner() {
    printf '%s job %s user %s\n' "$(basename "$STAGE_DIR")" "${SLURM_JOB_ID:-none}" "$(id -u)"
}

ours() {
    [[ -d $STAGE_DIR && ! -L $STAGE_DIR && -f $STAGE_DIR/$MARKER ]] &&
        [[ $(cat "$STAGE_DIR/$MARKER" 2>/dev/null) == "$(owner)" ]]
}

# Hold STAGE_DIR's lock for the rest of this shell (fd 9) or die saying why.
lock() {
    exec 9>>"$STAGE_DIR.lock"
    flock -w "${STAGE_LOCK_TIMEOUT:-3600}" 9 ||
        die "$NODE: could not lock $STAGE_DIR.lock (another node still copying after ${STAGE_LOCK_TIMEOUT:-3600} s?)"
}

# SRC and STAGE_DIR must not contain each other: a copy into its own source, or a dataset that
# the removal would delete.
check_apart() {
    local src dir
    src=$(realpath -m "$SRC") dir=$(realpath -m "$STAGE_DIR")
    [[ $src != "$dir" && $src != "$dir"/* ]] ||
        die "DATA_DIR=$SRC is inside the staging folder $STAGE_DIR: use it in place (the job scripts do when it is under SCRATCH)"
    [[ $dir != "$src"/* ]] ||
        die "the staging folder $STAGE_DIR is inside DATA_DIR=$SRC: set SCRATCH outside the dataset"
}

copy() {
    [[ -d $SRC ]] || die "DATA_DIR=$SRC is not a folder: set it to the preprocessed dataset"
    check_apart
    mkdir -p "$(dirname "$STAGE_DIR")" || die "cannot create $(dirname "$STAGE_DIR") (SCRATCH) on $NODE"
    local had_lock=0
    [[ -e $STAGE_DIR.lock ]] && had_lock=1
    lock
    if [[ -e $STAGE_DIR || -L $STAGE_DIR ]]; then
        if ! ours; then
            (( had_lock )) || rm -f "$STAGE_DIR.lock"
            die "$STAGE_DIR exists and was not made by this job: left untouched; remove it or set SCRATCH elsewhere"
        fi
    else
        mkdir "$STAGE_DIR" || die "cannot create $STAGE_DIR on $NODE"
        owner > "$STAGE_DIR/$MARKER" || die "cannot write $STAGE_DIR/$MARKER on $NODE"
    fi
    local dest=$STAGE_DIR/kits19 expected
    expected=$(listing "$SRC") || die "cannot read DATA_DIR=$SRC"
    [[ -n $expected ]] || die "DATA_DIR=$SRC holds no file: set it to the preprocessed dataset"
    if [[ -f $dest/.staged ]] && [[ $(listing "$dest") == "$expected" ]]; then
        echo "$NODE: $dest already staged (a node sharing this scratch, or this job's earlier attempt, copied it)"
    else
        # Inside this job's own folder: whatever is here, this job made.
        rm -rf "$dest" "$dest.partial"
        if command -v rsync >/dev/null 2>&1; then
            rsync -a "$SRC/" "$dest.partial/" || die "copy of $SRC to $dest.partial failed on $NODE"
        else
            mkdir -p "$dest.partial"
            cp -a "$SRC/." "$dest.partial/" || die "copy of $SRC to $dest.partial failed on $NODE"
        fi
        [[ $(listing "$dest.partial") == "$expected" ]] ||
            die "the copy in $dest.partial differs from $SRC (names or sizes) on $NODE"
        : > "$dest.partial/.staged"
        mv -T "$dest.partial" "$dest"
        echo "$NODE: copied $SRC to $dest"
    fi
    mkdir -p "$STAGE_DIR/.users"
    # Sign-ins of this job's earlier attempt (a node killed before it could leave) no longer
    # count. Only this job's folder is looked at: other jobs' sign-ins are theirs.
    find "$STAGE_DIR/.users" -mindepth 1 ! -name "$ATTEMPT.*" -delete
    : > "$STAGE_DIR/.users/$ATTEMPT.$NODE"
    flock -u 9
    exec 9>&-
}

# Never fails: a cleanup problem is a warning, the job keeps the status of its work.
remove() {
    (
        local had_lock=0
        [[ -e $STAGE_DIR.lock ]] && had_lock=1
        lock
        if ! ours; then
            (( had_lock )) || rm -f "$STAGE_DIR.lock"
            [[ -e $STAGE_DIR ]] && printf 'warning: %s is not this job'"'"'s staging folder: left untouched\n' "$STAGE_DIR" >&2
            exit 0
        fi
        rm -f "$STAGE_DIR/.users/$ATTEMPT.$NODE"
        if [[ -z $(ls -A "$STAGE_DIR/.users" 2>/dev/null) ]]; then
            rm -rf "$STAGE_DIR"
            rm -f "$STAGE_DIR.lock"
        fi
    ) || printf 'warning: could not clean %s on %s\n' "$STAGE_DIR" "$NODE" >&2
}

# Run COMMAND with the page cache dropped first (DATA_READ: the folder COMMAND reads), passing on
# the time-limit warning; returns COMMAND's status.
run_command() {
    UNET3D_CACHE_CLEARED=0
    if bash "$LIB/drop_page_cache.sh" "$NODE" "$DATA_READ"; then
        UNET3D_CACHE_CLEARED=1
    fi
    export UNET3D_CACHE_CLEARED
    local child=''
    # Forward the time-limit warning (once COMMAND can take it); note SIGTERM/SIGINT and keep
    # waiting for COMMAND, which got them too and is saving its checkpoint.
    trap 'if [[ -n $child ]]; then bash "$LIB/forward.sh" "$child" "$$" & else USR1_PENDING=1; fi' USR1
    trap ':' TERM INT
    "$@" &
    child=$!
    if [[ ${USR1_PENDING:-0} == 1 ]]; then
        bash "$LIB/forward.sh" "$child" "$$" &
    fi
    wait_until_done "$child"
}

# wait_until_done PID: `wait` returns early (> 128) when a trapped signal arrives: wait again
# until PID has ended; returns its status.
wait_until_done() {
    local status
    while true; do
        status=0
        wait "$1" || status=$?
        kill -0 "$1" 2>/dev/null || break
    done
    return "$status"
}

# Run FUNCTION in a child process and wait until it ends, however often the trap interrupts the
# wait; returns its status.
in_child() {
    ( "$@" ) &
    wait_until_done "$!"
}

around() {
    in_child copy
    DATA_READ=$STAGE_DIR/kits19
    local status=0
    run_command "$@" || status=$?
    remove
    return "$status"
}

main() {
    trap 'USR1_PENDING=1' USR1
    set -euo pipefail
    LIB=${BASH_SOURCE[0]%/*}/../lib
    NODE=${SLURMD_NODENAME:-${HOSTNAME%%.*}}
    # One attempt of one job: a requeued job's new attempt does not count its old attempt's nodes.
    ATTEMPT=${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}
    MARKER=.unet3d-stage
    action=${1:-}
    case $action in
        around)
            [[ $# -ge 5 && $4 == -- ]] || die "usage: stage.sh around SRC STAGE_DIR -- COMMAND..."
            SRC=$2 STAGE_DIR=$3
            shift 4
            around "$@"
            ;;
        in-place)
            [[ $# -ge 4 && $3 == -- ]] || die "usage: stage.sh in-place SRC -- COMMAND..."
            SRC=$2
            shift 3
            [[ -d $SRC ]] || die "DATA_DIR=$SRC is not a folder on $NODE: set it to the preprocessed dataset"
            DATA_READ=$SRC
            run_command "$@"
            ;;
        copy)
            [[ $# -eq 3 ]] || die "usage: stage.sh copy SRC STAGE_DIR"
            SRC=$2 STAGE_DIR=$3
            in_child copy
            ;;
        remove)
            [[ $# -eq 2 ]] || die "usage: stage.sh remove STAGE_DIR"
            STAGE_DIR=$2
            remove
            ;;
        *) die "usage: stage.sh around|in-place|copy|remove ... (see the comment at the top)" ;;
    esac
}

main "$@"
