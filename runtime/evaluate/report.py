"""What ``--exec_mode evaluate`` scored, said in words, and each case's Dice in a CSV.

The benchmark's Dice (the mean over cases that MLPerf compares) is computed on the preprocessed
volumes: the min-shape padding is scored, and the labels are the benchmark's resampled ones.
Predict scores the segmentation on the scan's own grid against the untouched ground truth, and
so reads higher on small or thick-slice scans. Where preprocessing left a geometry record
(``case_XXXXX_geometry.json``), evaluate also reports the Dice inside the scan (padding excluded),
marked as not the benchmark's number. docs/reliability.md ("Two Dice numbers") explains the three
causes (padding, label resampling, grid).
"""
from __future__ import annotations

import csv
import fnmatch
import io
import json
import os
from typing import Sequence

import numpy as np

from data_loading.atomic import atomic_write
from data_loading.write_errors import write_or_raise
from runtime.outputs import OutputError
from runtime.plan import RunPlan
from runtime.run_files import (EVAL_CASES_COLUMNS, EVAL_CASES_CSV, METRICS_LOG, MLPERF_LOG, RESULT, RESUMED_LOG_GLOB,
                               TRAIN)
from runtime.run_log import MetricsWriter

# evaluate's own files in a folder that holds a training run (never the run's log.json, eval_cases.csv)
OWN_RECORDS = "evaluate.json"
OWN_CASES = "evaluate_cases.csv"

SCORED = ("scored: the benchmark's Dice on the preprocessed volumes (resampled to 1.6 x 1.2 x 1.2 mm, "
          "min-shape padding and the benchmark's resampled labels included), the mean over cases")


def label_keys(case: dict) -> list[str]:
    """A case record's Dice per label (``kidney_dice``, ``tumour_dice`` for KiTS19; the labels'
    names for own data), in order."""
    return [key for key in case if key.endswith("_dice") and key != "mean_dice" and not key.startswith("scan_")]


def scan_means(cases: Sequence[dict]) -> dict | None:
    """Mean Dice per label (KiTS19: kidney, tumour) and mean Dice inside the scans, over the cases
    that have them (own data: a label's NaN, absent from both, left out)."""
    inside = [c for c in cases if c.get("scan_mean_dice") is not None]
    if not inside:
        return None
    keys = label_keys(inside[0]) + ["mean_dice"]
    values = {key: [c[f"scan_{key}"] for c in inside] for key in keys}
    means = {key: float(np.nanmean(v) if np.isnan(v).any() else np.mean(v)) for key, v in values.items()}
    return {**means, "cases": len(inside)}


def own_data_scored(plan: RunPlan) -> list[str]:
    """What evaluate scored on own data (``plan``: the run's), and how it relates to predict's."""
    from runtime.resolve import shape_text
    from runtime.spacing import spacing_text

    return [f"scored: nnU-Net's Dice on each scan's own voxels (the padding preprocessing added left out), "
            f"resampled to {spacing_text(plan.network.target_spacing)}, every voxel windowed as predict windows it; "
            "the mean over cases of each label present in the truth or the prediction",
            f"predict uses the same window ({shape_text(plan.inference.window)}) and backend "
            f"({plan.inference.backend}) by "
            "default: its Dice differs from this only by the grid (the scan's own voxels, not the resampled ones)"]


def explain_scores(cases: Sequence[dict], plan: RunPlan | None = None) -> list[str]:
    """Lines that say what was scored, and the Dice inside the scans where it is known (the
    benchmark's data; own data's numbers are the scans' own: :func:`own_data_scored`)."""
    if plan is not None and not plan.network.label_set.benchmark_data:
        return own_data_scored(plan)
    lines = [SCORED]
    inside = scan_means(cases)
    if inside is None:
        lines.append("inside the scans: unknown (no case_XXXXX_geometry.json beside the arrays; "
                     "preprocess_dataset.py writes them)")
        return lines
    of = "" if inside["cases"] == len(cases) else f" (of {len(cases)}; the others have no geometry record)"
    if "tumour_dice" in inside:  # KiTS19
        per_label = f"kidney {inside['kidney_dice']:.4f}, tumour {inside['tumour_dice']:.4f}"
    else:
        per_label = ", ".join(f"{key[:-len('_dice')]} {inside[key]:.4f}" for key in label_keys(cases[0]))
    lines.append(f"inside the scans (padding excluded; NOT the benchmark's number): mean_dice "
                 f"{inside['mean_dice']:.4f} ({per_label}) over {inside['cases']} cases{of}")
    return lines


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.6f}" if isinstance(value, float) else str(value)


def case_scores_csv(cases: Sequence[dict]) -> str:
    """The CSV text: one row per case, sorted by case."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    # KiTS19's columns; an own-data run's are its records' (the Dice named after its labels)
    columns = EVAL_CASES_COLUMNS if not cases or "tumour_dice" in cases[0] else tuple(cases[0])
    writer.writerow(columns)
    for case in sorted(cases, key=lambda c: str(c["case"])):
        writer.writerow([_cell(case.get(key)) for key in columns])
    return text.getvalue()


def holds_training_run(log_dir: str) -> bool:
    """Whether ``log_dir`` holds a training run's files: its MLPerf log, or a ``log.json`` with a
    training record (``train`` or ``result``)."""
    try:
        names = os.listdir(log_dir)
    except OSError:
        return False
    if MLPERF_LOG in names or any(fnmatch.fnmatchcase(n, RESUMED_LOG_GLOB) for n in names):
        return True
    try:
        with open(os.path.join(log_dir, METRICS_LOG), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    if json.loads(line).get("kind") in (TRAIN, RESULT):
                        return True
                except (ValueError, AttributeError):
                    continue
    except OSError:
        return False
    return False


class OwnRecords(MetricsWriter):
    """:class:`runtime.run_log.MetricsWriter` into ``<log_dir>/evaluate.json`` (:data:`OWN_RECORDS`)."""

    def __init__(self, log_dir: str, enabled: bool):
        super().__init__(log_dir, enabled)
        self.path = os.path.join(log_dir, OWN_RECORDS)


def write_case_scores(log_dir: str, cases: Sequence[dict], name: str = EVAL_CASES_CSV) -> str:
    """``<log_dir>/<name>`` (default ``eval_cases.csv``) written atomically; :class:`OutputError`
    (one line) when it cannot be written."""
    path = os.path.join(log_dir, name)
    data = case_scores_csv(cases).encode("utf-8")
    write_or_raise(lambda: atomic_write(path, lambda handle: handle.write(data)),
                     lambda reason, _: OutputError(f"cannot write {path!r}: {reason} (the scores are printed above)"))
    return path
