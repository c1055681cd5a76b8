# shellcheck shell=bash
# Shared by start.sh and stop.sh. Sourced, never run.

# The file that marks a folder as a cluster's state folder (stop.sh removes nothing else).
# shellcheck disable=SC2034  # used by start.sh and stop.sh
MARKER=.unet3d-cluster

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# The comment that tags the /etc/hosts line of the cluster in folder $1.
hosts_tag() {
    printf '# unet3d-test-cluster %s' "$1"
}

# True when nothing listens on TCP port $1 (reads /proc/net/tcp*, no tools needed).
port_free() {
    local hex
    hex=$(printf '%04X' "$1")
    ! awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" {found=1} END {exit !found}' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
