"""Every attempt counted, the page cache, the rules' window of 40, the score of unet3d (issue 48,
items 3, 4 and 10).

The MLPerf logs are written here by hand (``test_report.mlperf_lines``: complete 4.0.0 logs) with
chosen start times and durations, so each answer is known. Oracles: the rules' text (a failed
run counts as infinite; of M > N runs, the N consecutive ones whose olympic score is closest to
the median; "You must flush the cache or restart the system prior to benchmarking"), the
official RCP checker's reading of a packed log, and a brute force over the windows written from
that text."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from runtime.results import time_to_train as T
from runtime.results import validity as V
from runtime.report.cli import make_report, parse_args
from runtime.submission.package import PackageError, assemble
from test_report import T0_MS, mlperf_lines

MINUTE_MS = 60_000
HOUR_MS = 3_600_000


def write_log(folder: Path, start_ms: int, minutes: float | None, seed: int, *, status: str = "success",
              division: str = "closed", cache: bool | None = True) -> Path:
    """``folder/unet3d.log``: a run started at ``start_ms`` that stops after ``minutes`` with
    ``status`` (None: killed after run_start, no run_stop), its division and cache_clear."""
    stop = None if minutes is None else start_ms + int(minutes * MINUTE_MS)
    lines = mlperf_lines(start_ms, stop, status, seed, evals=[(2, 0.5), (4, 0.93 if status == "success" else 0.5)],
                         epochs=4)
    out = []
    for line in lines:
        record = json.loads(line.split(":::MLLOG ", 1)[1])
        if record["key"] == "cache_clear":
            if cache is None:
                continue
            record["value"] = cache
        if record["key"] == "submission_division":
            record["value"] = division
        out.append(":::MLLOG " + json.dumps(record))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "unet3d.log").write_text("\n".join(out) + "\n")
    return folder / "unet3d.log"


def package(paths, out: Path, **options) -> dict:
    # these logs are written by hand, with no run_description.json: described by this machine
    options.setdefault("packing_host", True)
    return assemble([str(p) for p in paths], str(out), check=False, code=False, say=lambda _: None, **options)


def packed(report: dict) -> dict[str, str]:
    """{result file: run folder} of a package's report."""
    return {r["packed_as"]: r["folder"] for r in report["runs"] if r["packed_as"]}


# -- every attempt counted -----------------------------------------------------------------------------------------


def test_a_sigkilled_and_rerun_attempt_is_a_failed_run_in_the_package_and_the_report(tmp_path):
    """40 run folders; run_05's first attempt was killed after run_start (no run_stop) and the
    folder ran again, which moved the killed attempt into previous-<time>/. The killed attempt is
    a failed run: packed as it is (the official RCP checker reads it as infinite), 40 files in
    all with run_05's rerun, and the report lists it and counts it failed. Today's code reads
    neither previous-* folder: 39 packed, the rerun a clean result."""
    sweep = tmp_path / "runs"
    for i in range(39):
        write_log(sweep / f"run_{i:02d}", T0_MS + i * HOUR_MS, 30 + i, seed=100 + i)
    killed = write_log(sweep / "run_05" / "previous-20261127-101500", T0_MS + 5 * HOUR_MS - 1800_000, None,
                       seed=500)
    report = package([sweep], tmp_path / "package")

    files = packed(report)
    assert sorted(files) == sorted(f"result_{i}.txt" for i in range(40))
    (killed_file,) = [name for name, folder in files.items() if folder == str(killed.parent)]
    results = tmp_path / "package" / "test" / "results" / "cpu" / "unet3d"
    assert (results / killed_file).read_bytes() == killed.read_bytes()
    # in start order: the killed attempt started before run_05's rerun
    assert killed_file == "result_5.txt" and files["result_6.txt"] == str(sweep / "run_05")
    from mlperf_logging.rcp_checker.rcp_checker import read_submission_file
    assert read_submission_file(str(results / killed_file), "4.0.0", False)[:2] == (1, 1e9)  # infinite
    (entry,) = [r for r in report["runs"] if r["folder"] == str(killed.parent)]
    assert entry["kind"] == V.FAILED and "no run_stop" in entry["reason"]
    assert "1 failed or not converged" in report["score"]
    markdown = (tmp_path / "package" / "report.md").read_text()
    assert "run_05/previous-20261127-101500" in markdown

    summary = make_report([str(sweep)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    labels = [s.label for s in summary["runs"]]
    assert len(labels) == 40 and "run_05/previous-20261127-101500 (seed 500)" in labels
    assert summary["score"].failed == 1 and summary["score"].successful == 39, summary["score"].text


def test_an_attempt_that_never_reached_run_start_is_no_run(tmp_path):
    """Killed during initialisation (no run_start): not a run, not counted, said."""
    write_log(tmp_path / "run_00", T0_MS, 30, seed=1)
    log = write_log(tmp_path / "run_00" / "previous-20261127-000000", T0_MS - HOUR_MS, None, seed=2)
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if '"run_start"' not in line
                           and '"block_' not in line and '"epoch_' not in line and '"eval_' not in line))
    report = package([tmp_path / "run_00"], tmp_path / "package", expected=1)
    (entry,) = [r for r in report["runs"] if r["folder"] == str(log.parent)]
    assert entry["kind"] == V.NOT_A_RESULT and "not a run" in entry["reason"] and entry["packed_as"] is None
    summary = make_report([str(tmp_path / "run_00")], str(tmp_path / "report"), check=False, draw=False,
                          say=lambda _: None, drop=1, window=3)
    assert summary["score"].failed == 0 and "not a run" in summary["score"].text


