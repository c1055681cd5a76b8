"""``--exec_mode predict`` over a folder: every scan isolated, the output folder locked, the
summary always written.

Each scan of this rank goes through :func:`runtime.predict.scan.segment_scan` after its header is
checked (:func:`data_loading.scan_checks.check_header`, before any voxel is read), unless its
output exists and the record beside it says it was made the way this run would make it
(:mod:`runtime.predict.provenance`: the same version, weights, backend, int8, AMP, TTA, window,
overlap and input; with ``--save_probabilities``, its probabilities saved too); an output made
otherwise is removed, with its record, preview and probabilities, and the scan segmented again
through the run's :class:`runtime.predict.api.Segmenter`.

Predict writes only what it owns: before any work, an output name that is a file of an input
scan (``os.path.samefile``: ``--output_dir`` the scans' own folder, or a single scan's folder)
or a summary of someone else refuses the run in one line naming the clash
(:func:`check_outputs`); per scan, a file it would write or replace that no record of this
project says predict wrote (an output with no record, the user's ``<case>.png``/``.npz``) fails
that scan in one line and stays as it was, with ``--force`` too. Any failure
inside one scan (bad input, out of memory, an allocator error) is that scan's one line and
summary row with its status, never the folder's end; once the output disk is full, the
remaining scans are "not run" and the summary names them. Rank 0 writes the summary
(:mod:`runtime.predict.records`); the exit code is 1 if any scan failed. The lifecycle (the
output folder checked and locked, the process group, signals) is :mod:`runtime.app`'s.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from data_loading.scan_checks import check_header
from data_loading.scan_io import input_digest, input_files
from data_loading.scans import Scan, ScanError, find_inputs, output_path, with_truths
from data_loading.write_errors import is_full_disk, write_failure, write_or_raise
from runtime import distributed as D
from runtime.config import UsageError
from runtime.outputs import OutputError
from runtime.plan import RunPlan
from runtime.progress import progress, write
from runtime.predict.api import Segmenter
from runtime.predict.provenance import (PendingRecord, difference, pending_records, read_record,
                                        record_path, recorded_files, run_fields)
from runtime.predict.scan import OutputWriteError, one_line_reason, probabilities_path, segment_scan, summarise_existing
from runtime.predict.records import SUMMARY_FIELDS, CaseResult, print_outcome, save_summary
from runtime.signals import Stopped


ALLOCATOR_SIGNS = ("can't allocate memory", "out of memory", "DefaultCPUAllocator", "std::bad_alloc")


def failure_message(scan: Scan, exc: BaseException) -> str:
    """One line naming the scan (or the output file) and what went wrong."""
    if isinstance(exc, NotOurs):
        return str(exc)
    if isinstance(exc, OutputWriteError):
        return f"{exc}" + ("; the remaining scans are not run (the output disk is full)" if exc.full else "")
    if isinstance(exc, ScanError):
        return str(exc).splitlines()[0] if str(exc) else f"{scan.image_path}: {type(exc).__name__}"
    if isinstance(exc, MemoryError) or any(sign in str(exc) for sign in ALLOCATOR_SIGNS):
        return f"{scan.image_path}: out of memory ({one_line_reason(exc)[:200]})"
    if isinstance(exc, OSError):
        return f"{scan.image_path}: cannot read it ({exc.strerror or type(exc).__name__})"
    return f"{scan.image_path}: {one_line_reason(exc)[:300]}"


def remove_output(path: str) -> None:
    """Remove ``path`` if it exists; a failure is an :class:`OutputWriteError` naming it."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise OutputWriteError(path, f"cannot remove it ({write_failure(exc) or exc.strerror})", False) from None


def pending_record(path: str, record: dict, output: str) -> PendingRecord:
    """:class:`PendingRecord` of ``output``; a failure to write it names both files."""
    return write_or_raise(lambda: PendingRecord(path, record), lambda reason, exc: OutputWriteError(
        path, f"{reason} (the record of {output})", is_full_disk(exc)))


class NotOurs(OutputError):
    """A file predict would write or remove that no record of this project says it wrote."""


def not_ours(path: str, why: str = "no record of this project says predict wrote it") -> NotOurs:
    return NotOurs(f"{path} exists and {why}: predict never replaces or removes it (move it away, or "
                   "choose another --output_dir)")


