"""Convergence with the fast CPU settings against float32: the demo's small network (the training
command of ``scripts/demo.sh``, ``make demo``) trained to its target with each setting and
seed; prints the epoch each run reached the target at (the RESULT line's ``epochs``).

    python -m benchmarks.bench_convergence --data_dir DEMO_DATA --seeds 0 1 2 \\
        --settings fp32 fast

``DEMO_DATA``: the demo's preprocessed data (``scripts/demo.sh`` steps 1-2: 24 small synthetic
cases). ``fast`` is ``--amp --channels_last``: bf16 autocast where the CPU has native bf16 dot
products (else float32: the run says which), channels-last with the fused norms.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import ROOT, header, table
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
            start = time.time()
            with open(log, "w") as handle:
                subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
            text = log.read_text()
            found = RESULT.search(text)
            precision = re.search(r"^bf16: .*$", text, re.M)
            _, status, dice, epochs = found.groups() if found else (None, f"failed (see {log})", None, None)
            rows.append([seed, setting, status, epochs, dice, f"{time.time() - start:.0f}",
                         precision.group(0) if precision else "float32"])
            print(f"seed {seed} {setting}: {status}, epochs {epochs}", flush=True)
    print(table(["seed", "setting", "status", "epochs to target", "best mean Dice", "seconds", "precision"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
