"""Predict's outcome: one :class:`CaseResult` per scan, ``summary.csv`` and ``summary.jsonl``
(one row per scan with its status, and a ``mean`` row), and the final console lines.

Two kinds of Dice against a ground truth, each column named for what it measures: the
benchmark's per-label Dice (``l1_dice``: label 1, kidney without tumour; ``l2_dice``: label 2,
tumour; ``mean_dice`` their mean, as evaluate and MLPerf average them) and KiTS19's leaderboard
scores (``kits_kidney_dice``: labels 1 and 2 together against 1 and 2 together, KiTS19's
"Kidney"; ``kits_tumour_dice``: label 2, KiTS19's "Tumour", the same number as ``l2_dice``).
Every row of a segmentation also carries the record of what made it
(:mod:`runtime.predict.provenance`).

The summary is never lost: when the output disk cannot take it, one line says so and the rows
are printed on stdout instead.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from data_loading.atomic import atomic_write
from data_loading.write_errors import write_failure
from model.losses import label_map_dice
from runtime.predict.provenance import FIELDS as PROVENANCE_FIELDS

DICE_FIELDS = ("l1_dice", "l2_dice", "mean_dice", "kits_kidney_dice", "kits_tumour_dice")
STAGES = ("read", "preprocess", "infer", "restore", "write", "preview")  # a scan's steps, timed each
STAGE_FIELDS = tuple(f"{stage}_seconds" for stage in STAGES)
SUMMARY_FIELDS = ("case", "status", "shape", "spacing", "kidney_ml", "tumour_ml", "seconds", *STAGE_FIELDS, "windows",
                  *DICE_FIELDS, "image", "error", *PROVENANCE_FIELDS)
# segmented | skipped (its output was made the same way) | failed | not run (stopped: the output disk is full)
STATUSES = ("segmented", "skipped", "failed", "not run")


@dataclass
class CaseResult:
    """One scan's outcome. ``status``: one of ``STATUSES``. ``shape`` (D, H, W) and
    ``spacing`` (mm) of the scan; volumes in mL from the labels on the original grid; Dice
    against the ground truth there when one lies beside the scan (:meth:`score`); ``error`` why
    it failed (or, for a segmented scan, why its preview is missing); ``full_disk`` when the
    output disk is full (the remaining scans are not run); ``stages`` the seconds of each step;
    ``windows`` the sliding windows the network ran on (a segmented scan); ``provenance`` the
    record of what made its segmentation; ``replaced`` why an earlier output was not reused."""

    case: str
    status: str
    image: str
    shape: tuple[int, ...] | None = None
    spacing: tuple[float, ...] | None = None
    kidney_ml: float | None = None
    tumour_ml: float | None = None
    seconds: float | None = None
    windows: int | None = None
    l1_dice: float | None = None
    l2_dice: float | None = None
    mean_dice: float | None = None
    kits_kidney_dice: float | None = None
    kits_tumour_dice: float | None = None
    error: str = ""
    full_disk: bool = False
    stages: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    replaced: str = ""

    def score(self, labels: np.ndarray, truth: np.ndarray) -> None:
        """The Dice of ``labels`` against ``truth`` (same grid): the benchmark's per label and
        their mean, and KiTS19's "Kidney" (labels 1 and 2 as one) and "Tumour" (label 2)."""
        self.l1_dice, self.l2_dice = label_map_dice(labels, truth)
        self.mean_dice = (self.l1_dice + self.l2_dice) / 2
        (self.kits_kidney_dice,) = label_map_dice(np.asarray(labels) > 0, np.asarray(truth) > 0, classes=(True,))
        self.kits_tumour_dice = self.l2_dice

    def line(self) -> str:
        """One console line."""
        if self.status in ("failed", "not run"):
            return f"{self.case}: {self.status}: {self.error}"
        text = (f"{self.case}: {self.status}, {'x'.join(map(str, self.shape))} voxels, "
                f"kidney {self.kidney_ml:.1f} mL, tumour {self.tumour_ml:.1f} mL")
        if self.mean_dice is not None:
            text += (f", dice l1 {self.l1_dice:.4f} l2 {self.l2_dice:.4f}, KiTS19 kidney (1+2) "
                     f"{self.kits_kidney_dice:.4f} tumour {self.kits_tumour_dice:.4f}")
        text += f", {self.seconds:.1f} s" if self.seconds is not None else ""
        if self.provenance.get("int8"):  # which calibration: the scan alone, or a named set
            on = self.provenance.get("int8_calibration_set") or "the scans being predicted"
            text += (", int8 calibrated on this scan alone" if on == "this scan" else
                     f", int8 calibrated on {on} ({str(self.provenance.get('int8_calibration', ''))[:12]})")
        return text + (f"; replaced an earlier output {self.replaced}" if self.replaced else "")

    @property
    def ok(self) -> bool:
        return self.status in ("segmented", "skipped") and not self.error


