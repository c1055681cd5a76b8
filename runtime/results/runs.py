"""Reading run folders: ``log.json`` and the MLPerf logs of a ``--log_dir`` into a :class:`Run`.

A run folder is any ``--log_dir`` of main.py (``log.json``, ``unet3d.log`` and, after a resume,
``unet3d.resumed-<time>.log``); a folder without those files (a sweep's parent) expands to the
run folders below it. A ``previous-<time>/`` folder inside a run folder (an earlier attempt that a
new run in the same ``--log_dir`` moved out of its way) is read as a run of its own: every attempt
of every folder is listed (:func:`folder_runs`), a crashed one included.

Files are read as they are found on disk: a last line cut by a run still writing, a run that
crashed before its first evaluation, a diverged run (NaN loss), a resumed run with several MLPerf
logs, a folder reused for a second run: each is shown with what it has, and a note says what is
missing.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from runtime.run_files import (CACHE_CLEAR, CHECKPOINTS_ON_THE_CLOCK, EVAL, EVAL_START, EVAL_STOP,
                               GLOBAL_BATCH_SIZE, METRICS_LOG, MLLOG_PREFIX, MLPERF_LOG, NOT_CLOSED,
                               PREVIOUS_RUN_PREFIX, RECORD_HEADER, RESULT, RESUMED_FROM_CHECKPOINT, RESUMED_LOG_GLOB,
                               RUN_START, RUN_STOP, SAMPLES_PER_EPOCH, SAMPLES_TRAINED_PER_EPOCH, SEED,
                               SUBMISSION_DIVISION, TRAIN, TRAIN_SAMPLES)

SEARCH_DEPTH = 4  # how deep a sweep's parent folder is searched for runs
# the MLPerf log's keys of the training patch, evaluation window and overlap (what a step and an
# evaluation cost, beside the network)
SHAPE_KEYS = ("training_input_shape", "validation_input_shape", "validation_overlap")


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
    # Every key of the eval record but time and kind, as written: a metric added to the writer
    # (and declared in runtime/run_files.py) arrives here without a change to the report.
    metrics: dict = field(default_factory=dict)


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
    # what the predicted time to train needs (runtime.results.time_to_train): the run's logged
    # global batch, samples per epoch (padding counted) and trained per epoch (not counted: None in
    # logs written before it was logged), training cases, and each evaluation's (epoch, seconds)
    global_batch: int | None = None
    samples_per_epoch: int | None = None
    samples_trained_per_epoch: int | None = None
    train_samples: int | None = None
    # the logged training patch, evaluation window and overlap (SHAPE_KEYS: value), when logged
    shapes: dict = field(default_factory=dict)
    evals: tuple[tuple[int, float], ...] = ()
    # why this attempt is not an MLPerf result, from its own log (runtime/run_files.py's events):
    # it started from a checkpoint, or wrote checkpoints between run_start and run_stop
    not_a_result: tuple[str, ...] = ()
    # the log's cache_clear (None: not logged) and submission_division, before its run_start
    cache_clear: bool | None = None
    division: str | None = None

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


def _train_point(record: dict) -> TrainPoint:
    return TrainPoint(record["epoch"], _number(record.get("loss")), _number(record.get("lr")),
                      _number(record.get("throughput")), _number(record.get("time")))


def _eval_point(record: dict) -> EvalPoint:
    return EvalPoint(record["epoch"], _number(record.get("mean_dice")), _number(record.get("l1_dice")),
                     _number(record.get("l2_dice")), _number(record.get("eval_loss")),
                     _number(record.get("time")),
                     metrics={k: v for k, v in record.items() if k not in RECORD_HEADER})


def metrics_from_records(records: Sequence[dict]) -> tuple[list[TrainPoint], list[EvalPoint], list[str]]:
    """Training and evaluation points of ``log.json``, one per epoch, in epoch order.

    A ``train`` record of epoch 1 after others starts a new run in a reused folder: only the last
    run is kept. An epoch logged twice (re-trained after a crash and ``--resume``) keeps its later
    values. Evaluations of a checkpoint (``--exec_mode evaluate``, they carry ``checkpoint``) are
    not part of the training curves: they get a note."""
    notes: list[str] = []
    starts = [i for i, r in enumerate(records) if r.get("kind") == TRAIN and r.get("epoch") == 1]
    if len(starts) > 1:
        notes.append(f"{METRICS_LOG} holds {len(starts)} runs started at epoch 1: the last one is shown")
        records = records[starts[-1]:]
    train: dict[int, TrainPoint] = {}
    evals: dict[int, EvalPoint] = {}
    repeated: set[int] = set()
    for r in records:
        kind, epoch = r.get("kind"), r.get("epoch")
        if not isinstance(epoch, int):
            continue
        if kind == EVAL and "checkpoint" in r:
            notes.append(f"evaluation of checkpoint {r['checkpoint']}: mean_dice "
                         f"{_number(r.get('mean_dice')):.4f} (not drawn)")
        elif kind == TRAIN:
            if epoch in train:
                repeated.add(epoch)
            train[epoch] = _train_point(r)
        elif kind == EVAL:
            evals[epoch] = _eval_point(r)
    if repeated:
        notes.append(f"epochs {min(repeated)}-{max(repeated)} trained again after a resume: "
                     "the later values are shown")
    return ([train[e] for e in sorted(train)], [evals[e] for e in sorted(evals)], notes)


def final_result(records: Sequence[dict]) -> str | None:
    """The status of training's last ``result`` record in ``log.json`` (None: none, as in
    logs written before the record existed)."""
    results = [r for r in records if r.get("kind") == RESULT and isinstance(r.get("status"), str)]
    return results[-1]["status"] if results else None


def _last_int(events: Sequence[dict], key: str) -> int | None:
    values = [e.get("value") for e in events if e.get("key") == key]
    return values[-1] if values and isinstance(values[-1], int) and not isinstance(values[-1], bool) else None


def _run_int(head: Sequence[dict], body: Sequence[dict], key: str) -> int | None:
    """``key`` of the run: logged after its run_start (where the data is first read: the case
    and sample counts) or, by older versions, before it."""
    value = _last_int(body, key)
    return value if value is not None else _last_int(head, key)


def evaluation_times(events: Sequence[dict]) -> tuple[tuple[int, float], ...]:
    """``(epoch, seconds)`` of each evaluation: its eval_start to the eval_stop of its epoch."""
    starts: dict[int, float] = {}
    done = []
    for e in events:
        metadata = e.get("metadata") or {}
        epoch = metadata.get("epoch", metadata.get("epoch_num"))  # epoch_num: samples trained (older logs: epochs)
        if not isinstance(epoch, int) or not isinstance(e.get("time_ms"), (int, float)):
            continue
        if e.get("key") == EVAL_START:
            starts[epoch] = e["time_ms"]
        elif e.get("key") == EVAL_STOP and epoch in starts:
            done.append((epoch, (e["time_ms"] - starts.pop(epoch)) / 1000.0))
    return tuple(done)


def not_a_result(events: Sequence[dict]) -> tuple[str, ...]:
    """Why the attempt of ``events`` is not an MLPerf result: the events this project logs
    before ``run_start`` when the attempt resumed from a checkpoint or writes checkpoints on the
    clock (``runtime.run_log.MLPerfLogger.not_a_result``), and after it when a log that says
    closed turns out to run on data that is not KiTS19's (``MLPerfLogger.not_closed``); () for
    a result."""
    reasons = []
    for e in events:
        if e.get("key") == RESUMED_FROM_CHECKPOINT:
            metadata = e.get("metadata") or {}
            epoch = metadata.get("epoch")
            if metadata.get("weights_only"):
                reasons.append(f"started from the trained weights of {e.get('value')} (a warm start, "
                               "--load_ckpt_path)")
                continue
            reasons.append(f"resumed from the checkpoint {e.get('value')}"
                           + (f" after epoch {epoch}" if epoch is not None else "") + " (the clock was paused)")
        elif e.get("key") == CHECKPOINTS_ON_THE_CLOCK:
            reasons.append(f"wrote checkpoints between run_start and run_stop ({e.get('value')}; "
                           "--ckpt_during_run), which the reference's timed run does not")
        elif e.get("key") == NOT_CLOSED:
            reasons.append(f"logged closed, but not closed: {e.get('value')}")
    return tuple(reasons)


def attempts_from_events(events: Sequence[dict], path: str) -> tuple[Attempt, list[str]]:
    """The run of one MLPerf log: run_start, run_stop (time_ms, status) and the seed.

    A log holding several run_starts (a folder reused without ``--resume``) gives its last run."""
    name = os.path.basename(path)
    notes: list[str] = []
    starts = [i for i, e in enumerate(events) if e.get("key") == RUN_START]
    if len(starts) > 1:
        notes.append(f"{name} holds {len(starts)} run_starts: the last run is used")
    first = starts[-1] if starts else 0
    head = events[:first] if starts else events
    body = events[first:]
    seeds = [e.get("value") for e in head if e.get("key") == SEED]
    cache = [e.get("value") for e in head if e.get("key") == CACHE_CLEAR]
    divisions = [e.get("value") for e in head if e.get("key") == SUBMISSION_DIVISION]
    stops = [e for e in body if e.get("key") == RUN_STOP]
    times = [e["time_ms"] for e in body if isinstance(e.get("time_ms"), (int, float))]
    start_ms = body[0].get("time_ms") if starts else None
    stop = stops[-1] if stops else None
    if not starts:
        notes.append(f"{name}: no run_start (the run stopped during initialisation)")
    elif stop is None:
        notes.append(f"{name}: no run_stop (the run is still going, or it crashed)")
    status = (stop.get("metadata") or {}).get("status") if stop else None
    own = events[starts[-2] + 1:] if len(starts) > 1 else events  # the last run's lines, before and after run_start
    return Attempt(path=path, start_ms=start_ms, stop_ms=stop.get("time_ms") if stop else None,
                   status=status, last_ms=max(times) if times else None,
                   seed=seeds[-1] if seeds and isinstance(seeds[-1], int) else None,
                   notes=tuple(notes), global_batch=_run_int(head, body, GLOBAL_BATCH_SIZE),
                   samples_per_epoch=_run_int(head, body, SAMPLES_PER_EPOCH),
                   samples_trained_per_epoch=_run_int(head, body, SAMPLES_TRAINED_PER_EPOCH),
                   shapes={k: v[-1] for k in SHAPE_KEYS
                           for v in [[e.get("value") for e in events if e.get("key") == k]] if v},
                   train_samples=_run_int(head, body, TRAIN_SAMPLES),
                   evals=evaluation_times(body), not_a_result=not_a_result(own),
                   cache_clear=cache[-1] if cache else None, division=divisions[-1] if divisions else None), notes


def mlperf_logs(folder: str) -> list[str]:
    """``unet3d.log`` first, then the resumed attempts' logs in the order they were started
    (their names carry a sortable time)."""
    logs = [os.path.join(folder, MLPERF_LOG)] if os.path.isfile(os.path.join(folder, MLPERF_LOG)) else []
    return logs + sorted(glob.glob(os.path.join(glob.escape(folder), RESUMED_LOG_GLOB)))


def holds_run_files(folder: str) -> bool:
    """Whether ``folder`` itself holds a run's files (log.json or an MLPerf log)."""
    return os.path.isfile(os.path.join(folder, METRICS_LOG)) or bool(mlperf_logs(folder))


