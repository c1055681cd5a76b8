"""Preprocess raw KiTS19 into the benchmark's .npy files, or verify them against checksums.

    python preprocess_dataset.py --data_dir RAW --results_dir OUT [--num_workers N] [--force]
                                 [--verify] [--checksum FILE]
    python preprocess_dataset.py --mode verify --results_dir OUT [--checksum FILE]
    python preprocess_dataset.py --data_dir RAW --results_dir OUT [--description dataset.json]
                                 [--target_spacing median|D,H,W] [--evaluation_cases FILE]

Without a description (and without RAW/dataset.json) RAW is KiTS19, preprocessed exactly as the
reference does it. A description (data_loading/description.py, docs/own-data.md) names other
data's labels, file layout and target spacing; it is saved into OUT with the data's fingerprint.

The steps live in ``data_loading/preprocessing.py``; this file parses, runs and reports.
Input errors print one line on stderr and exit 1; a failed verification lists every problem
file and exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, replace
from typing import Sequence

from data_loading import description as ds
from data_loading import preprocessing as pp
from data_loading.fingerprint import dataset_fingerprint, fingerprint_lines
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
    description: str | None = None
    target_spacing: str | None = None
    evaluation_cases: str | None = None


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


def median_spacing(cases: Sequence[pp.RawCase]) -> list[float]:
    """The median of the cases' spacings per axis, as preprocessing reads them
    (:func:`data_loading.preprocessing.header_geometry`: in KiTS19's axes, slices first, for a
    described dataset; from the headers, no voxel is read)."""
    spacings = [pp.header_geometry(case)[1] for case in cases]
    return [float(statistics.median(axis)) for axis in zip(*spacings)]


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
    parser.add_argument("--description", default=None, metavar="FILE",
                        help="the dataset's description, nnU-Net's dataset.json shape (labels, file "
                             "layout, target spacing; docs/own-data.md); default: --data_dir's "
                             "dataset.json if there is one, else KiTS19 as the benchmark preprocesses it")
    parser.add_argument("--target_spacing", default=None, metavar="median|D,H,W",
                        help="resample to this spacing in mm (array axes order), or to the data's median "
                             "spacing; default: the description's, else KiTS19's 1.6,1.2,1.2")
    parser.add_argument("--evaluation_cases", default=None, metavar="FILE",
                        help="the evaluation split: case ids one per line (3, 00003 or case_00003), "
                             "saved with the description; default: KiTS19's 42 (evaluation_cases.txt)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig:
    parser = build_parser()
    cfg = PreprocessConfig(**vars(parser.parse_args(argv)))
    if cfg.mode == "preprocess" and not cfg.data_dir:
        parser.error("--data_dir is required with --mode preprocess")
    return cfg


def chosen_description(cfg: PreprocessConfig) -> ds.DatasetDescription | None:
    """The description of ``--data_dir``: ``--description``, else its dataset.json, else KiTS19
    (None: the benchmark's preprocessing, as today) unless a flag asks for another target spacing
    or split (then KiTS19's description with them)."""
    path = cfg.description
    if path is None and os.path.isfile(os.path.join(cfg.data_dir, ds.DESCRIPTION_FILE)):
        path = os.path.join(cfg.data_dir, ds.DESCRIPTION_FILE)
        print(f"reading the dataset description {path}")
    if path is not None:
        description = ds.load_description(path)
    elif cfg.target_spacing is not None or cfg.evaluation_cases is not None:
        description = ds.KITS19
    else:
        return None
    if cfg.target_spacing is not None:
        description = replace(description, target_spacing=ds.parse_target_spacing(cfg.target_spacing, "--target_spacing"))
    if cfg.evaluation_cases is not None:
        description = replace(description, evaluation_cases=ds.read_split(cfg.evaluation_cases))
    return description


def check_split(description: ds.DatasetDescription, cases: Sequence[pp.RawCase], where: str) -> None:
    """Every id of ``--evaluation_cases`` is a labelled case, and some case is left to train on;
    without one, a line when none of KiTS19's evaluation ids is among the cases."""
    ids = {f"{case.case_id:05d}" for case in cases}
    if description.evaluation_cases:
        missing = [i for i in description.evaluation_cases if i not in ids]
        if missing:
            raise ds.DescriptionError(f"--evaluation_cases {where}: case {missing[0]} is not a labelled case of "
                                      f"--data_dir ({len(missing)} of its {len(description.evaluation_cases)} ids are not)")
        if ids <= set(description.evaluation_cases):
            raise ds.DescriptionError(f"--evaluation_cases {where}: lists every case; none is left to train on")
        return
    default = ds.read_split(pp.DEFAULT_EVALUATION_CASES)
    if not ids & set(default):
        print(f"none of KiTS19's {len(default)} evaluation ids is among these cases: give the evaluation "
              "split with --evaluation_cases FILE")


def check_results_dir(results_dir: str, record: dict | None) -> None:
    """``results_dir`` holds no case preprocessed another way: a description saved there must be
    this run's (labels, target spacing) and name the canonical axes (an earlier version kept each
    file's axis order), and a described run needs a folder without KiTS19 cases."""
    try:
        saved = ds.read_written_description(results_dir)
    except ds.DescriptionError as exc:
        raise pp.PreprocessError(str(exc)) from None
    keys = ("labels", "target_spacing", "layout", "image_file", "label_file", "file_ending")
    if saved is not None and saved.get("axes") != ds.CANONICAL_AXES:
        raise pp.PreprocessError(f"--results_dir {results_dir}: preprocessed by an earlier version, each case in its "
                                 f"files' stored axis order ({ds.DESCRIPTION_FILE} has no \"axes\": "
                                 f"\"{ds.CANONICAL_AXES}\"); use another --results_dir")
    if saved is not None:
        if record is None or any(saved.get(k) != record[k] for k in keys):
            theirs = ", ".join(f"{k} {saved[k]}" for k in ("labels", "target_spacing") if k in saved)
            raise pp.PreprocessError(f"--results_dir {results_dir}: preprocessed with another description "
                                     f"({ds.DESCRIPTION_FILE}: {theirs}); use another --results_dir")
    elif record is not None and any(n.endswith("_x.npy") and n.startswith("case_") for n in os.listdir(results_dir)):
        raise pp.PreprocessError(f"--results_dir {results_dir}: holds cases preprocessed without a description "
                                 "(KiTS19's); use another --results_dir")


def run_preprocess(cfg: PreprocessConfig) -> None:
    from tqdm import tqdm

    description = chosen_description(cfg)
    record = None
    if description is None:
        labelled, unlabelled = pp.find_cases(cfg.data_dir)
        target, target_from, labels = list(pp.TARGET_SPACING), "kits19", ds.KITS19.labels
        if unlabelled:
            print(pp.skipped_line(unlabelled))
        if not labelled:
            raise pp.PreprocessError(
                f"--data_dir {cfg.data_dir}: nothing to preprocess: its {len(unlabelled)} cases all have ids >= "
                f"{pp.FIRST_UNLABELLED_ID} (KiTS19's labelled cases are 0-{pp.FIRST_UNLABELLED_ID - 1}); KiTS21, "
                "KiTS23 and other data need a description (docs/own-data.md)")
    else:
        labelled, unlabelled_names = pp.find_described_cases(cfg.data_dir, description)
        if unlabelled_names:
            print(f"skipping {len(unlabelled_names)} cases without a label file ({unlabelled_names[0]}"
                  f"{', ...' if len(unlabelled_names) > 1 else ''})")
        if not labelled:
            raise pp.PreprocessError(f"--data_dir {cfg.data_dir}: nothing to preprocess: none of its "
                                     f"{len(unlabelled_names)} cases has its label file")
        labels = description.labels
        if description.target_spacing == "median":
            target, target_from = median_spacing(labelled), "median"
        else:
            target = list(description.target_spacing)
            target_from = "--target_spacing" if cfg.target_spacing else description.spacing_from
        record = description.record(target, target_from)
        print(f"{description.name}: {len(labelled)} labelled cases, labels {description.labels_text()}, "
              f"target spacing {target} mm (axes {ds.CANONICAL_AXES}: {ds.spacing_source_text(target_from)}); "
              f"each case read in those axes whatever its file's")
        check_split(description, labelled, cfg.evaluation_cases or description.path)
    pp.prepare_results_dir(cfg.results_dir)
    check_results_dir(cfg.results_dir, record)
    if record is not None:
        pp.write_or_explain(os.path.join(cfg.results_dir, ds.DESCRIPTION_FILE),
                            lambda handle: handle.write((json.dumps(record, indent=1) + "\n").encode("utf-8")))
    if pp.carry_synthetic_marker(cfg.data_dir, cfg.results_dir):
        print(f"{cfg.data_dir} is synthetic (data_loading.synthetic): its marker is copied into "
              f"{cfg.results_dir}, and a training run on it is not a closed MLPerf result")
    if pp.remove_stale_temporaries(cfg.results_dir):
        print("removed temporary files left by an interrupted run")
    todo = labelled if cfg.force else [
        c for c in labelled if not pp.is_complete(cfg.results_dir, c.name)]
    if len(todo) < len(labelled):
        print(f"{len(labelled) - len(todo)} of {len(labelled)} cases already complete, kept "
              "(--force redoes them)")
        done = [c for c in labelled if c not in todo]
        if pp.save_missing_geometry(done, cfg.results_dir, target):
            print("wrote the missing case_XXXXX_geometry.json records of those cases (from the headers)")
    workers = workers_within_memory(todo, cfg.num_workers)
    # disable=None: no bar when stderr is not a terminal (logs, CI)
    with tqdm(total=len(todo), unit="case", disable=None) as bar:
        def report(stats: pp.CaseStats) -> None:
            if stats.warning:
                bar.write(stats.warning, file=sys.stderr)
            bar.write(stats.line())
            bar.update()

        stats = pp.preprocess_cases(todo, cfg.results_dir, workers, report, target)
    if stats:
        print(pp.median_line(stats))
    entries = [s.fingerprint for s in stats]
    if record is not None:  # the whole dataset's, finished cases of an earlier run included
        entries += pp.kept_fingerprints([c for c in labelled if c not in todo], cfg.results_dir)
    if entries:
        fingerprint = dataset_fingerprint(entries, labels, target, target_from)
        for line in fingerprint_lines(fingerprint, described=record is not None):
            print(line)
        if record is not None:
            path = os.path.join(cfg.results_dir, ds.FINGERPRINT_FILE)
            pp.write_or_explain(path, lambda handle: handle.write((json.dumps(fingerprint, indent=1) + "\n").encode("utf-8")))
            print(f"fingerprint saved to {path}")
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
    except (pp.PreprocessError, ds.DescriptionError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; finished cases are kept, run again to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
