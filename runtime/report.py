"""See a run: training curves, a per-run summary, the MLPerf compliance verdict and score.

    python -m runtime.report RUN_DIR [RUN_DIR ...] --output DIR

A RUN_DIR is any ``--log_dir`` of main.py (``log.json``, ``unet3d.log`` and, after a resume,
``unet3d.resumed-<time>.log``); a folder without those files (a sweep's parent) expands to the
run folders below it. Writes ``DIR/curves.png`` (when matplotlib is installed), ``DIR/summary.md``
and ``DIR/summary.json``, each atomically.

Training can draw ``<log_dir>/curves.png`` while it runs: ``CurvePlotter(log_dir).request()``
after each evaluation renders in one background thread (matplotlib's object API with the Agg
canvas, never pyplot), so the training step never waits for a picture.

Files are read as they are found on disk: a last line cut by a run still writing, a run that
crashed before its first evaluation, a diverged run (NaN loss), a resumed run with several MLPerf
logs, a folder reused for a second run: each is shown with what it has, and a note says what is
missing. Nothing here is imported at module import beyond the standard library.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

METRICS_LOG = "log.json"
MLPERF_LOG = "unet3d.log"
RESUMED_LOG_GLOB = "unet3d.resumed-*.log"
CURVES_NAME = "curves.png"
DEFAULT_THRESHOLD = 0.908
DEFAULT_RULESET = "4.0.0"
DIVERGED_DICE = 1e-6  # training.py stops a run as diverged below this mean Dice
MATPLOTLIB_HINT = "matplotlib is not installed: pip install matplotlib"
MLLOG_PREFIX = ":::MLLOG "
SEARCH_DEPTH = 4  # how deep a sweep's parent folder is searched for runs


class ReportError(Exception):
    """A user-facing problem: one line, exit code 1."""


class MissingMatplotlib(ReportError):
    pass


# ------------------------------------------------------------------------------- data

@dataclass(frozen=True)
class TrainPoint:
    epoch: int
    loss: float
    lr: float
    throughput: float  # samples/s over the epoch, all ranks
    time: float  # seconds since the Unix epoch, when the epoch ended


@dataclass(frozen=True)
class EvalPoint:
    epoch: int
    mean_dice: float
    l1_dice: float  # kidney
    l2_dice: float  # tumour
    eval_loss: float
    time: float


@dataclass(frozen=True)
class Attempt:
    """One MLPerf log's run: run_start .. run_stop (a resumed run has one per log file)."""
    path: str
    start_ms: int | None
    stop_ms: int | None
    status: str | None  # run_stop's metadata status: success | aborted; None without run_stop
    last_ms: int | None  # the last event's time, the end of an attempt without run_stop
    seed: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def seconds(self) -> float | None:
        """run_stop - run_start; for an attempt without run_stop, up to its last event."""
        end = self.stop_ms if self.stop_ms is not None else self.last_ms
        if self.start_ms is None or end is None:
            return None
        return (end - self.start_ms) / 1000.0


@dataclass(frozen=True)
class Run:
    folder: str
    label: str
    train: tuple[TrainPoint, ...]
    evals: tuple[EvalPoint, ...]
    attempts: tuple[Attempt, ...]
    notes: tuple[str, ...] = ()
    result: str | None = None  # training's own last status in log.json (finished, aborted, ...)


@dataclass(frozen=True)
class Compliance:
    log: str
    checked: bool
    passed: bool
    problems: tuple[str, ...] = ()

    def short(self) -> str:
        if not self.checked:
            return "not checked"
        return "PASS" if self.passed else f"FAIL ({len(self.problems)} problem{'s' * (len(self.problems) != 1)})"

    def verdict(self) -> str:
        if not self.checked:
            return "not checked: " + "; ".join(self.problems)
        if self.passed:
            return "PASS"
        return f"FAIL ({len(self.problems)}): " + "; ".join(self.problems)


@dataclass(frozen=True)
class RunSummary:
    folder: str
    label: str
    status: str
    epochs: int | None
    seed: int | None
    time_to_target_s: float | None
    run_time_s: float | None
    best_mean_dice: float | None
    best_epoch: int | None
    reached_epoch: int | None
    mean_throughput: float | None
    attempts: int
    notes: tuple[str, ...]
    compliance: tuple[Compliance, ...] = field(default_factory=tuple)