def test_more_than_four_failed_attempts_make_no_score(tmp_path):
    """unet3d drops 4 at each end: a fifth failed run (a crashed attempt counts) leaves no score."""
    sweep = tmp_path / "runs"
    for i in range(40):
        crashed = i in (3, 9, 17, 25, 33)
        write_log(sweep / f"run_{i:02d}", T0_MS + i * HOUR_MS, None if crashed else 30 + i, seed=i)
    report = package([sweep], tmp_path / "package")
    assert len(packed(report)) == 40 and report["score_minutes"] is None and "5 failed" in report["score"]
    summary = make_report([str(sweep)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    assert summary["score"].minutes is None and summary["score"].failed == 5


# -- the page cache ------------------------------------------------------------------------------------------------


def test_closed_logs_whose_cache_was_not_dropped_are_no_closed_results(tmp_path):
    """cache_clear false (or none logged) in a closed log: not a result, in the package and in
    the report's score, with the reason and the fix; in an open log: said, still counted."""
    write_log(tmp_path / "closed" / "a", T0_MS, 30, seed=1, cache=False)
    write_log(tmp_path / "closed" / "b", T0_MS + HOUR_MS, 31, seed=2, cache=None)
    with pytest.raises(PackageError, match="cache_clear false.*sudo -n"):
        package([tmp_path / "closed"], tmp_path / "p1")
    verdict = V.judge_log(str(tmp_path / "closed" / "b" / "unet3d.log"))
    assert verdict.kind == V.NOT_A_RESULT and "no cache_clear" in verdict.reason and "Prolog=" in verdict.reason

    write_log(tmp_path / "closed" / "c", T0_MS + 2 * HOUR_MS, 32, seed=3, cache=True)
    report = package([tmp_path / "closed"], tmp_path / "p2", expected=1)
    assert list(packed(report).values()) == [str(tmp_path / "closed" / "c")]
    summary = make_report([str(tmp_path / "closed")], str(tmp_path / "r1"), check=False, draw=False,
                          say=lambda _: None)
    assert [s.label for s in summary["runs"] if s.is_result] == ["c (seed 3)"]
    assert "a (seed 1) (unet3d.log: cache_clear false" in summary["score"].text

    write_log(tmp_path / "open" / "a", T0_MS, 30, seed=1, division="open", cache=False)
    verdict = V.judge_log(str(tmp_path / "open" / "a" / "unet3d.log"))
    assert verdict.kind == V.RESULT and "cache_clear false" in verdict.note
    report = package([tmp_path / "open"], tmp_path / "p3", expected=1)
    assert len(packed(report)) == 1 and "cache_clear false" in report["runs"][0]["note"]
    (run,) = make_report([str(tmp_path / "open")], str(tmp_path / "r2"), check=False, draw=False,
                         say=lambda _: None)["runs"]
    assert run.is_result and any("cache_clear false" in note for note in run.notes)


# -- more than 40 runs: the rules' window --------------------------------------------------------------------------


def oracle_window(minutes: list[float | None], n: int = 40, drop: int = 4) -> int:
    """From the rules' text, by brute force: each n consecutive runs' olympic score (failed runs
    infinite: sorted last), the median of those scores, the first window closest to it."""
    scores = []
    for first in range(len(minutes) - n + 1):
        ordered = sorted(float("inf") if m is None else m for m in minutes[first:first + n])
        kept = ordered[drop:n - drop]
        scores.append(float("inf") if kept[-1] == float("inf") else sum(kept) / len(kept))
    ordered = sorted(scores)
    half = len(ordered) // 2
    middle = ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
    gaps = [0.0 if s == middle else abs(s - middle) for s in scores]
    return gaps.index(min(gaps))


def test_44_runs_are_packed_as_the_window_of_40_the_rules_pick(tmp_path):
    rng = random.Random(48)
    minutes: list[float | None] = [round(rng.uniform(20, 60) + i, 2) for i in range(44)]
    aborted, killed = (2, 20), 41  # failed runs: two not converged (run_stop aborted), one killed
    for i in (*aborted, killed):
        minutes[i] = None
    first = oracle_window(minutes)
    assert first != 0  # today's code packs the first 40
    sweep = tmp_path / "runs"
    # folder names in the reverse of start order: the choice follows the start times, not the names
    for i, m in enumerate(minutes):
        write_log(sweep / f"run_{43 - i:02d}", T0_MS + i * HOUR_MS, 70.0 if i in aborted else m, seed=1000 + i,
                  status="aborted" if i in aborted else "success")
    report = package([sweep], tmp_path / "package")
    chosen = [str(sweep / f"run_{43 - i:02d}") for i in range(first, first + 40)]
    assert [packed(report)[f"result_{k}.txt"] for k in range(40)] == chosen
    left = [r for r in report["runs"] if r["packed_as"] is None]
    assert len(left) == 4 and all("outside the 40 consecutive runs" in r["note"] for r in left)

    summary = make_report([str(sweep)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    by_folder = {s.folder: s.label for s in summary["runs"]}
    assert list(summary["score"].scored) == [by_folder[folder] for folder in chosen]
    kept = sorted(float("inf") if m is None else m for m in minutes[first:first + 40])[4:36]
    assert summary["score"].minutes == pytest.approx(sum(kept) / 32)


def test_window_choice_on_known_answers():
    from runtime.results.scoring import rules_window, window_scores

    assert window_scores([1.0, 2.0, 3.0, None], runs=3, drop=1) == [2.0, 3.0]
    assert window_scores([None, None, 1.0], runs=3, drop=1) == [float("inf")]
    # windows of 3 (drop 1): scores 2, 3, 4, 10, 11, 12; median 7; closest: 4 and 10, the earlier
    assert rules_window([1.0, 2.0, 3.0, 4.0, 10.0, 11.0, 12.0, 13.0], runs=3, drop=1) == 2
    assert rules_window([5.0, 5.0, 5.0, 5.0], runs=3, drop=1) == 0  # ties: the earliest
    assert rules_window([1.0, 2.0, 3.0], runs=3, drop=1) == 0
    rng = random.Random(0)
    for _ in range(200):
        n, drop = rng.choice([(3, 1), (5, 1), (9, 4), (40, 4)])
        runs = [None if rng.random() < 0.1 else rng.uniform(10, 100) for _ in range(n + rng.randint(0, 8))]
        assert rules_window(runs, n, drop) == oracle_window(runs, n, drop), runs


# -- the report's score is unet3d's ---------------------------------------------------------------------------------


def test_the_reports_score_drops_4_and_4_by_default_as_unet3d():
    """The defaults of python -m runtime.report, and the counts mlperf_logging itself uses for
    unet3d (its result file count and the RCP checker's run count)."""
    from mlperf_logging.benchmark_meta import get_result_file_counts
    from mlperf_logging.rcp_checker import rcp_checker

    args = parse_args(["run", "--output", "out"])
    assert (args.drop, args.window) == (T.DROPPED_EACH_END, T.SUBMISSION_RUNS) == (4, 40)
    assert get_result_file_counts("training")["unet3d"] == rcp_checker.submission_runs["training"]["unet3d"] == 40


def test_the_reports_default_score_of_nine_runs_keeps_the_middle_one(tmp_path):
    """Nine runs of 1, 2, 3, 4, 10, 11, 12, 13 and 100 minutes: unet3d's score drops 4 at each
    end and keeps 10; the old default (1 at each end) gave 55/7."""
    for i, m in enumerate([13, 2, 100, 4, 10, 1, 12, 3, 11]):
        write_log(tmp_path / f"run_{i}", T0_MS + i * HOUR_MS, m, seed=i)
    summary = make_report([str(tmp_path)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    assert summary["score"].minutes == 10.0 and summary["score"].drop == 4
