#!/usr/bin/env bash
# `make demo`: the whole chain on a small synthetic KiTS19, in a few minutes on 2 CPU cores
# (or faster on a GPU): generate raw NIfTI cases, preprocess them, train a small UNet3D until a
# demo Dice target, then evaluate the saved checkpoint.
set -euo pipefail
PY=${1:-python3}
WORK=${2:-demo_work}
CASES=${DEMO_CASES:-24}
TARGET=${DEMO_TARGET:-0.6}
EPOCHS=${DEMO_EPOCHS:-60}

echo "== 1/4 synthetic KiTS19: $CASES cases in $WORK/raw"
if [ ! -d "$WORK/raw/case_$(printf %05d $((CASES - 1)))" ]; then
    "$PY" -m data_loading.synthetic --output_dir "$WORK/raw" --cases "$CASES" --seed 0 --size small
fi

echo "== 2/4 preprocess into $WORK/data"
"$PY" preprocess_dataset.py --data_dir "$WORK/raw" --results_dir "$WORK/data" | tail -n 2

echo "== 3/4 train a small UNet3D until mean_dice >= $TARGET (at most $EPOCHS epochs)"
"$PY" main.py --exec_mode train --data_dir "$WORK/data" --log_dir "$WORK/results" \
    --save_ckpt_path "$WORK/results/checkpoint.pt" --filters 4 8 16 32 32 \
    --input_shape 64 64 64 --batch_size 2 --optimizer adam --learning_rate 0.003 \
    --init_learning_rate 0.0003 --lr_warmup_epochs 2 --epochs "$EPOCHS" --start_eval_at 4 \
    --evaluate_every 2 --quality_threshold "$TARGET" --oversampling 0.7 --num_workers 0 \
    --sw_batch_size 2 --seed 0

echo "== 4/4 evaluate the best checkpoint"
"$PY" main.py --exec_mode evaluate --data_dir "$WORK/data" --log_dir "$WORK/results" \
    --load_ckpt_path "$WORK/results/checkpoint.pt" --filters 4 8 16 32 32

echo "== report: curves, summary and MLPerf compliance verdict in $WORK/report"
"$PY" -m runtime.report "$WORK/results" --output "$WORK/report" --quality_threshold "$TARGET"
echo "demo done: MLPerf log $WORK/results/unet3d.log, metrics $WORK/results/log.json"
echo "report: $WORK/report/summary.md (curves.png beside it when matplotlib is installed)"