# ------------------------------------------------------------------------------- reading files

def read_json_lines(path: str, prefix: str = "") -> tuple[list[dict], list[str]]:
    """The JSON objects of the lines of ``path`` that start with ``prefix`` (others ignored).

    A cut last line (a run still writing) and unreadable lines are skipped with a note; NaN and
    Infinity (how json.dumps writes a diverged loss) are read as floats."""
    name = os.path.basename(path)
    with open(path, "r", encoding="utf-8", errors="replace") as handle:
        lines = handle.read().split("\n")
    records, notes, bad = [], [], []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        if not line.startswith(prefix) or not line.strip():
            continue
        try:
            record = json.loads(line[len(prefix):])
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if index == last:
                notes.append(f"{name}: last line cut (the run may still be writing it); skipped")
            else:
                bad.append(index + 1)
            continue
        records.append(record)
    if bad:
        notes.append(f"{name}: {len(bad)} unreadable line(s) skipped (line {bad[0]} first)")
    return records, notes


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def metrics_from_records(records: Sequence[dict]) -> tuple[list[TrainPoint], list[EvalPoint], list[str]]:
    """Training and evaluation points of ``log.json``, one per epoch, in epoch order.

    A ``train`` record of epoch 1 after others starts a new run in a reused folder: only the last
    run is kept. An epoch logged twice (re-trained after a crash and ``--resume``) keeps its later
    values. Evaluations of a checkpoint (``--exec_mode evaluate``, they carry ``checkpoint``) are
    not part of the training curves: they get a note."""
    notes: list[str] = []
    starts = [i for i, r in enumerate(records) if r.get("kind") == "train" and r.get("epoch") == 1]
    if len(starts) > 1:
        notes.append(f"log.json holds {len(starts)} runs started at epoch 1: the last one is shown")
        records = records[starts[-1]:]
    train: dict[int, TrainPoint] = {}
    evals: dict[int, EvalPoint] = {}
    repeated: set[int] = set()
    for r in records:
        kind, epoch = r.get("kind"), r.get("epoch")
        if not isinstance(epoch, int):
            continue
        if kind == "eval" and "checkpoint" in r:
            notes.append(f"evaluation of checkpoint {r['checkpoint']}: mean_dice "
                         f"{_number(r.get('mean_dice')):.4f} (not drawn)")
        elif kind == "train":
            if epoch in train:
                repeated.add(epoch)
            train[epoch] = TrainPoint(epoch, _number(r.get("loss")), _number(r.get("lr")),
                                      _number(r.get("throughput")), _number(r.get("time")))
        elif kind == "eval":
            evals[epoch] = EvalPoint(epoch, _number(r.get("mean_dice")), _number(r.get("l1_dice")),
                                     _number(r.get("l2_dice")), _number(r.get("eval_loss")),
                                     _number(r.get("time")))
    if repeated:
        notes.append(f"epochs {min(repeated)}-{max(repeated)} trained again after a resume: "
                     "the later values are shown")
    return ([train[e] for e in sorted(train)], [evals[e] for e in sorted(evals)], notes)


def attempts_from_events(events: Sequence[dict], path: str) -> tuple[Attempt, list[str]]:
    """The run of one MLPerf log: run_start, run_stop (time_ms, status) and the seed.

    A log holding several run_starts (a folder reused without ``--resume``) gives its last run."""
    name = os.path.basename(path)
    notes: list[str] = []
    starts = [i for i, e in enumerate(events) if e.get("key") == "run_start"]
    if len(starts) > 1:
        notes.append(f"{name} holds {len(starts)} run_starts: the last run is used")
    first = starts[-1] if starts else 0
    head = events[:first] if starts else events
    body = events[first:]
    seeds = [e.get("value") for e in head if e.get("key") == "seed"]
    stops = [e for e in body if e.get("key") == "run_stop"]
    times = [e["time_ms"] for e in body if isinstance(e.get("time_ms"), (int, float))]
    start_ms = body[0].get("time_ms") if starts else None
    stop = stops[-1] if stops else None
    if not starts:
        notes.append(f"{name}: no run_start (the run stopped during initialisation)")
    elif stop is None:
        notes.append(f"{name}: no run_stop (the run is still going, or it crashed)")
    status = (stop.get("metadata") or {}).get("status") if stop else None
    return Attempt(path=path, start_ms=start_ms, stop_ms=stop.get("time_ms") if stop else None,
                   status=status, last_ms=max(times) if times else None,
                   seed=seeds[-1] if seeds and isinstance(seeds[-1], int) else None,
                   notes=tuple(notes)), notes


