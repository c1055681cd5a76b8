# shellcheck shell=bash
# run CMD...: run it, or with DRY_RUN=1 print it shell-quoted on one line instead. Sourced.
run() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        local line
        printf -v line '%q ' "$@"
        printf '%s\n' "${line% }"
    else
        "$@"
    fi
}