def previous_runs(folder: str) -> list[str]:
    """The ``previous-<time>`` folders of ``folder`` that hold a run's files: earlier attempts that
    a new run in the same ``--log_dir`` moved out of its way (``runtime.outputs.move_previous_run``),
    sorted by name (their time)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names
            if n.startswith(PREVIOUS_RUN_PREFIX) and os.path.isdir(os.path.join(folder, n))
            and holds_run_files(os.path.join(folder, n))]


def folder_runs(folder: str) -> list[str]:
    """Every attempt of the run folder ``folder``: its ``previous-*`` folders, then itself when
    it holds a run's files."""
    return previous_runs(folder) + ([folder] if holds_run_files(folder) else [])


def is_run_folder(folder: str) -> bool:
    return holds_run_files(folder) or bool(previous_runs(folder))


def _read_metrics(folder: str) -> tuple[list[TrainPoint], list[EvalPoint], str | None, list[str]]:
    """The points and the final result status of ``folder``'s log.json, and notes."""
    path = os.path.join(folder, METRICS_LOG)
    if not os.path.isfile(path):
        return [], [], None, [f"no {METRICS_LOG}: no curves"]
    records, read_notes = read_json_lines(path)
    train, evals, metric_notes = metrics_from_records(records)
    return train, evals, final_result(records), read_notes + metric_notes