def mlperf_logs(folder: str) -> list[str]:
    """``unet3d.log`` first, then the resumed attempts' logs in the order they were started
    (their names carry a sortable ``%Y%m%d-%H%M%S`` time)."""
    logs = [os.path.join(folder, MLPERF_LOG)] if os.path.isfile(os.path.join(folder, MLPERF_LOG)) else []
    return logs + sorted(glob.glob(os.path.join(glob.escape(folder), RESUMED_LOG_GLOB)))


def is_run_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, METRICS_LOG)) or bool(mlperf_logs(folder))


def load_run(folder: str, label: str | None = None) -> Run:
    """Everything ``folder`` holds about one run (see the module docstring for what is tolerated)."""
    notes: list[str] = []
    train: list[TrainPoint] = []
    evals: list[EvalPoint] = []
    metrics_path = os.path.join(folder, METRICS_LOG)
    result = None
    if os.path.isfile(metrics_path):
        records, read_notes = read_json_lines(metrics_path)
        train, evals, metric_notes = metrics_from_records(records)
        notes += read_notes + metric_notes
        result = final_result(records)
    else:
        notes.append("no log.json: no curves")
    attempts = []
    for path in mlperf_logs(folder):
        events, read_notes = read_json_lines(path, prefix=MLLOG_PREFIX)
        attempt, attempt_notes = attempts_from_events(events, path)
        attempts.append(attempt)
        notes += read_notes + attempt_notes
    if not attempts:
        notes.append("no unet3d.log: no time to target or compliance verdict")
    elif len(attempts) > 1:
        notes.append(f"resumed: {len(attempts)} MLPerf logs (attempts); run time is their sum, gaps "
                     "between them left out (each log is an attempt of its own: the sum is no MLPerf result)")
    if not train:
        notes.append("no training epoch logged yet")
    elif not evals:
        notes.append("no evaluation logged (the run stopped or is still before its first evaluation)")
    return Run(folder=folder, label=label or os.path.basename(os.path.abspath(folder)),
               train=tuple(train), evals=tuple(evals), attempts=tuple(attempts), notes=tuple(notes),
               result=result)


def final_result(records: Sequence[dict]) -> str | None:
    """The status of training's last ``result`` record in ``log.json`` (None: none, as in
    logs written before the record existed)."""
    results = [r for r in records if r.get("kind") == "result" and isinstance(r.get("status"), str)]
    return results[-1]["status"] if results else None


def find_runs(path: str, depth: int = SEARCH_DEPTH) -> list[str]:
    """``path`` itself when it holds a run, else the run folders below it (a sweep), sorted."""
    if is_run_folder(path):
        return [path]
    if depth <= 0 or not os.path.isdir(path):
        return []
    found = []
    for name in sorted(os.listdir(path)):
        child = os.path.join(path, name)
        if not name.startswith(".") and os.path.isdir(child):
            found += find_runs(child, depth - 1)
    return found


def run_labels(folders: Sequence[str], seeds: Sequence[int | None]) -> list[str]:
    """Folder names, or paths below the folders' common parent where names repeat; plus the seed."""
    names = [os.path.basename(os.path.abspath(f)) for f in folders]
    if len(set(names)) < len(names):
        root = os.path.commonpath([os.path.abspath(f) for f in folders])
        names = [os.path.relpath(os.path.abspath(f), root) for f in folders]
    return [f"{n} (seed {s})" if s is not None else n for n, s in zip(names, seeds)]


# ------------------------------------------------------------------------------- numbers

def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def best_eval(evals: Sequence[EvalPoint]) -> EvalPoint | None:
    """The evaluation with the highest finite mean Dice; the earliest one on a tie."""
    best = None
    for point in evals:
        if finite(point.mean_dice) and (best is None or point.mean_dice > best.mean_dice):
            best = point
    return best


