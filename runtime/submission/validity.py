"""Which MLPerf logs are results: the one rule that the submission package and the report's
score both apply.

A log is one of three kinds:

* ``result``: a timed run that reached the target (``run_stop`` status ``success``); it counts
  with its time.
* ``not converged``: a timed run that ran to its end without reaching the target (``run_stop``
  status ``aborted``: out of epochs, or diverged). MLPerf counts such a run, as a failed one:
  olympic scoring drops it as one of the slowest, the package checker accepts up to 4 of
  unet3d's 40, the RCP checker marks it "infinite". Leaving it out would choose runs by their
  outcome.
* ``not a result``: anything else, left out of the score and of the package, with the reason:
  no MLPerf line, no or several ``run_start`` (stopped during initialisation, a reused log), no
  ``run_stop`` (crashed, killed, still running), a run of several attempts, an attempt resumed
  from a checkpoint, one that wrote checkpoints on the clock, or one whose log says closed on
  data that is not KiTS19's (``not_closed``: synthetic, not 168/42) (``runtime/run_files.py``'s
  ``NOT_A_RESULT_EVENTS``, read by ``runtime.report.runs.not_a_result``: "The clock may not be
  paused during the run"; the reference's timed run writes none), a log of another
  benchmark, or one the official compliance checker rejects for anything but the target (a
  ``not converged`` run fails the closed checker's ``eval_accuracy >= 0.908`` test by definition).

Standard library only (the report reads runs without torch); the compliance verdict, when
there is one, comes from ``runtime.report.compliance`` (the official checker).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from data_loading.write_errors import failure_reason
from runtime import run_files as F
from runtime.report.runs import not_a_result

RESULT = "result"
NOT_CONVERGED = "not converged"
NOT_A_RESULT = "not a result"

BENCHMARK = "unet3d"
# the compliance checker's problem lines that a run which did not reach the target fails by
# definition (closed_unet3d.yaml: ATLEAST_ONE_CHECK "v['value'] >= 0.908" on eval_accuracy)
TARGET_KEY = "eval_accuracy"


@dataclass(frozen=True)
class Validity:
    kind: str  # RESULT | NOT_CONVERGED | NOT_A_RESULT
    reason: str = ""  # why, for anything but a result

    @property
    def counts(self) -> bool:
        """Whether the run belongs in the score and the package (converged or not)."""
        return self.kind != NOT_A_RESULT

    def text(self) -> str:
        return self.kind + (f": {self.reason}" if self.reason else "")


def read_events(path: str) -> list[dict]:
    """The ``:::MLLOG`` events of ``path`` (lines that are not JSON objects are skipped: the
    compliance checker judges them)."""
    events = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            at = line.find(F.MLLOG_PREFIX)
            if at < 0:
                continue
            try:
                event = json.loads(line[at + len(F.MLLOG_PREFIX):])
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def _values(events: Sequence[dict], key: str) -> list:
    return [e.get("value") for e in events if e.get("key") == key]


def classify(status: str | None, not_a_result: Sequence[str] = (), compliance_problems: Iterable[str] | None = None,
             starts: int = 1, attempts: int = 1) -> Validity:
    """The rule itself, on a run's facts: ``status`` its ``run_stop`` status (None: no
    run_stop), ``not_a_result`` the reasons its log gives (``runtime.report.runs.not_a_result``:
    resumed from a checkpoint, checkpoints written on the clock), ``compliance_problems`` the
    official compliance checker's problems (empty: passed; None: not run), ``starts`` its
    run_starts in one log, ``attempts`` its MLPerf logs (a resumed run has several).

    The report's score (``runtime.report.scoring.score_runs``) and the package apply it."""
    if not_a_result:
        return Validity(NOT_A_RESULT, "; ".join(not_a_result))
    if attempts > 1:
        return Validity(NOT_A_RESULT, f"{attempts} attempts (a resumed run: the clock may not be paused)")
    if starts == 0:
        return Validity(NOT_A_RESULT, "no run_start (the run stopped during initialisation)")
    if starts > 1:
        return Validity(NOT_A_RESULT, f"{starts} run_starts in one log (several runs in one file)")
    if status is None:
        return Validity(NOT_A_RESULT, "no run_stop (the run crashed, was stopped, or is still running)")
    problems = list(compliance_problems) if compliance_problems is not None else []
    if status == "success":
        if problems:
            return Validity(NOT_A_RESULT, "the compliance checker failed it: " + "; ".join(problems))
        return Validity(RESULT)
    if status == "aborted":
        other = [p for p in problems if TARGET_KEY not in p]
        if other:
            return Validity(NOT_A_RESULT, "the compliance checker failed it: " + "; ".join(other))
        return Validity(NOT_CONVERGED, "run_stop status aborted: the target was not reached "
                                       "(counted as a failed run, as MLPerf counts it)")
    return Validity(NOT_A_RESULT, f"run_stop status {status!r} (MLPerf knows success and aborted)")


def judge_events(events: Sequence[dict], compliance_problems: Iterable[str] | None = None) -> Validity:
    """The kind of the run that ``events`` (one MLPerf log's, in order) record (:func:`classify`).

    ``compliance_problems``: the official compliance checker's problems for this log (empty: it
    passed), or None when it was not run (then only the log's own events are judged)."""
    if not events:
        return Validity(NOT_A_RESULT, "no MLPerf log line")
    benchmarks = _values(events, "submission_benchmark")
    if benchmarks and benchmarks[-1] != BENCHMARK:
        return Validity(NOT_A_RESULT, f"a log of benchmark {benchmarks[-1]!r}, not {BENCHMARK}")
    stops = [e for e in events if e.get("key") == F.RUN_STOP]
    status = (stops[-1].get("metadata") or {}).get("status") if stops else None
    return classify(status, not_a_result(events), compliance_problems,
                    starts=sum(1 for e in events if e.get("key") == F.RUN_START))


def judge_log(path: str, compliance_problems: Iterable[str] | None = None) -> Validity:
    """:func:`judge_events` of the MLPerf log at ``path`` (a missing or unreadable file is not a
    result)."""
    try:
        events = read_events(path)
    except OSError as error:
        return Validity(NOT_A_RESULT, f"cannot read {path}: {failure_reason(error)}")
    return judge_events(events, compliance_problems)
