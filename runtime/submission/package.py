"""Assemble an MLPerf Training submission package from run folders and check it with the
official tools.

    OUT/<org>/results/<system>/unet3d/result_<i>.txt   the counted runs' MLPerf logs (unet3d.log)
    OUT/<org>/systems/<system>.json                    the system description
    OUT/<org>/benchmarks/unet3d/implementations/<impl> the code the runs logged (git archive of their commit)
    OUT/<org>/benchmarks/unet3d/implementations/<system>/
                                    README.md, run_and_time.sh, <system>_<impl>.json: what ran, and its recipe
    OUT/report.md, OUT/report.json                     what was packed, left out and why; the
                                                       checkers' verdicts; the score
    OUT/checkers/                                      the checkers' own logs

<org>, <system>, the division and the status are the ones the runs logged
(``--submission_org``, ``--submission_platform``, ``--submission_division``,
``--submission_status``); every counted run must agree on them. Every attempt of every run
folder is judged, its ``previous-<time>/`` folders included (earlier attempts moved out of the way
of a rerun); a run is counted or left out by :mod:`runtime.results.validity`: a crashed attempt
(``run_start``, no ``run_stop``) is a failed run and is packed as it is. The counted runs are
packed in the order they started; of more than ``--expected_runs``, the consecutive ones whose
olympic score is closest to the median of every such window's (the rules' choice,
``runtime.results.scoring.rules_window``; never chosen by their outcome alone).
The system description,
the code and the recipe come from the runs' own records (:mod:`runtime.submission.what_ran`).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Sequence

from data_loading.write_errors import failure_reason
from runtime.results.compliance import check_compliance
from runtime.results.runs import find_runs, folder_runs, mlperf_logs
from runtime.results.scoring import DROPPED_EACH_END, SUBMISSION_RUNS, olympic_score, rules_window
from runtime.results.validity import NOT_A_RESULT, NOT_CONVERGED, RESULT, Validity, judge_events, read_events
from runtime.run_files import MLPERF_LOG, RUN_START, RUN_STOP, SEED_FROM_OS, SEED_SOURCE, UNVERIFIED
from runtime.submission import system as S
from runtime.submission import what_ran as W

RULESET = "4.0.0"  # the only ruleset whose checkers still know unet3d (retired after v4.0)
USAGE = "training"
BENCHMARK = "unet3d"
EXPECTED_RUNS = SUBMISSION_RUNS  # mlperf_logging.benchmark_meta: unet3d's result file count (40)
# DROPPED_EACH_END: olympic scoring of unet3d, the 4 fastest and the 4 slowest (from runtime.results.scoring)
IMPLEMENTATION = "pytorch-unet3d-kits19"
DEFAULT_ORG = "reference_implementation"  # main.py's --submission_org default (tests check they agree)
PACKAGE_CHECKER_SUCCESS = "PACKAGE CHECKER FOUND NO ERRORS, SUCCESS"
# the flags of main.py whose logged values name the package's folders and system description
METADATA_KEYS = {"submission_org": "--submission_org", "submission_platform": "--submission_platform",
                 "submission_division": "--submission_division", "submission_status": "--submission_status"}


class PackageError(Exception):
    """A user-facing problem: one line, exit code 1."""


@dataclass
class RunEntry:
    folder: str
    log: str | None
    validity: Validity
    start_ms: int | None = None
    stop_ms: int | None = None
    seed: int | None = None
    metadata: dict = field(default_factory=dict)
    global_batch: int | None = None
    seed_source: str | None = None  # the seed event's "source": os, given, or None (a log older than it)
    final_quality: float | None = None  # the last eval_accuracy (mean Dice): the run's final quality
    eval_samples: int | None = None
    packed_as: str | None = None
    note: str = ""

    @property
    def minutes(self) -> float | None:
        if self.validity.kind != RESULT or self.start_ms is None or self.stop_ms is None:
            return None
        return (self.stop_ms - self.start_ms) / 60000.0


def _last(events: Sequence[dict], key: str):
    values = [e.get("value") for e in events if e.get("key") == key]
    return values[-1] if values else None


def _time(events: Sequence[dict], key: str) -> int | None:
    times = [e.get("time_ms") for e in events if e.get("key") == key]
    return times[-1] if times and isinstance(times[-1], (int, float)) else None


def _seed_source(events: Sequence[dict]) -> str | None:
    seeds = [e for e in events if e.get("key") == "seed"]
    return ((seeds[-1].get("metadata") or {}).get(SEED_SOURCE)) if seeds else None


def hand_seeded(entries: Sequence[RunEntry], division: str) -> list[RunEntry]:
    """The packed runs of a closed package whose seed was not drawn from the OS (``given`` by
    hand; a log that does not say, written before the seed's source was logged, is listed too)."""
    if division != "closed":
        return []
    return [e for e in entries if e.packed_as and e.seed_source != SEED_FROM_OS]


def judge_folder(folder: str, check: bool = True, ruleset: str = RULESET) -> RunEntry:
    """One run folder: its MLPerf log judged (with the official compliance checker's verdict
    when ``check``). A folder with resumed attempts' logs holds no result."""
    logs = mlperf_logs(folder)
    main_log = os.path.join(folder, MLPERF_LOG)
    if not logs or logs[0] != main_log:
        return RunEntry(folder, None, Validity(NOT_A_RESULT, f"no {MLPERF_LOG}"))
    events = read_events(main_log)
    entry = RunEntry(folder, main_log, Validity(RESULT), start_ms=_time(events, RUN_START),
                     stop_ms=_time(events, RUN_STOP), seed=_last(events, "seed"),
                     metadata={k: _last(events, k) for k in METADATA_KEYS},
                     global_batch=_last(events, "global_batch_size"), seed_source=_seed_source(events),
                     final_quality=_last(events, "eval_accuracy"), eval_samples=_last(events, "eval_samples"))
    if len(logs) > 1:
        entry.validity = Validity(NOT_A_RESULT, f"resumed: {len(logs) - 1} later attempt(s) in "
                                                f"{', '.join(os.path.basename(p) for p in logs[1:])} (the clock "
                                                "may not be paused during a run)")
        return entry
    problems = None
    if check:
        verdict = check_compliance(main_log, ruleset)
        if not verdict.checked:
            raise PackageError(f"the compliance checker could not check {main_log}: {'; '.join(verdict.problems)}")
        problems = verdict.problems
    entry.validity = judge_events(events, problems)
    entry.note = entry.validity.note
    return entry


def _start_order(entry: RunEntry):
    return (entry.start_ms is None, entry.start_ms or 0, entry.folder)


def _agreed(entries: Sequence[RunEntry], key: str) -> str:
    values = {}
    for entry in entries:
        values.setdefault(entry.metadata.get(key), entry.folder)
    if len(values) > 1:
        (a, fa), (b, fb) = list(values.items())[:2]
        raise PackageError(f"the runs disagree on {key}: {a!r} in {fa}, {b!r} in {fb} (one package holds one "
                           f"system's runs of one division; {METADATA_KEYS[key]} sets it)")
    value = next(iter(values))
    if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
        raise PackageError(f"{key} {value!r} (logged by {next(iter(values.values()))}) cannot name a folder of the "
                           f"package: run with {METADATA_KEYS[key]} NAME")
    return value


def _empty_output(output: str) -> None:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise PackageError(f"--output {output} exists and is not an empty folder: the package is written into a "
                           "new one (nothing already there is replaced)")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as error:
        raise PackageError(f"cannot create --output {output}: {failure_reason(error)}") from None


def _code_files(repo: str) -> list[str]:
    """The checkout's tracked files (``git ls-files``), else every file of the project's folders."""
    try:
        proc = subprocess.run(["git", "-C", repo, "ls-files", "-z"], capture_output=True, timeout=30)
        if proc.returncode == 0 and proc.stdout:
            return [name for name in proc.stdout.decode().split("\0") if name and
                    os.path.isfile(os.path.join(repo, name))]
    except (OSError, subprocess.TimeoutExpired):
        pass
    files = []
    for top in ("main.py", "preprocess_dataset.py", "run_and_time.sh", "requirements.txt", "LICENSE", "README.md",
                "data_loading", "model", "runtime", "scripts"):
        path = os.path.join(repo, top)
        if os.path.isfile(path):
            files.append(top)
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            files += [os.path.relpath(os.path.join(root, n), repo) for n in names]
    return files


def copy_code(destination: str) -> int:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = _code_files(repo)
    for name in files:
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(repo, name), target)
    return len(files)


