"""Predict's outcome: one :class:`CaseResult` per scan, ``summary.csv`` and ``summary.jsonl``
(one row per scan with its status, and a ``mean`` row), and the final console lines.

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

SUMMARY_FIELDS = ("case", "status", "shape", "spacing", "kidney_ml", "tumour_ml", "seconds", "windows",
                  "kidney_dice", "tumour_dice", "mean_dice", "image", "error")
# segmented | skipped (its output existed) | failed | not run (stopped: the output disk is full)
STATUSES = ("segmented", "skipped", "failed", "not run")


@dataclass
class CaseResult:
    """One scan's outcome. ``status``: one of ``STATUSES``. ``shape`` (D, H, W) and
    ``spacing`` (mm) of the scan; volumes in mL from the labels on the original grid; Dice
    against the ground truth there when one lies beside the scan; ``error`` why it failed (or,
    for a segmented scan, why its preview is missing); ``full_disk`` when the output disk is
    full (the remaining scans are not run); ``stages`` the seconds of each step; ``windows`` the
    sliding windows the network ran on (a segmented scan)."""

    case: str
    status: str
    image: str
    shape: tuple[int, ...] | None = None
    spacing: tuple[float, ...] | None = None
    kidney_ml: float | None = None
    tumour_ml: float | None = None
    seconds: float | None = None
    windows: int | None = None
    kidney_dice: float | None = None
    tumour_dice: float | None = None
    mean_dice: float | None = None
    error: str = ""
    full_disk: bool = False
    stages: dict = field(default_factory=dict)

    def line(self) -> str:
        """One console line."""
        if self.status in ("failed", "not run"):
            return f"{self.case}: {self.status}: {self.error}"
        text = (f"{self.case}: {self.status}, {'x'.join(map(str, self.shape))} voxels, "
                f"kidney {self.kidney_ml:.1f} mL, tumour {self.tumour_ml:.1f} mL")
        if self.mean_dice is not None:
            text += f", dice kidney {self.kidney_dice:.4f} tumour {self.tumour_dice:.4f}"
        return text + (f", {self.seconds:.1f} s" if self.seconds is not None else "")

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
        rows.append(row)
    scored = [r for r in results if r.mean_dice is not None]
    if scored:
        mean = {k: None for k in SUMMARY_FIELDS}
        mean.update(case="mean", status=f"{len(scored)} cases", error="")
        for key in ("kidney_dice", "tumour_dice", "mean_dice"):
            mean[key] = float(np.mean([getattr(r, key) for r in scored]))
        rows.append(mean)
    return rows


def _csv_value(value) -> str:
    if value is None:
        return ""
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
    print(f"predict: {counts['segmented']} segmented, {counts['skipped']} skipped (output exists; --force "
          f"redoes them), {counts['failed']} failed" + (f", {counts['not run']} not run" if counts["not run"] else "")
          + f" of {len(results)} scans; summary in {where}")
    scored = [r for r in results if r.mean_dice is not None]
    if scored:
        print(f"mean_dice {np.mean([r.mean_dice for r in scored]):.4f} over {len(scored)} cases with ground truth")
    failed = sorted(r.case for r in results if r.status == "failed")
    if failed:
        print(f"failed scans: {', '.join(failed)}")
    not_run = sorted(r.case for r in results if r.status == "not run")
    if not_run:
        print(f"not run (the output disk is full): {', '.join(not_run)}")
    return 0 if summary_written and all(r.ok for r in results) else 1
