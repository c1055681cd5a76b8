"""Convergence with the fast CPU settings against float32 (the baseline): the demo's small network
(``scripts/demo.sh``'s training command) trained to its target per setting and seed, on the demo's
preprocessed data (``--data_dir``); the epoch each run reached the target at (its RESULT line).
``fast``: ``--amp --channels_last`` (bf16 where the CPU has native bf16 dot products; the run says).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.harness import header, run_child, table

SETTINGS = {"fp32": [], "fast": ["--amp", "--channels_last"]}
# scripts/demo.sh's training flags (its defaults: target 0.6, at most 60 epochs)
DEMO = ["--filters", "4", "8", "16", "32", "32", "--input_shape", "64", "64", "64", "--batch_size", "2",
        "--optimizer", "adam", "--learning_rate", "0.003", "--init_learning_rate", "0.0003",
        "--lr_warmup_epochs", "2", "--start_eval_at", "4", "--evaluate_every", "2", "--oversampling", "0.7",
        "--num_workers", "0", "--sw_batch_size", "2"]
RESULT = re.compile(r"RESULT,image_segmentation,\d+,([0-9.]+),(\w+),best_mean_dice=(-?[0-9.]+),epochs=(\d+)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", required=True)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", default=["fp32", "fast"], choices=sorted(SETTINGS))
    p.add_argument("--target", default="0.6")
    p.add_argument("--epochs", default="60")
    p.add_argument("--work", default="/tmp/bench_convergence")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(header("bench_convergence", argv))
    rows = []
    for seed in args.seeds:
        for setting in args.settings:
            log = work / f"seed{seed}-{setting}.log"
            command = [sys.executable, "main.py", "--exec_mode", "train", "--data_dir", args.data_dir,
                       "--log_dir", str(work / f"logs-seed{seed}-{setting}"), *DEMO, "--epochs", args.epochs,
                       "--quality_threshold", args.target, "--seed", str(seed), *SETTINGS[setting]]
            wall, _, _, text = run_child(command, log)
            found = RESULT.search(text)
            precision = re.search(r"^bf16: .*$", text, re.M)
            _, status, dice, epochs = found.groups() if found else (None, f"failed (see {log})", None, None)
            rows.append([seed, setting, status, epochs, dice, f"{wall:.0f}",
                         precision.group(0) if precision else "float32"])
            print(f"seed {seed} {setting}: {status}, epochs {epochs}", flush=True)
    print(table(["seed", "setting", "status", "epochs to target", "best mean Dice", "seconds", "precision"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