def _not_the_default_org(org: str, entries: Sequence[RunEntry]) -> None:
    if org == DEFAULT_ORG:
        raise PackageError(f"submission_org {org!r} (logged by {entries[0].folder}) is main.py's default, not a "
                           "submitter: run with --submission_org YOUR_ORG")


def _what_ran(entries: Sequence[RunEntry], names: tuple[str, str, str, str], system_fields: dict | None,
              nodes: int | None, packing_host: bool, code: bool,
              repo: str | None) -> tuple[W.WhatRan, dict, W.CodeSource | None]:
    """The packed runs' records, checked to agree, the system description made from them
    (``names``: org, system, division, status) and where the code they ran is; before anything
    is written."""
    try:
        what = W.read_records([os.path.dirname(e.log) if e.log else e.folder for e in entries], packing_host)
        description = W.system_description(what, *names, system_fields, nodes, entries[0].folder)
        return what, description, (W.code_source(what, repo or W.H.ROOT) if code else None)
    except W.RecordError as error:
        raise PackageError(str(error)) from None


def _write_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2)
        handle.write("\n")


def _write_implementation(what: W.WhatRan, source: W.CodeSource | None, benchmarks: str, description: dict,
                          system_name: str, batches: Sequence[int], packed: int) -> tuple[int, list[str]]:
    """The code (``source``; None: ``--no_code``) in ``<benchmarks>/implementations/<impl>`` and
    the system's README, launch script and recipe beside it: (code files, paths written)."""
    implementations = os.path.join(benchmarks, "implementations")
    files = W.pack_code(source, os.path.join(implementations, IMPLEMENTATION), copy_code) if source else 0
    said = source.said if source else "not packed (--no_code)"
    written = W.write_implementation(os.path.join(implementations, system_name), what, description, system_name,
                                     IMPLEMENTATION, batches, packed, said)
    return files, written


