"""Preprocess raw KiTS19 into the benchmark's .npy files, or verify them against checksums.

    python preprocess_dataset.py --data_dir RAW --results_dir OUT [--num_workers N] [--force]
                                 [--verify] [--checksum FILE]
    python preprocess_dataset.py --mode verify --results_dir OUT [--checksum FILE]

The steps live in ``data_loading/preprocessing.py``; this file parses, runs and reports.
Input errors print one line on stderr and exit 1; a failed verification lists every problem
file and exits 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from data_loading import preprocessing as pp
from data_loading.cli_types import OneLineParser, positive_int
from runtime import __version__

PROG = "preprocess_dataset.py"


@dataclass(frozen=True)
class PreprocessConfig:
    data_dir: str | None
    results_dir: str
    mode: str
    checksum: str
    num_workers: int
    force: bool
    verify: bool


def default_workers() -> int:
    """Cores this process may run on (affinity-aware where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def workers_within_memory(cases: Sequence[pp.RawCase], requested: int, memory=None) -> int:
    """``requested`` workers, fewer when that many of the largest case would not fit in the
    memory this process may take now (:mod:`data_loading.memory_limits`: MemAvailable, its
    job's cgroup, SLURM's --mem); one line says so. A case's need is predict's estimate for
    its header's shape (:func:`data_loading.scan_checks.predict_bytes`: more copies than
    preprocessing holds, so an upper bound); at least one worker always runs."""
    from data_loading.memory_limits import read_memory
    from data_loading.scan_checks import predict_bytes, read_header
    from data_loading.scans import ScanError

    if requested <= 1 or len(cases) <= 1:
        return requested
    memory = memory or read_memory()
    if memory.available is None:
        return requested
    need = 0
    for case in cases:
        try:
            header = read_header(case.image_path)
        except ScanError:   # the worker that reads it says why, naming the case
            continue
        need = max(need, predict_bytes(header.shape, header.spacing))
    fit = max(1, int(memory.available // need)) if need else requested
    if fit >= min(requested, len(cases)):
        return requested
    print(f"memory: {fit} worker(s) instead of {requested}: the largest case needs up to "
          f"{need / 2**30:.1f} GiB and {memory.available / 2**30:.1f} GiB is available "
          f"({memory.available_source})")
    return fit


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, version=__version__, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None,
                        help="raw KiTS19: case_XXXXX/{imaging,segmentation}.nii.gz, directly "
                             "or under data/ (required for --mode preprocess)")
    parser.add_argument("--results_dir", required=True,
                        help="folder of the case_XXXXX_{x,y}.npy files (created if missing)")
    parser.add_argument("--mode", choices=("preprocess", "verify"), default="preprocess",
                        help="preprocess (default), or only verify md5 sums of --results_dir")
    parser.add_argument("--checksum", default=pp.DEFAULT_CHECKSUM,
                        help="JSON of file name -> md5 for verification (default: "
                             "data_loading/checksum.json, the reference's sums for KiTS19)")
    parser.add_argument("--num_workers", type=positive_int, default=default_workers(),
                        help="parallel processes (default: all cores, here %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="redo cases whose outputs are already complete")
    parser.add_argument("--verify", action="store_true",
                        help="after preprocessing, verify against --checksum")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig:
    parser = build_parser()
    cfg = PreprocessConfig(**vars(parser.parse_args(argv)))
    if cfg.mode == "preprocess" and not cfg.data_dir:
        parser.error("--data_dir is required with --mode preprocess")
    return cfg


def run_preprocess(cfg: PreprocessConfig) -> None:
    from tqdm import tqdm

    labelled, unlabelled = pp.find_cases(cfg.data_dir)
    pp.prepare_results_dir(cfg.results_dir)
    if pp.carry_synthetic_marker(cfg.data_dir, cfg.results_dir):
        print(f"{cfg.data_dir} is synthetic (data_loading.synthetic): its marker is copied into "
              f"{cfg.results_dir}, and a training run on it is not a closed MLPerf result")
    if unlabelled:
        print(pp.skipped_line(unlabelled))
    if pp.remove_stale_temporaries(cfg.results_dir):
        print("removed temporary files left by an interrupted run")
    todo = labelled if cfg.force else [
        c for c in labelled if not pp.is_complete(cfg.results_dir, c.name)]
    if len(todo) < len(labelled):
        print(f"{len(labelled) - len(todo)} of {len(labelled)} cases already complete, kept "
              "(--force redoes them)")
        done = [c for c in labelled if c not in todo]
        if pp.save_missing_geometry(done, cfg.results_dir):
            print("wrote the missing case_XXXXX_geometry.json records of those cases (from the headers)")
    workers = workers_within_memory(todo, cfg.num_workers)
    # disable=None: no bar when stderr is not a terminal (logs, CI)
    with tqdm(total=len(todo), unit="case", disable=None) as bar:
        def report(stats: pp.CaseStats) -> None:
            if stats.warning:
                bar.write(stats.warning, file=sys.stderr)
            bar.write(stats.line())
            bar.update()

        stats = pp.preprocess_cases(todo, cfg.results_dir, workers, report)
    if stats:
        print(pp.median_line(stats))
    print(f"{len(stats)} cases preprocessed into {cfg.results_dir}")


def run_verify(cfg: PreprocessConfig) -> bool:
    checksums = pp.load_checksums(cfg.checksum)
    problems = pp.verify(cfg.results_dir, checksums, cfg.num_workers)
    if not problems:
        print(f"verify: all {len(checksums)} files in {cfg.results_dir} match {cfg.checksum}")
        return True
    print(f"verify: {len(problems)} problem files in {cfg.results_dir} against {cfg.checksum}:")
    for problem in problems:
        print(f"  {problem.kind:<8} {problem.file}")
    counts = {kind: sum(p.kind == kind for p in problems) for kind in ("missing", "extra",
                                                                         "mismatch")}
    print(f"{PROG}: verify failed: {counts['missing']} missing, {counts['extra']} extra, "
          f"{counts['mismatch']} mismatching", file=sys.stderr)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        if cfg.mode == "preprocess":
            run_preprocess(cfg)
        if cfg.mode == "verify" or cfg.verify:
            return 0 if run_verify(cfg) else 1
        return 0
    except pp.PreprocessError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; finished cases are kept, run again to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