def _read_attempts(folder: str) -> tuple[list[Attempt], list[str]]:
    """One attempt per MLPerf log of ``folder``, and notes."""
    attempts, notes = [], []
    for path in mlperf_logs(folder):
        events, read_notes = read_json_lines(path, prefix=MLLOG_PREFIX)
        attempt, attempt_notes = attempts_from_events(events, path)
        first = attempts[0].start_ms if attempts else None
        if first is not None and attempt.start_ms is not None and attempt.start_ms < first:
            # a folder reused by an older version of the program: an earlier run's resumed
            # attempt, not this run's (today a new run moves it into previous-<time>)
            notes.append(f"{os.path.basename(path)} started before {MLPERF_LOG}: an earlier run's attempt, "
                         "left out")
            continue
        attempts.append(attempt)
        notes += read_notes + attempt_notes
    if not attempts:
        notes.append(f"no {MLPERF_LOG}: no time to target or compliance verdict")
    elif len(attempts) > 1:
        notes.append(f"resumed: {len(attempts)} MLPerf logs (attempts); run time is their sum, gaps "
                     "between them left out (the clock was paused: the sum is no MLPerf result)")
    return attempts, notes


def load_run(folder: str, label: str | None = None) -> Run:
    """Everything ``folder`` holds about one run (see the module docstring for what is tolerated)."""
    train, evals, result, notes = _read_metrics(folder)
    attempts, attempt_notes = _read_attempts(folder)
    notes += attempt_notes
    if not train:
        notes.append("no training epoch logged yet")
    elif not evals:
        notes.append("no evaluation logged (the run stopped or is still before its first evaluation)")
    return Run(folder=folder, label=label or os.path.basename(os.path.abspath(folder)),
               train=tuple(train), evals=tuple(evals), attempts=tuple(attempts), notes=tuple(notes),
               result=result)