def reached_epoch(evals: Sequence[EvalPoint], threshold: float) -> int | None:
    """The first evaluated epoch whose mean Dice is at least ``threshold``."""
    return next((p.epoch for p in evals if finite(p.mean_dice) and p.mean_dice >= threshold), None)


def diverged_epoch(run: Run) -> int | None:
    """The first epoch with a non-finite loss or a mean Dice below 1e-6 (training's own test)."""
    epochs = [p.epoch for p in run.train if not math.isfinite(p.loss)]
    epochs += [p.epoch for p in run.evals if finite(p.mean_dice) and p.mean_dice < DIVERGED_DICE]
    return min(epochs) if epochs else None


def run_outcome(run: Run) -> str:
    """success | finished (ran its --epochs without reaching the target) | aborted | diverged |
    incomplete (no run_stop: running or crashed) | no MLPerf log.

    MLPerf's run_stop knows only success and aborted: a run that simply ran out of epochs is
    "aborted" there; training's ``result`` record in log.json tells it apart."""
    if diverged_epoch(run) is not None:
        return "diverged"
    if not run.attempts:
        return "no MLPerf log"
    last = run.attempts[-1]
    if last.status is None:
        return "incomplete"
    if last.status == "success":
        return "success"
    return "finished" if run.result == "finished" else "aborted"


def run_seconds(attempts: Sequence[Attempt]) -> float | None:
    """The run's MLPerf time: the sum of its attempts' run_start..run_stop intervals."""
    parts = [a.seconds for a in attempts]
    if not parts or any(p is None for p in parts):
        return None
    return float(sum(parts))


def elapsed_minutes(times: Sequence[float], attempts: Sequence[Attempt]) -> list[float]:
    """Run time in minutes at each wall-clock time ``times`` (seconds since the Unix epoch).

    Inside an attempt the clock starts at its run_start and continues from the earlier attempts'
    total, so the gaps between a pre-emption and its resume are left out. Without MLPerf log the
    clock starts at the first time given."""
    spans = [(a.start_ms / 1000.0, a.seconds or 0.0) for a in attempts if a.start_ms is not None]
    finite_times = [t for t in times if math.isfinite(t)]
    if not spans:
        origin = min(finite_times, default=0.0)
        return [(t - origin) / 60.0 for t in times]
    minutes = []
    for t in times:
        index = max([i for i, (start, _) in enumerate(spans) if start <= t], default=0)
        before = sum(length for _, length in spans[:index])
        minutes.append((before + t - spans[index][0]) / 60.0)
    return minutes


def olympic_score(times: Sequence[float], failed: int = 0, drop: int = 1) -> float | None:
    """MLPerf-style score: the mean of the run times left after dropping the ``drop`` fastest and
    the ``drop`` slowest; each failed run (no time) takes one of the slow-end drops, as MLPerf's
    result summarizer counts a non-converged run. None with fewer than ``2·drop + 1`` runs, or
    more than ``drop`` failed runs."""
    if failed > drop or len(times) + failed < 2 * drop + 1:
        return None
    ordered = sorted(times)
    kept = ordered[drop:len(ordered) - (drop - failed)]
    return sum(kept) / len(kept) if kept else None


def summarize_run(run: Run, threshold: float) -> RunSummary:
    best = best_eval(run.evals)
    status = run_outcome(run)
    notes = list(run.notes)
    bad = diverged_epoch(run)
    if bad is not None:
        notes.append(f"diverged at epoch {bad} (non-finite loss or mean Dice below {DIVERGED_DICE:g})")
    seconds = run_seconds(run.attempts)
    speeds = [p.throughput for p in run.train if math.isfinite(p.throughput)]
    seeds = [a.seed for a in run.attempts if a.seed is not None]
    return RunSummary(
        folder=run.folder, label=run.label, status=status,
        epochs=run.train[-1].epoch if run.train else None, seed=seeds[0] if seeds else None,
        time_to_target_s=seconds if status == "success" else None, run_time_s=seconds,
        best_mean_dice=best.mean_dice if best else None, best_epoch=best.epoch if best else None,
        reached_epoch=reached_epoch(run.evals, threshold),
        mean_throughput=sum(speeds) / len(speeds) if speeds else None,
        attempts=len(run.attempts), notes=tuple(notes))


