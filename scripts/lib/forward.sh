#!/usr/bin/env bash
# forward_usr1 PID [PARENT]: send SIGUSR1 to PID (a child of this shell, or of PARENT) as soon
# as PID has a handler for it (SigCgt in /proc/PID/status), polling; gives up when PID is gone.
# Run it in the background. Sourced (the job scripts), or run as a program with the same
# arguments (`bash forward.sh PID PARENT &`: stage.sh, which traps SIGUSR1 before anything
# else and so must not source a file while a trap can run: bash may misparse it).
# Why: SLURM's warning before the time limit can come in a job's first seconds (it may be
# sent up to a minute early), while the next program of the chain is still starting; the
# default action of SIGUSR1 would kill that program, and the job's requeue with it.
forward_usr1() {
    local pid=$1 mask self now
    self=$(tr '\0' ' ' < "/proc/${2:-$$}/cmdline")
    while kill -0 "$pid" 2>/dev/null; do
        # A child that has not run exec yet is a copy of this shell, with its handlers: the
        # signal would stay there. Wait for the command itself.
        now=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || now=
        if [[ -n $now && $now != "$self" ]]; then
            mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || mask=
            # SIGUSR1 is signal 10: bit 9 of the mask.
            if [[ -n $mask ]] && (( (16#$mask >> 9) & 1 )); then
                kill -USR1 "$pid" 2>/dev/null || true
                return 0
            fi
        fi
        sleep 0.2
    done
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    forward_usr1 "$@"
fi
