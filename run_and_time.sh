#!/usr/bin/env bash
# The MLPerf timed run, as the reference's run_and_time.sh: clear the caches, train to the
# target quality, print the start and end times and the reference's result line
# `RESULT,image_segmentation,<seed>,<seconds>,<user>,<start>`. The program logs the MLPerf
# `cache_clear` event (true only when the cache was dropped).
#
#   ./run_and_time.sh [SEED] [more main.py flags...]
#   RECIPE=gbs28 NPROC_PER_NODE=4 ./run_and_time.sh     # a recipe an MLPerf RCP stands behind
#
# Settings (environment variables):
#   RECIPE          scripts/recipes/<RECIPE>.sh: the hyper-parameters of one GLOBAL batch: gbs28,
#                   gbs56, gbs64, gbs84 (those of the MLPerf 4.0.0 RCPs) or gbs2 (the reference's
#                   1-GPU run, no 4.0.0 RCP); the batch per process is the global batch /
#                   (NPROC_PER_NODE x GA_STEPS), refused when it does not divide. Unset: the
#                   reference's 1-GPU hyper-parameters at BATCH_SIZE (default 2) per process, with
#                   a warning that no RCP stands behind them. docs/submission.md, "Recipes".
#   DATASET_DIR     preprocessed dataset; unset: /data (REFERENCE_DATA_DIR) when it holds one
#                   (case_*_x.npy), as the reference's script reads /data; where neither is, an
#                   embedded synthetic dataset is generated and preprocessed first, said in one
#                   line (SYNTHETIC_DIR, SYNTHETIC_CASES, SYNTHETIC_SEED). The images set
#                   DATASET_DIR=/data; DATASET_DIR= (empty) there asks for the synthetic data
#   RESULTS_DIR     for the logs (LOG_DIR) and the checkpoint (SAVE_CKPT_PATH); default
#                   results/run_and_time-seed<SEED> in the working directory, with -2, -3, ...
#                   added when that folder holds anything already: one folder per run
#   SEED            the master seed (or the first argument); -1 (default): drawn here from the
#                   OS, so that the folder's name and the log say which seed the run used
#   SAVE_CKPT_PATH  the final weights, written once after run_stop (as the reference: nothing
#                   is written on the clock); CKPT_DURING_RUN=1 also writes it at every
#                   evaluation and on a signal (--ckpt_during_run: resumable, but then the run
#                   is not an MLPerf result and its log says so)
#   MAX_EPOCHS      default auto: the rules' non-convergence limit for the run's global batch
#   START_EVAL_AT EVALUATE_EVERY  passed only when set (default: the rules' schedule, computed
#                   by main.py from the run's global batch; a hand-set one makes the run open)
#   QUALITY_THRESHOLD NUM_WORKERS GA_STEPS, and a recipe's settings (OPTIMIZER LEARNING_RATE
#   INIT_LEARNING_RATE LR_WARMUP_EPOCHS LR_DECAY_EPOCHS LR_DECAY_FACTOR MOMENTUM WEIGHT_DECAY
#   GLOBAL_BATCH_SIZE), each overriding the recipe's value
#   NPROC_PER_NODE  more than 1: torchrun ($PYTHON -m torch.distributed.run) --standalone on this node
#   PYTHON          the interpreter (default: python, else python3)
#   DRY_RUN=1       print the commands, shell-quoted, one per line, instead of running them
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SEED=${1:-${SEED:--1}}
if (( $# > 0 )); then shift; fi
if [[ $SEED == -1 ]]; then
    # main.py would draw it too (31 bits from the OS, as resolve_master_seed): drawn here, the
    # run's folder is named after the seed it really uses, and main.py is told that it came from
    # the OS (a seed given by hand is not: a closed run says so; the rules want clock or OS seeds)
    read -r SEED < <(od -An -N4 -tu4 /dev/urandom)
    SEED=$(( SEED & 0x7FFFFFFF ))
    export UNET3D_SEED_SOURCE=os
fi

PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
MAX_EPOCHS=${MAX_EPOCHS:-auto}
QUALITY_THRESHOLD=${QUALITY_THRESHOLD:-0.908}
NUM_WORKERS=${NUM_WORKERS:-8}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
CKPT_DURING_RUN=${CKPT_DURING_RUN:-0}
if [[ -z ${RESULTS_DIR:-} ]]; then
    # Never a folder that holds a run already (the same seed given twice): the next free name.
    RESULTS_DIR=$PWD/results/run_and_time-seed$SEED
    n=1
    while [[ -e $RESULTS_DIR && -n $(ls -A "$RESULTS_DIR" 2>/dev/null) ]]; do
        n=$(( n + 1 ))
        RESULTS_DIR=$PWD/results/run_and_time-seed$SEED-$n
    done
fi
LOG_DIR=${LOG_DIR:-$RESULTS_DIR}
SAVE_CKPT_PATH=${SAVE_CKPT_PATH:-$RESULTS_DIR/checkpoint.pt}
SYNTHETIC_DIR=${SYNTHETIC_DIR:-$PWD/results/synthetic-kits19}
SYNTHETIC_CASES=${SYNTHETIC_CASES:-12}
SYNTHETIC_SEED=${SYNTHETIC_SEED:-0}
REFERENCE_DATA_DIR=${REFERENCE_DATA_DIR:-/data}

# shellcheck source=scripts/lib/run.sh
source "$REPO_DIR/scripts/lib/run.sh"
# shellcheck source=scripts/lib/recipe.sh
source "$REPO_DIR/scripts/lib/recipe.sh"

# The recipe's flags, checked before anything is prepared or created.
if [[ ! $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'" >&2
    exit 1
fi
recipe_args "$NPROC_PER_NODE" "$@"
# The rules' evaluation schedule unless set by hand (main.py computes it from the global batch).
schedule=()
if [[ -n ${START_EVAL_AT:-} ]]; then
    schedule+=(--start_eval_at "$START_EVAL_AT")
fi
if [[ -n ${EVALUATE_EVERY:-} ]]; then
    schedule+=(--evaluate_every "$EVALUATE_EVERY")
fi

# The embedded dataset: small synthetic KiTS19-like cases, generated and preprocessed once
# (a marker file records a finished preparation; a half-written one is redone).
prepare_synthetic() {
    local raw=$SYNTHETIC_DIR/raw data=$SYNTHETIC_DIR/preprocessed
    DATASET_DIR=$data
    if [[ -f $data/.complete ]]; then
        echo "no DATASET_DIR given and $REFERENCE_DATA_DIR holds no preprocessed dataset: training on the" \
            "synthetic cases prepared before in $data (not KiTS19: an open run)" >&2
        return 0
    fi
    echo "no DATASET_DIR given and $REFERENCE_DATA_DIR holds no preprocessed dataset: preparing" \
        "$SYNTHETIC_CASES synthetic cases in $SYNTHETIC_DIR (not KiTS19: an open run)" >&2
    run rm -rf "$raw" "$data"
    # -m imports from the checkout, wherever the caller stands.
    run env "PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
        "$PYTHON" -m data_loading.synthetic --output_dir "$raw" \
        --cases "$SYNTHETIC_CASES" --seed "$SYNTHETIC_SEED"
    run "$PYTHON" "$REPO_DIR/preprocess_dataset.py" --data_dir "$raw" --results_dir "$data"
    run touch "$data/.complete"
}

# Drop the page cache so that the timed run reads its data cold ("You must flush the cache or
# restart the system prior to benchmarking"; CLEAR_CACHES=0 skips it). The ways that work
# (scripts/lib/drop_page_cache.sh): root, `sudo -n sysctl`, a SLURM Prolog= that dropped it
# when the job started (scripts/slurm/prolog_drop_caches.sh), or, in a container, which runs
# as non-root and cannot, the host: drop it there right before starting the container and pass
# `--env UNET3D_CACHE_DROPPED_AT=$(date +%s)`. Such an earlier drop counts only when the dataset
# was not written after it, and data on tmpfs is in RAM whatever is dropped. The program is told
# whether the data is cold (UNET3D_CACHE_CLEARED) and logs the MLPerf `cache_clear` event with that
# value: a closed run logged false is no result (docs/submission.md, "The page cache").
clear_page_cache() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        echo 'sync; echo 3 > /proc/sys/vm/drop_caches'
        return 0
    fi
    UNET3D_CACHE_CLEARED=0
    if bash "$REPO_DIR/scripts/lib/drop_page_cache.sh" "$(hostname -s)" "$DATASET_DIR"; then
        UNET3D_CACHE_CLEARED=1
    fi
    export UNET3D_CACHE_CLEARED
}

# Timestamps are real output; in a dry run stdout holds only the commands.
say() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        return 0
    fi
    printf '%s\n' "$*"
}

# holds_dataset DIR: DIR holds a preprocessed dataset (case_XXXXX_x.npy files)
holds_dataset() {
    compgen -G "$1/case_*_x.npy" > /dev/null
}

if [[ -z ${DATASET_DIR:-} ]] && holds_dataset "$REFERENCE_DATA_DIR"; then
    # the reference's run_and_time.sh reads /data: so does its command line here
    DATASET_DIR=$REFERENCE_DATA_DIR
    echo "no DATASET_DIR given: the preprocessed dataset in $DATASET_DIR (the reference's folder)" >&2
elif [[ -z ${DATASET_DIR:-} ]]; then
    prepare_synthetic
elif [[ ! -d $DATASET_DIR ]]; then
    echo "error: DATASET_DIR=$DATASET_DIR does not exist" >&2
    exit 1
fi
run mkdir -p "$LOG_DIR" "$(dirname "$SAVE_CKPT_PATH")"

during_run=()
if [[ $CKPT_DURING_RUN == 1 ]]; then
    during_run=(--ckpt_during_run)
fi

launcher=("$PYTHON")
if (( NPROC_PER_NODE > 1 )); then
    launcher=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC_PER_NODE")
fi

clear_page_cache

start=$(date +%s)
start_fmt=$(date '+%Y-%m-%d %r')
say "STARTING TIMING RUN AT $start_fmt"
status=0
run "${launcher[@]}" "$REPO_DIR/main.py" \
    --data_dir "$DATASET_DIR" \
    --log_dir "$LOG_DIR" \
    --save_ckpt_path "$SAVE_CKPT_PATH" \
    ${during_run[@]+"${during_run[@]}"} \
    --seed "$SEED" \
    --epochs "$MAX_EPOCHS" \
    --quality_threshold "$QUALITY_THRESHOLD" \
    ${schedule[@]+"${schedule[@]}"} \
    "${RECIPE_ARGS[@]}" \
    --num_workers "$NUM_WORKERS" \
    "$@" || status=$?
end=$(date +%s)
say "ENDING TIMING RUN AT $(date '+%Y-%m-%d %r') ($(( end - start )) s, exit status $status)"
# The reference's result line (its run_and_time.sh): benchmark, seed, seconds, user, start.
say "RESULT,image_segmentation,$SEED,$(( end - start )),${USER:-$(id -un)},$start_fmt"
exit "$status"
