"""The numbers of a run and of several: outcome, run time, time to target, best and reached
Dice, the time axis of the curves, and the MLPerf-style olympic score (unet3d's: 40 runs, the 4
fastest and the 4 slowest dropped; of more runs, the 40 consecutive ones the rules pick,
:func:`rules_window`)."""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from runtime.results import time_to_train as T
from runtime.results.compliance import Compliance
from runtime.results.runs import Attempt, EvalPoint, Run
from runtime.results.validity import Validity, classify, page_cache
from runtime.run_files import DIVERGED_DICE

SUBMISSION_RUNS = T.SUBMISSION_RUNS  # unet3d's result: 40 runs ...
DROPPED_EACH_END = T.DROPPED_EACH_END  # ... less the 4 fastest and the 4 slowest


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
    # the MLPerf time to train predicted at this run's speed (time_to_train.Prediction.as_dict)
    predicted: dict | None = None
    # why the run is not an MLPerf result (left out of the score): an attempt resumed from a
    # checkpoint, checkpoints written on the clock, several attempts; () for a result
    not_a_result: tuple[str, ...] = ()
    # the last MLPerf log's run_stop status (success | aborted; None: no run_stop); "" unknown
    mlperf_status: str | None = ""
    # the run's first run_start (ms since the Unix epoch; None: none), and whether its last MLPerf
    # log reached run_start (None: unknown)
    start_ms: int | None = None
    started: bool | None = None

    @property
    def is_result(self) -> bool:
        return not self.not_a_result


@dataclass(frozen=True)
class Score:
    minutes: float | None
    successful: int
    failed: int  # runs with an MLPerf log that did not reach the target (or have not yet)
    drop: int
    text: str
    # the labels of the runs the score is over (the rules' window of SUBMISSION_RUNS when more count)
    scored: tuple[str, ...] = ()


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
    """The first epoch with a non-finite loss or a mean Dice below ``DIVERGED_DICE`` (training's
    own test)."""
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


def window_scores(minutes: Sequence[float | None], runs: int = SUBMISSION_RUNS,
                  drop: int = DROPPED_EACH_END) -> list[float]:
    """The olympic score of every ``runs`` consecutive runs of ``minutes`` (in start order; None:
    a failed or not converged run, infinite): one per window, ``math.inf`` for a window with more
    failed runs than ``drop`` (no score)."""
    scores = []
    for first in range(len(minutes) - runs + 1):
        window = minutes[first:first + runs]
        times = [m for m in window if m is not None]
        score = olympic_score(times, len(window) - len(times), drop)
        scores.append(math.inf if score is None else score)
    return scores


def rules_window(minutes: Sequence[float | None], runs: int = SUBMISSION_RUNS, drop: int = DROPPED_EACH_END) -> int:
    """Of more than ``runs`` runs (``minutes`` in start order, None for a failed run), the first
    index of the ``runs`` consecutive ones whose olympic score is closest to the median of every
    such window's score (a failed run counts as infinite; a window with too many is infinite);
    the earliest window on a tie. The rules ("Benchmark Results", v4.0): the N consecutive runs
    by start time whose olympic score is closest to the median; read here as the median of the
    windows' scores (docs/submission.md, "Which runs are packed"). 0 for ``runs`` or fewer."""
    if len(minutes) <= runs:
        return 0
    scores = window_scores(minutes, runs, drop)
    middle = statistics.median(scores)
    distance = [0.0 if score == middle else abs(score - middle) for score in scores]
    return distance.index(min(distance))


def run_schedule(attempts: Sequence[Attempt]) -> tuple[T.Schedule | None, str]:
    """The schedule the run's MLPerf logs show: samples per epoch, the first evaluated epoch and
    the spacing of the evaluations; ``(None, why not)`` without them."""
    spe = next((a.samples_per_epoch for a in reversed(attempts) if a.samples_per_epoch), None)
    epochs = sorted({epoch for a in attempts for epoch, _ in a.evals})
    if spe is None:
        return None, "no samples_per_epoch in the MLPerf log"
    if len(epochs) < 2:
        return None, "fewer than 2 evaluations logged (the schedule's spacing is unknown)"
    every = min(b - a for a, b in zip(epochs, epochs[1:]))
    trained = next((a.samples_trained_per_epoch for a in reversed(attempts) if a.samples_trained_per_epoch), None)
    # the logged first evaluation, then every `every` epochs
    return T.Schedule(spe, epochs[0], every, trained), ""


