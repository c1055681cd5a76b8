#!/usr/bin/env bash
# A SLURM Prolog (and Epilog) that drops each node's page cache when a job starts, for the
# sites where jobs may neither be root nor use `sudo -n sysctl`. The administrator installs it
# on every node and names it in slurm.conf:
#
#   Prolog=/etc/slurm/prolog_drop_caches.sh
#   Epilog=/etc/slurm/prolog_drop_caches.sh
#
# slurmd runs it as root before the job's first step on each node (and again when a requeued
# job starts) with SLURM_JOB_ID set. It syncs, drops the cache and writes the time (Unix
# seconds) to $UNET3D_PROLOG_DIR/<job id> (default /run/unet3d-drop-caches, root-owned), where
# scripts/lib/drop_page_cache.sh finds it: a job started at most UNET3D_CACHE_MAX_AGE seconds
# (300) after the drop logs cache_clear true. Run as the Epilog (SLURM_SCRIPT_CONTEXT
# epilog_slurmd), it removes the job's file. A prolog that fails would drain the node: this one
# always exits 0 and says on stderr (slurmd's log) what it could not do.
#
# The job must read its data in place (STAGE=0 for scripts/slurm/*.sbatch): a copy made after
# the drop brings the data into the page cache again, and drop_page_cache.sh does not count this
# drop for data written after it.
set -u
dir=${UNET3D_PROLOG_DIR:-/run/unet3d-drop-caches}
job=${SLURM_JOB_ID:-}
[[ $job =~ ^[0-9_]+$ ]] || { echo "prolog_drop_caches: no SLURM_JOB_ID: nothing done" >&2; exit 0; }
if [[ ${SLURM_SCRIPT_CONTEXT:-prolog_slurmd} == epilog_slurmd ]]; then
    rm -f -- "$dir/$job"
    exit 0
fi
sync
if ! { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; then
    echo "prolog_drop_caches: cannot write /proc/sys/vm/drop_caches (not root?): page cache not dropped" >&2
    exit 0
fi
if mkdir -p -- "$dir" 2>/dev/null && chmod 755 -- "$dir" && [[ ! -L $dir/$job ]]; then
    date +%s > "$dir/$job.tmp" && chmod 644 "$dir/$job.tmp" && mv -f -- "$dir/$job.tmp" "$dir/$job"
else
    echo "prolog_drop_caches: cannot write $dir/$job: the job will not know the cache was dropped" >&2
fi
exit 0
