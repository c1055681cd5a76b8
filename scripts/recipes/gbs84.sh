# shellcheck shell=bash disable=SC2034
# Recipe gbs84: global batch 84. The hyper-parameters of the MLPerf Training 4.0.0 RCP unet3d_ref_84
# (mlperf_logging/rcp_checker/training_4.0.0/rcps_unet3d.json: its warm-up, 252000 samples, is
# 1500 epochs of KiTS19's 168 training cases).
# Sourced by scripts/lib/recipe.sh (RECIPE=gbs84 ./run_and_time.sh, the SLURM jobs, `runs --recipe gbs84`);
# an environment variable of the same name overrides a value. tests/test_recipes.py checks every
# value against the RCP file of the installed mlperf-logging.
RECIPE_RCP=unet3d_ref_84
GLOBAL_BATCH_SIZE=84
OPTIMIZER=sgd
LEARNING_RATE=1.5
INIT_LEARNING_RATE=1e-4
LR_WARMUP_EPOCHS=1500
LR_DECAY_EPOCHS=
LR_DECAY_FACTOR=1.0
MOMENTUM=0.9
WEIGHT_DECAY=0.0