def _python(code_or_module: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, *code_or_module], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(code_or_module, -1, "", f"timed out after {timeout:.0f} s")


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1]


def _lines(text: str, level: str) -> list[str]:
    return [line.split(" - ", 1)[1].strip() for line in text.splitlines()
            if line.startswith(f"{level} - ") and line.split(" - ", 1)[1].strip()]


# The official result summarizer on a copy of the package (its RCP pass may write scaling.json into
# the results, and it writes summary.json where it runs): its unet3d score and scaling factor, and
# the lines it printed, as JSON on the last line.
RESULT_SUMMARIZER = """
import contextlib, io, json, sys
from mlperf_logging.result_summarizer.result_summarizer import summarize_results
said = io.StringIO()
with contextlib.redirect_stdout(said):
    strong, _, detailed, _ = summarize_results(sys.argv[1], sys.argv[2], sys.argv[3])
rows, details = strong.to_dict("records"), detailed.to_dict("records")
def number(value):
    return None if value is None or value != value else float(value)
print(said.getvalue())
print(json.dumps({"minutes": number(rows[0].get("unet3d")) if rows else None,
                  "scaling": number(details[0].get("unet3d:rcp_scaling_factor")) if details else None}))
"""

SEED_CHECKER = """
import logging, sys, warnings
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s - %(message)s")
warnings.simplefilter("always")
logging.captureWarnings(True)
from mlperf_logging.package_checker.seed_checker import SeedChecker
sys.exit(0 if SeedChecker(sys.argv[1]).check_seeds(sys.argv[2:]) else 1)
"""


def _package_verdict(proc: subprocess.CompletedProcess, text: str) -> dict:
    passed = proc.returncode == 0 and PACKAGE_CHECKER_SUCCESS in text
    return {"passed": passed, "summary": "no errors, SUCCESS" if passed else "found errors",
            "errors": _lines(text, "ERROR") or ([] if passed else [_last_line(proc.stderr)]),
            "warnings": _lines(text, "WARNING")}


def _rcp_verdict(proc: subprocess.CompletedProcess, text: str) -> dict:
    return {"passed": proc.returncode == 0,
            "summary": ((_lines(text, "INFO") + _lines(text, "ERROR")) or [proc.stderr.strip() or "no output"])[-1],
            "errors": _lines(text, "ERROR"), "warnings": _lines(text, "WARNING"),
            "details": [line for line in _lines(text, "INFO") if "RCP Record" in line or "Submission mean" in line]}


