#!/usr/bin/env bash
# Parameter sweep: one SLURM job per (learning rate, seed), each a job script run with its
# settings passed through `sbatch --export`; the job script turns them into main.py flags.
#   LEARNING_RATES="0.4 0.8 1.0" SEEDS="1 2 3" bash scripts/slurm/sweep.sh [main.py flags...]
# Settings: LEARNING_RATES, SEEDS (space-separated lists), JOB_SCRIPT (default: the
# single-node job), SBATCH_ARGS (more sbatch options as one string, e.g. "--partition gpu"),
# DRY_RUN=1 prints the sbatch commands instead of submitting them. Flags after the script's
# name go to every run's main.py; everything else in the environment reaches the jobs too
# (--export=ALL), e.g. GPUS_PER_NODE, CONTAINER, DATA_DIR.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/slurm/common.sh
source "$here/common.sh"

LEARNING_RATES=${LEARNING_RATES:-0.4 0.8 1.0}
SEEDS=${SEEDS:-1 2 3}
JOB_SCRIPT=${JOB_SCRIPT:-$here/single_node.sbatch}
read -r -a learning_rates <<< "$LEARNING_RATES"
read -r -a seeds <<< "$SEEDS"
sbatch_extra=()
if [[ -n ${SBATCH_ARGS:-} ]]; then
    read -r -a sbatch_extra <<< "$SBATCH_ARGS"
fi
[[ -f $JOB_SCRIPT ]] || die "JOB_SCRIPT=$JOB_SCRIPT not found"

for lr in "${learning_rates[@]}"; do
    for seed in "${seeds[@]}"; do
        # --export takes NAME=value pairs separated by commas: values must not contain one.
        [[ $lr != *,* && $seed != *,* ]] || die "a comma in '$lr' or '$seed' would break --export"
        run sbatch --job-name "unet3d-lr$lr-seed$seed" \
            --export "ALL,LEARNING_RATE=$lr,SEED=$seed" \
            ${sbatch_extra[@]+"${sbatch_extra[@]}"} "$JOB_SCRIPT" "$@"
    done
done
