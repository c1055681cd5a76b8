# shellcheck shell=bash
# Helpers shared by the SLURM job scripts in this folder. Sourced, never run.
#
# Every setting is an environment variable with a default, so a job is tuned with
# `sbatch --export=ALL,NAME=value job.sbatch` and nothing has to be edited:
#   GPUS_PER_NODE processes per node (default: the GPUs allocated, --gres=gpu:N; else 4)
#   PYTHON        the interpreter that runs torchrun (default python3, in the container if any)
#   CONTAINER     Apptainer image (.sif); empty = run on the host's Python (a venv, a module)
#   GPU_VENDOR    amd (apptainer --rocm), nvidia (--nv) or none
#   APPTAINER     the container runtime's command (apptainer; singularity on older sites)
#   DATA_DIR      preprocessed dataset on the large, slow shared filesystem
#   SCRATCH       fast folder on each node (per job, or the user's own persistent one); the
#                 dataset is copied into the job's own SCRATCH/unet3d-job-<job id> first and
#                 that folder alone is removed after; a DATA_DIR already under SCRATCH is
#                 used in place (nothing copied, nothing removed)
#   STAGE=0       use DATA_DIR in place, never copy it
#   CLEAR_CACHES  1 (default): drop each node's page cache before the run (root or sudo -n)
#   RESULTS_DIR   where the MLPerf log, log.json and the checkpoint go
#   CKPT_DURING_RUN  0 (default, the timed mode): the checkpoint is written once, after
#                 run_stop, as the reference writes it (a stop by the scheduler saves it too,
#                 after run_stop, and a requeued attempt resumes from it); 1: also at every
#                 evaluation and every --ckpt_every_minutes (--ckpt_during_run), so that a lost
#                 node or an OOM kill loses little; those writes are on the clock, so such a
#                 run is not an MLPerf result (its log says checkpoints_on_the_clock)
#   CODE_DIR      checkout that holds main.py, as seen in the container (Apptainer mounts
#                 $HOME; a checkout elsewhere is bound at the same path; /opt/unet3d is the
#                 copy inside an image built from apptainer.def)
#   RECIPE        scripts/recipes/<RECIPE>.sh, the hyper-parameters of one global batch
#                 (gbs28, gbs56, gbs64, gbs84: those of the MLPerf 4.0.0 RCPs; gbs2: the
#                 reference's 1-GPU run); the batch per process is the global batch / (nodes x
#                 GPUS_PER_NODE x GA_STEPS), refused when it does not divide. Unset: the
#                 reference's 1-GPU hyper-parameters at BATCH_SIZE (default 2) per process, with a
#                 warning that no RCP stands behind them (scripts/lib/recipe.sh)
#   SEED, LEARNING_RATE, ... a recipe's settings override it (see training_args); MAX_EPOCHS
#                 default auto (the rules' limit for the global batch); START_EVAL_AT and
#                 EVALUATE_EVERY are passed only when set (default: the rules' schedule)
#   EXTRA_ARGS    more main.py flags as one string; flags after the job script's name also pass
#   DRY_RUN=1     print each command, shell-quoted, one per line, instead of running it

# run CMD...: print the command shell-quoted (DRY_RUN=1) or run it.
# shellcheck source=scripts/lib/run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/run.sh"
# forward_usr1 PID: SIGUSR1 to PID once it has a handler for it.
# shellcheck source=scripts/lib/forward.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/forward.sh"
# recipe_args PROCESSES FLAGS...: a recipe's main.py flags (RECIPE_ARGS).
# shellcheck source=scripts/lib/recipe.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/recipe.sh"

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# absolute PATH NAME: PATH made absolute (from $PWD) without trailing slashes, into variable NAME.
absolute() {
    local path=$1
    [[ $path == /* ]] || path=$PWD/$path
    while [[ $path == */ && $path != / ]]; do
        path=${path%/}
    done
    printf -v "$2" '%s' "$path"
}

