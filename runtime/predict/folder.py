"""``--exec_mode predict`` over a folder: every scan isolated, the output folder locked, the
summary always written.

Each scan of this rank (:func:`predict_one`) claims its outputs through its
:class:`runtime.predict.ledger.OutputLedger`: reused when its record says it was made the way
this run would make it (:mod:`runtime.predict.provenance`), refused when a file there is not
predict's or, without ``--force``, another model's output; else its header is checked
(:func:`data_loading.scan_checks.check_header`, before any voxel is read) and it goes through
:func:`runtime.predict.scan.segment_scan` with the run's :class:`runtime.predict.api.Segmenter`.

Before any work, an output name that is a file of an input scan (``os.path.samefile``:
``--output_dir`` the scans' own folder, or a single scan's folder) or a summary of someone else
refuses the run in one line naming the clash (:func:`check_outputs`). Any failure inside one
scan (bad input, out of memory, an allocator error) is that scan's one line and summary row with
its status, never the folder's end; once the output disk is full, the remaining scans are "not
run" and the summary names them. Rank 0 writes the summary (:mod:`runtime.predict.records`); the
exit code is 1 if any scan failed. The lifecycle (the output folder checked and locked, the
process group, signals) is :mod:`runtime.app`'s.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from data_loading.scan_checks import check_header
from data_loading.scan_io import input_files
from data_loading.scans import SUMMARY_NAMES, Scan, ScanError, find_inputs, with_truths
from runtime import distributed as D
from runtime.config import UsageError
from runtime.plan import RunPlan
from runtime.progress import progress, write
from runtime.predict.api import Segmenter
from runtime.predict.ledger import Claim, OutputLedger, ScanOutputs, is_summary
from runtime.predict.provenance import run_fields
from runtime.predict.scan import OutputWriteError, one_line_reason, segment_scan, summarise_existing
from runtime.predict.records import CaseResult, Status, print_outcome, save_summary
from runtime.signals import Stopped


ALLOCATOR_SIGNS = ("can't allocate memory", "out of memory", "DefaultCPUAllocator", "std::bad_alloc")


def failure_message(scan: Scan, exc: BaseException) -> str:
    """One line naming the scan (or the output file) and what went wrong."""
    if isinstance(exc, OutputWriteError):
        return f"{exc}" + ("; the remaining scans are not run (the output disk is full)" if exc.full else "")
    if isinstance(exc, ScanError):
        return str(exc).splitlines()[0] if str(exc) else f"{scan.image_path}: {type(exc).__name__}"
    if isinstance(exc, MemoryError) or any(sign in str(exc) for sign in ALLOCATOR_SIGNS):
        return f"{scan.image_path}: out of memory ({one_line_reason(exc)[:200]})"
    if isinstance(exc, OSError):
        return f"{scan.image_path}: cannot read it ({exc.strerror or type(exc).__name__})"
    return f"{scan.image_path}: {one_line_reason(exc)[:300]}"


def entry_result(scan: Scan) -> CaseResult:
    """The result of an entry of ``--input`` that is no scan (left out) or cannot be read (failed)."""
    if scan.unreadable:
        return CaseResult(scan.name, Status.FAILED, scan.image_path, error=scan.unreadable)
    return CaseResult(scan.name, Status.LEFT_OUT, scan.image_path, error=scan.left_out)


def claimed_result(scan: Scan, ledger: OutputLedger, claim: Claim, label_set) -> CaseResult:
    """The result of a scan whose outputs stay as they are (``claim`` REUSE or REFUSE): its
    segmentation's numbers read back, skipped or kept (another model's); failed, naming the file,
    when that file is not predict's."""
    if ledger.foreign:
        return CaseResult(scan.name, Status.FAILED, scan.image_path, error=ledger.why)
    result = summarise_existing(scan, ledger.outputs.segmentation, label_set)
    result.status = Status.SKIPPED if claim is Claim.REUSE else Status.KEPT
    result.provenance, result.error = ledger.stored, ledger.why
    return result


def predict_one(scan: Scan, segmenter: Segmenter, plan: RunPlan) -> CaseResult:
    """Segment (or reuse) one scan; every failure inside it (bad input, out of memory, an
    allocator error, a full output disk) is its result, and an entry of ``--input`` that is no
    scan is its result as it is (:func:`entry_result`).

    Its :class:`runtime.predict.ledger.OutputLedger` claims its outputs: an output made the way
    this run would make it is reused, a file predict did not write or (without ``--force``)
    another model's output is refused and kept (:func:`claimed_result`); else what predict wrote
    before is cleared, the header checked before any voxel is read, this run's record begun, the
    scan segmented (int8 on the segmenter's calibration set for it), and the record committed
    after the segmentation, or what this run wrote abandoned."""
    if not scan.is_scan:
        return entry_result(scan)
    try:
        calibration = segmenter.calibration_for(scan.name, scan.image_path)
        config = plan.config
        ledger = OutputLedger(ScanOutputs.of(config.output_dir, scan, config.preview, config.save_probabilities),
                              run_fields(plan, calibration, segmenter.policy.source), scan.image_path, config.force)
        claim = ledger.claim()
        if claim is not Claim.FRESH:
            return claimed_result(scan, ledger, claim, plan.network.label_set)
        ledger.clear()
        check_header(scan.image_path)
        ledger.begin()
        try:
            return ledger.commit(segment_scan(scan, segmenter, config.output_dir, config.preview,
                                              probabilities=config.save_probabilities, calibration=calibration,
                                              label_set=plan.network.label_set))
        except BaseException:  # a failure or a signal: only what this run wrote is cleaned up
            ledger.abandon()
            raise
    except Stopped:  # SIGTERM / SIGUSR1: the run stops, it is no failure of this scan
        raise
    except Exception as exc:  # noqa: BLE001 - one scan's failure is never the folder's end
        return CaseResult(scan.name, Status.FAILED, scan.image_path, error=failure_message(scan, exc),
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
            result = CaseResult(scan.name, Status.NOT_RUN, scan.image_path,
                                error=f"the output disk is full ({full_disk})")
        else:
            result = predict_one(scan, segmenter, plan)
            full_disk = result.error if result.full_disk else None
        refused = result.status in (Status.FAILED, Status.KEPT)
        if refused or (result.error and result.status not in (Status.NOT_RUN, Status.LEFT_OUT)):
            write(f"main.py: error: {result.error}", sys.stderr)
        if not refused:
            write(result.line())
        results.append(result)
    return results


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
    names = [os.path.join(output_dir, n) for n in SUMMARY_NAMES]
    for scan in scans:
        outputs = ScanOutputs.of(output_dir, scan)
        names += [outputs.segmentation, outputs.record, outputs.preview, outputs.probabilities]
    for name in names:
        key = _file_id(name)
        if key is not None and key in inputs:
            raise UsageError(f"--output_dir {output_dir}: {name} would be written over the input "
                             f"{inputs[key]}; predict never replaces an input (choose another --output_dir)")
    for name in names[:len(SUMMARY_NAMES)]:
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
