#!/usr/bin/env bash
# drop_page_cache.sh WHERE: drop this machine's page cache (sync, then vm.drop_caches=3) before a
# timed run when CLEAR_CACHES=1 (the default), as the rules ask ("You must flush the cache or
# restart the system prior to benchmarking") and NVIDIA's MLPerf jobs do. Says how on one line
# (stderr); exits 0 when the cache was dropped, 1 when not (the MLPerf log then says cache_clear
# false, and a closed run is no result). The ways that work, in the order tried:
#   1. root: writes /proc/sys/vm/drop_caches;
#   2. `sudo -n /sbin/sysctl -q vm.drop_caches=3` where the site allows it without a password
#      (a sudoers line such as `%users ALL=(root) NOPASSWD: /sbin/sysctl -q vm.drop_caches=3`);
#   3. a drop made just before by a process that had the right (at most UNET3D_CACHE_MAX_AGE
#      seconds ago, default 300), counted for one run only: each drop counted is listed in
#      UNET3D_CACHE_DROPS_USED (default ${TMPDIR:-/tmp}/unet3d-cache-drops-used-<uid>), and a drop
#      already listed there, or one that cannot be listed, is not counted again:
#      - a SLURM prolog (scripts/slurm/prolog_drop_caches.sh as the cluster's `Prolog=`, root on
#        each node) drops it when the job starts and leaves the time in
#        $UNET3D_PROLOG_DIR/<job id> (default /run/unet3d-drop-caches, a root-owned file);
#        the job's data must then be read in place (STAGE=0: a copy made after the drop is in
#        the page cache);
#      - the host side of a container: the image runs as non-root and cannot drop the cache, so
#        the host drops it right before starting the container and passes the time:
#          sudo sysctl -q vm.drop_caches=3 && apptainer exec --env UNET3D_CACHE_DROPPED_AT=$(date +%s) IMAGE ...
#        (podman run -e UNET3D_CACHE_DROPPED_AT=$(date +%s) ...).
# A program of its own, not a sourced library: stage.sh traps SIGUSR1 from its first line, and
# bash can misparse a file it is sourcing when a trap runs in the middle of it.
set -u
where=${1:-$(hostname -s)}
if [[ ${CLEAR_CACHES:-1} != 1 ]]; then
    printf '%s: page cache not dropped (CLEAR_CACHES=%s)\n' "$where" "${CLEAR_CACHES}" >&2
    exit 1
fi
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
marker=${UNET3D_PROLOG_DIR:-/run/unet3d-drop-caches}/${SLURM_JOB_ID:-none}
if [[ -n ${SLURM_JOB_ID:-} && -f $marker && ! -L $marker && $(stat -c %u "$marker" 2>/dev/null) == 0 ]]; then
    read -r dropped < "$marker" || dropped=''
    if recent "$dropped" && claim "prolog $marker $dropped"; then
        printf '%s: page cache dropped by the SLURM prolog %s s ago (%s)\n' "$where" "$(( now - dropped ))" "$marker" >&2
        exit 0
    fi
fi
if [[ -n ${UNET3D_CACHE_DROPPED_AT:-} ]]; then
    if recent "$UNET3D_CACHE_DROPPED_AT" && claim "caller $UNET3D_CACHE_DROPPED_AT"; then
        printf '%s: page cache dropped by the caller %s s ago (UNET3D_CACHE_DROPPED_AT: the host side of a container)\n' \
            "$where" "$(( now - UNET3D_CACHE_DROPPED_AT ))" >&2
        exit 0
    fi
    recent "$UNET3D_CACHE_DROPPED_AT" ||
        printf '%s: UNET3D_CACHE_DROPPED_AT=%s is not a drop in the last %s s: not counted\n' "$where" \
            "$UNET3D_CACHE_DROPPED_AT" "$max_age" >&2
fi
printf '%s: page cache not dropped, so cache_clear is false and a closed run is no result; fix: run as root or allow `sudo -n /sbin/sysctl -q vm.drop_caches=3`, install scripts/slurm/prolog_drop_caches.sh as the SLURM Prolog=, or in a container drop it on the host and pass --env UNET3D_CACHE_DROPPED_AT=$(date +%%s) (docs/submission.md, "The page cache")\n' "$where" >&2
exit 1
