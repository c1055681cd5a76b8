"""Predict's outcome: one :class:`CaseResult` per scan, ``summary.csv`` and ``summary.jsonl``
(one row per scan with its status, and a ``mean`` row), and the final console lines.

Two kinds of Dice against a ground truth, each column named for what it measures: the
benchmark's per-label Dice (``l1_dice``: label 1, kidney without tumour; ``l2_dice``: label 2,
tumour; ``mean_dice`` their mean, as evaluate and MLPerf average them) and KiTS19's leaderboard
scores (``kits_kidney_dice``: labels 1 and 2 together against 1 and 2 together, KiTS19's
"Kidney"; ``kits_tumour_dice``: label 2, KiTS19's "Tumour", the same number as ``l2_dice``).
Every row of a segmentation also carries the record of what made it
(:mod:`runtime.predict.provenance`).

A label absent from both the ground truth and the prediction has nothing to score: its Dice is
NaN for that scan and it is left out of every mean (nnU-Net's rule; MONAI's ``ignore_empty``
agrees wherever the ground truth holds the label), where the benchmark's formula would give 1.0
(:func:`score`). The summary's ``mean`` row holds each column's mean over the scans it is
defined for, and the ``count`` row before it how many scans that is.

The summary is a cohort's: each run's rows replace those of the same scans and every other row
of the folder's earlier summary is kept (:func:`earlier_rows`), so that predicting a subset
never loses the rest. It is never lost: when the output disk cannot take a file of it, one line
names that file and the rows are printed on stdout instead.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Sequence

import numpy as np

from data_loading.atomic import atomic_write
from data_loading.scans import SUMMARY_NAMES
from data_loading.write_errors import write_failure
from runtime.labels import LabelSet
from runtime.predict.provenance import FIELDS as PROVENANCE_FIELDS

DICE_FIELDS = ("l1_dice", "l2_dice", "mean_dice", "kits_kidney_dice", "kits_tumour_dice")
STAGES = ("read", "preprocess", "infer", "restore", "write", "preview")  # a scan's steps, timed each
STAGE_FIELDS = tuple(f"{stage}_seconds" for stage in STAGES)
SUMMARY_FIELDS = ("case", "status", "shape", "spacing", "kidney_ml", "tumour_ml", "seconds", *STAGE_FIELDS, "windows",
                  *DICE_FIELDS, "image", "error", *PROVENANCE_FIELDS)


class Status(str, Enum):
    """What became of one entry of ``--input``; its text is the summary's ``status``."""

    SEGMENTED = "segmented"
    SKIPPED = "skipped"    # its output was made the same way: reused
    FAILED = "failed"
    NOT_RUN = "not run"    # stopped: the output disk is full
    KEPT = "kept"          # the output of another model, kept: --force replaces it
    LEFT_OUT = "left out"  # an entry of --input that is no scan: its reason in ``error``

    def __str__(self) -> str:
        return self.value


STATUSES = tuple(status.value for status in Status)  # the statuses a summary's rows may hold
AGGREGATES = ("count", "mean")  # the rows after the scans': how many scans each mean is over, the means


@dataclass(frozen=True)
class Dice:
    """One scan's Dice against its ground truth (same grid), nnU-Net's definition
    (``compute_metrics``): per label ``2·TP / (2·TP + FP + FN)``, NaN for a label absent from both
    (nothing to score), counted where the truth is not nnU-Net's ignore label. ``per_label``:
    ``{value: Dice}`` in value order; ``mean_dice`` the mean of those that are scored (NaN when
    none is). ``l1_dice``, ``l2_dice``: labels 1 and 2 (KiTS19's kidney without tumour, tumour)."""

    per_label: dict
    mean_dice: float

    @property
    def l1_dice(self) -> float:
        return self.per_label.get(1, math.nan)

    @property
    def l2_dice(self) -> float:
        return self.per_label.get(2, math.nan)