def preview_path(output_dir: str, scan: Scan) -> str:
    return os.path.join(output_dir, f"{scan.name}.png")


def another_model(stored: dict | None, current: dict) -> bool:
    """Whether the record ``stored`` says its output was made by other weights than ``current``'s
    (another model: its output is kept without ``--force``)."""
    return stored is not None and "weights_sha256" in stored and stored["weights_sha256"] != current["weights_sha256"]


def model_text(record: dict) -> str:
    """The model of a record in words: its weights' digest(s) and checkpoint(s)."""
    checkpoint = record.get("checkpoint")
    checkpoint = " ".join(checkpoint) if isinstance(checkpoint, list) else checkpoint
    return f"weights {_short(record.get('weights_sha256'))}" + (f" of {checkpoint}" if checkpoint else "")


def _short(value) -> str:
    return "+".join(str(v)[:12] for v in value) if isinstance(value, list) else str(value)[:12]


def entry_result(scan: Scan) -> CaseResult:
    """The result of an entry of ``--input`` that is no scan (left out) or cannot be read (failed)."""
    if scan.unreadable:
        return CaseResult(scan.name, "failed", scan.image_path, error=scan.unreadable)
    return CaseResult(scan.name, "left out", scan.image_path, error=scan.left_out)


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
    def of(cls, scan: Scan, plan: RunPlan) -> "ScanOutputs":
        path = output_path(plan.config.output_dir, scan)
        png, npz = preview_path(plan.config.output_dir, scan), probabilities_path(plan.config.output_dir, scan)
        return cls(path, record_path(path), png, npz,
                   (path,) + ((png,) if plan.config.preview else ())
                   + ((npz,) if plan.config.save_probabilities else ()))


@dataclass(frozen=True)
class Earlier:
    """What earlier runs left of one scan: its record (None: ``why_none``), the pending records
    of a run stopped while it wrote them (``leftovers``: ``(path, record)``), and the names of
    the files those records say predict wrote (``owned``: the only ones it replaces or removes)."""

    record: dict | None
    why_none: str
    leftovers: list
    owned: frozenset


def earlier_outputs(outputs: ScanOutputs) -> Earlier:
    """What earlier runs left of a scan's ``outputs``; :class:`NotOurs` when its record is no
    record of this project, or a file this run would write is not predict's own."""
    stored, why_none = read_record(outputs.record)
    if os.path.lexists(outputs.record) and stored is None:  # unreadable, or someone else's file
        raise not_ours(outputs.record, "is no record of this project")
    leftovers = pending_records(outputs.record)  # of a run stopped while it wrote this scan's outputs
    path = outputs.segmentation
    owned = frozenset(recorded_files(stored, path).union(*(recorded_files(r, path) for _, r in leftovers)))
    for target in outputs.writes:
        if os.path.lexists(target) and os.path.basename(target) not in owned:
            raise not_ours(target)
    return Earlier(stored, why_none, leftovers, owned)


def reuse(scan: Scan, outputs: ScanOutputs, earlier: Earlier, current: dict,
          plan: RunPlan) -> tuple[CaseResult | None, str]:
    """Whether the scan's existing segmentation (``current``: this run's record of it, its input's
    digest too) is kept: ``(its result, "")`` when it is (its record matches this run, or it is
    another model's and there is no ``--force``), else ``(None, why it is replaced)``."""
    stored = earlier.record
    replaced = difference(stored, earlier.why_none, current)
    if replaced is None and plan.config.save_probabilities and not (stored.get("probabilities")
                                                               and os.path.exists(outputs.probabilities)):
        replaced = "without saved probabilities"
    if another_model(stored, current) and not plan.config.force:
        result = summarise_existing(scan, outputs.segmentation, plan.network.label_set)
        result.status, result.provenance = "kept", stored
        result.error = (f"{outputs.segmentation} was made by another model ({model_text(stored)}): kept; --force "
                        "replaces it")
        return result, ""
    if replaced is None and not plan.config.force:
        result = summarise_existing(scan, outputs.segmentation, plan.network.label_set)
        result.provenance = stored
        return result, ""
    if replaced and another_model(stored, current):
        replaced = f"of another model ({model_text(stored)})"
    return None, replaced or ""


