"""See a run: training curves, a per-run summary, the MLPerf compliance verdict and score.

    python -m runtime.report RUN_DIR [RUN_DIR ...] --output DIR

A RUN_DIR is any ``--log_dir`` of main.py (``log.json``, ``unet3d.log`` and, after a resume,
``unet3d.resumed-<time>.log``); a folder without those files (a sweep's parent) expands to the
run folders below it, and a folder's ``previous-<time>/`` folders (earlier attempts moved out of
the way of a new run) are runs of their own: every attempt is listed and counted. Writes
``DIR/curves.png`` (when matplotlib is installed), ``DIR/summary.md`` and ``DIR/summary.json``,
each atomically.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from data_loading.write_errors import failure_reason
from runtime import __version__
from runtime.results.compliance import DEFAULT_RULESET, check_all
from runtime.results.figure import MissingMatplotlib, write_figure
from runtime.results.files import ReportError
from runtime.report.run_summary import number_text, predicted_text, time_text, write_summaries
from runtime.results.runs import collect_runs
from runtime.results.scoring import DROPPED_EACH_END, SUBMISSION_RUNS, RunSummary, score_runs, summarize_run
from runtime.run_files import (CURVES_PNG, METRICS_LOG, MLPERF_LOG, QUALITY_THRESHOLD, SUMMARY_JSON, SUMMARY_MD,
                               UNVERIFIED)


def _output_folder(output: str) -> None:
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as error:
        raise ReportError(f"cannot create --output {output}: {failure_reason(error)}") from None


def make_report(paths: Sequence[str], output: str, threshold: float = QUALITY_THRESHOLD,
                ruleset: str = DEFAULT_RULESET, check: bool = True, drop: int = DROPPED_EACH_END, draw: bool = True,
                say: Callable[[str], None] = print, window: int = SUBMISSION_RUNS) -> dict:
    """Write curves.png, summary.md and summary.json for the runs under ``paths`` into ``output``.

    Returns {"runs", "no_run", "summary_md", "summary_json", "curves" (None without matplotlib),
    "score"}; one line through ``say`` per path without a run; raises ReportError (one line)
    when no path holds a run."""
    runs, empty = collect_runs(paths)
    missing = [f"{path}: no such folder" if not os.path.exists(path)
               else f"{path}: no run here (no {METRICS_LOG} or {MLPERF_LOG} in it or below it)" for path in empty]
    if not runs:  # one line in all
        raise ReportError("; ".join(missing))
    for line in missing:
        say(line)
    _output_folder(output)
    verdicts = check_all([a.path for run in runs for a in run.attempts], ruleset) if check else {}
    summaries = []
    for run in runs:
        summary = summarize_run(run, threshold)
        found = tuple(verdicts[a.path] for a in run.attempts if a.path in verdicts)
        summaries.append(RunSummary(**{**summary.__dict__, "compliance": found}))
    curves = None
    try:
        if draw:
            write_figure(runs, threshold, os.path.join(output, CURVES_PNG))
            curves = CURVES_PNG
    except MissingMatplotlib as error:
        say(f"{CURVES_PNG} not written: {error}")
    score = score_runs(summaries, drop, window)
    md, js = write_summaries(output, summaries, empty, score, threshold, ruleset, curves)
    return {"runs": summaries, "no_run": empty, "summary_md": md, "summary_json": js,
            "curves": os.path.join(output, curves) if curves else None, "score": score}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the program's version and exit")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="a --log_dir of main.py, or a folder of them (a sweep)")
    parser.add_argument("--output", required=True,
                        help=f"folder for {CURVES_PNG}, {SUMMARY_MD}, {SUMMARY_JSON}")
    parser.add_argument("--quality_threshold", type=float, default=QUALITY_THRESHOLD,
                        help=f"target mean Dice drawn and used for 'reached at epoch' (default {QUALITY_THRESHOLD:g})")
    parser.add_argument("--ruleset", default=DEFAULT_RULESET,
                        help=f"compliance checker ruleset (default {DEFAULT_RULESET})")
    parser.add_argument("--no_compliance", action="store_true", help="skip the compliance checker")
    parser.add_argument("--no_curves", action="store_true", help=f"write the summary only, no {CURVES_PNG}")
    parser.add_argument("--drop", type=int, default=DROPPED_EACH_END,
                        help=f"runs dropped at each end for the score (default {DROPPED_EACH_END}, as unet3d's "
                             f"{SUBMISSION_RUNS}-run score); a score needs 2*drop+1 runs")
    parser.add_argument("--window", type=int, default=SUBMISSION_RUNS,
                        help=f"of more counted runs than this (default {SUBMISSION_RUNS}), the score is over this many "
                             "consecutive runs by start time, those whose score is closest to the median of every "
                             "such window's (the rules' choice)")
    args = parser.parse_args(argv)
    if not 0 < args.quality_threshold <= 1:
        parser.error(f"--quality_threshold {args.quality_threshold}: must be in (0, 1]")
    if args.drop < 1:
        parser.error(f"--drop {args.drop}: must be at least 1")
    if args.window < 2 * args.drop + 1:
        parser.error(f"--window {args.window}: must be at least 2*--drop+1 ({2 * args.drop + 1})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = make_report(args.runs, args.output, args.quality_threshold, args.ruleset,
                             check=not args.no_compliance, drop=args.drop, draw=not args.no_curves,
                             window=args.window)
    except (ReportError, OSError) as error:
        print(f"report: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        return 1
    for s in result["runs"]:
        print(f"{s.label}: {s.status}, {s.epochs or 0} epochs, time to target {time_text(s.time_to_target_s)}, "
              f"best mean Dice {number_text(s.best_mean_dice, '.4f')} (epoch {number_text(s.best_epoch, 'd')})"
              + (f"; predicted time to train at its speed {predicted_text(s.predicted)}" if s.predicted else "")
              + ("" if s.is_result else f"; not an MLPerf result: {s.not_a_result[0]}"))
    print(result["score"].text)
    print(UNVERIFIED)
    print(f"report: {result['summary_md']}" + (f" and {result['curves']}" if result["curves"] else ""))
    return 0
