#!/usr/bin/env bash
# The project's Dockerfile, built for real on a stand-in site base and run (root, Linux):
#   1. the stand-in base (once; cached in podman's store as BASE_IMAGE): a Debian root made
#      with debootstrap, a venv with a CPU torch first on PATH, this machine's CA bundle;
#   2. the project's Dockerfile, unchanged, with --build-arg BASE_IMAGE=<that base>;
#   3. its checks, as RUN steps of a build on top of it (check.Containerfile): the base's torch
#      kept, the whole chain run as the image's unprivileged user into /results.
# `podman build --isolation chroot` works on hosts where `podman run` does not (cgroups).
# Settings: BASE_IMAGE, IMAGE, TORCH_SPEC (the base's torch, default torch==2.13.0),
# DEBIAN_MIRROR. A fetch that fails is retried 3 times, then one line says which.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/scripts/container
BASE_IMAGE=${BASE_IMAGE:-localhost/unet3d-site-base:cpu}
DEBIAN_IMAGE=${DEBIAN_IMAGE:-localhost/unet3d-debian:bookworm}
IMAGE=${IMAGE:-localhost/unet3d:test}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# retry WHAT CMD...: up to 3 tries, output to a log; one line naming WHAT when all fail.
retry() {
    local what=$1 log attempt
    shift
    log=$(mktemp /tmp/unet3d-container-XXXXXX.log)
    for attempt in 1 2 3; do
        if "$@" > "$log" 2>&1; then
            rm -f "$log"
            return 0
        fi
        sleep $(( attempt * 5 ))
    done
    die "$what failed 3 times (last output: $log)"
}

(( EUID == 0 )) || die "build_and_check.sh must run as root (debootstrap, podman's store)"
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if (( ${#missing[@]} )); then
    command -v apt-get >/dev/null || die "${missing[*]} missing and no apt-get to install them"
    retry "apt-get update" apt-get update
    retry "apt-get install ${missing[*]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"
fi
BUILD=(podman build --isolation chroot --quiet)

work=$(mktemp -d /tmp/unet3d-container-XXXXXX)
trap 'rm -rf "$work"' EXIT

if podman image exists "$BASE_IMAGE"; then
    echo "stand-in site base: $BASE_IMAGE (cached)"
else
    start=$SECONDS
    if ! podman image exists "$DEBIAN_IMAGE"; then
        echo "stand-in site base: debootstrap of Debian bookworm"
        retry "debootstrap of Debian bookworm from $DEBIAN_MIRROR" bash -c \
            'rm -rf "$1" && debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$1" "$2"' \
            _ "$work/rootfs" "$DEBIAN_MIRROR"
        tar -C "$work/rootfs" -c . | podman import --quiet - "$DEBIAN_IMAGE" >/dev/null
        rm -rf "$work/rootfs"
    fi
    mkdir -p "$work/base/wheels"
    cp /etc/ssl/certs/ca-certificates.crt "$work/base/ca-certificates.crt"
    # This machine's pip finds the CPU wheel in its local wheel folder (else on PyPI).
    retry "download of $TORCH_SPEC" "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$work/base/wheels" "$TORCH_SPEC"
    cp "$HERE/site-base.Containerfile" "$work/base/Containerfile"
    retry "build of the stand-in base $BASE_IMAGE" "${BUILD[@]}" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
        -t "$BASE_IMAGE" "$work/base"
    rm -rf "$work/base"
    echo "stand-in site base: $BASE_IMAGE built in $(( SECONDS - start )) s"
fi

start=$SECONDS
retry "build of the project's Dockerfile on $BASE_IMAGE" "${BUILD[@]}" --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -t "$IMAGE" "$ROOT"
echo "image: $IMAGE built from the Dockerfile in $(( SECONDS - start )) s"

# The base's torch version, read from the base image's files (no container run needed).
mount=$(podman image mount "$BASE_IMAGE")
base_torch=$(sed -n 's/^Version: //p' "$mount"/opt/pytorch/lib/python3*/site-packages/torch-*.dist-info/METADATA)
podman image unmount "$BASE_IMAGE" >/dev/null
start=$SECONDS
log=$work/check.log
if ! podman build --isolation chroot --no-cache --build-arg IMAGE="$IMAGE" --build-arg BASE_TORCH="$base_torch" \
    -f "$HERE/check.Containerfile" "$HERE" > "$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "the image's checks failed (the output above)"
fi
grep -E "^(torch |image check passed|mean_dice )" "$log" || true
echo "image checks passed in $(( SECONDS - start )) s: base torch $base_torch kept, chain run as unet3d into /results"

# USER_ID that a user of the base already has (65534, Debian's nobody): the image's user must
# still get exactly that uid (files in /results belong to the host user), not another one.
start=$SECONDS
retry "build of the project's Dockerfile with USER_ID=65534" "${BUILD[@]}" --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg USER_ID=65534 -t "$IMAGE-uid" "$ROOT"
mkdir -p "$work/uid"
printf 'FROM %s\nRUN test "$(id -u)" = 65534 && touch /results/written && python main.py --help > /dev/null\n' \
    "$IMAGE-uid" > "$work/uid/Containerfile"
if ! podman build --isolation chroot --no-cache "$work/uid" > "$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "the image built with USER_ID=65534 does not run as uid 65534 (the output above)"
fi
podman rmi --force "$IMAGE-uid" >/dev/null 2>&1 || true
echo "uid check passed in $(( SECONDS - start )) s: USER_ID=65534, a uid the base already has, is the image's user"
