#!/usr/bin/env bash
# drop_page_cache.sh WHERE: drop this machine's page cache (sync, then vm.drop_caches=3) when
# CLEAR_CACHES=1 (the default), as NVIDIA's MLPerf jobs do before each timed run: as root by
# writing /proc/sys/vm/drop_caches, else through `sudo -n sysctl` where the site allows it.
# Says which on one line (stderr); exits 0 when the cache was dropped, 1 when not.
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
printf '%s: page cache not dropped (needs root or passwordless sudo for sysctl vm.drop_caches; the MLPerf log says cache_clear false)\n' "$where" >&2
exit 1