def label_dice(labels: np.ndarray, truth: np.ndarray, value, keep: np.ndarray | None = None) -> float:
    """nnU-Net's Dice of one label ``value`` (``2·TP / (2·TP + FP + FN)``, NaN when it is in
    neither map), over the voxels ``keep`` (all when None)."""
    p, t = labels == value, truth == value
    if keep is not None:
        p, t = p & keep, t & keep
    both = int(np.count_nonzero(p & t))
    total = int(np.count_nonzero(p)) + int(np.count_nonzero(t))
    return 2.0 * both / total if total else math.nan


def score(labels: np.ndarray, truth: np.ndarray, label_set=None, ignore: int | None = None) -> Dice:
    """:class:`Dice` of the label map ``labels`` against ``truth`` (same shape), every label of a
    label set scored: ``label_set`` a ``runtime.labels.LabelSet`` (its foreground labels and its
    ignore label), or label values; None: every label other than 0 that the truth or the
    prediction holds (a binary map: one Dice). ``ignore``: nnU-Net's ignore label's value, whose
    voxels of the truth are not scored (a ``LabelSet``'s own by default)."""
    labels, truth = np.asarray(labels), np.asarray(truth)
    if labels.shape != truth.shape:
        raise ValueError(f"labels {labels.shape} and truth {truth.shape} differ in shape")
    if isinstance(label_set, LabelSet):
        ignore = label_set.ignore if ignore is None else ignore
        values = [value for _, value in label_set.foreground]
    elif label_set is not None:
        values = sorted(int(v) for v in label_set)
    else:
        present = set(np.unique(truth).tolist()) | set(np.unique(labels).tolist())
        values = sorted(int(v) for v in present - {0, ignore})
    keep = None if ignore is None else truth != ignore
    per_label = {value: label_dice(labels, truth, value, keep) for value in values}
    scored = [v for v in per_label.values() if not math.isnan(v)]
    return Dice(per_label, sum(scored) / len(scored) if scored else math.nan)


def kits19_dice(labels: np.ndarray, truth: np.ndarray) -> dict:
    """The KiTS19 columns of predict's summary: ``l1_dice``, ``l2_dice`` and ``mean_dice``
    (:func:`score` of labels 1 and 2), ``kits_kidney_dice`` labels 1 and 2 as one (KiTS19's
    "Kidney"), ``kits_tumour_dice`` label 2 (KiTS19's "Tumour")."""
    labels, truth = np.asarray(labels), np.asarray(truth)
    dice = score(labels, truth, (1, 2))
    kidney = label_dice(labels > 0, truth > 0, True)
    return {"l1_dice": dice.l1_dice, "l2_dice": dice.l2_dice, "mean_dice": dice.mean_dice,
            "kits_kidney_dice": kidney, "kits_tumour_dice": dice.l2_dice}


def own_label_numbers(labels: np.ndarray, truth: np.ndarray | None, spacing, label_set) -> dict:
    """Each label's volume (``<name>_ml``) and, with a ground truth, its Dice (``<name>_dice``,
    ``runtime.labels.LabelSet.keys``: :func:`score`, nnU-Net's) and ``mean_dice``, for a network
    of own data (any label set that is not the benchmark's)."""
    from data_loading.scans import class_volumes_ml

    keys, values = label_set.keys, [value for _, value in label_set.foreground]
    numbers = {f"{key[:-len('_dice')]}_ml": ml for key, ml in zip(keys, class_volumes_ml(labels, spacing, values))}
    if truth is not None:
        dice = score(labels, truth, label_set)
        numbers.update(zip(keys, (dice.per_label[value] for value in values)))
        numbers["mean_dice"] = dice.mean_dice
    return numbers


