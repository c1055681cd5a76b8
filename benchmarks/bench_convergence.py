"""Convergence with the fast CPU settings against float32 (the baseline): the demo's small network (its training
command in ``scripts/demo.sh``) trained to its target per setting and seed on the demo's preprocessed data
(``--data_dir``); the epoch each run reached the target at. ``fast``: ``--amp --channels_last`` (bf16 where the
CPU has native bf16 dot products; the run says). Then whether the settings' epochs can be told apart: the exact
two-sided Mann-Whitney U test (scipy), no assumption on how epochs spread."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.harness import header, result_numbers, run_child, table

SETTINGS = {"fp32": [], "fast": ["--amp", "--channels_last"]}
# scripts/demo.sh's training flags (`make demo-convergence`: target 0.6, at most 60 epochs); the project's sampler,
# the only one when docs/performance.md's convergence runs were measured
DEMO = ["--filters", "4", "8", "16", "32", "32", "--input_shape", "64", "64", "64", "--batch_size", "2",
        "--optimizer", "adam", "--learning_rate", "0.003", "--init_learning_rate", "0.0003",
        "--lr_warmup_epochs", "2", "--start_eval_at", "4", "--evaluate_every", "2", "--oversampling", "0.7",
        "--num_workers", "0", "--sw_batch_size", "2", "--semantics", "project"]
NOT_REACHED = float("inf")  # a run that did not reach the target ranks after all that did


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", default=["fp32", "fast"], choices=sorted(SETTINGS))
    p.add_argument("--target", default="0.6")
    p.add_argument("--epochs", default="60")
    p.add_argument("--work", default="/tmp/bench_convergence")
    p.add_argument("--compare", nargs=2, metavar="SETTING=E1,E2,...",
                   help="only compare epochs already measured (runs of several sessions; x: not reached), "
                        "e.g. fp32=16,52,16,x fast=34,40,42,38")
    args = p.parse_args(argv)
    if args.compare:
        try:
            print(compare({k: [NOT_REACHED if e == "x" else int(e) for e in v.split(",")]
                           for k, v in (c.split("=") for c in args.compare)}))
        except ValueError:
            p.error(f"--compare {' '.join(args.compare)}: give SETTING=E1,E2,... twice")
        return 0
    if not args.data_dir:
        p.error("--data_dir: the demo's preprocessed data is needed")
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
            found = result_numbers(text)
            precision = re.search(r"^bf16: .*$", text, re.M)
            status, epochs = found.get("status", f"failed (see {log})"), found.get("epochs")
            dice = f"{found['best_mean_dice']:.4f}" if found else None
            rows.append([seed, setting, status, epochs if status == "success" else "not reached", dice,
                         f"{wall:.0f}", precision.group(0) if precision else "float32"])
            print(f"seed {seed} {setting}: {status}, epochs {epochs}", flush=True)
    print(table(["seed", "setting", "status", "epochs to target", "best mean Dice", "seconds", "precision"], rows))
    print(compare({setting: [int(r[3]) if r[2] == "success" else NOT_REACHED for r in rows if r[1] == setting]
                   for setting in args.settings}))
    return 0


def compare(epochs: dict[str, list[float]]) -> str:
    """Each setting's epochs to the target (mean and range of the runs that reached it); for two settings of three
    runs or more, the exact two-sided Mann-Whitney U p-value and, with the same seeds, the sign test over their pairs.
    A run that never reached the target (diverged, or out of epochs) ranks after every one that did; two tie."""
    from scipy.stats import binomtest, mannwhitneyu

    lines = []
    for name, values in epochs.items():
        reached = [int(v) for v in values if v != NOT_REACHED]
        shown = ", ".join(str(int(v)) if v != NOT_REACHED else "x" for v in values)
        lines.append(f"{name}: epochs [{shown}], {len(reached)} of {len(values)} reached the target"
                     + (f", mean {sum(reached) / len(reached):.1f}, range {min(reached)}-{max(reached)}" if reached else ""))
    pairs = [values for values in epochs.values() if len(values) >= 3]
    if len(epochs) == 2 and len(pairs) == 2:
        p = mannwhitneyu(*pairs, alternative="two-sided", method="exact").pvalue
        lines.append(f"Mann-Whitney U (exact, two-sided) p = {p:.3f}: "
                     + ("told apart at the 5% level" if p < 0.05 else "not told apart from seed noise at the 5% level"))
        (a, first), (b, second) = epochs.items()
        if len(first) == len(second):  # the same seeds in the same order: each seed a pair
            more = sum(y > x for x, y in zip(first, second))
            fewer = sum(y < x for x, y in zip(first, second))
            if more + fewer:
                sign = binomtest(more, more + fewer).pvalue
                lines.append(f"paired by seed: {b} needed more epochs than {a} for {more} seeds, fewer for {fewer}, "
                             f"as many for {len(first) - more - fewer}; sign test (exact, two-sided) p = {sign:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