@dataclass(frozen=True)
class Score:
    minutes: float | None
    successful: int
    failed: int  # runs with an MLPerf log that did not reach the target (or have not yet)
    drop: int
    text: str


def score_runs(summaries: Sequence[RunSummary], drop: int = 1) -> Score:
    """The olympic score over the runs that have an MLPerf log, in minutes (MLPerf's unit)."""
    times = [s.time_to_target_s / 60.0 for s in summaries if s.time_to_target_s is not None]
    failed = sum(1 for s in summaries if s.attempts and s.time_to_target_s is None)
    minutes = olympic_score(times, failed, drop)
    need = 2 * drop + 1
    if failed > drop:
        text = (f"no score: {failed} runs did not reach the target (or have not yet); dropping "
                f"{drop} at each end allows at most {drop}")
    elif minutes is None:
        text = (f"no score: {len(times) + failed} run(s) with an MLPerf log, {need} needed to drop "
                f"the {drop} fastest and {drop} slowest (real unet3d submissions: 40 runs, 4 dropped each end)")
    else:
        text = (f"score {minutes:.2f} min: mean of {len(times) + failed - 2 * drop} of {len(times) + failed} "
                f"runs after dropping the {drop} fastest and {drop} slowest"
                + (f" ({failed} failed run(s) counted as the slowest)" if failed else ""))
    resumed = sum(1 for s in summaries if s.attempts > 1 and s.time_to_target_s is not None)
    if resumed and minutes is not None:
        text += f"; includes {resumed} resumed run(s), timed over all their attempts"
    return Score(minutes, len(times), failed, drop, text)


# ------------------------------------------------------------------------------- compliance

def _checker_problems(output: str) -> list[str]:
    """One line per problem in the checker's log (records ``LEVEL - message``): the first line
    of each message, plus the failed test of a ``CHECK for 'key' failed in line N`` message, and
    ``parse error: ...`` per line the checker's parser rejected."""
    parts = re.split(r"^(INFO|WARNING|ERROR) - ", output, flags=re.M)
    problems = []
    for level, body in zip(parts[1::2], parts[2::2]):
        if level != "WARNING":
            continue
        if body.lstrip().startswith("^^"):  # the parser's reason for the line logged before it
            problems.append("parse error: " + body.lstrip()[2:].strip())
            continue
        if not body.startswith(" ") or body.startswith("  "):  # a rejected line, or its header
            continue
        for chunk in body.split("-" * 30):
            lines = [line.strip() for line in chunk.strip().splitlines() if line.strip()]
            if not lines:
                continue
            first = lines[0].rstrip(":")
            if first.startswith("Found parsing errors"):  # the "parse error" lines say which
                continue
            test = next((line for line in lines if line.startswith("failed test:")), None)
            if first.startswith("CHECK for") and test:
                first += ": " + test[len("failed test:"):].strip()
            problems.append(" ".join(first.split()))
    return problems


def check_compliance(log: str, ruleset: str = DEFAULT_RULESET, timeout: float = 300) -> Compliance:
    """Run ``mlperf_logging.compliance_checker`` on ``log`` in a subprocess (the checker keeps
    module-level state, configures the root logger and writes its own log file: a process of
    its own keeps all that away from ours)."""
    if importlib.util.find_spec("mlperf_logging") is None:
        return Compliance(log, False, False, ("mlperf_logging is not installed: pip install mlperf-logging",))
    with tempfile.TemporaryDirectory(prefix="unet3d-compliance-") as work:
        out = os.path.join(work, "checker.log")
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                 "--ruleset", ruleset, "--log_output", out, os.path.abspath(log)],
                cwd=work, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Compliance(log, False, False, (f"the checker took more than {timeout:.0f} s",))
        text = open(out, encoding="utf-8", errors="replace").read() if os.path.isfile(out) else ""
    problems = _checker_problems(text or proc.stderr)
    if proc.returncode == 0:
        return Compliance(log, True, True)
    if not problems:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        problems = [tail[-1] if tail else f"checker exit code {proc.returncode}"]
    return Compliance(log, True, False, tuple(problems))