def remove_stale(outputs: ScanOutputs, earlier: Earlier, replaced: str, force: bool) -> None:
    """What claims or shows an earlier output goes first (only what its record says predict
    wrote), and the pending records of a stopped run; with ``--force`` the segmentation itself
    is kept until the new one replaces it."""
    for stale in (outputs.record, outputs.preview, outputs.probabilities) + (
            (outputs.segmentation,) if replaced and not force else ()):
        if stale == outputs.record or os.path.basename(stale) in earlier.owned:
            remove_output(stale)
    for leftover, _ in earlier.leftovers:
        remove_output(leftover)


def segment_recorded(scan: Scan, segmenter: Segmenter, calibration, outputs: ScanOutputs, current: dict,
                     plan: RunPlan) -> CaseResult:
    """Segment the scan with ``segmenter`` (int8 on ``calibration``), its record ``current``
    written first under a temporary name (:class:`PendingRecord`) and put in place only after
    the segmentation took its own."""
    pending = pending_record(outputs.record, current, outputs.segmentation)
    keep = False
    try:
        result = segment_scan(scan, segmenter, plan.config.output_dir, plan.config.preview,
                              probabilities=plan.config.save_probabilities, calibration=calibration,
                              label_set=plan.network.label_set)
        write_or_raise(pending.commit, lambda reason, exc: OutputWriteError(outputs.record, reason, is_full_disk(exc)))
    except BaseException:
        # stopped or failed with a segmentation there (this run's, or with --force the earlier
        # one, whose record is gone): the pending record stays, so that the next run knows
        # the files it lists as predict's own (it claims nothing: it is no record)
        keep = os.path.lexists(outputs.segmentation)
        raise
    finally:
        if not keep:
            pending.discard()
    return result


def predict_one(scan: Scan, segmenter: Segmenter, plan: RunPlan) -> CaseResult:
    """Segment (or reuse) one scan, its header checked before any voxel is read; every failure
    inside it (bad input, out of memory, an allocator error, a full output disk) is its result.

    An existing output is reused when its record matches this run (:func:`reuse`; never with
    ``--force``); one made otherwise is removed first, with its record and preview
    (:func:`remove_stale`), so that a failure of this run never leaves another run's
    segmentation behind. The new record is written before the scan is segmented and takes its
    place only after the segmentation has taken its own (:func:`segment_recorded`).
    Only files a record says predict wrote are replaced or removed (:func:`earlier_outputs`,
    :class:`NotOurs`). An output of another model (other weights: :func:`another_model`) is
    kept, status "kept", unless ``--force``; replaced with it, the result says so. The scan's
    int8 calibration set is the segmenter's (:meth:`Segmenter.calibration_for`). An entry of
    ``--input`` that is no scan is its result as it is (:func:`entry_result`)."""
    if not scan.is_scan:
        return entry_result(scan)
    outputs = ScanOutputs.of(scan, plan)
    try:
        calibration = segmenter.calibration_for(scan.name, scan.image_path)
        current = dict(run_fields(plan, calibration, segmenter.policy.source))
        earlier = earlier_outputs(outputs)
        replaced = ""
        if os.path.exists(outputs.segmentation):
            current["input_sha256"] = input_digest(scan.image_path)
            kept, replaced = reuse(scan, outputs, earlier, current, plan)
            if kept is not None:
                return kept
        remove_stale(outputs, earlier, replaced, plan.config.force)
        check_header(scan.image_path)
        if "input_sha256" not in current:
            current["input_sha256"] = input_digest(scan.image_path)
        current["probabilities"] = os.path.basename(outputs.probabilities) if plan.config.save_probabilities else ""
        current["files"] = [os.path.basename(f) for f in outputs.writes]
        result = segment_recorded(scan, segmenter, calibration, outputs, current, plan)
        result.provenance, result.replaced = current, replaced
        return result
    except Stopped:  # SIGTERM / SIGUSR1: the run stops, it is no failure of this scan
        raise
    except Exception as exc:  # noqa: BLE001 - one scan's failure is never the folder's end
        return CaseResult(scan.name, "failed", scan.image_path, error=failure_message(scan, exc),
                          full_disk=isinstance(exc, OutputWriteError) and exc.full)


