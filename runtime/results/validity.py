"""Which MLPerf logs are results: the one rule that the report's score and the submission
package both apply (``runtime.results`` holds it; the report and ``runtime.submission.package`` import it).

A log is one of four kinds:

* ``result``: a timed run that reached the target (``run_stop`` status ``success``); it counts
  with its time.
* ``not converged``: a timed run that ran to its end without reaching the target (``run_stop``
  status ``aborted``: out of epochs, or diverged). MLPerf counts such a run, as a failed one:
  olympic scoring drops it as one of the slowest, the package checker accepts up to 4 of
  unet3d's 40, the RCP checker marks it "infinite". Leaving it out would choose runs by their
  outcome.
* ``failed``: an attempt that reached ``run_start`` and has no ``run_stop`` (crashed, killed:
  SIGKILL, a node lost, a job requeued; or still running). Every attempt counts ("a failed run
  counts as infinite"): packed as it is (its log fails the compliance checker, which the package
  checker accepts for up to 4 of unet3d's 40 files; the RCP checker and the result summarizer
  count it infinite), never hidden. An attempt that never reached ``run_start`` is no run.
* ``not a result``: anything else, left out of the score and of the package, with the reason:
  no MLPerf line, no or several ``run_start`` (stopped during initialisation: not a run; a reused
  log), a closed log whose ``cache_clear`` is not true (:func:`page_cache`: "You must flush the
  cache or restart the system prior to benchmarking"; an open log only gets a note), a run of
  several attempts, an attempt resumed
  from a checkpoint, one that wrote checkpoints on the clock, or one whose log says closed on
  data that is not KiTS19's (``not_closed``: synthetic, not 168/42) (``runtime/run_files.py``'s
  ``NOT_A_RESULT_EVENTS``, read by ``runtime.results.runs.not_a_result``: "The clock may not be
  paused during the run"; the reference's timed run writes none), a log of another
  benchmark, or one the official compliance checker rejects for anything but the target (a
  ``not converged`` run fails the closed checker's ``eval_accuracy >= 0.908`` test by definition).

Standard library only (the report reads runs without torch); the compliance verdict, when
there is one, comes from ``runtime.results.compliance`` (the official checker).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from data_loading.write_errors import failure_reason
from runtime import run_files as F
from runtime.results.runs import not_a_result

RESULT = "result"
NOT_CONVERGED = "not converged"
FAILED = "failed"
NOT_A_RESULT = "not a result"
INFINITE = (NOT_CONVERGED, FAILED)  # the kinds that count as infinite in the olympic score

# How to drop the page cache where users run, for the one line that says a run did not.
CACHE_FIX = ("drop it right before every run, after the data is written, and keep the data off tmpfs: as root, "
             "with passwordless `sudo -n sysctl vm.drop_caches=3` (run_and_time.sh and the SLURM jobs try both, "
             "after their copy), with scripts/slurm/prolog_drop_caches.sh as the SLURM `Prolog=` and the data read in "
             "place (STAGE=0), or in a container (non-root, it cannot) on the host before `apptainer exec`/`podman "
             "run`, passing UNET3D_CACHE_DROPPED_AT=$(date +%s); docs/submission.md, \"The page cache\"")

BENCHMARK = "unet3d"
# the compliance checker's problem lines that a run which did not reach the target fails by
# definition (closed_unet3d.yaml: ATLEAST_ONE_CHECK "v['value'] >= 0.908" on eval_accuracy)
TARGET_KEY = "eval_accuracy"


@dataclass(frozen=True)
class Validity:
    kind: str  # RESULT | NOT_CONVERGED | FAILED | NOT_A_RESULT
    reason: str = ""  # why, for anything but a result
    note: str = ""  # said, but no reason to leave the run out (an open run's cache_clear false)

    @property
    def counts(self) -> bool:
        """Whether the run belongs in the score and the package (converged, not converged, failed)."""
        return self.kind != NOT_A_RESULT

    @property
    def infinite(self) -> bool:
        """Whether the run counts as infinite in the score (not converged, or failed)."""
        return self.kind in INFINITE

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


def page_cache(division, cache_clear) -> tuple[str, str]:
    """``(reason, note)`` for a log's ``cache_clear`` (its last value; None: not logged) and
    ``submission_division``: a closed log that does not say ``true`` is not a result (the reason
    says how to drop the cache); an open one only gets the note; ``("", "")`` when it says true."""
    if cache_clear is True:
        return "", ""
    said = "cache_clear false" if cache_clear is False else "no cache_clear logged"
    text = (f"{said}: the data was not cold at the start of the run (\"You must flush the cache or restart the "
            "system prior to benchmarking\")")
    if division == "closed":
        return f"{text}; {CACHE_FIX}", ""
    return "", f"{text}; open division: said, not left out"


def classify(status: str | None, not_a_result: Sequence[str] = (), compliance_problems: Iterable[str] | None = None,
             starts: int = 1, attempts: int = 1) -> Validity:
    """The rule itself, on a run's facts: ``status`` its ``run_stop`` status (None: no
    run_stop), ``not_a_result`` the reasons its log gives (``runtime.results.runs.not_a_result``:
    resumed from a checkpoint, checkpoints written on the clock), ``compliance_problems`` the
    official compliance checker's problems (empty: passed; None: not run), ``starts`` its
    run_starts in one log, ``attempts`` its MLPerf logs (a resumed run has several).

    The report's score (``runtime.results.scoring.score_runs``) and the package apply it."""
    if not_a_result:
        return Validity(NOT_A_RESULT, "; ".join(not_a_result))
    if attempts > 1:
        return Validity(NOT_A_RESULT, f"{attempts} attempts (a resumed run: the clock may not be paused)")
    if starts == 0:
        return Validity(NOT_A_RESULT, "no run_start: not a run (it stopped during initialisation), not counted")
    if starts > 1:
        return Validity(NOT_A_RESULT, f"{starts} run_starts in one log (several runs in one file)")
    if status is None:  # the compliance checker fails such a log by definition (no run_stop)
        return Validity(FAILED, "no run_stop: the attempt crashed or was killed after run_start (or is still "
                                "running); counted as a failed run (infinite), as MLPerf counts it")
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
    divisions, cache = _values(events, "submission_division"), _values(events, F.CACHE_CLEAR)
    reason, note = page_cache(divisions[-1] if divisions else None, cache[-1] if cache else None)
    verdict = classify(status, list(not_a_result(events)) + ([reason] if reason else []), compliance_problems,
                       starts=sum(1 for e in events if e.get("key") == F.RUN_START))
    return Validity(verdict.kind, verdict.reason, note)


def judge_log(path: str, compliance_problems: Iterable[str] | None = None) -> Validity:
    """:func:`judge_events` of the MLPerf log at ``path`` (a missing or unreadable file is not a
    result)."""
    try:
        events = read_events(path)
    except OSError as error:
        return Validity(NOT_A_RESULT, f"cannot read {path}: {failure_reason(error)}")
    return judge_events(events, compliance_problems)