# ------------------------------------------------------------------------------- writing files

def atomic_write(path: str, write: Callable) -> str:
    """:func:`data_loading.atomic.atomic_write` (temporary file beside ``path``, then rename:
    a reader never sees half a file), returning ``path``. A failure to write (full disk, quota,
    read-only) is one :class:`ReportError` naming ``path``."""
    from data_loading.atomic import atomic_write as write_atomically
    from data_loading.write_errors import write_failure

    try:
        write_atomically(path, write)
    except Exception as error:  # noqa: BLE001 - a write failure is one line, anything else a bug
        reason = write_failure(error)
        if reason is None:
            raise
        raise ReportError(f"cannot write {path}: {reason}") from None
    return path


def write_figure(runs: Sequence[Run], threshold: float, path: str) -> str:
    """Draw ``runs`` (see runtime/curves_figure.py) into the PNG ``path``; MissingMatplotlib
    when matplotlib is not installed."""
    from runtime.curves_figure import build_figure

    figure = build_figure(runs, threshold)
    return atomic_write(path, lambda handle: figure.savefig(handle, format="png"))


def write_curves(log_dir: str, quality_threshold: float = DEFAULT_THRESHOLD) -> str:
    """Write ``<log_dir>/curves.png`` from the run's files in ``log_dir``; returns its path.

    Safe to call from a background thread while training writes the logs: it only reads them,
    uses no pyplot state, and replaces the picture atomically."""
    if not os.path.isdir(log_dir):
        raise ReportError(f"{log_dir}: no such folder")
    return write_figure([load_run(log_dir)], quality_threshold, os.path.join(log_dir, CURVES_NAME))


_CHILD_CODE = ("import sys; sys.path.insert(0, sys.argv[1]); from runtime.report import main_curves; "
               "sys.exit(main_curves(sys.argv[2], float(sys.argv[3])))")


def main_curves(log_dir: str, quality_threshold: float) -> int:
    """write_curves with a one-line error on stderr and exit code 1 (the child process's entry)."""
    try:
        write_curves(log_dir, quality_threshold)
    except Exception as error:  # reported by the parent as one line
        print(str(error).splitlines()[0] if str(error) else type(error).__name__, file=sys.stderr)
        return 1
    return 0