def predict_cases(scans: Sequence[Scan], segmenter: Segmenter, plan: RunPlan, show_progress: bool,
                  results: list | None = None) -> list[CaseResult]:
    """Segment (or skip) each scan of this rank with ``segmenter`` (of the resolved ``plan``;
    a window inference given as it is: :meth:`Segmenter.from_inference`) into ``results``
    (returned); a scan that fails
    is one stderr line naming it. Once the output disk is full, the remaining scans are "not
    run" (each would fail the same way after minutes of work)."""
    results = [] if results is None else results
    full_disk = None
    # in a log file each scan's own line is its progress line
    for scan in progress(scans, "predict", len(scans), show=show_progress, own_lines=True, unit="scan"):
        if full_disk is not None:
            result = CaseResult(scan.name, "not run", scan.image_path, error=f"the output disk is full ({full_disk})")
        else:
            result = predict_one(scan, segmenter, plan)
            full_disk = result.error if result.full_disk else None
        if result.status in ("failed", "kept") or (result.error and result.status not in ("not run", "left out")):
            write(f"main.py: error: {result.error}", sys.stderr)
        if result.status not in ("failed", "kept"):
            write(result.line())
        results.append(result)
    return results


SUMMARY_FILES = ("summary.csv", "summary.jsonl")


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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


def check_outputs(output_dir: str, scans: Sequence[Scan]) -> None:
    """Before any work: no name predict may write in ``--output_dir`` is a file of an input scan
    (every file of each scan, its ground truth too: ``os.path.samefile``), and a summary there
    is predict's own; else one :class:`UsageError` line naming the clash."""
    scans = [scan for scan in scans if scan.is_scan]
    inputs: dict[tuple[int, int], str] = {}
    for scan in scans:
        try:
            files = input_files(scan.image_path)
        except ScanError:  # a scan that cannot be read fails on its own, later
            files = [scan.image_path]
        for name in files + ([scan.label_path] if scan.label_path else []):
            key = _file_id(name)
            if key is not None:
                inputs.setdefault(key, name)
    names = [os.path.join(output_dir, n) for n in SUMMARY_FILES]
    for scan in scans:
        path = output_path(output_dir, scan)
        names += [path, record_path(path), preview_path(output_dir, scan),
                  probabilities_path(output_dir, scan)]
    for name in names:
        key = _file_id(name)
        if key is not None and key in inputs:
            raise UsageError(f"--output_dir {output_dir}: {name} would be written over the input "
                             f"{inputs[key]}; predict never replaces an input (choose another --output_dir)")
    for name in names[:len(SUMMARY_FILES)]:
        if os.path.lexists(name) and not is_summary(name):
            raise UsageError(f"--output_dir {output_dir}: {name} exists and is no summary of predict; "
                             "predict never replaces it (move it away, or choose another --output_dir)")


def scans_to_predict(input: str, output_dir: str, truth: str = "", preview: bool = False) -> list[Scan]:
    """The scans of ``--input`` and its entries that are none (:func:`data_loading.scans.find_inputs`:
    each named in the summary), their truths (``--truth``), none of whose files (nor a file of
    someone else) would be written over in ``--output_dir`` (:func:`check_outputs`); ``--preview``
    needs matplotlib (all checked before any work)."""
    scans = with_truths(find_inputs(input, output_dir), truth)
    check_outputs(output_dir, scans)
    if preview:
        from runtime.predict.preview import matplotlib_missing

        if matplotlib_missing():
            raise UsageError("--preview needs matplotlib, which is not installed (pip install matplotlib)")
    return scans


def predict_scans(plan: RunPlan, segmenter: Segmenter, scans: Sequence[Scan], dist_info: D.DistInfo) -> int:
    """Segment this rank's share of ``scans`` with ``segmenter`` (the run's
    :class:`runtime.predict.api.Segmenter`, of the resolved ``plan``), write the summary
    (rank 0); the exit code."""
    results: list[CaseResult] = []
    try:
        predict_cases(scans[dist_info.rank::dist_info.world_size], segmenter, plan, dist_info.is_main, results)
    except BaseException:
        if not dist_info.distributed:  # stopped (a signal, Ctrl-C): what is finished is summarised
            save_summary(plan.config.output_dir, results)
        raise
    everything = [r for part in D.all_gather_objects(results) for r in part]
    code = 0
    if dist_info.is_main:
        code = print_outcome(everything, plan.config.output_dir, save_summary(plan.config.output_dir, everything))
    return 1 if any(not r.ok for r in everything) else code
