"""Preprocessing throughput: cases per minute with 1 and with 2 worker processes, in one run.

Generates ``--cases`` synthetic KiTS19 cases of the ``--size`` preset (default ``realistic``:
512 x 512 in-plane, 300-600 slices, about 190 x 250 x 250 after resampling) into a temporary
folder, then runs ``preprocess_dataset.py`` on them once per worker count, each into a fresh
results folder, and times the whole command (start-up, pool, every case) from the outside, as
a user would see it. The raw files are in the page cache for every run alike. Each worker
count runs ``--repeats`` times, the order alternating, and the table shows every run (with the
load average before it and how busy the cores were during it) and the best per worker count.

Usage: ``python benchmarks/bench_preprocess.py [--cases 6] [--workers 1 2] [--repeats 2]
[--size realistic]``.
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


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) processor time of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def run_preprocess(raw: Path, out: Path, workers: int) -> tuple[float, float]:
    """Wall-clock seconds of one preprocess run, and how busy the machine was meanwhile (%).

    A busy share near 100% with others' jobs running means the run competed for the cores.
    """
    busy0, total0 = cpu_jiffies()
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "preprocess_dataset.py"), "--data_dir", str(raw),
                    "--results_dir", str(out), "--num_workers", str(workers)],
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    busy1, total1 = cpu_jiffies()
    return wall, 100.0 * (busy1 - busy0) / max(1, total1 - total0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", choices=sorted(synthetic.PRESETS), default="realistic")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per worker count, alternating the order (default 2)")
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
        print("'load' is the 1-minute load average before each run and 'busy' the share of all")
        print("cores in use during it (this run and anything else on the machine).")
        rows = []
        for repeat in range(args.repeats):
            order = args.workers if repeat % 2 == 0 else args.workers[::-1]
            for workers in order:
                load = os.getloadavg()[0]
                wall, busy = run_preprocess(raw, work / f"out_{workers}", workers)
                rows.append((repeat + 1, workers, load, wall, busy))
                shutil.rmtree(work / f"out_{workers}")
        print()
        print("| run | workers | load | busy | wall s | cases/min |")
        print("|---:|---:|---:|---:|---:|---:|")
        for repeat, workers, load, wall, busy in rows:
            print(f"| {repeat} | {workers} | {load:.1f} | {busy:.0f}% | {wall:.1f} | "
                  f"{args.cases / wall * 60:.2f} |")
        print()
        print("| workers | best wall s | cases/min (best) | speed-up |")
        print("|---:|---:|---:|---:|")
        best = {w: min(r[3] for r in rows if r[1] == w) for w in args.workers}
        for workers in args.workers:
            print(f"| {workers} | {best[workers]:.1f} | {args.cases / best[workers] * 60:.2f} | "
                  f"{best[args.workers[0]] / best[workers]:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
