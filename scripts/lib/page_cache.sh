# shellcheck shell=bash
# drop_page_cache WHERE: drop this machine's page cache (sync, then vm.drop_caches=3) when
# CLEAR_CACHES=1 (the default), as NVIDIA's MLPerf jobs do before each timed run: as root by
# writing /proc/sys/vm/drop_caches, else through `sudo -n sysctl` where the site allows it.
# Sets CACHE_CLEARED=1 when it was dropped, 0 otherwise, and says which on one line (stderr).
# Sourced.
drop_page_cache() {
    local where=$1
    CACHE_CLEARED=0
    if [[ ${CLEAR_CACHES:-1} != 1 ]]; then
        printf '%s: page cache not dropped (CLEAR_CACHES=%s)\n' "$where" "${CLEAR_CACHES}" >&2
        return 0
    fi
    sync
    if [[ -w /proc/sys/vm/drop_caches ]] && { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; then
        CACHE_CLEARED=1
    elif command -v sudo >/dev/null 2>&1 && sudo -n /sbin/sysctl -q vm.drop_caches=3 >/dev/null 2>&1; then
        CACHE_CLEARED=1
    fi
    if (( CACHE_CLEARED )); then
        printf '%s: page cache dropped\n' "$where" >&2
    else
        printf '%s: page cache not dropped (needs root or passwordless sudo for sysctl vm.drop_caches; the MLPerf log says cache_clear false)\n' "$where" >&2
    fi
}