# Defaults shared by both jobs. Call after SLURM has set its variables, first thing.
set_common_defaults() {
    # The warning before the time limit can come in the job's first seconds: from here on it
    # is noted (run_and_watch passes it on), not the end of the job script.
    STOPPED_BY=
    trap 'STOPPED_BY=USR1' USR1
    JOB_ID=${SLURM_JOB_ID:-local-$$}
    GPU_VENDOR=${GPU_VENDOR:-amd}
    CONTAINER=${CONTAINER-$HOME/containers/unet3d.sif}
    # Sites export $DATA for the large shared filesystem.
    DATA_DIR=${DATA_DIR:-${DATA:-$HOME}/kits19/preprocessed}
    SCRATCH=${SCRATCH:-/scratch/slurm-$JOB_ID}
    RESULTS_DIR=${RESULTS_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/results/$JOB_ID}
    CODE_DIR=${CODE_DIR:-$REPO_DIR}
    # GPUs are asked for on the sbatch command line (--gres=gpu:N), not in the job's header, so
    # that the same script runs on a CPU partition (GPU_VENDOR=none GPUS_PER_NODE=N processes).
    if [[ -z ${GPUS_PER_NODE:-} && -z ${SLURM_GPUS_ON_NODE:-} && $GPU_VENDOR != none && -n ${SLURM_JOB_ID:-} ]]; then
        printf 'warning: no GPU allocated to job %s (submit with --gres=gpu:N, or set GPU_VENDOR=none '\
'and GPUS_PER_NODE for CPU processes): starting 4 processes per node\n' "$JOB_ID" >&2
    fi
    GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-4}}
    [[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE must be a positive integer, got '$GPUS_PER_NODE'"
    # The reference's 8 data workers per process can oversubscribe a node with several GPUs:
    # share the job's CPUs between the processes, leaving one CPU for each training process.
    if [[ -z ${NUM_WORKERS:-} ]]; then
        if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
            NUM_WORKERS=$(( SLURM_CPUS_PER_TASK / GPUS_PER_NODE - 1 ))
            (( NUM_WORKERS >= 1 )) || NUM_WORKERS=1
        else
            NUM_WORKERS=8
        fi
    fi
    # This job's own staging folder: the only thing on SCRATCH the job creates and removes.
    STAGE_DIR=$SCRATCH/unet3d-job-$JOB_ID
    # A dataset already on SCRATCH (a user's persistent scratch) is read where it is: copying
    # it would cost time and space for nothing. SCRATCH inside DATA_DIR is refused by stage.sh.
    # (Compared as written, absolute, trailing slashes off: no $(...) once the USR1 trap is set,
    # since bash 5.2 can fail to parse a trap's action that runs during one. A path reached
    # through another spelling, a symbolic link say, is staged instead: a copy, never a loss;
    # stage.sh checks the real paths before it copies.)
    local data scratch
    absolute "$DATA_DIR" data
    absolute "$SCRATCH" scratch
    IN_PLACE=0
    if [[ ${STAGE:-1} == 0 ]]; then
        IN_PLACE=1 IN_PLACE_WHY="STAGE=0"
    elif [[ $data == "$scratch" || $data == "$scratch"/* ]]; then
        IN_PLACE=1 IN_PLACE_WHY="it is already under SCRATCH=$SCRATCH"
    fi
    # Paths as the training process sees them (inside the container when there is one).
    DATA_IN_JOB=/scratch/${STAGE_DIR##*/}/kits19
    (( IN_PLACE )) && DATA_IN_JOB=/data
    RESULTS_IN_JOB=/results
    if [[ -z $CONTAINER ]]; then
        DATA_IN_JOB=$STAGE_DIR/kits19
        (( IN_PLACE )) && DATA_IN_JOB=$DATA_DIR
        RESULTS_IN_JOB=$RESULTS_DIR
    fi
}

# The timed run's flags: the recipe's hyper-parameters for NNODES x GPUS_PER_NODE processes
# (scripts/lib/recipe.sh; each setting overridable from the environment), the rules' schedule
# unless START_EVAL_AT / EVALUATE_EVERY are set, then EXTRA_ARGS (word-split on purpose: it is a
# flag string), then the job's own arguments. Sets the array TRAIN_ARGS.
training_args() {
    local extra=()
    if [[ -n ${EXTRA_ARGS:-} ]]; then
        read -r -a extra <<< "$EXTRA_ARGS"
    fi
    recipe_args $(( ${NNODES:-1} * GPUS_PER_NODE )) ${extra[@]+"${extra[@]}"} "$@"
    TRAIN_ARGS=(
        --data_dir "$DATA_IN_JOB"
        --log_dir "$RESULTS_IN_JOB"
        --save_ckpt_path "$RESULTS_IN_JOB/checkpoint.pt"
        --seed "${SEED:--1}"
        --epochs "${MAX_EPOCHS:-auto}"
        --quality_threshold "${QUALITY_THRESHOLD:-0.908}"
    )
    if [[ -n ${START_EVAL_AT:-} ]]; then
        TRAIN_ARGS+=(--start_eval_at "$START_EVAL_AT")
    fi
    if [[ -n ${EVALUATE_EVERY:-} ]]; then
        TRAIN_ARGS+=(--evaluate_every "$EVALUATE_EVERY")
    fi
    TRAIN_ARGS+=("${RECIPE_ARGS[@]}" --num_workers "$NUM_WORKERS")
    case ${CKPT_DURING_RUN:-0} in
        0) ;;
        1) TRAIN_ARGS+=(--ckpt_during_run) ;;
        *) die "CKPT_DURING_RUN must be 0 or 1, got '$CKPT_DURING_RUN'" ;;
    esac
    # ${a[@]+"${a[@]}"}: an empty array under `set -u` is an error before bash 4.4.
    TRAIN_ARGS+=(${extra[@]+"${extra[@]}"} "$@")
}

