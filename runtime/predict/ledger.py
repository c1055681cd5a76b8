"""One ledger per scan for predict's outputs in ``--output_dir``: what the scan may claim of them,
and what it leaves there whether it succeeds or not.

:meth:`OutputLedger.claim` reads what earlier runs left and decides (:class:`Claim`). For a fresh
scan, :meth:`~OutputLedger.clear` removes what showed or claimed its earlier output, and
:meth:`~OutputLedger.begin` writes and fsyncs this run's record under a hidden temporary name
before the scan is segmented (a disk that fills up meanwhile cannot keep it from being
written). :meth:`~OutputLedger.commit` renames it into place after the segmentation took its
own: a segmentation with its record beside it marks the scan done, and no record claims an
output that was not completely written. :meth:`~OutputLedger.abandon` removes only what this
run wrote; where a segmentation stays without its record, so does the pending record: it is no
record (nothing is reused on its word), but the next run knows the files it lists as predict's
own (:func:`pending_records`). Predict replaces or removes only the files a record lists
(:func:`data_loading.scans.recorded_files`), never the user's ``<case>.png``, a scan copied there
as ``<case>.nii.gz`` or a JSON file that is no record of this project.
"""
from __future__ import annotations

import json
import os
from contextlib import suppress
from dataclasses import dataclass
from enum import Enum

from data_loading.scan_io import input_digest
from data_loading.scans import Scan, output_path, recorded_files
from data_loading.write_errors import is_full_disk, write_failure, write_or_raise
from runtime.predict.provenance import difference, read_record, record_path, short
from runtime.predict.records import SUMMARY_FIELDS, CaseResult
from runtime.predict.scan import OutputWriteError, probabilities_path, write_output


class Claim(Enum):
    """A scan's claim on its outputs (:meth:`OutputLedger.claim`)."""

    FRESH = "fresh"    # segment it: nothing there, predict's own output made otherwise (replaced), or --force
    REUSE = "reuse"    # an output made the way this run would make it (its record's digests): skipped
    REFUSE = "refuse"  # a file predict did not write, or without --force another model's output: kept


@dataclass(frozen=True)
class ScanOutputs:
    """The files of one scan in ``--output_dir``: its segmentation, the record beside it, its
    preview and its probabilities; ``writes``: those this run writes (the segmentation, and the
    preview and probabilities when asked for)."""

    segmentation: str
    record: str
    preview: str
    probabilities: str
    writes: tuple[str, ...]

    @classmethod
    def of(cls, output_dir: str, scan: Scan, preview: bool = False, probabilities: bool = False) -> ScanOutputs:
        path, png = output_path(output_dir, scan), os.path.join(output_dir, f"{scan.name}.png")
        npz = probabilities_path(output_dir, scan)
        return cls(path, record_path(path), png, npz, (path,) + ((png,) if preview else ()) + ((npz,) if probabilities
                                                                                                  else ()))


def not_ours(path: str, why: str = "no record of this project says predict wrote it") -> str:
    return (f"{path} exists and {why}: predict never replaces or removes it (move it away, or choose another "
            "--output_dir)")


def model_text(record: dict) -> str:
    """The model of a record in words: its weights' digest(s) and checkpoint(s)."""
    checkpoint = record.get("checkpoint")
    checkpoint = " ".join(checkpoint) if isinstance(checkpoint, list) else checkpoint
    return f"weights {short(record.get('weights_sha256'))}" + (f" of {checkpoint}" if checkpoint else "")


def another_model(stored: dict | None, current: dict) -> bool:
    """Whether the record ``stored`` says its output was made by other weights than ``current``'s."""
    return stored is not None and stored.get("weights_sha256", current["weights_sha256"]) != current["weights_sha256"]


def pending_records(record: str) -> list[tuple[str, dict]]:
    """``(path, record)`` of each pending record of ``record`` left beside it by a run stopped,
    failed or killed while it wrote that scan's outputs: the files it lists are predict's own."""
    folder, name = os.path.split(os.path.abspath(record))
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = [(os.path.join(folder, n), read_record(os.path.join(folder, n))[0]) for n in names
             if n.startswith(f".{name}.") and n.endswith(".tmp")]
    return [(path, stored) for path, stored in found if stored is not None]


def write_synced(path: str, data: bytes) -> None:
    """``data`` as ``path``, fsynced; nothing left on failure."""
    try:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        with suppress(OSError):
            os.remove(path)
        raise