def summary_rows(results: Sequence[CaseResult]) -> list[dict]:
    """One dict per case (``SUMMARY_FIELDS``), sorted by case, and a final ``mean`` row with the
    mean Dice over the cases that have a ground truth (when any has)."""
    rows = []
    for r in sorted(results, key=lambda r: r.case):
        row = {k: v for k, v in asdict(r).items() if k in SUMMARY_FIELDS}
        row["shape"] = list(r.shape) if r.shape else None
        row["spacing"] = list(r.spacing) if r.spacing else None
        row.update({f"{stage}_seconds": r.stages.get(stage) for stage in STAGES})
        row.update({k: r.provenance.get(k) for k in PROVENANCE_FIELDS})
        rows.append(row)
    scored = [r for r in results if r.mean_dice is not None]
    if scored:
        mean = {k: None for k in SUMMARY_FIELDS}
        mean.update(case="mean", status=f"{len(scored)} cases", error="")
        for key in DICE_FIELDS:
            mean[key] = float(np.mean([getattr(r, key) for r in scored]))
        rows.append(mean)
    return rows


def _csv_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # an ensemble's checkpoints
        return " ".join(value)
    if isinstance(value, list):
        return "x".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def summary_texts(results: Sequence[CaseResult]) -> dict[str, str]:
    """``{"summary.csv": text, "summary.jsonl": text}`` (the same rows)."""
    rows = summary_rows(results)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(SUMMARY_FIELDS)
    for row in rows:
        writer.writerow([_csv_value(row[k]) for k in SUMMARY_FIELDS])
    return {"summary.csv": text.getvalue(), "summary.jsonl": "".join(json.dumps(row) + "\n" for row in rows)}


def write_summary(output_dir: str, results: Sequence[CaseResult]) -> None:
    """``summary.csv`` and ``summary.jsonl``, each written atomically."""
    for name, text in summary_texts(results).items():
        data = text.encode("utf-8")
        atomic_write(os.path.join(output_dir, name), lambda handle, data=data: handle.write(data))


def save_summary(output_dir: str, results: Sequence[CaseResult]) -> bool:
    """:func:`write_summary`; when the output disk refuses it, one stderr line names the file
    and the reason, and the rows go to stdout instead. Returns whether the files were written."""
    try:
        write_summary(output_dir, results)
        return True
    except Exception as exc:  # noqa: BLE001 - a write failure is one line, anything else a bug
        reason = write_failure(exc)
        if reason is None:
            raise
    print(f"main.py: error: cannot write the summary in {output_dir}: {reason}; its rows follow on stdout",
          file=sys.stderr)
    sys.stdout.write(summary_texts(results)["summary.jsonl"])
    return False


def print_outcome(results: Sequence[CaseResult], output_dir: str, summary_written: bool = True) -> int:
    """Print the run's outcome; the exit code: 1 if any scan failed or was not run (or a
    preview or the summary is missing), else 0."""
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    where = os.path.join(output_dir, "summary.csv") if summary_written else "the lines above (not written)"
    replaced = sum(bool(r.replaced) for r in results)
    print(f"predict: {counts['segmented']} segmented, {counts['skipped']} skipped (output made the same way "
          f"already; --force redoes them), {counts['failed']} failed"
          + (f", {counts['not run']} not run" if counts["not run"] else "") + f" of {len(results)} scans"
          + (f"; replaced {replaced} earlier output{'' if replaced == 1 else 's'} made otherwise" if replaced else "")
          + f"; summary in {where}")
    scored = [r for r in results if r.mean_dice is not None]
    if scored:
        print(f"mean_dice {np.mean([r.mean_dice for r in scored]):.4f} over {len(scored)} cases with ground truth "
              f"(KiTS19 kidney {np.mean([r.kits_kidney_dice for r in scored]):.4f}, tumour "
              f"{np.mean([r.kits_tumour_dice for r in scored]):.4f})")
    failed = sorted(r.case for r in results if r.status == "failed")
    if failed:
        print(f"failed scans: {', '.join(failed)}")
    not_run = sorted(r.case for r in results if r.status == "not run")
    if not_run:
        print(f"not run (the output disk is full): {', '.join(not_run)}")
    return 0 if summary_written and all(r.ok for r in results) else 1
