#!/usr/bin/env bash
# Install the Python requirements on top of an existing PyTorch without ever replacing it:
# the no-build way on a cluster (a site's Apptainer image, packages in the user site), and
# the dependency layer of Dockerfile and apptainer.def.
#
#   scripts/install_requirements.sh [--user] [REQUIREMENTS_FILE ...]
#   apptainer exec --rocm SITE.sif bash scripts/install_requirements.sh --user
#
# The installed versions of torch and of KEEP_PACKAGES (default: numpy, which the site's torch
# was compiled against) are written to a pip constraints file, so pip either leaves them alone
# or stops with a conflict; it never downloads a replacement. Files default to the checkout's
# requirements.txt. PYTHON selects the interpreter (default: python, else python3).
# With --user the packages go to ~/.local (or $PYTHONUSERBASE, e.g. on a larger filesystem than
# a small home quota; then set it at run time as well).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
KEEP_PACKAGES=${KEEP_PACKAGES:-numpy}

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

pip_args=()
files=()
for arg in "$@"; do
    case $arg in
        --user) pip_args+=(--user) ;;
        -h | --help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) die "unknown option $arg (try --help)" ;;
        *) files+=("$arg") ;;
    esac
done
if (( ${#files[@]} == 0 )); then
    files=("$(dirname "$here")/requirements.txt")
fi
for file in "${files[@]}"; do
    [[ -f $file ]] || die "no requirements file $file"
    pip_args+=(--requirement "$file")
done

# The version pip sees (the distribution's metadata), empty when the package is absent.
installed_version() {
    "$PYTHON" - "$1" <<'PYEOF'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
PYEOF
}

torch_before=$(installed_version torch)
[[ -n $torch_before ]] ||
    die "$PYTHON has no torch: install the platform's PyTorch first (this script never does)"

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\n' "$torch_before" > "$constraints"
read -r -a keep <<< "$KEEP_PACKAGES"
for package in ${keep[@]+"${keep[@]}"}; do
    version=$(installed_version "$package")
    if [[ -n $version ]]; then
        printf '%s==%s\n' "$package" "$version" >> "$constraints"
    fi
done
printf 'keeping the installed packages: %s\n' "$(tr '\n' ' ' < "$constraints")"

"$PYTHON" -m pip install --constraint "$constraints" "${pip_args[@]}"

torch_after=$(installed_version torch)
[[ $torch_after == "$torch_before" ]] ||
    die "torch changed from $torch_before to $torch_after: check the requirements' torch bound"
echo "requirements installed; torch $torch_after untouched"
