#!/usr/bin/env bash
# drop_page_cache.sh WHERE [DATA...]: drop this machine's page cache (sync, then vm.drop_caches=3)
# before a timed run when CLEAR_CACHES=1 (the default), as the rules ask ("You must flush the cache
# or restart the system prior to benchmarking ... This explicitly excludes RAM") and NVIDIA's MLPerf
# jobs do. DATA: the folders the run reads (the dataset, or its staged copy). Says how on one line
# (stderr); exits 0 when the data the run reads is cold, 1 when not (the MLPerf log then says
# cache_clear false, and a closed run is no result).
#
# The promise: exit 0 only when the page cache was dropped after the last write to every DATA
# folder, and no DATA folder is in RAM. So:
#   - DATA on tmpfs or ramfs: 1, whatever is dropped (a drop cannot evict a file system in RAM);
#   - root writes /proc/sys/vm/drop_caches, or `sudo -n /sbin/sysctl -q vm.drop_caches=3` where the
#     site allows it without a password (a sudoers line such as
#     `%users ALL=(root) NOPASSWD: /sbin/sysctl -q vm.drop_caches=3`): the drop is made here, after
#     everything the job wrote (stage.sh calls this after its copy): 0;
#   - else a drop made before by a process that had the right counts only when it is recent (at
#     most UNET3D_CACHE_MAX_AGE seconds ago, default 300), when no DATA folder changed after it
#     (its change time, which every file added, removed or renamed in it moves: a staged copy, a
#     dataset made since), and for one run only (each drop counted is listed in
#     UNET3D_CACHE_DROPS_USED, default ${TMPDIR:-/tmp}/unet3d-cache-drops-used-<uid>; a drop already
#     listed there, or one that cannot be listed, is not counted again):
#       - a SLURM prolog (scripts/slurm/prolog_drop_caches.sh as the cluster's `Prolog=`, root on
#         each node) drops it when the job starts and leaves the time in
#         $UNET3D_PROLOG_DIR/<job id> (default /run/unet3d-drop-caches, a root-owned file); a copy
#         the job stages after it is in the page cache: read the data in place (STAGE=0);
#       - the host side of a container: the image runs as non-root and cannot drop the cache, so
#         the host drops it right before starting the container and passes the time:
#           sudo sysctl -q vm.drop_caches=3 && apptainer exec --env UNET3D_CACHE_DROPPED_AT=$(date +%s) IMAGE ...
#         (podman run -e UNET3D_CACHE_DROPPED_AT=$(date +%s) ...).
# The change time has a resolution of one second here: data written in the drop's own second
# counts as written after it (never a warm cache called cold).
# A program of its own, not a sourced library: stage.sh traps SIGUSR1 from its first line, and
# bash can misparse a file it is sourcing when a trap runs in the middle of it.
set -u
where=${1:-$(hostname -s)}
(( $# )) && shift
data=("$@")
not_cold='so cache_clear is false and a closed run is no result'
if [[ ${CLEAR_CACHES:-1} != 1 ]]; then
    printf '%s: page cache not dropped (CLEAR_CACHES=%s), %s\n' "$where" "${CLEAR_CACHES}" "$not_cold" >&2
    exit 1
fi
# Data in RAM: no drop makes it cold.
for folder in ${data[@]+"${data[@]}"}; do
    kind=$(stat -L -f -c %T -- "$folder" 2>/dev/null) || kind=''
    if [[ $kind == tmpfs || $kind == ramfs ]]; then
        printf '%s: the data %s is on %s, in RAM, which no page-cache drop can evict, %s; fix: keep the dataset (and SCRATCH, where it is staged) on a disk\n' \
            "$where" "$folder" "$kind" "$not_cold" >&2
        exit 1
    fi
done
sync
if { [[ -w /proc/sys/vm/drop_caches ]] && { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; } ||
    { command -v sudo >/dev/null 2>&1 && sudo -n /sbin/sysctl -q vm.drop_caches=3 >/dev/null 2>&1; }; then
    printf '%s: page cache dropped\n' "$where" >&2
    exit 0
fi

# A drop made just before by someone with the right: its time (Unix seconds) and who made it.
max_age=${UNET3D_CACHE_MAX_AGE:-300}
now=$(date +%s)
recent() {  # recent TIME: TIME is a number of seconds at most max_age before now
    [[ $1 =~ ^[0-9]+$ ]] && (( now - $1 >= 0 && now - $1 <= max_age ))
}
# written_after TIME: prints the first DATA folder that changed at or after TIME (true), else false
written_after() {
    local folder changed
    for folder in ${data[@]+"${data[@]}"}; do
        changed=$(stat -L -c %Z -- "$folder" 2>/dev/null) || changed=''
        if [[ ! $changed =~ ^[0-9]+$ ]] || (( changed >= $1 )); then
            printf '%s' "$folder"
            return 0
        fi
    done
    return 1
}
# claim KEY: true the first time KEY (a drop) is claimed on this machine by this user, never again
used=${UNET3D_CACHE_DROPS_USED:-${TMPDIR:-/tmp}/unet3d-cache-drops-used-$(id -u)}
claim() {
    if grep -qxF "$1" "$used" 2>/dev/null; then
        printf '%s: the drop %s was counted for an earlier run already: not counted again\n' "$where" "$1" >&2
        return 1
    fi
    { printf '%s\n' "$1" >> "$used"; } 2>/dev/null && return 0
    printf '%s: cannot note the drop %s in %s (so it could count for several runs): not counted\n' "$where" "$1" \
        "$used" >&2
    return 1
}
# counted WHO TIME FIX: the drop WHO made at TIME counts for this run (the data unchanged since)
counted() {
    local changed
    if changed=$(written_after "$2"); then
        printf '%s: the page cache was dropped by %s %s s ago, but the data %s was written after it (a staged copy, or data made since): it is in the page cache, %s; fix: %s\n' \
            "$where" "$1" "$(( now - $2 ))" "$changed" "$not_cold" "$3" >&2
        exit 1
    fi
    claim "$4"
}
marker=${UNET3D_PROLOG_DIR:-/run/unet3d-drop-caches}/${SLURM_JOB_ID:-none}
if [[ -n ${SLURM_JOB_ID:-} && -f $marker && ! -L $marker && $(stat -c %u "$marker" 2>/dev/null) == 0 ]]; then
    read -r dropped < "$marker" || dropped=''
    if recent "$dropped" && counted "the SLURM prolog" "$dropped" \
        'read the data in place (STAGE=0), or let the job drop the cache itself after its copy (root, or sudo -n /sbin/sysctl -q vm.drop_caches=3)' \
        "prolog $marker $dropped"; then
        printf '%s: page cache dropped by the SLURM prolog %s s ago (%s), the data unchanged since\n' "$where" \
            "$(( now - dropped ))" "$marker" >&2
        exit 0
    fi
fi
if [[ -n ${UNET3D_CACHE_DROPPED_AT:-} ]]; then
    if recent "$UNET3D_CACHE_DROPPED_AT" && counted "the caller" "$UNET3D_CACHE_DROPPED_AT" \
        'drop it on the host after the data is written, right before the container starts' \
        "caller $UNET3D_CACHE_DROPPED_AT"; then
        printf '%s: page cache dropped by the caller %s s ago (UNET3D_CACHE_DROPPED_AT: the host side of a container), the data unchanged since\n' \
            "$where" "$(( now - UNET3D_CACHE_DROPPED_AT ))" >&2
        exit 0
    fi
    recent "$UNET3D_CACHE_DROPPED_AT" ||
        printf '%s: UNET3D_CACHE_DROPPED_AT=%s is not a drop in the last %s s: not counted\n' "$where" \
            "$UNET3D_CACHE_DROPPED_AT" "$max_age" >&2
fi
printf '%s: page cache not dropped, %s; fix: run as root or allow `sudo -n /sbin/sysctl -q vm.drop_caches=3`, install scripts/slurm/prolog_drop_caches.sh as the SLURM Prolog= (and read the data in place, STAGE=0), or in a container drop it on the host and pass --env UNET3D_CACHE_DROPPED_AT=$(date +%%s) (docs/submission.md, "The page cache")\n' "$where" "$not_cold" >&2
exit 1