def find_runs(path: str, depth: int = SEARCH_DEPTH) -> list[str]:
    """``path`` itself when it holds a run, else the run folders below it (a sweep), sorted."""
    if is_run_folder(path):
        return [path]
    if depth <= 0 or not os.path.isdir(path):
        return []
    found = []
    for name in sorted(os.listdir(path)):
        child = os.path.join(path, name)
        # previous-*: an earlier attempt of its parent, read with it (folder_runs)
        if not name.startswith((".", PREVIOUS_RUN_PREFIX)) and os.path.isdir(child):
            found += find_runs(child, depth - 1)
    return found


def _name(folder: str) -> str:
    """A folder's name; ``<parent>/previous-<time>`` for an earlier attempt of a run folder."""
    path = os.path.abspath(folder)
    name = os.path.basename(path)
    return f"{os.path.basename(os.path.dirname(path))}/{name}" if name.startswith(PREVIOUS_RUN_PREFIX) else name


def run_labels(folders: Sequence[str], seeds: Sequence[int | None]) -> list[str]:
    """Folder names, or paths below the folders' common parent where names repeat; plus the seed."""
    names = [_name(f) for f in folders]
    if len(set(names)) < len(names):
        root = os.path.commonpath([os.path.abspath(f) for f in folders])
        names = [os.path.relpath(os.path.abspath(f), root) for f in folders]
    return [f"{n} (seed {s})" if s is not None else n for n, s in zip(names, seeds)]


def collect_runs(paths: Iterable[str]) -> tuple[list[Run], list[str]]:
    """The runs under ``paths`` (each folder once, each earlier attempt in its ``previous-*``
    folders a run of its own, labelled uniquely), and the paths without any."""
    folders: list[str] = []
    empty: list[str] = []
    for path in paths:
        found = [attempt for folder in find_runs(path) for attempt in folder_runs(folder)]
        if not found:
            empty.append(path)
        folders += [f for f in found if f not in folders]
    runs = [load_run(f) for f in folders]
    seeds = [next((a.seed for a in run.attempts if a.seed is not None), None) for run in runs]
    labels = run_labels(folders, seeds)
    return [dataclasses.replace(run, label=label) for run, label in zip(runs, labels)], empty
