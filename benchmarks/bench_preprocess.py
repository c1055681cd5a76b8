"""Preprocessing throughput: cases per minute with 1 and with 2 worker processes, in one run.

Generates ``--cases`` synthetic KiTS19 cases of the ``--size`` preset (default ``realistic``:
512 x 512 in-plane, 300-600 slices, about 190 x 250 x 250 after resampling) into a temporary
folder, then runs ``preprocess_dataset.py`` on them once per worker count, each into a fresh
results folder, and times the whole command (start-up, pool, every case) from the outside, as
a user would see it. The raw files are in the page cache for every run alike.

Usage: ``python benchmarks/bench_preprocess.py [--cases 6] [--workers 1 2] [--size realistic]``.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nibabel  # noqa: E402

from data_loading import synthetic  # noqa: E402


def machine() -> str:
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {cores} usable cores (nproc), python {platform.python_version()}, "
            f"torch {torch.__version__}, numpy {numpy.__version__}")


def run_preprocess(raw: Path, out: Path, workers: int) -> float:
    """Wall-clock seconds of one preprocess_dataset.py run."""
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "preprocess_dataset.py"), "--data_dir", str(raw),
                    "--results_dir", str(out), "--num_workers", str(workers)],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", choices=sorted(synthetic.PRESETS), default="realistic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp", default=None, help="parent folder for the temporary data")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_preprocess_", dir=args.tmp))
    try:
        raw = work / "raw"
        start = time.perf_counter()
        # start at id 1: id 0 (every fourth id) has the target spacing and a small raw array
        synthetic.generate(str(raw), args.cases, seed=args.seed, size=args.size, start_id=1)
        generated = time.perf_counter() - start
        voxels = [nibabel.load(case / "imaging.nii.gz").shape for case in sorted(raw.iterdir())]
        mean_voxels = sum(d * h * w for d, h, w in voxels) / len(voxels)
        print(f"machine: {machine()}")
        print(f"data: {args.cases} {args.size} synthetic cases, raw shapes {voxels}, "
              f"mean {mean_voxels / 1e6:.0f} M voxels; generated in {generated:.0f} s")
        rows = []
        for workers in args.workers:
            seconds = run_preprocess(raw, work / f"out_{workers}", workers)
            rows.append((workers, seconds, args.cases / seconds * 60))
            shutil.rmtree(work / f"out_{workers}")
        base = rows[0][2]
        print()
        print("| workers | cases | wall s | cases/min | speed-up |")
        print("|---:|---:|---:|---:|---:|")
        for workers, seconds, per_minute in rows:
            print(f"| {workers} | {args.cases} | {seconds:.1f} | {per_minute:.2f} | "
                  f"{per_minute / base:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