# Sets the array LAUNCH: the prefix that runs a program in the container (empty without one).
container_prefix() {
    LAUNCH=()
    [[ -z $CONTAINER ]] && return 0
    local gpu_flag=()
    case $GPU_VENDOR in
        amd) gpu_flag=(--rocm) ;;
        nvidia) gpu_flag=(--nv) ;;
        none) ;;
        *) die "GPU_VENDOR must be amd, nvidia or none, got '$GPU_VENDOR'" ;;
    esac
    [[ ${DRY_RUN:-0} == 1 || -f $CONTAINER ]] ||
        die "CONTAINER=$CONTAINER not found: build it from apptainer.def, or CONTAINER= for none"
    LAUNCH=("${APPTAINER:-apptainer}" exec ${gpu_flag[@]+"${gpu_flag[@]}"}
        --bind "$DATA_DIR:/data:ro"
        --bind "$SCRATCH:/scratch"
        --bind "$RESULTS_DIR:/results")
    # $HOME is mounted by Apptainer; a checkout elsewhere must be bound (same path inside).
    if [[ $CODE_DIR != "$HOME"/* && -d $CODE_DIR ]]; then
        LAUNCH+=(--bind "$CODE_DIR")
    fi
    LAUNCH+=("$CONTAINER")
}

# The training command, run once per node by the job scripts: scripts/slurm/stage.sh copies
# the dataset into the job's own folder on SCRATCH (once per node, or once for nodes that
# share SCRATCH), drops the page cache, runs torchrun through scripts/slurm/launch.py (the
# scheduler's signals handled, no traceback when a job is stopped) and removes the job's folder
# however the run ends; with IN_PLACE it only drops the cache and runs. Arguments: torchrun's
# own flags. Sets the array NODE_TASK.
node_task() {
    [[ ${DRY_RUN:-0} == 1 || -d $DATA_DIR ]] ||
        die "DATA_DIR=$DATA_DIR is not a folder: set it to the preprocessed dataset"
    local stage=(around "$DATA_DIR" "$STAGE_DIR")
    (( IN_PLACE )) && stage=(in-place "$DATA_DIR")
    # shellcheck disable=SC2034  # used by the job scripts
    NODE_TASK=(bash "$REPO_DIR/scripts/slurm/stage.sh" "${stage[@]}" --
        ${LAUNCH[@]+"${LAUNCH[@]}"} "${PYTHON:-python3}" "$CODE_DIR/scripts/slurm/launch.py" "$@"
        "$CODE_DIR/main.py" "${TRAIN_ARGS[@]}")
}

# rendezvous_port BASE: print the first port from BASE up that nothing on this host listens on
# (the batch script runs on the job's first node, where the rendezvous lives), so two jobs
# sharing a node never meet at one port. BASE itself where no Python is at hand to look.
# Read it with a pipe into `read` under lastpipe, not $(...) (see absolute's comment).
rendezvous_port() {
    local base=$1
    if [[ ${DRY_RUN:-0} == 1 ]] || ! command -v python3 >/dev/null 2>&1; then
        echo "$base"
        return 0
    fi
    python3 - "$base" <<'PY' || echo "$base"
import socket, sys
base = int(sys.argv[1])
for port in list(range(base, 65536)) + list(range(1024, base)):
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            continue
    print(port)
    break
PY
}

# A requeued job (its own requeue before the time limit, a pre-emption, an administrator's
# `scontrol requeue`) starts this script again with SLURM_RESTART_COUNT > 0: continue the run
# from its checkpoint (main.py --resume starts afresh when there is none yet).
resume_if_requeued() {
    if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
        printf 'job %s: attempt %s, resuming from %s if it exists\n' "$JOB_ID" \
            $(( SLURM_RESTART_COUNT + 1 )) "$RESULTS_DIR/checkpoint.pt" >&2
        TRAIN_ARGS+=(--resume)
    fi
}

# run_and_watch CMD...: run CMD in the background and wait for it, so that signals reach this
# shell while it waits. SIGUSR1 (the warning `#SBATCH --signal=B:USR1@...` sends before the
# time limit) is passed on to CMD (its training processes save and exit) and makes the job
# requeue itself; SIGTERM (scancel, requeue, pre-emption, the time limit itself) reaches every
# process of the job from SLURM directly, so here it is only noted. Sets STATUS and STOPPED_BY.
run_and_watch() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        run "$@"
        STATUS=0 STOPPED_BY=
        return 0
    fi
    STOPPED_BY=${STOPPED_BY:-}
    local child=
    # Passed on as soon as CMD (stage.sh, or srun on several nodes) has its handler for it.
    trap 'STOPPED_BY=USR1; [[ -n $child ]] && { forward_usr1 "$child" & }' USR1
    trap 'STOPPED_BY=${STOPPED_BY:-TERM}' TERM
    trap 'STOPPED_BY=${STOPPED_BY:-INT}' INT
    "$@" &
    child=$!
    # A warning that came before CMD started.
    if [[ $STOPPED_BY == USR1 ]]; then
        forward_usr1 "$child" &
    fi
    while true; do
        STATUS=0
        wait "$child" || STATUS=$?
        kill -0 "$child" 2>/dev/null || break
    done
    trap - USR1 TERM INT
}

# After run_and_watch: one line on a stop by the scheduler, and a requeue after the warning.
after_stop() {
    [[ -z $STOPPED_BY ]] && return 0
    local checkpoint=$RESULTS_DIR/checkpoint.pt where
    if [[ -f $checkpoint ]]; then
        where="its checkpoint is $checkpoint"
    else
        where="no checkpoint was saved yet"
    fi
    if [[ $STOPPED_BY == USR1 ]]; then
        if (( STATUS == 0 )) && scontrol requeue "$SLURM_JOB_ID" >/dev/null 2>&1; then
            printf 'job %s: stopped before its time limit (SIGUSR1); %s; requeued, it will resume from it\n' \
                "$JOB_ID" "$where" >&2
            # SLURM now ends this attempt (SIGTERM to this script, then SIGKILL): wait for
            # that instead of exiting first. An exit that races with the requeue was seen to
            # leave the job FAILED instead of pending for its next attempt.
            sleep "${REQUEUE_WAIT:-120}" &
            wait $! || true
        else
            printf 'job %s: stopped before its time limit (SIGUSR1); %s; could not requeue (exit %s): resubmit to resume\n' \
                "$JOB_ID" "$where" "$STATUS" >&2
        fi
    else
        printf 'job %s: stopped by the scheduler (SIG%s); %s; a requeued job resumes from it\n' \
            "$JOB_ID" "$STOPPED_BY" "$where" >&2
    fi
}

# Settings go to stderr so that a dry run's stdout holds nothing but commands.
print_settings() {
    printf 'job %s: %s node(s) x %s GPU(s), container %s (%s)\n' \
        "$JOB_ID" "${NNODES:-1}" "$GPUS_PER_NODE" "${CONTAINER:-none}" "$GPU_VENDOR" >&2
    if (( IN_PLACE )); then
        printf 'data %s used in place (%s), results %s\n' "$DATA_DIR" "$IN_PLACE_WHY" "$RESULTS_DIR" >&2
    else
        printf 'data %s -> %s/kits19 (removed after), results %s\n' "$DATA_DIR" "$STAGE_DIR" "$RESULTS_DIR" >&2
    fi
}