def _number(value) -> float | None:
    """A Dice of a row as a float (NaN: not scored), or None when the row has none."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass
class CaseResult:
    """One scan's outcome (``status``). ``shape`` (D, H, W) and
    ``spacing`` (mm) of the scan; volumes in mL from the labels on the original grid; Dice
    against the ground truth there when one lies beside the scan (:meth:`score`); ``error`` why
    it failed (or, for a segmented scan, why its preview is missing); ``full_disk`` when the
    output disk is full (the remaining scans are not run); ``stages`` the seconds of each step;
    ``windows`` the sliding windows the network ran on (a segmented scan); ``provenance`` the
    record of what made its segmentation; ``replaced`` why an earlier output was not reused."""

    case: str
    status: Status
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
    # a network of another label set than KiTS19's: each label's mL and Dice under its name
    # (own_label_numbers), in place of the KiTS19 fields
    per_label: dict = field(default_factory=dict)

    def score(self, labels: np.ndarray, truth: np.ndarray) -> None:
        """The KiTS19 Dice of ``labels`` against ``truth`` (same grid, :func:`kits19_dice`) into this result."""
        for name, value in kits19_dice(labels, truth).items():
            setattr(self, name, value)

    def line(self) -> str:
        """One console line."""
        if self.status not in (Status.SEGMENTED, Status.SKIPPED):
            return f"{self.case}: {self.status}: {self.error}"
        text = f"{self.case}: {self.status}, {'x'.join(map(str, self.shape))} voxels, "
        if self.per_label:
            volumes = [f"{key[:-3]} {value:.1f} mL" for key, value in self.per_label.items() if key.endswith("_ml")]
            text += ", ".join(volumes)
            dice = [f"{key[:-5]} {value:.4f}" for key, value in self.per_label.items() if key.endswith("_dice")]
            text += f", dice {' '.join(dice)}" if dice else ""
        else:
            text += f"kidney {self.kidney_ml:.1f} mL, tumour {self.tumour_ml:.1f} mL"
        if self.mean_dice is not None and not self.per_label:  # nan: a label absent from both, not scored
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
        """Nothing went wrong: segmented or reused without an error, or an entry that is no scan."""
        return self.status == Status.LEFT_OUT or (self.status in (Status.SEGMENTED, Status.SKIPPED) and not self.error)


def result_row(result: CaseResult) -> dict:
    """The summary row (``SUMMARY_FIELDS``) of one result."""
    row = {k: v for k, v in asdict(result).items() if k in SUMMARY_FIELDS}
    row["shape"] = list(result.shape) if result.shape else None
    row["spacing"] = list(result.spacing) if result.spacing else None
    row.update({f"{stage}_seconds": result.stages.get(stage) for stage in STAGES})
    row.update({k: result.provenance.get(k) for k in PROVENANCE_FIELDS})
    row.update(result.per_label)  # another label set's columns (own_label_numbers), after KiTS19's
    return row


KITS19_FIELDS = ("kidney_ml", "tumour_ml", *DICE_FIELDS)  # KiTS19's network's numbers


def summary_fields(rows: Sequence[dict]) -> tuple[str, ...]:
    """``SUMMARY_FIELDS`` and, after them, the columns of a network of another label set
    (``<name>_ml``, ``<name>_dice``) in the order its rows give them; KiTS19's columns only where
    a row has a value in one (a summary of own data's network has its labels' columns only)."""
    extra = {key: None for row in rows for key in row if key not in SUMMARY_FIELDS}
    kits19 = not extra or any(row.get(key) is not None for row in rows for key in KITS19_FIELDS if key != "mean_dice")
    own = extra and any(row.get(key) is not None for row in rows for key in extra)
    fields = SUMMARY_FIELDS if kits19 or not own else tuple(f for f in SUMMARY_FIELDS
                                                             if f not in KITS19_FIELDS or f == "mean_dice")
    return (*fields, *extra)


def aggregate_rows(rows: Sequence[dict]) -> list[dict]:
    """The ``count`` and ``mean`` rows of the scans' ``rows`` (none when no scan has a ground
    truth): per Dice column, how many scans score it (a number, not NaN) and their mean."""
    fields = summary_fields(rows)
    dice_fields = [k for k in fields if k in DICE_FIELDS or (k not in SUMMARY_FIELDS and k.endswith("_dice"))]
    scored = {key: [v for v in (_number(row.get(key)) for row in rows) if v is not None and not math.isnan(v)]
              for key in dice_fields}
    with_truth = sum(any(_number(row.get(key)) is not None for key in dice_fields) for row in rows)
    if not with_truth:
        return []
    count = {k: None for k in fields}
    count.update(case="count", status="scans behind each mean", error="")
    mean = {k: None for k in fields}
    mean.update(case="mean", status=f"{with_truth} cases", error="")
    for key, values in scored.items():
        count[key] = len(values)
        mean[key] = float(np.mean(values)) if values else math.nan
    return [count, mean]


def summary_rows(results: Sequence[CaseResult], earlier: Sequence[dict] = ()) -> list[dict]:
    """One dict per scan (``SUMMARY_FIELDS``), sorted by case: this run's results, and the rows of
    ``earlier`` (an earlier summary's scans) for every other scan; then the ``count`` and ``mean``
    rows over them all (:func:`aggregate_rows`)."""
    ours = {r.case: result_row(r) for r in results}
    fields = summary_fields([*ours.values(), *(row for row in earlier if isinstance(row, dict))])
    kept = {row["case"]: {k: row.get(k) for k in fields} for row in earlier
            if isinstance(row, dict) and row.get("case") not in ours and row.get("status") in STATUSES}
    rows = [row for _, row in sorted({**kept, **ours}.items())]
    return rows + aggregate_rows(rows)


def earlier_rows(output_dir: str) -> list[dict]:
    """The scans' rows of the summary already in ``output_dir`` (``summary.jsonl``, else
    ``summary.csv``: a disk that took only one of them), without its ``count`` and ``mean``
    rows; none when there is none or it cannot be read (the caller checked that a summary
    there is predict's: :func:`runtime.predict.folder.check_outputs`)."""
    try:
        with open(os.path.join(output_dir, "summary.jsonl"), encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError):
        rows = _csv_rows(os.path.join(output_dir, "summary.csv"))
    return [row for row in rows if isinstance(row, dict) and row.get("status") in STATUSES]


def _csv_rows(path: str) -> list[dict]:
    """The rows of a ``summary.csv``, numbers read back as numbers (``x``-joined lists as lists)."""
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            table = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    numbers = {"kidney_ml", "tumour_ml", "seconds", "windows", "overlap", *STAGE_FIELDS, *DICE_FIELDS}
    rows = []
    for raw in table:
        row = {}
        for key, value in raw.items():
            if key is None or value is None or value == "":
                row[key] = None
            elif key in numbers:
                row[key] = _number(value)
            elif key in ("shape", "spacing", "window_shape"):
                row[key] = [float(v) if "." in v else int(v) for v in value.split("x")] if value else None
            elif key == "int8" or key == "tta":
                row[key] = value == "True"
            else:
                row[key] = value
        rows.append(row)
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


def summary_texts(results: Sequence[CaseResult], earlier: Sequence[dict] = ()) -> dict[str, str]:
    """``{"summary.csv": text, "summary.jsonl": text}`` (the same rows, :func:`summary_rows`; a
    Dice not scored is ``nan`` in the CSV and ``NaN`` in the JSON lines, as Python writes it)."""
    rows = summary_rows(results, earlier)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    fields = summary_fields(rows)
    writer.writerow(fields)
    for row in rows:
        writer.writerow([_csv_value(row.get(k)) for k in fields])
    return {"summary.csv": text.getvalue(), "summary.jsonl": "".join(json.dumps(row) + "\n" for row in rows)}


def save_summary(output_dir: str, results: Sequence[CaseResult]) -> list[str]:
    """``summary.csv`` and ``summary.jsonl`` (this run's rows and the earlier summary's others:
    :func:`earlier_rows`), each written atomically; the names written, in that order (a list
    that is false when none was). When the output disk refuses a file, one stderr line names it
    and the reason, and the rows go to stdout instead."""
    texts, written = summary_texts(results, earlier_rows(output_dir)), []
    for name, text in texts.items():
        try:
            atomic_write(os.path.join(output_dir, name), lambda handle, data=text.encode("utf-8"): handle.write(data))
        except Exception as exc:  # noqa: BLE001 - a write failure is one line, anything else a bug
            reason = write_failure(exc)
            if reason is None:
                raise
            print(f"main.py: error: cannot write {os.path.join(output_dir, name)}: {reason}; the summary's rows "
                  "follow on stdout", file=sys.stderr)
            sys.stdout.write(texts["summary.jsonl"])
            return written
        written.append(name)
    return written


def summary_place(output_dir: str, written: Sequence[str] | bool) -> str:
    """Where the summary is, in words: its CSV (or JSON lines), and which of its files was not
    written (``written``: the names :func:`save_summary` wrote; True: both)."""
    written = list(SUMMARY_NAMES) if written is True else list(written or ())
    if not written:
        return "the lines above (not written)"
    missing = [n for n in SUMMARY_NAMES if n not in written]
    return os.path.join(output_dir, written[0]) + (f" ({', '.join(missing)} not written)" if missing else "")


def _mean_text(values: Sequence[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    return f"{np.mean(values):.4f} over {len(values)}" if values else "none"


def print_outcome(results: Sequence[CaseResult], output_dir: str, written: Sequence[str] | bool = True) -> int:
    """Print the run's outcome: the scans found and what became of each, the entries of
    ``--input`` left out (no scans) and why, the mean Dice of this run's scans; the exit code: 1
    if any scan failed, was not run or kept (or a preview or a file of the summary is missing),
    else 0."""
    count = {s: sum(r.status == s for r in results) for s in Status}
    where = summary_place(output_dir, written)
    replaced = sum(bool(r.replaced) for r in results)
    found, left_out = len(results) - count[Status.LEFT_OUT], count[Status.LEFT_OUT]
    print(f"predict: {found} scan{'' if found == 1 else 's'} found: {count[Status.SEGMENTED]} segmented, "
          f"{count[Status.SKIPPED]} skipped (output made the same way already; --force redoes them), "
          f"{count[Status.FAILED]} failed"
          + (f", {count[Status.NOT_RUN]} not run" if count[Status.NOT_RUN] else "")
          + (f", {count[Status.KEPT]} kept (the output of another model; --force replaces it)"
             if count[Status.KEPT] else "")
          + f" of {found} scans"
          + (f"; replaced {replaced} earlier output{'' if replaced == 1 else 's'} made otherwise" if replaced else "")
          + (f"; {left_out} entr{'y' if left_out == 1 else 'ies'} of --input left out (no scans)" if left_out else "")
          + f"; summary in {where}")
    scored = [r for r in results if r.mean_dice is not None]
    own = [r for r in scored if r.per_label]
    if own:  # another label set than KiTS19's: its labels' names
        keys = [k for k in own[0].per_label if k.endswith("_dice") and k != "mean_dice"]
        per_label = ", ".join(f"{k[:-5]} {_mean_text([r.per_label.get(k, math.nan) for r in own])}" for k in keys)
        print(f"mean_dice {_mean_text([r.mean_dice for r in own])} of {len(own)} cases with ground truth ({per_label}; "
              "a label absent from both the ground truth and the prediction is not scored)")
    elif scored:
        def over(key):
            return _mean_text([getattr(r, key) for r in scored])

        print(f"mean_dice {over('mean_dice')} of {len(scored)} cases with ground truth (l1 {over('l1_dice')}, "
              f"l2 {over('l2_dice')}; KiTS19 kidney {over('kits_kidney_dice')}, tumour {over('kits_tumour_dice')}; "
              "a label absent from both the ground truth and the prediction is not scored)")
    for status, title in ((Status.FAILED, "failed scans"), (Status.NOT_RUN, "not run (the output disk is full)"),
                          (Status.KEPT, "kept (the output of another model; --force replaces it)")):
        names = sorted(r.case for r in results if r.status == status)
        if names:
            print(f"{title}: {', '.join(names)}")
    others = sorted((r for r in results if r.replaced.startswith("of another model")), key=lambda r: r.case)
    if others:
        print(f"replaced the outputs of another model (--force): {', '.join(r.case for r in others)}")
    left = sorted((r for r in results if r.status == Status.LEFT_OUT), key=lambda r: r.case)
    if left:
        print(f"left out: {'; '.join(f'{r.case} ({r.error})' for r in left)}")
    complete = bool(written) and (written is True or len(list(written)) == len(SUMMARY_NAMES))
    return 0 if complete and all(r.ok for r in results) else 1