def _seed_verdict(proc: subprocess.CompletedProcess, text: str) -> dict:
    return {"passed": proc.returncode == 0,
            "summary": "every run logs its own seed" if proc.returncode == 0 else "failed",
            "errors": _lines(text, "ERROR") or ([] if proc.returncode == 0 else [_last_line(proc.stderr)]),
            "warnings": _lines(text, "WARNING")}


@dataclass(frozen=True)
class Checked:
    """The package as the checkers are given it: its org folder, its results folder, the ruleset."""
    org_folder: str
    results: str
    ruleset: str

    def result_files(self) -> list[str]:
        return sorted(os.path.join(self.results, n) for n in os.listdir(self.results) if n.startswith("result_"))


@dataclass(frozen=True)
class Checker:
    """An official checker: ``python``'s arguments for it (given the package and its log's path),
    whether it writes that log itself (``--log_output``; else its stdout and stderr are kept there)
    and how its verdict reads (``verdict(process, its log's text)``: passed, summary, errors,
    warnings and maybe details)."""
    name: str
    arguments: Callable[[Checked, str], list[str]]
    verdict: Callable[[subprocess.CompletedProcess, str], dict]
    writes_its_log: bool = True


CHECKERS = (
    Checker("package_checker", lambda p, log: ["-m", "mlperf_logging.package_checker", os.path.abspath(p.org_folder),
                                               USAGE, p.ruleset, "--log_output", log], _package_verdict),
    Checker("rcp_checker", lambda p, log: ["-m", "mlperf_logging.rcp_checker", os.path.abspath(p.results),
                                           "--rcp_usage", USAGE, "--rcp_version", p.ruleset, "--log_output", log],
            _rcp_verdict),
    Checker("seed_checker", lambda p, log: ["-c", SEED_CHECKER, p.ruleset, *p.result_files()], _seed_verdict,
            writes_its_log=False),
)


