#!/usr/bin/env bash
# `make demo`: each product once on a small synthetic KiTS19, in a few minutes on 2 CPU cores:
# generate raw NIfTI cases, preprocess them, train a small UNet3D for DEMO_EPOCHS epochs (12: it
# finds the kidneys, the tumours not yet), evaluate the checkpoint, predict one scan the training
# never saw (with its preview), and draw the report. `make demo-convergence` runs the same chain with
# DEMO_EPOCHS=60: training stops at the demo's target, mean Dice DEMO_TARGET, or after 60 epochs.
# --semantics project: the project's crop sampler, with which the demo's recorded runs converged
# (the run is open division anyway: the demo's network is not the reference's).
set -euo pipefail
PY=${1:-python3}
WORK=${2:-demo_work}
CASES=${DEMO_CASES:-24}
TARGET=${DEMO_TARGET:-0.6}
EPOCHS=${DEMO_EPOCHS:-12}
SCAN=case_00000  # the first of evaluation_cases.txt: evaluated, never trained on

echo "== 1/6 synthetic KiTS19: $CASES cases in $WORK/raw"
if [ ! -d "$WORK/raw/case_$(printf %05d $((CASES - 1)))" ]; then
    "$PY" -m data_loading.synthetic --output_dir "$WORK/raw" --cases "$CASES" --seed 0 --size small
fi

echo "== 2/6 preprocess into $WORK/data"
"$PY" preprocess_dataset.py --data_dir "$WORK/raw" --results_dir "$WORK/data" | tail -n 2

echo "== 3/6 train a small UNet3D until mean_dice >= $TARGET or $EPOCHS epochs"
"$PY" main.py --exec_mode train --data_dir "$WORK/data" --log_dir "$WORK/results" \
    --save_ckpt_path "$WORK/results/checkpoint.pt" --filters 4 8 16 32 32 \
    --input_shape 64 64 64 --batch_size 2 --optimizer adam --learning_rate 0.003 \
    --init_learning_rate 0.0003 --lr_warmup_epochs 2 --epochs "$EPOCHS" --start_eval_at 4 \
    --evaluate_every 2 --quality_threshold "$TARGET" --oversampling 0.7 --num_workers 0 \
    --sw_batch_size 2 --seed 0 --semantics project

echo "== 4/6 evaluate the best checkpoint"
"$PY" main.py --exec_mode evaluate --data_dir "$WORK/data" --log_dir "$WORK/results" \
    --load_ckpt_path "$WORK/results/checkpoint.pt" --filters 4 8 16 32 32

# the preview needs matplotlib (requirements-test.txt); without it predict writes everything else
PREVIEW=--preview
"$PY" -c "import matplotlib" 2>/dev/null || { PREVIEW=; echo "(matplotlib missing: no preview)"; }
echo "== 5/6 predict the raw scan $SCAN into $WORK/predict"
"$PY" main.py --exec_mode predict --input "$WORK/raw/$SCAN" --output_dir "$WORK/predict" \
    --load_ckpt_path "$WORK/results/checkpoint.pt" --force $PREVIEW

echo "== 6/6 report: curves, summary and MLPerf compliance verdict in $WORK/report"
"$PY" -m runtime.report "$WORK/results" --output "$WORK/report" --quality_threshold "$TARGET"
echo "demo done: MLPerf log $WORK/results/unet3d.log, metrics $WORK/results/log.json"
echo "segmentation: $WORK/predict/$SCAN.nii.gz (summary.csv beside it${PREVIEW:+, preview $SCAN.png})"
echo "report: $WORK/report/summary.md (curves.png beside it when matplotlib is installed)"