def write_curves_in_subprocess(log_dir: str, quality_threshold: float = DEFAULT_THRESHOLD) -> str:
    """write_curves in a child Python process, for ``CurvePlotter(..., write=...)``: a matplotlib
    failure or leak cannot touch the training process, and the drawing shares no GIL with it. It
    costs a Python start and a matplotlib import per picture, and was no faster on a loaded 2-core
    machine (docs/performance.md, "Curve plotter")."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _CHILD_CODE, root, os.path.abspath(log_dir),
                           repr(float(quality_threshold))], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise ReportError(lines[-1] if lines else f"drawing process exit code {proc.returncode}")
    return os.path.join(log_dir, CURVES_NAME)


class CurvePlotter:
    """Redraws ``<log_dir>/curves.png`` in one daemon thread whenever asked.

    ``request()`` never blocks: it marks a redraw as wanted and returns; requests made while a
    picture is being drawn are coalesced into one more drawing. The first failure (matplotlib
    missing, an unwritable folder) is reported once, as one line through ``say``; training goes
    on. ``close()`` waits for the drawing asked for last."""

    def __init__(self, log_dir: str, quality_threshold: float = DEFAULT_THRESHOLD,
                 write: Callable[[str, float], str] = write_curves,
                 say: Callable[[str], None] | None = None):
        self.log_dir, self.quality_threshold = log_dir, quality_threshold
        self._write = write
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wake = threading.Condition()
        self._pending = self._closed = self._reported = False
        self._thread: threading.Thread | None = None
        self.drawn = 0  # pictures written, for tests and curiosity

    def request(self) -> None:
        with self._wake:
            if self._closed:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="curve-plotter", daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                self._pending = False
            try:
                self._write(self.log_dir, self.quality_threshold)
                self.drawn += 1
            except Exception as error:  # a picture is never worth stopping a training run
                if not self._reported:
                    self._reported = True
                    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                    self._say(f"curves.png not written in {self.log_dir}: {reason}")


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:{spec}}{unit}"


def _time_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ({seconds / 60:.2f} min)"


def summary_markdown(summaries: Sequence[RunSummary], empty: Sequence[str], score: Score,
                     threshold: float, ruleset: str, curves: str | None) -> str:
    lines = ["# Run report", "",
             f"Target mean Dice {threshold:g}; compliance: `mlperf_logging` ruleset {ruleset}.", ""]
    if curves:
        lines += [f"![training curves]({curves})", ""]
    lines += ["| run | status | epochs | time to target | best mean Dice (epoch) | target reached at epoch "
              "| mean throughput | compliance |", "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        best = "-" if s.best_mean_dice is None else f"{s.best_mean_dice:.4f} ({s.best_epoch})"
        compliance = "<br>".join(f"{os.path.basename(c.log)}: {c.short()}" for c in s.compliance) or "-"
        time_text = _time_text(s.time_to_target_s)
        if s.time_to_target_s is None and s.run_time_s is not None:
            time_text = f"- (ran {_time_text(s.run_time_s)})"
        lines.append(f"| {s.label} | {s.status} | {_fmt(s.epochs, 'd')} | {time_text} | {best} "
                     f"| {_fmt(s.reached_epoch, 'd')} | {_fmt(s.mean_throughput, '.2f', ' samples/s')} "
                     f"| {compliance.replace('|', '/')} |")
    lines += ["", f"**Score**: {score.text}.", ""]
    failing = [(s, c) for s in summaries for c in s.compliance if c.problems]
    if failing:
        lines += [f"## Compliance problems (ruleset {ruleset})", ""]
        for s, c in failing:
            lines.append(f"- {s.label}, `{os.path.basename(c.log)}`:")
            lines += [f"  - {problem}" for problem in c.problems]
        lines.append("")
    noted = [s for s in summaries if s.notes]
    if noted or empty:
        lines += ["## Notes", ""]
        lines += [f"- {s.label} (`{s.folder}`): {note}" for s in noted for note in s.notes]
        lines += [f"- `{folder}`: no run here (no log.json or unet3d.log)" for folder in empty]
        lines.append("")
    return "\n".join(lines)


def _clean(value):
    """JSON without NaN or Infinity (not JSON): non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def summary_json(summaries: Sequence[RunSummary], empty: Sequence[str], score: Score,
                 threshold: float, ruleset: str, curves: str | None) -> str:
    runs = []
    for s in summaries:
        entry = {k: getattr(s, k) for k in ("folder", "label", "status", "epochs", "seed", "time_to_target_s",
                                            "run_time_s", "best_mean_dice", "best_epoch", "reached_epoch",
                                            "mean_throughput", "attempts", "notes")}
        entry["compliance"] = [{"log": c.log, "checked": c.checked, "passed": c.passed,
                                "problems": list(c.problems)} for c in s.compliance]
        runs.append(entry)
    document = {"quality_threshold": threshold, "ruleset": ruleset, "curves": curves, "runs": runs,
                "no_run": list(empty),
                "score": {"minutes": score.minutes, "successful_runs": score.successful,
                          "failed_runs": score.failed, "dropped_each_end": score.drop, "text": score.text}}
    return json.dumps(_clean(document), indent=2, allow_nan=False) + "\n"


# ------------------------------------------------------------------------------- command line

def collect_runs(paths: Iterable[str]) -> tuple[list[Run], list[str]]:
    """The runs under ``paths`` (each folder once, labelled uniquely), and the paths without any."""
    folders: list[str] = []
    empty: list[str] = []
    for path in paths:
        found = find_runs(path)
        if not found:
            empty.append(path)
        folders += [f for f in found if f not in folders]
    runs = [load_run(f) for f in folders]
    seeds = [next((a.seed for a in run.attempts if a.seed is not None), None) for run in runs]
    labels = run_labels(folders, seeds)
    return [Run(r.folder, label, r.train, r.evals, r.attempts, r.notes) for r, label in zip(runs, labels)], empty


def check_all(runs: Sequence[Run], ruleset: str) -> dict[str, Compliance]:
    """The checker's verdict for every MLPerf log of ``runs`` (about a second each)."""
    logs = [a.path for run in runs for a in run.attempts]
    try:
        from tqdm import tqdm

        logs_iter = tqdm(logs, desc="compliance", unit="log", disable=len(logs) < 4)
    except ImportError:
        logs_iter = logs
    return {log: check_compliance(log, ruleset) for log in logs_iter}