def measured_differences(attempt: Attempt) -> list[str]:
    """What of ``attempt``'s run is not the benchmark's network, patch, window or overlap
    (``runtime.division.cost_reasons``): the shapes from its MLPerf log, the network from the
    flags its ``run_description.json`` recorded (a flag not given is the reference's default); a
    network not recorded is not judged."""
    from runtime.division import network_reasons, shape_reasons
    from runtime.run_files import RUN_DESCRIPTION

    shapes = attempt.shapes
    reasons = shape_reasons(tuple(shapes.get("training_input_shape") or (128, 128, 128)),
                            tuple(shapes.get("validation_input_shape") or (128, 128, 128)),
                            shapes.get("validation_overlap", 0.5))
    try:
        with open(os.path.join(os.path.dirname(attempt.path), RUN_DESCRIPTION), encoding="utf-8") as handle:
            flags = json.load(handle)["recipe"]["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        return reasons
    from runtime.config import Config

    given: dict[str, list[str]] = {}
    for token in flags:
        if token.startswith("--"):
            current = given.setdefault(token[2:], [])
        elif given:
            current.append(token)
    defaults = Config()
    network = dict(filters=tuple(int(f) for f in given["filters"]) if given.get("filters") else defaults.filters,
                   normalization=(given.get("normalization") or [defaults.normalization])[0],
                   activation=(given.get("activation") or [defaults.activation])[0])
    return network_reasons(network) + reasons


def predict_run(run: Run, throughput: float | None) -> tuple[dict | None, str | None]:
    """The MLPerf time to train predicted from ``run``'s own logs: its mean training throughput,
    median seconds per evaluation and schedule (``(prediction, None)``), or ``(None, a note)``.
    Only a run on KiTS19's 168 training cases gets one (the RCPs' data and schedule)."""
    attempts = run.attempts
    if not attempts:
        return None, None
    cases = next((a.train_samples for a in reversed(attempts) if a.train_samples), None)
    if cases != T.TRAIN_CASES:
        return None, (f"no predicted time to train: the run trained on {cases} cases, the RCPs on KiTS19's "
                      f"{T.TRAIN_CASES}" if cases else None)
    batch = next((a.global_batch for a in reversed(attempts) if a.global_batch), None)
    seconds = [s for a in attempts for _, s in a.evals if math.isfinite(s)]
    schedule, why = run_schedule(attempts)
    if batch is None or schedule is None or not seconds or not finite(throughput):
        missing = why or ("no global_batch_size" if batch is None else "no evaluation time" if not seconds
                          else "no training throughput in log.json")
        return None, f"no predicted time to train: {missing}"
    try:
        return T.predict(throughput, statistics.median(seconds), batch, schedule,
                         differs=measured_differences(attempts[-1])).as_dict(), None
    except T.TimeToTrainError as error:
        return None, str(error)


def run_not_a_result(run: Run) -> tuple[str, ...]:
    """Why ``run`` is not an MLPerf result, each reason naming its MLPerf log: its attempts'
    own events (``Attempt.not_a_result``) and, for logs written before those events existed, a
    run of several attempts (the clock may not be paused)."""
    reasons = [f"{os.path.basename(a.path)}: {why}" for a in run.attempts for why in a.not_a_result]
    reasons += [f"{os.path.basename(a.path)}: {why}" for a in run.attempts
                for why in [page_cache(a.division, a.cache_clear)[0]] if why]
    if len(run.attempts) > 1 and not any(a.not_a_result for a in run.attempts[1:]):
        reasons.append(f"{len(run.attempts)} attempts (a resumed run: the clock was paused)")
    return tuple(reasons)


def summarize_run(run: Run, threshold: float) -> RunSummary:
    best = best_eval(run.evals)
    status = run_outcome(run)
    notes = list(run.notes)
    bad = diverged_epoch(run)
    if bad is not None:
        notes.append(f"diverged at epoch {bad} (non-finite loss or mean Dice below {DIVERGED_DICE:g})")
    seconds = run_seconds(run.attempts)
    speeds = [p.throughput for p in run.train if math.isfinite(p.throughput)]
    mean_throughput = sum(speeds) / len(speeds) if speeds else None
    predicted, why_not = predict_run(run, mean_throughput)
    if why_not:
        notes.append(why_not)
    if predicted and predicted.get("not_the_benchmark"):
        notes.append("the predicted time to train is this configuration's, not the benchmark's: "
                     + "; ".join(predicted["not_the_benchmark"]))
    seeds = [a.seed for a in run.attempts if a.seed is not None]
    reasons = run_not_a_result(run)
    notes += [f"not an MLPerf result, left out of the score: {why}" for why in reasons]
    notes += [f"{os.path.basename(a.path)}: {note}" for a in run.attempts
              for note in [page_cache(a.division, a.cache_clear)[1]] if note]
    return RunSummary(
        folder=run.folder, label=run.label, status=status,
        epochs=run.train[-1].epoch if run.train else None, seed=seeds[0] if seeds else None,
        time_to_target_s=seconds if status == "success" else None, run_time_s=seconds,
        best_mean_dice=best.mean_dice if best else None, best_epoch=best.epoch if best else None,
        reached_epoch=reached_epoch(run.evals, threshold),
        mean_throughput=mean_throughput, attempts=len(run.attempts), notes=tuple(notes), predicted=predicted,
        not_a_result=reasons, mlperf_status=run.attempts[-1].status if run.attempts else None,
        start_ms=next((a.start_ms for a in run.attempts if a.start_ms is not None), None),
        started=run.attempts[-1].start_ms is not None if run.attempts else None)


def run_validity(summary: RunSummary) -> Validity:
    """Whether ``summary``'s run counts in the score, and why not (``validity.classify`` on its
    outcome, its reasons for not being a result and its compliance verdict when checked)."""
    status = summary.mlperf_status
    if status == "":  # a summary made without it: from the outcome
        status = {"success": "success", "incomplete": None, "no MLPerf log": None}.get(summary.status, "aborted")
    checked = [c for c in summary.compliance if c.checked]
    problems = [p for c in checked for p in c.problems] if checked else None
    return classify(status, summary.not_a_result, problems, starts=0 if summary.started is False else 1)


def score_runs(summaries: Sequence[RunSummary], drop: int = DROPPED_EACH_END, window: int = SUBMISSION_RUNS) -> Score:
    """The olympic score over the runs that have an MLPerf log and count, in minutes (MLPerf's
    unit): a run that did not reach the target, or crashed after run_start (no run_stop), counts
    as a failed run (infinite); a run that is not a result (``RunSummary.not_a_result``, or no
    run_start) is left out, and the text says which and why. Which runs count is
    ``run_validity``'s, the rule the submission package applies too
    (``runtime.results.validity``). Of more than ``window`` counted runs, the score is over
    the ``window`` consecutive ones (by start time) the rules pick (:func:`rules_window`)."""
    judged = [(s, run_validity(s)) for s in summaries if s.attempts]
    left_out = [(s, v) for s, v in judged if not v.counts]
    counted = sorted((s for s, v in judged if v.counts),
                     key=lambda s: (s.start_ms is None, s.start_ms or 0, s.folder))
    outside = []
    if len(counted) > window:
        minutes_in_order = [s.time_to_target_s / 60.0 if s.time_to_target_s is not None else None for s in counted]
        first = rules_window(minutes_in_order, window, drop)
        outside = counted[:first] + counted[first + window:]
        counted = counted[first:first + window]
    summaries = counted
    times = [s.time_to_target_s / 60.0 for s in summaries if s.time_to_target_s is not None]
    failed = sum(1 for s in summaries if s.time_to_target_s is None)
    minutes = olympic_score(times, failed, drop)
    need = 2 * drop + 1
    if failed > drop:
        text = (f"no score: {failed} runs did not reach the target (or crashed, or have not finished yet); dropping "
                f"{drop} at each end allows at most {drop}")
    elif minutes is None:
        counted_text = "that count (an MLPerf log, a result)" if left_out else "with an MLPerf log"
        text = (f"no score: {len(times) + failed} run(s) {counted_text}, {need} needed to drop "
                f"the {drop} fastest and {drop} slowest (real unet3d submissions: {SUBMISSION_RUNS} runs, "
                f"{DROPPED_EACH_END} dropped each end)")
    else:
        text = (f"score {minutes:.2f} min: mean of {len(times) + failed - 2 * drop} of {len(times) + failed} "
                f"runs after dropping the {drop} fastest and {drop} slowest"
                + (f" ({failed} failed run(s) counted as the slowest)" if failed else ""))
    if outside:
        text += (f"; of {len(outside) + window} counted runs, the {window} consecutive ones (by start) whose score "
                 f"is closest to the median of every {window} consecutive runs' score, as the rules pick: "
                 f"{summaries[0].label} to {summaries[-1].label}; not scored: "
                 + ", ".join(s.label for s in outside))
    if left_out:
        text += (f"; {len(left_out)} run(s) left out, not MLPerf results: "
                 + "; ".join(f"{s.label} ({v.reason})" for s, v in left_out))
    return Score(minutes, len(times), failed, drop, text, scored=tuple(s.label for s in summaries))
