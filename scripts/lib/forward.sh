# shellcheck shell=bash
# forward_usr1 PID: send SIGUSR1 to PID as soon as PID has a handler for it (SigCgt in
# /proc/PID/status), polling; gives up when PID is gone. Run it in the background. Sourced.
# Why: SLURM's warning before the time limit can come in a job's first seconds (it may be
# sent up to a minute early), while the next program of the chain is still starting; the
# default action of SIGUSR1 would kill that program, and the job's requeue with it.
forward_usr1() {
    local pid=$1 mask
    while kill -0 "$pid" 2>/dev/null; do
        mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || mask=
        # SIGUSR1 is signal 10: bit 9 of the mask.
        if [[ -n $mask ]] && (( (16#$mask >> 9) & 1 )); then
            kill -USR1 "$pid" 2>/dev/null || true
            return 0
        fi
        sleep 0.2
    done
}
