"""``package`` beside mlperf-logging's result summarizer, the final quality of open results, and
the exit code of a package accepted without a score.

Forty hand-written open-division logs (``test_every_attempt.write_log``: known start and stop
times), packed and checked with the official tools, as a submitter runs them. Oracles: the result
summarizer itself (run here on its own, on a copy of the package), the rules' text (unet3d: at most
4 non-converged runs of 40, the 4 fastest and 4 slowest dropped; open results "must include the
geometric mean of the final quality as measured by the closed quality measure"), and
``statistics.geometric_mean``."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.submission.cli import ACCEPTED_NO_SCORE, main as submission_main
from test_every_attempt import write_log
from test_report import T0_MS

HOUR_MS = 3_600_000


def sweep(folder: Path, aborted: int) -> list[float]:
    """40 open runs of 30 + i minutes, the first ``aborted`` stopped without the target (their
    last mean Dice 0.5; the others' 0.93); the runs' final qualities."""
    finals = []
    for i in range(40):
        status = "aborted" if i < aborted else "success"
        write_log(folder / f"run_{i:02d}", T0_MS + i * HOUR_MS, 30 + i, seed=100 + i, status=status, division="open")
        finals.append(0.5 if status == "aborted" else 0.93)
    return finals


def package(runs: Path, out: Path) -> tuple[int, dict, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        code = submission_main(["package", str(runs), "--output", str(out), "--no_code", "--system_from_packing_host"])
    return code, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def summarizer(org: Path, cwd: Path) -> float | None:
    """The official summarizer's unet3d score, from its own command line's summary.json."""
    shutil.copytree(org, cwd / org.name)
    subprocess.run([sys.executable, "-m", "mlperf_logging.result_summarizer", org.name, "training", "4.0.0"], cwd=cwd,
                   capture_output=True, text=True, timeout=600, check=True)
    (row,) = json.loads((cwd / "summary.json").read_text())
    return row["unet3d:time_to_train"]


def test_an_open_package_with_six_runs_short_of_the_target_is_accepted_without_a_score(tmp_path):
    """The package checker accepts it (the open rules do not check the target), the summarizer
    scores the aborted runs' times as if they had converged; the rules count them as failed, and
    unet3d allows 4: no score, exit code 5, and the difference said."""
    finals = sweep(tmp_path / "runs", aborted=6)
    code, report, text = package(tmp_path / "runs", tmp_path / "package")
    assert report["accepted"] and report["score_minutes"] is None and code == ACCEPTED_NO_SCORE == 5
    official = summarizer(tmp_path / "package" / "test", tmp_path / "official")
    # the olympic mean of all 40 times, the aborted ones included: the summarizer's reading
    assert official == pytest.approx(statistics.mean(sorted(30 + i for i in range(40))[4:36]))
    assert report["result_summarizer"]["minutes"] == pytest.approx(official)
    comparison = report["summarizer_comparison"]
    assert "6 packed run(s) stopped without reaching the target" in comparison and "no score" in comparison
    assert f"{official:.4f} min" in text and "**no score** (exit code 5)" in text
    quality = report["final_quality"]
    assert quality["runs"] == 40 and quality["geometric_mean"] == pytest.approx(statistics.geometric_mean(finals))
    assert f"closed quality measure: {statistics.geometric_mean(finals):.4f}**" in text
    assert not (tmp_path / "package" / "test" / "results" / "cpu" / "unet3d" / "scaling.json").exists()


@pytest.mark.slow
def test_an_open_package_that_converged_agrees_with_the_summarizer_and_exits_0(tmp_path):
    finals = sweep(tmp_path / "runs", aborted=0)
    code, report, text = package(tmp_path / "runs", tmp_path / "package")
    expected = statistics.mean(sorted(30 + i for i in range(40))[4:36])
    assert code == 0 and report["score_minutes"] == pytest.approx(expected)
    assert report["result_summarizer"]["minutes"] == pytest.approx(expected)
    assert report["summarizer_comparison"].endswith("they agree")
    assert report["final_quality"]["geometric_mean"] == pytest.approx(statistics.geometric_mean(finals))


def test_the_comparison_names_the_summarizers_normalisation():
    """The summarizer multiplies an RCP-normalised result by its factor (rcp_checker's
    set_scaling); this command does not: the same runs, the difference said."""
    from runtime.submission.package import compare_scores

    said = compare_scores(40.0, {"ran": True, "minutes": 44.0, "scaling": 1.1, "summary": "44.0000 min"}, [])
    assert "normalisation factor 1.1000" in said and "does not normalise" in said
    assert compare_scores(40.0, {"ran": True, "minutes": 40.0, "scaling": 1.0, "summary": "40.0000 min"},
                          []).endswith("they agree")
    assert "cannot tell why" in compare_scores(40.0, {"ran": True, "minutes": 41.0, "scaling": 1.0,
                                                      "summary": "41.0000 min"}, [])
    assert "could not run" in compare_scores(None, {"ran": False, "summary": "could not run: no pandas"}, [])
