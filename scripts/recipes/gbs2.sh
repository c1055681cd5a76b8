# shellcheck shell=bash disable=SC2034
# Recipe gbs2: global batch 2. The MLCommons reference's 1-GPU timed run (its run_and_time.sh).
# NO MLPerf 4.0.0 RCP stands behind it: the 4.0.0 RCPs are at global batches 28, 56, 64 and 84
# only, so rcp_checker holds a run at global batch 2 to converge no faster than the one at 28.
# (Rulesets 1.0.0-3.1.0 had an RCP at global batch 2 with these values.)
# Sourced by scripts/lib/recipe.sh (RECIPE=gbs2 ./run_and_time.sh, the SLURM jobs, `runs --recipe gbs2`);
# an environment variable of the same name overrides a value. tests/test_recipes.py checks every
# value against the RCP file of the installed mlperf-logging.
RECIPE_RCP=none
GLOBAL_BATCH_SIZE=2
OPTIMIZER=sgd
LEARNING_RATE=0.8
INIT_LEARNING_RATE=1e-4
LR_WARMUP_EPOCHS=200
LR_DECAY_EPOCHS=
LR_DECAY_FACTOR=1.0
MOMENTUM=0.9
WEIGHT_DECAY=0.0