def remove_output(path: str) -> None:
    """Remove ``path`` if it exists; a failure is an :class:`OutputWriteError` naming it."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise OutputWriteError(path, f"cannot remove it ({write_failure(exc) or exc.strerror})", False) from None


class OutputLedger:
    """One scan's ``outputs`` and ``record``, this run's record of them (the digest of the scan
    ``input_path`` added when needed). Read at once: ``stored``, the record beside the
    segmentation (None: ``why_none``), the pending records of stopped runs (``leftovers``), and
    the names of the files they all say predict wrote (``owned``: the only ones it replaces or
    removes). After :meth:`claim`: ``why`` (FRESH: why the earlier output is replaced, or "";
    REFUSE: the one line) and ``foreign`` (REFUSE: the file is not predict's)."""

    def __init__(self, outputs: ScanOutputs, record: dict, input_path: str, force: bool = False):
        self.outputs, self.record, self.input_path, self.force = outputs, record, input_path, force
        self.stored, self.why_none = read_record(outputs.record)
        self.leftovers = pending_records(outputs.record)
        path = outputs.segmentation
        self.owned = frozenset(recorded_files(self.stored, path).union(
            *(recorded_files(r, path) for _, r in self.leftovers)))
        self.why, self.foreign, self.pending = "", False, ""

    def claim(self) -> Claim:
        """FRESH, REUSE or REFUSE (:class:`Claim`); nothing is written or removed."""
        outputs, stored = self.outputs, self.stored
        if os.path.lexists(outputs.record) and stored is None:  # unreadable, or someone else's file
            return self._refuse(not_ours(outputs.record, "is no record of this project"), foreign=True)
        for target in outputs.writes:
            if os.path.lexists(target) and os.path.basename(target) not in self.owned:
                return self._refuse(not_ours(target), foreign=True)
        if not os.path.exists(outputs.segmentation):
            return Claim.FRESH
        self.record["input_sha256"] = input_digest(self.input_path)
        replaced = difference(stored, self.why_none, self.record)
        if replaced is None and outputs.probabilities in outputs.writes and not (
                stored.get("probabilities") and os.path.exists(outputs.probabilities)):
            replaced = "without saved probabilities"
        if another_model(stored, self.record):  # kept without --force
            if not self.force:
                return self._refuse(f"{outputs.segmentation} was made by another model ({model_text(stored)}): "
                                    "kept; --force replaces it")
            replaced = f"of another model ({model_text(stored)})"
        if replaced is None and not self.force:
            return Claim.REUSE
        self.why = replaced or ""
        return Claim.FRESH

    def _refuse(self, why: str, foreign: bool = False) -> Claim:
        self.why, self.foreign = why, foreign
        return Claim.REFUSE

    def clear(self) -> None:
        """What claims or shows the earlier output goes first (only what a record says predict
        wrote; with ``--force`` the segmentation itself stays until the new one replaces it), and
        the pending records of a stopped run: a failure from here on leaves no output of another
        configuration behind."""
        outputs = self.outputs
        for stale in (outputs.record, outputs.preview, outputs.probabilities) + (
                (outputs.segmentation,) if self.why and not self.force else ()):
            if stale == outputs.record or os.path.basename(stale) in self.owned:
                remove_output(stale)
        for leftover, _ in self.leftovers:
            remove_output(leftover)

    def begin(self) -> None:
        """This run's record (the input's digest, the files it writes) written and fsynced under a
        hidden temporary name; a failure to write it names both files."""
        outputs, record = self.outputs, self.record
        if "input_sha256" not in record:
            record["input_sha256"] = input_digest(self.input_path)
        record["files"] = [os.path.basename(f) for f in outputs.writes]
        saved = outputs.probabilities in outputs.writes
        record["probabilities"] = os.path.basename(outputs.probabilities) if saved else ""
        folder, name = os.path.split(os.path.abspath(outputs.record))
        pending, data = os.path.join(folder, f".{name}.{os.getpid()}.tmp"), json.dumps(record, indent=1) + "\n"
        write_or_raise(lambda: write_synced(pending, data.encode("utf-8")), lambda reason, exc: OutputWriteError(
            outputs.record, f"{reason} (the record of {outputs.segmentation})", is_full_disk(exc)))
        self.pending = pending

    def commit(self, result: CaseResult) -> CaseResult:
        """The record put in place, once the segmentation took its own: ``result`` with it, and
        why the earlier output was replaced."""
        write_output(self.outputs.record, lambda: os.replace(self.pending, self.outputs.record))
        self.pending = ""
        result.provenance, result.replaced = self.record, self.why
        return result

    def abandon(self) -> None:
        """After a failure or a signal: with a segmentation there (this run's, or with ``--force``
        the earlier one, whose record is gone) the pending record stays, hidden (it is no record:
        nothing is reused on its word); else the files this run wrote (the probabilities written
        before the segmentation) go with it. Nothing else is touched."""
        if not self.pending or os.path.lexists(self.outputs.segmentation):
            return
        for path in self.outputs.writes + (self.pending,):  # none of them was there at begin: this run's own
            with suppress(OSError):  # best effort: the failure or signal being handled is what the run reports
                os.remove(path)
        self.pending = ""


def is_summary(path: str) -> bool:
    """Whether ``path`` (``summary.csv`` or ``summary.jsonl``) is a summary predict wrote: its
    first line is predict's CSV header (or a JSON row with a case and a status; an empty
    ``summary.jsonl`` is predict's when the ``summary.csv`` beside it is)."""
    try:
        with open(path, encoding="utf-8") as handle:
            first = handle.readline().strip()
    except (OSError, UnicodeDecodeError):
        return False
    if path.endswith(".csv"):
        return first.startswith(",".join(SUMMARY_FIELDS[:2]) + ",")
    if not first:  # no rows (a run stopped before any scan): its CSV beside says whose it is
        return is_summary(path[: -len(".jsonl")] + ".csv")
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and "case" in row and "status" in row