def make_report(paths: Sequence[str], output: str, threshold: float = DEFAULT_THRESHOLD,
                ruleset: str = DEFAULT_RULESET, check: bool = True, drop: int = 1, draw: bool = True,
                say: Callable[[str], None] = print) -> dict:
    """Write curves.png, summary.md and summary.json for the runs under ``paths`` into ``output``.

    Returns {"runs", "no_run", "summary_md", "summary_json", "curves" (None without matplotlib),
    "score"}; one line through ``say`` per path without a run; raises ReportError (one line)
    when no path holds a run."""
    runs, empty = collect_runs(paths)
    missing = [f"{path}: no such folder" if not os.path.exists(path)
               else f"{path}: no run here (no log.json or unet3d.log in it or below it)" for path in empty]
    if not runs:  # one line in all
        raise ReportError("; ".join(missing))
    for line in missing:
        say(line)
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as error:
        raise ReportError(f"cannot create --output {output}: {error.strerror or type(error).__name__}") from None
    verdicts = check_all(runs, ruleset) if check else {}
    summaries = []
    for run in runs:
        summary = summarize_run(run, threshold)
        found = tuple(verdicts[a.path] for a in run.attempts if a.path in verdicts)
        summaries.append(RunSummary(**{**summary.__dict__, "compliance": found}))
    curves = None
    try:
        if draw:
            write_figure(runs, threshold, os.path.join(output, CURVES_NAME))
            curves = CURVES_NAME
    except MissingMatplotlib as error:
        say(f"curves.png not written: {error}")
    score = score_runs(summaries, drop)
    md = atomic_write(os.path.join(output, "summary.md"), lambda h: h.write(
        summary_markdown(summaries, empty, score, threshold, ruleset, curves).encode()))
    js = atomic_write(os.path.join(output, "summary.json"), lambda h: h.write(
        summary_json(summaries, empty, score, threshold, ruleset, curves).encode()))
    return {"runs": summaries, "no_run": empty, "summary_md": md, "summary_json": js,
            "curves": os.path.join(output, curves) if curves else None, "score": score}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="a --log_dir of main.py, or a folder of them (a sweep)")
    parser.add_argument("--output", required=True, help="folder for curves.png, summary.md, summary.json")
    parser.add_argument("--quality_threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="target mean Dice drawn and used for 'reached at epoch' (default 0.908)")
    parser.add_argument("--ruleset", default=DEFAULT_RULESET, help="compliance checker ruleset (default 4.0.0)")
    parser.add_argument("--no_compliance", action="store_true", help="skip the compliance checker")
    parser.add_argument("--no_curves", action="store_true", help="write the summary only, no curves.png")
    parser.add_argument("--drop", type=int, default=1,
                        help="runs dropped at each end for the score (MLPerf drops 4 of unet3d's 40); "
                             "a score needs 2*drop+1 runs")
    args = parser.parse_args(argv)
    if not 0 < args.quality_threshold <= 1:
        parser.error(f"--quality_threshold {args.quality_threshold}: must be in (0, 1]")
    if args.drop < 1:
        parser.error(f"--drop {args.drop}: must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = make_report(args.runs, args.output, args.quality_threshold, args.ruleset,
                             check=not args.no_compliance, drop=args.drop, draw=not args.no_curves)
    except (ReportError, OSError) as error:
        print(f"report: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        return 1
    for s in result["runs"]:
        print(f"{s.label}: {s.status}, {s.epochs or 0} epochs, time to target {_time_text(s.time_to_target_s)}, "
              f"best mean Dice {_fmt(s.best_mean_dice, '.4f')} (epoch {_fmt(s.best_epoch, 'd')})")
    print(result["score"].text)
    print(f"report: {result['summary_md']}" + (f" and {result['curves']}" if result["curves"] else ""))
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: runtime/curves_figure.py raises
    # runtime.report's MissingMatplotlib, which only that module's `except` clauses catch.
    from runtime.report import main as report_main

    sys.exit(report_main())