def run_checkers(output: str, org_folder: str, results: str, ruleset: str, timeout: float = 1800) -> dict:
    """The official checkers of :data:`CHECKERS` (package, RCP, seed) on the package: {name:
    {"passed", "log", "summary", "errors", "warnings"[, "details"]}}; each in a process of its own
    (they configure the root logger), its log in ``<output>/checkers/<name>.log``."""
    logs = os.path.join(output, "checkers")
    os.makedirs(logs, exist_ok=True)
    package, verdicts = Checked(org_folder, results, ruleset), {}
    for checker in CHECKERS:
        log = os.path.join(logs, f"{checker.name}.log")
        proc = _python(checker.arguments(package, log), logs, timeout)
        text = proc.stderr if checker.writes_its_log else proc.stdout  # the seed checker logs to stdout
        if checker.writes_its_log and os.path.isfile(log):
            with open(log, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        elif not checker.writes_its_log:
            with open(log, "w", encoding="utf-8") as handle:
                handle.write(proc.stdout + proc.stderr)
        verdict = checker.verdict(proc, text)
        verdicts[checker.name] = {"passed": verdict.pop("passed"), "log": log, **verdict}
    return verdicts


def run_summarizer(output: str, org_folder: str, ruleset: str, timeout: float = 1800) -> dict:
    """mlperf-logging's result summarizer on a copy of ``org_folder``: {"minutes" (its unet3d score,
    None when it gives none), "scaling" (the RCP factor it multiplied by), "ran" (False: it could
    not run, "summary" says why), "summary", "log"}."""
    logs = os.path.join(output, "checkers")
    os.makedirs(logs, exist_ok=True)
    log = os.path.join(logs, "result_summarizer.log")
    with tempfile.TemporaryDirectory() as scratch:
        copy = os.path.join(scratch, os.path.basename(org_folder))
        shutil.copytree(org_folder, copy)
        proc = _python(["-c", RESULT_SUMMARIZER, copy, USAGE, ruleset], scratch, timeout)
    with open(log, "w", encoding="utf-8") as handle:
        handle.write(proc.stdout + proc.stderr)
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (ValueError, IndexError):
        found = None
    if not isinstance(found, dict):
        return {"ran": False, "minutes": None, "scaling": None, "log": log,
                "summary": f"could not run: {_last_line(proc.stderr or proc.stdout)}"}
    minutes = found.get("minutes")
    return {"ran": True, "minutes": minutes, "scaling": found.get("scaling"), "log": log,
            "summary": f"{minutes:.4f} min" if minutes is not None else "no score"}


def compare_scores(minutes: float | None, summarized: dict, packed: Sequence[RunEntry]) -> str:
    """The tool's score beside the summarizer's, and why they differ, in words."""
    if not summarized.get("ran"):
        return f"the official result summarizer {summarized['summary']}"
    theirs, factor = summarized["minutes"], summarized.get("scaling") or 1.0
    mine = "no score" if minutes is None else f"{minutes:.4f} min"
    said = f"this command: {mine}; the official result summarizer: {summarized['summary']}"
    if theirs is None and minutes is None:
        return f"{said}: they agree"
    if theirs is not None and minutes is not None and math.isclose(theirs, minutes * factor, rel_tol=1e-6):
        if factor == 1.0:
            return f"{said}: they agree"
        return (f"{said}: the summarizer multiplies by the RCP checker's normalisation factor {factor:.4f} (the runs "
                "converged faster than the RCP's mean, within its allowed speed-up); this command does not normalise")
    aborted = [e for e in packed if e.validity.kind == NOT_CONVERGED]
    if minutes is None and theirs is not None and aborted:
        return (f"{said}: {len(aborted)} packed run(s) stopped without reaching the target (run_stop aborted). The "
                "summarizer drops only logs that fail the compliance checker, and the open division's rules do not "
                "check the target, so it scores their time from run_start to run_stop as if they had converged; the "
                "rules count a run that does not reach the target as failed (\"A run is classified as non-converged "
                "if the target quality metric is not reached\"), and unet3d allows at most 4: no score")
    return f"{said}: they differ, and this command cannot tell why; read the summarizer's log"


def final_quality(packed: Sequence[RunEntry]) -> dict:
    """The geometric mean of the packed runs' final quality, the closed quality measure (each run's
    last eval_accuracy: mean Dice of kidney and tumour over the evaluation cases), which the rules
    ask open results to report (``training_rules.adoc``, "Quality measure": "the reported results
    must include the geometric mean of the final quality as measured by the closed quality
    measure"); runs without an evaluation are named, not counted."""
    values = [e.final_quality for e in packed if isinstance(e.final_quality, (int, float))]
    missing = [e.packed_as for e in packed if not isinstance(e.final_quality, (int, float))]
    cases = sorted({e.eval_samples for e in packed if e.eval_samples is not None})
    if not values:
        mean = None
    elif min(values) <= 0:
        mean = 0.0
    else:
        mean = math.exp(sum(math.log(v) for v in values) / len(values))
    return {"geometric_mean": mean, "runs": len(values), "without_evaluation": missing, "eval_samples": cases}


def not_checked(division: str, verdicts: dict) -> list[str]:
    """What the official checkers do not check for this package (said in the report)."""
    items = []
    if division == "open":
        items.append("the package checker runs the seed and RCP checks on closed-division packages only: both were "
                     "run here on their own, and their verdicts do not decide an open package")
    items += [
        "the compliance checker (ruleset 4.0.0) checks that keys exist, not what they mean: that a closed run used "
        "the reference's model, loss, data and fixed hyper-parameters is this project's division rule, in resolve()",
        "when the clock started: that no dataset file was opened before run_start, that the clock was not paused "
        "(a resumed attempt) and that nothing was written on it (this project logs resumed_from_checkpoint and "
        "checkpoints_on_the_clock, and this command leaves such runs out)",
        "that every attempt is here and the runs are not chosen by outcome: this command reads every run folder "
        "given and its previous-* attempts, packs a crashed attempt as a failed run, and of more runs than the "
        "package holds packs the consecutive ones (by start) whose score is closest to the median of every such "
        "window's; runs kept elsewhere it cannot see",
        "the system description's values: only that every field exists and the status is one of four (this command "
        "fills them from the runs' own records, run_description.json, packed beside the results, refuses runs that "
        "disagree and --system_fields that contradict them, and lists every field --system_fields changed); fields "
        "the machines could not tell are listed below",
        "that the code in benchmarks/ is the code that ran: the checker only lists its source files (this command "
        "packs the commit the runs logged, checked against the hash of the files that ran)",
        "that the logs' submission_org and submission_platform match the package's folders (this command names "
        "the folders after them)",
    ]
    return items


def _score(entries: Sequence[RunEntry]) -> tuple[float | None, str]:
    times = [e.minutes for e in entries if e.minutes is not None]
    failed = sum(1 for e in entries if e.validity.infinite)
    minutes = olympic_score(times, failed, DROPPED_EACH_END)
    if minutes is None:
        return None, (f"no score: {len(times)} converged and {failed} failed or not converged run(s) packed; unet3d's "
                      f"score needs {EXPECTED_RUNS} runs with at most {DROPPED_EACH_END} failed or not converged")
    return minutes, (f"score {minutes:.2f} min: mean of the {len(times) + failed - 2 * DROPPED_EACH_END} runs left "
                     f"after dropping the {DROPPED_EACH_END} fastest and {DROPPED_EACH_END} slowest of "
                     f"{len(times) + failed}" + (f" ({failed} failed or not converged, counted as the slowest)"
                                                 if failed else "")
                     + "; not normalised by the RCP checker's factor")


def run_folders(paths: Sequence[str]) -> list[str]:
    """Every attempt under ``paths``: each run folder and its ``previous-*`` folders, once each."""
    return sorted({os.path.abspath(a) for path in paths for f in find_runs(path) for a in folder_runs(f)})


def choose_runs(counted: Sequence[RunEntry], expected: int) -> list[RunEntry]:
    """The counted runs (in start order) that the package holds: all of them, or of more than
    ``expected``, the ``expected`` consecutive ones the rules pick (``rules_window``; a failed or
    not converged run infinite); the others get a note."""
    first = rules_window([e.minutes if not e.validity.infinite else None for e in counted], expected,
                         DROPPED_EACH_END)
    chosen = list(counted[first:first + expected])
    if len(counted) > expected:
        span = f"runs {first + 1}-{first + expected} of the {len(counted)} counted, in start order"
        for entry in counted:
            if entry not in chosen:
                entry.note = (f"not packed: outside the {expected} consecutive runs the rules pick ({span}: their "
                              f"score is the closest to the median of every {expected} consecutive runs' score)")
    return chosen


def assemble(paths: Sequence[str], output: str, ruleset: str = RULESET, expected: int = EXPECTED_RUNS,
             system_fields: dict | None = None, nodes: int | None = None, check: bool = True, code: bool = True,
             say: Callable[[str], None] = print, packing_host: bool = False, repo: str | None = None) -> dict:
    """Judge the runs under ``paths``, write the package into the new folder ``output``, run
    the official checkers (``check``) and write the report. Returns the report's dict.
    ``packing_host``: runs without a record described by this machine; ``repo``: the checkout
    whose git history holds the runs' commit (default: this project's)."""
    folders = run_folders(paths)
    missing = [p for p in paths if not find_runs(p)]
    if not folders:
        raise PackageError("no run folder (one with unet3d.log or log.json) in or below " + ", ".join(paths))
    entries = sorted((judge_folder(f, check, ruleset) for f in folders), key=_start_order)
    counted = [e for e in entries if e.validity.counts]
    if not counted:
        raise PackageError(f"none of the {len(entries)} run(s) is a result: " + "; ".join(
            f"{os.path.basename(e.folder)}: {e.validity.reason}" for e in entries[:3]))
    org = _agreed(counted, "submission_org")
    system_name = _agreed(counted, "submission_platform")
    division = _agreed(counted, "submission_division")
    status = _agreed(counted, "submission_status")
    _not_the_default_org(org, counted)
    chosen = choose_runs(counted, expected)
    # the runs packed must agree on what ran; a run outside the rules' window is not in the package
    what, description, source = _what_ran(chosen, (org, system_name, division, status), system_fields, nodes,
                                          packing_host, code, repo)
    _empty_output(output)
    results = os.path.join(output, org, "results", system_name, BENCHMARK)
    os.makedirs(results)
    records = []
    for index, entry in enumerate(chosen):
        entry.packed_as = f"result_{index}.txt"
        shutil.copyfile(entry.log, os.path.join(results, entry.packed_as))
        # the run's own record of its machine, software, code and recipe, beside its result
        record = W.record_path(os.path.dirname(entry.log))
        if os.path.isfile(record):
            records.append(f"run_description_{index}.json")
            shutil.copyfile(record, os.path.join(results, records[-1]))
    packed = [e for e in counted if e.packed_as]
    batches = sorted({e.global_batch for e in packed if e.global_batch is not None})
    description_path = os.path.join(output, org, "systems", f"{system_name}.json")
    _write_json(description_path, description)
    unknown = sorted(set(system_fields or {}) - set(S.REQUIRED_FIELDS))
    code_files, implementation_files = _write_implementation(
        what, source, os.path.join(output, org, "benchmarks", BENCHMARK), description, system_name, batches,
        len(packed))
    verdicts = run_checkers(output, os.path.join(output, org), results, ruleset) if check else {}
    minutes, score_text = _score(packed)
    summarized = run_summarizer(output, os.path.join(output, org), ruleset) if check else None
    report = {
        "output": output, "package": os.path.join(output, org), "ruleset": ruleset, "org": org,
        "system": system_name, "division": division, "status": status, "expected_runs": expected,
        "global_batch_sizes": batches, "system_description": description_path,
        "system_fields_to_fill": S.unfilled(description), "unknown_system_fields": unknown,
        "code_files": code_files, "code": source.said if source else "not packed (--no_code)",
        "system_from": what.source, "what_ran_notes": what.notes, "implementation_files": implementation_files,
        "system_fields_changed": [{"field": f, "measured": m, "given": g} for f, m, g in what.changed],
        "run_descriptions": records,
        "score_minutes": minutes, "score": score_text, "checkers": verdicts,
        "result_summarizer": summarized,
        "summarizer_comparison": compare_scores(minutes, summarized, packed) if summarized else "",
        "final_quality": final_quality(packed),
        "not_checked": not_checked(division, verdicts), "paths_without_runs": missing,
        "runs": [{"folder": e.folder, "kind": e.validity.kind, "reason": e.validity.reason, "seed": e.seed,
                  "seed_source": e.seed_source, "minutes": e.minutes, "packed_as": e.packed_as, "note": e.note,
                  "start_ms": e.start_ms}
                 for e in entries],
        "hand_seeded": [e.packed_as for e in hand_seeded(entries, division)],
    }
    report["accepted"] = bool(verdicts) and verdicts["package_checker"]["passed"]
    write_report(report)
    return report


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _run_name(folder: str) -> str:
    """A run folder's name; ``<folder>/previous-<time>`` for an earlier attempt in it."""
    name = os.path.basename(folder)
    return f"{os.path.basename(os.path.dirname(folder))}/{name}" if name.startswith("previous-") else name


def report_markdown(report: dict) -> str:
    runs = report["runs"]
    packed = [r for r in runs if r["packed_as"]]
    left = [r for r in runs if not r["packed_as"]]
    lines = [f"# MLPerf Training {report['ruleset']} submission package: {report['org']} / {report['system']} / "
             f"{BENCHMARK}", "",
             f"Package: `{report['package']}` ({report['division']} division, status {report['status']}). "
             f"{len(packed)} run(s) packed of the {report['expected_runs']} unet3d needs; "
             f"{len(left)} left out. Global batch size(s): {', '.join(map(str, report['global_batch_sizes'])) or '?'}.",
             "", f"**{report['score']}**", ""]
    if report.get("summarizer_comparison"):
        lines += [f"Score beside mlperf-logging's result summarizer (log `{report['result_summarizer']['log']}`): "
                  f"{report['summarizer_comparison']}.", ""]
    quality = report.get("final_quality") or {}
    if report["division"] == "open" and quality:
        mean = quality["geometric_mean"]
        cases = quality["eval_samples"]
        on = "" if cases in ([], [42]) else (f" (measured on {', '.join(map(str, cases))} evaluation cases, not "
                                              "KiTS19's 42)")
        lines += ["**Final quality (open division): geometric mean of the packed runs' last mean Dice, the closed "
                  f"quality measure: {'none' if mean is None else f'{mean:.4f}'}** over {quality['runs']} run(s)"
                  + on + (f"; without an evaluation, not counted: {', '.join(quality['without_evaluation'])}"
                          if quality["without_evaluation"] else "")
                  + " (`training_rules.adoc`, \"Quality measure\": open results report it).", ""]
    if report.get("accepted") and report.get("score_minutes") is None:
        lines += ["The package checker accepted the package, but it has **no score** (exit code 5).", ""]
    lines += [UNVERIFIED, "", "## The official checkers", ""]
    if not report["checkers"]:
        lines.append("Not run (`--no_check`).")
    for name, verdict in report["checkers"].items():
        aside = " (informational: the package checker applies it to closed packages only)" \
            if report["division"] == "open" and name != "package_checker" else ""
        lines.append(f"- **{name}**: {'PASS' if verdict['passed'] else 'FAIL'}{aside} ({_cell(verdict['summary'])}); "
                     f"log `{verdict['log']}`")
        lines += [f"  - error: {_cell(e)}" for e in verdict["errors"][:10]]
        lines += [f"  - {_cell(d)}" for d in verdict.get("details", [])[:4]]
    hand = [r for r in runs if r["packed_as"] in report.get("hand_seeded", [])]
    if hand:
        lines += ["", f"**Seeds not drawn from the OS** ({len(hand)} closed run(s)): the rules want closed-division "
                      "seeds from the clock, the OS's randomness or an RNG seeded from them (`training_rules.adoc`, "
                      "\"Random numbers\"); the seed checker checks only that they differ: "
                  + ", ".join(f"{r['packed_as']} ({_run_name(r['folder'])}, seed {r['seed']}, "
                              f"{'given by hand' if r['seed_source'] else 'its source not logged'})" for r in hand)
                  + "."]
    lines += ["", "## What the checkers could not check", ""] + [f"- {item}" for item in report["not_checked"]]
    source = ("the runs' own records (run_description.json)" + (", with the fields below given by --system_fields"
                                                                if report.get("system_fields_changed") else "")) \
        if report.get("system_from") == "runs" else \
        f"the packing host ({W.PACKING_HOST_FLAG})"
    lines += ["", f"System description from {source}; code: "
                  f"{_cell(report.get('code', ''))}; what ran and how to run it again: "
                  f"`benchmarks/{BENCHMARK}/implementations/{report['system']}/README.md`."]
    lines += [f"- {_cell(note)}" for note in report.get("what_ran_notes", [])]
    changed = report.get("system_fields_changed") or []
    if changed:
        lines += ["", f"`--system_fields` changed {len(changed)} field(s) of what the runs' records tell (also in the "
                      "description's `hw_notes` / `sw_notes`):", "", "| field | measured (the runs' records) | given |",
                  "| --- | --- | --- |"]
        lines += [f"| `{c['field']}` | {_cell(c['measured'])} | {_cell(c['given'])} |" for c in changed]
    if report.get("run_descriptions"):
        lines += ["", f"The runs' records (`run_description_<i>.json`, one per `result_<i>.txt`) are packed beside "
                      f"their results; the package checker warns of files there that are not `result_*.txt`: these."]
    if report["system_fields_to_fill"]:
        lines += ["", f"System description fields the machines could not tell, left empty in "
                      f"`{report['system_description']}` (give them with `--system_fields FILE.json`): "
                      + ", ".join(f"`{f}`" for f in report["system_fields_to_fill"]) + "."]
    lines += ["", "## Runs", "", "| run | seed | outcome | minutes | packed as | why |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        minutes = f"{r['minutes']:.2f}" if r["minutes"] is not None else ""
        why = "; ".join(text for text in (r["reason"], r["note"]) if text)
        lines.append(f"| {_cell(_run_name(r['folder']))} | {r['seed'] if r['seed'] is not None else ''} | "
                     f"{r['kind']} | {minutes} | {r['packed_as'] or ''} | {_cell(why)} |")
    if report["paths_without_runs"]:
        lines += ["", "Paths without any run: " + ", ".join(report["paths_without_runs"])]
    return "\n".join(lines) + "\n"


def write_report(report: dict) -> tuple[str, str]:
    md = os.path.join(report["output"], "report.md")
    js = os.path.join(report["output"], "report.json")
    for path, text in ((md, report_markdown(report)), (js, json.dumps(report, indent=2) + "\n")):
        with tempfile.NamedTemporaryFile("w", dir=report["output"], delete=False, encoding="utf-8") as handle:
            handle.write(text)
        os.replace(handle.name, path)
    return md, js
