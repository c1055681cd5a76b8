# shellcheck shell=bash disable=SC2034
# Recipe gbs56: global batch 56. The hyper-parameters of the MLPerf Training 4.0.0 RCP unet3d_ref_56
# (mlperf_logging/rcp_checker/training_4.0.0/rcps_unet3d.json: its warm-up, 168000 samples, is
# 1000 epochs of KiTS19's 168 training cases).
# Sourced by scripts/lib/recipe.sh (RECIPE=gbs56 ./run_and_time.sh, the SLURM jobs, `runs --recipe gbs56`);
# an environment variable of the same name overrides a value. tests/test_recipes.py checks every
# value against the RCP file of the installed mlperf-logging.
RECIPE_RCP=unet3d_ref_56
GLOBAL_BATCH_SIZE=56
OPTIMIZER=sgd
LEARNING_RATE=2.0
INIT_LEARNING_RATE=1e-4
LR_WARMUP_EPOCHS=1000
LR_DECAY_EPOCHS=
LR_DECAY_FACTOR=1.0
MOMENTUM=0.9
WEIGHT_DECAY=0.0
