"""Preprocessing throughput: cases per minute of ``preprocess_dataset.py`` with 1 worker process (the baseline)
and with 2, in lock-step rounds, each into a fresh results folder and timed from the outside as a user sees it,
on ``--cases`` synthetic KiTS19 cases of the ``--size`` preset (``realistic``: 512 x 512 in-plane, 300-600
slices), the raw files in the page cache for all alike."""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nibabel

from benchmarks.harness import header, lockstep, loads, ratios, table
from data_loading import synthetic


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="the first is the baseline")
    parser.add_argument("--size", choices=sorted(synthetic.PRESETS), default="realistic")
    parser.add_argument("--repeats", type=int, default=2, help="lock-step rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp", default=None, help="parent folder for the temporary data")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_preprocess_", dir=args.tmp))
    try:
        raw, start = work / "raw", time.perf_counter()
        # start at id 1: id 0 (every fourth id) has the target spacing and a small raw array
        synthetic.generate(str(raw), args.cases, seed=args.seed, size=args.size, start_id=1)
        shapes = [nibabel.load(case / "imaging.nii.gz").shape for case in sorted(raw.glob("case_*"))]
        print(header("bench_preprocess", argv) + f"\ndata: {args.cases} {args.size} synthetic cases, raw shapes "
              f"{shapes}; generated in {time.perf_counter() - start:.0f} s", flush=True)

        def command(name, r):
            shutil.rmtree(work / name, ignore_errors=True)
            return [sys.executable, "preprocess_dataset.py", "--data_dir", str(raw), "--results_dir", str(work / name),
                    "--num_workers", name.split()[0]]

        names = [f"{w} workers" for w in args.workers]
        runs = lockstep(names, command, args.repeats, work / "logs")
        seconds = {n: [r.value for r in rs] for n, rs in runs.items()}
        speed = ratios(seconds, names[0])
        print(f"\n{loads(runs)}\n" + table(["workers", "median wall s", "cases/min", f"vs {names[0]}"], [
            [n, statistics.median(s), args.cases / statistics.median(s) * 60, f"{speed[n]:.2f}x"]
            for n, s in seconds.items()]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
