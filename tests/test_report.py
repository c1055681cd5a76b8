"""runtime.report on synthetic run folders whose numbers are known.

The log files are written here by hand in the formats runtime/run_log.py writes (log.json: one
JSON object per line; unet3d.log: ``:::MLLOG {json}`` lines), with chosen times and values, so
every number in the summary has a known answer. The compliance verdict is the official checker's
(mlperf_logging), and the olympic score is compared with mlperf_logging's own result summarizer.
Figure tests read the data handed to matplotlib (each line's gid and points), not pixels; they
skip when matplotlib is not installed.
"""
from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.report.cli import make_report
from runtime.results.compliance import _checker_problems, check_compliance
from runtime.results.figure import MATPLOTLIB_HINT, MissingMatplotlib
from runtime.results.plotter import CurvePlotter, write_curves, write_curves_in_subprocess
from runtime.results.runs import Attempt, collect_runs, load_run
from runtime.results.scoring import elapsed_minutes, olympic_score, run_outcome, score_runs, summarize_run

ROOT = Path(__file__).resolve().parent.parent
T0_MS = 1_795_000_000_000  # run_start of the synthetic runs (ms since the Unix epoch)
T0 = T0_MS / 1000.0
needs_matplotlib = pytest.mark.skipif(
    __import__("importlib").util.find_spec("matplotlib") is None, reason="matplotlib is not installed")


# --------------------------------------------------------------------------- writing synthetic runs

def mllog(key, t_ms, value=None, event_type="POINT_IN_TIME", **metadata) -> str:
    record = {"namespace": "", "time_ms": t_ms, "event_type": event_type, "key": key, "value": value,
              "metadata": {"file": "synthetic.py", "lineno": 1, **metadata}}
    return ":::MLLOG " + json.dumps(record)


HYPERPARAMETERS = [("global_batch_size", 2), ("gradient_accumulation_steps", 1), ("opt_name", "sgd"),
                   ("opt_base_learning_rate", 0.8), ("opt_learning_rate_warmup_epochs", 200),
                   ("opt_learning_rate_decay_boundary_epochs", []), ("opt_learning_rate_decay_factor", 1.0),
                   ("opt_weight_decay", 0.0), ("opt_momentum", 0.9), ("oversampling", 0.4),
                   ("training_input_shape", [128, 128, 128]), ("validation_input_shape", [128, 128, 128]),
                   ("validation_overlap", 0.5), ("train_samples", 168), ("eval_samples", 42)]


def mlperf_lines(start_ms, stop_ms=None, status="success", seed=1, evals=(), epochs=2):
    """A complete MLPerf log for ruleset 4.0.0 (when stop_ms is given and an eval reaches 0.908)."""
    lines = [mllog("cache_clear", start_ms - 900, True), mllog("submission_benchmark", start_ms - 900, "unet3d"),
             mllog("submission_org", start_ms - 900, "test"), mllog("submission_division", start_ms - 900, "closed"),
             mllog("submission_status", start_ms - 900, "onprem"),
             mllog("submission_platform", start_ms - 900, "cpu"),
             mllog("init_start", start_ms - 800, event_type="INTERVAL_START"), mllog("seed", start_ms - 700, seed)]
    lines += [mllog(k, start_ms - 700, v) for k, v in HYPERPARAMETERS]
    lines += [mllog("init_stop", start_ms - 1, event_type="INTERVAL_END"),
              mllog("run_start", start_ms, event_type="INTERVAL_START"),
              mllog("block_start", start_ms, event_type="INTERVAL_START", first_epoch_num=1, epoch_count=epochs)]
    for epoch in range(1, epochs + 1):
        lines += [mllog("epoch_start", start_ms + epoch, event_type="INTERVAL_START", epoch_num=epoch),
                  mllog("epoch_stop", start_ms + epoch, event_type="INTERVAL_END", epoch_num=epoch)]
    for epoch, value in evals:
        lines += [mllog("eval_start", start_ms + 10 * epoch, event_type="INTERVAL_START", epoch_num=epoch),
                  mllog("eval_accuracy", start_ms + 10 * epoch, value, epoch_num=epoch),
                  mllog("eval_stop", start_ms + 10 * epoch, event_type="INTERVAL_END", epoch_num=epoch)]
    lines.append(mllog("block_stop", start_ms + 999, event_type="INTERVAL_END", first_epoch_num=1))
    if stop_ms is not None:
        lines.append(mllog("run_stop", stop_ms, event_type="INTERVAL_END", status=status, epoch_num=epochs))
    return lines


def train_record(epoch, loss=1.0, lr=0.1, throughput=2.0, t=None):
    return {"time": T0 + 10 * epoch if t is None else t, "kind": "train", "epoch": epoch, "loss": loss,
            "lr": lr, "throughput": throughput}


def eval_record(epoch, mean, l1=None, l2=None, t=None):
    return {"time": T0 + 10 * epoch + 1 if t is None else t, "kind": "eval", "epoch": epoch, "mean_dice": mean,
            "l1_dice": mean + 0.05 if l1 is None else l1, "l2_dice": mean - 0.05 if l2 is None else l2,
            "eval_loss": 1 - mean, "eval_cases": 42}


def write_lines(path: Path, lines, cut_last: bool = False) -> None:
    text = "\n".join(lines) + "\n"
    if cut_last:  # a run still writing: the last line is half there, without its newline
        text = text[:-1][:-(len(lines[-1]) // 2)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_run(folder: Path, records, mlperf=None, cut_metrics=False, cut_mlperf=False) -> Path:
    write_lines(folder / "log.json", [json.dumps(r) for r in records], cut_last=cut_metrics)
    if mlperf is not None:
        write_lines(folder / "unet3d.log", mlperf, cut_last=cut_mlperf)
    return folder


def good_run(folder: Path, seconds: float, seed: int = 1) -> Path:
    """Four epochs, evaluations at 2 and 4 (0.5, 0.93), success after ``seconds``."""
    records = [train_record(e, loss=1.0 / e, throughput=float(e)) for e in range(1, 5)]
    records[2:2] = [eval_record(2, 0.5)]
    records.append(eval_record(4, 0.93))
    return write_run(folder, records, mlperf_lines(T0_MS, T0_MS + int(seconds * 1000), "success", seed,
                                                    evals=[(2, 0.5), (4, 0.93)], epochs=4))


# --------------------------------------------------------------------------- numbers

def test_summary_numbers_are_exact(tmp_path):
    records = [train_record(1, 1.0, 0.1, 1.0), train_record(2, 0.8, 0.2, 2.0), eval_record(2, 0.5),
               train_record(3, 0.6, 0.3, 3.0), train_record(4, 0.5, 0.4, 6.0), eval_record(4, 0.93),
               train_record(5, 0.4, 0.4, 3.0), eval_record(5, 0.93), train_record(6, 0.3, 0.4, 3.0),
               eval_record(6, 0.91)]
    folder = write_run(tmp_path / "run", records,
                       mlperf_lines(T0_MS, T0_MS + 123_456, "success", seed=7, evals=[(4, 0.93)], epochs=6))
    summary = summarize_run(load_run(str(folder)), threshold=0.908)
    assert summary.status == "success"
    assert summary.time_to_target_s == 123.456
    assert summary.best_mean_dice == 0.93 and summary.best_epoch == 4  # the earlier of a tie
    assert summary.reached_epoch == 4
    assert summary.epochs == 6 and summary.seed == 7 and summary.attempts == 1
    assert summary.mean_throughput == 3.0  # (1 + 2 + 3 + 6 + 3 + 3) / 6
    assert summarize_run(load_run(str(folder)), threshold=0.92).reached_epoch == 4
    assert summarize_run(load_run(str(folder)), threshold=0.95).reached_epoch is None


def test_aborted_run_has_run_time_but_no_time_to_target(tmp_path):
    records = [train_record(1), train_record(2), eval_record(2, 0.4)]
    folder = write_run(tmp_path / "run", records, mlperf_lines(T0_MS, T0_MS + 30_000, "aborted"))
    summary = summarize_run(load_run(str(folder)), 0.908)
    assert summary.status == "aborted" and summary.time_to_target_s is None and summary.run_time_s == 30.0


@pytest.mark.parametrize("times, failed, drop, expected", [
    ([5.0, 1.0, 3.0, 4.0], 0, 1, 3.5),      # drop 1 and 5
    ([5.0, 1.0, 3.0], 1, 1, 4.0),           # the failed run is the slowest dropped: mean of 3 and 5
    ([2.0, 1.0, 3.0], 0, 1, 2.0),
    ([1.0, 2.0], 0, 1, None),               # too few to drop one at each end
    ([1.0, 2.0, 3.0], 2, 1, None),          # two failed: more than the one slow-end drop
    ([9.0, 1.0, 2.0, 3.0, 4.0], 0, 2, 3.0),
])
def test_olympic_score_known_answers(times, failed, drop, expected):
    assert olympic_score(times, failed, drop) == expected


def test_olympic_score_matches_mlperf_result_summarizer():
    summarizer = pytest.importorskip("mlperf_logging.result_summarizer.result_summarizer")
    rng = random.Random(0)
    for _ in range(200):
        drop = rng.choice([1, 2, 4])
        failed = rng.randint(0, drop)
        times = [rng.uniform(10, 100) for _ in range(rng.randint(max(0, 2 * drop + 1 - failed), 40))]
        ours = olympic_score(times, failed, drop)
        theirs = summarizer._compute_olympic_average(list(times), failed, drop)
        assert ours == pytest.approx(theirs, rel=1e-12), (times, failed, drop)


def test_score_over_run_folders(tmp_path):
    for name, seconds in [("a", 60), ("b", 120), ("c", 180), ("d", 600)]:
        good_run(tmp_path / "sweep" / name, seconds)
    result = make_report([str(tmp_path / "sweep")], str(tmp_path / "out"), check=False, draw=False,
                         say=lambda line: None, drop=1)
    assert [s.label for s in result["runs"]] == ["a (seed 1)", "b (seed 1)", "c (seed 1)", "d (seed 1)"]
    assert result["score"].minutes == 2.5  # mean of 2 and 3 minutes after dropping 1 and 10
    document = json.loads(Path(result["summary_json"]).read_text())
    assert document["score"]["minutes"] == 2.5
    assert [r["time_to_target_s"] for r in document["runs"]] == [60.0, 120.0, 180.0, 600.0]
    assert "score 2.50 min" in Path(result["summary_md"]).read_text()


def test_score_needs_three_runs(tmp_path):
    good_run(tmp_path / "a", 60)
    good_run(tmp_path / "b", 120)
    result = make_report([str(tmp_path)], str(tmp_path / "out"), check=False, draw=False, say=lambda line: None,
                         drop=1)
    assert result["score"].minutes is None and "3 needed" in result["score"].text


def test_elapsed_minutes_leave_out_gaps_between_attempts():
    first = Attempt("a", start_ms=1_000_000, stop_ms=1_060_000, status="aborted", last_ms=1_060_000)
    second = Attempt("b", start_ms=5_000_000, stop_ms=5_030_000, status="success", last_ms=5_030_000)
    minutes = elapsed_minutes([1_030.0, 1_060.0, 5_000.0, 5_030.0], [first, second])
    assert minutes == [0.5, 1.0, 1.0, 1.5]
    assert elapsed_minutes([100.0, 160.0], []) == [0.0, 1.0]


# --------------------------------------------------------------------------- real files

def test_truncated_run_still_writing(tmp_path):
    records = [train_record(1), train_record(2), eval_record(2, 0.4), train_record(3)]
    mlperf = mlperf_lines(T0_MS, None, evals=[(2, 0.4)], epochs=3)
    folder = write_run(tmp_path / "run", records, mlperf, cut_metrics=True, cut_mlperf=True)
    run = load_run(str(folder))
    assert [p.epoch for p in run.train] == [1, 2] and [p.epoch for p in run.evals] == [2]
    summary = summarize_run(run, 0.908)
    assert summary.status == "incomplete" and summary.time_to_target_s is None
    assert summary.best_mean_dice == 0.4 and summary.epochs == 2
    notes = " | ".join(summary.notes)
    assert "log.json: last line cut" in notes and "unet3d.log: last line cut" in notes
    assert "no run_stop" in notes


def test_unreadable_middle_line_is_skipped_with_a_note(tmp_path):
    folder = tmp_path / "run"
    write_lines(folder / "log.json", [json.dumps(train_record(1)), "{not json", json.dumps(train_record(2))])
    run = load_run(str(folder))
    assert [p.epoch for p in run.train] == [1, 2]
    assert any("1 unreadable line(s) skipped (line 2 first)" in n for n in run.notes)


def test_crashed_before_any_evaluation(tmp_path):
    records = [train_record(1), train_record(2), train_record(3)]
    folder = write_run(tmp_path / "run", records, mlperf_lines(T0_MS, None, epochs=3))
    summary = summarize_run(load_run(str(folder)), 0.908)
    assert summary.status == "incomplete" and summary.epochs == 3
    assert summary.best_mean_dice is None and summary.best_epoch is None and summary.reached_epoch is None
    assert summary.run_time_s == 0.999  # up to the last event of the log: block_stop at +999 ms
    assert any("no evaluation logged" in n for n in summary.notes)


def test_crashed_during_initialisation(tmp_path):
    folder = tmp_path / "run"
    write_lines(folder / "unet3d.log", mlperf_lines(T0_MS)[:5])
    run = load_run(str(folder))
    summary = summarize_run(run, 0.908)
    assert summary.status == "incomplete" and summary.run_time_s is None and summary.epochs is None
    assert any("no run_start" in n for n in summary.notes) and any("no log.json" in n for n in summary.notes)


def test_diverged_run(tmp_path):
    records = [train_record(1, 1.0), train_record(2, 0.9), eval_record(2, 0.3), train_record(3, math.nan)]
    folder = write_run(tmp_path / "run", records, mlperf_lines(T0_MS, T0_MS + 40_000, "aborted", epochs=3))
    assert "NaN" in (folder / "log.json").read_text()  # how json.dumps writes a diverged loss
    summary = summarize_run(load_run(str(folder)), 0.908)
    assert summary.status == "diverged" and summary.time_to_target_s is None and summary.run_time_s == 40.0
    assert any("diverged at epoch 3" in n for n in summary.notes)
    result = make_report([str(folder)], str(tmp_path / "out"), check=False, draw=False, say=lambda line: None)

    def no_nan(constant):
        raise AssertionError(f"{constant} in summary.json")
    json.loads(Path(result["summary_json"]).read_text(), parse_constant=no_nan)


def test_dice_below_1e6_is_diverged(tmp_path):
    records = [train_record(1), train_record(2), eval_record(2, 0.0)]
    folder = write_run(tmp_path / "run", records, mlperf_lines(T0_MS, T0_MS + 5_000, "aborted"))
    assert summarize_run(load_run(str(folder)), 0.908).status == "diverged"


def test_resumed_run(tmp_path):
    """Pre-empted after 100 s in epoch 4, resumed (from the epoch 2 checkpoint of a crash: epoch 3
    is trained again) 50 s later in wall-clock, success after another 50 s."""
    folder = tmp_path / "run"
    t1_ms = T0_MS + 1_000_000
    records = [train_record(1), train_record(2), eval_record(2, 0.5), train_record(3, loss=0.7),
               train_record(3, loss=0.6, t=t1_ms / 1000 + 10), train_record(4, t=t1_ms / 1000 + 20),
               eval_record(4, 0.95, t=t1_ms / 1000 + 21)]
    write_run(folder, records, mlperf_lines(T0_MS, T0_MS + 100_000, "aborted", seed=5, epochs=3))
    write_lines(folder / "unet3d.resumed-20261121-120000.log",
                mlperf_lines(t1_ms, t1_ms + 50_000, "success", seed=5, evals=[(4, 0.95)], epochs=4))
    run = load_run(str(folder))
    assert [a.status for a in run.attempts] == ["aborted", "success"]
    assert [p.loss for p in run.train if p.epoch == 3] == [0.6]  # the later values of a repeated epoch
    summary = summarize_run(run, 0.908)
    assert summary.status == "success" and summary.attempts == 2 and summary.seed == 5
    assert summary.time_to_target_s == 150.0
    notes = " | ".join(summary.notes)
    assert "resumed: 2 MLPerf logs" in notes and "epochs 3-3 trained again" in notes
    minutes = elapsed_minutes([p.time for p in run.train], run.attempts)
    assert minutes[-1] == pytest.approx((100 + 20) / 60)
    # Not an MLPerf result ("The clock may not be paused during the run"): left out of the score,
    # the score says which and why (this log predates the resumed_from_checkpoint event).
    assert summary.not_a_result == ("2 attempts (a resumed run: the clock was paused)",)
    score = score_runs([summary, summary, summary])
    assert score.minutes is None and score.successful == 0 and score.failed == 0
    assert "3 run(s) left out, not MLPerf results" in score.text and "clock was paused" in score.text


def test_reused_folder_shows_the_last_run(tmp_path):
    records = [train_record(1), train_record(2), train_record(3), train_record(1, loss=5.0), train_record(2)]
    mlperf = mlperf_lines(T0_MS, T0_MS + 9_000, "aborted") + mlperf_lines(T0_MS + 50_000, T0_MS + 80_000)
    run = load_run(str(write_run(tmp_path / "run", records, mlperf)))
    assert [p.epoch for p in run.train] == [1, 2] and run.train[0].loss == 5.0
    assert run.attempts[0].seconds == 30.0 and run.attempts[0].status == "success"
    assert any("2 runs started at epoch 1" in n for n in run.notes)
    assert any("2 run_starts" in n for n in run.notes)


def test_checkpoint_evaluation_is_not_a_curve_point(tmp_path):
    records = [train_record(1), train_record(2), eval_record(2, 0.5), {**eval_record(0, 0.6), "checkpoint": "c.pt"}]
    run = load_run(str(write_run(tmp_path / "run", records)))
    assert [p.epoch for p in run.evals] == [2]
    assert any("evaluation of checkpoint c.pt: mean_dice 0.6000" in n for n in run.notes)
    assert run_outcome(run) == "no MLPerf log"


def test_the_command_keeps_trainings_result_a_run_that_ran_its_epochs_is_finished(tmp_path):
    """MLPerf's run_stop says aborted; training's result record in log.json says finished, and the
    report's summary (not only load_run) says so too."""
    records = [train_record(1), train_record(2), eval_record(2, 0.4),
               {"time": T0 + 30, "kind": "result", "status": "finished", "epoch": 2, "epochs": 2}]
    folder = write_run(tmp_path / "run", records, mlperf_lines(T0_MS, T0_MS + 30_000, "aborted"))
    result = make_report([str(folder)], str(tmp_path / "out"), check=False, draw=False, say=lambda line: None)
    assert [s.status for s in result["runs"]] == ["finished"]
    assert json.loads(Path(result["summary_json"]).read_text())["runs"][0]["status"] == "finished"


def test_sweep_folders_expand_and_labels_are_unique(tmp_path):
    good_run(tmp_path / "sweep" / "lr0.4" / "results", 60, seed=1)
    good_run(tmp_path / "sweep" / "lr0.8" / "results", 60, seed=2)
    (tmp_path / "sweep" / "empty").mkdir()
    runs, empty = collect_runs([str(tmp_path / "sweep"), str(tmp_path / "sweep" / "empty")])
    assert [r.label for r in runs] == [os.path.join("lr0.4", "results") + " (seed 1)",
                                      os.path.join("lr0.8", "results") + " (seed 2)"]
    assert empty == [str(tmp_path / "sweep" / "empty")]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "runtime.report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_folder_with_no_run_is_one_line(tmp_path):
    proc = run_cli(str(tmp_path), "--output", str(tmp_path / "out"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and output.count("\n") == 1 and "no run here" in output and str(tmp_path) in output
    assert "Traceback" not in output and not (tmp_path / "out").exists()
    proc = run_cli(str(tmp_path / "missing"), "--output", str(tmp_path / "out"))
    assert proc.returncode == 1 and (proc.stdout + proc.stderr).count("\n") == 1 and "no such folder" in proc.stderr


def test_empty_folder_beside_a_run_is_one_line_and_the_report_goes_on(tmp_path):
    good_run(tmp_path / "run", 60)
    (tmp_path / "nothing").mkdir()
    said = []
    result = make_report([str(tmp_path / "run"), str(tmp_path / "nothing")], str(tmp_path / "out"),
                           check=False, draw=False, say=said.append)
    assert said[0] == f"{tmp_path / 'nothing'}: no run here (no log.json or unet3d.log in it or below it)"
    assert len(result["runs"]) == 1 and "no run here" in Path(result["summary_md"]).read_text()


def test_command_without_matplotlib_writes_the_summary_and_one_line(tmp_path):
    folder = good_run(tmp_path / "run", 60)
    hide = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['report'] + sys.argv[1:]; "
            "runpy.run_module('runtime.report', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide, str(folder), "--output", str(tmp_path / "out"),
                           "--no_compliance"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.splitlines()[0] == f"curves.png not written: {MATPLOTLIB_HINT}"
    assert (tmp_path / "out" / "summary.md").is_file() and not (tmp_path / "out" / "curves.png").exists()


def test_bad_flag_is_a_usage_error(tmp_path):
    proc = run_cli(str(tmp_path), "--output", str(tmp_path / "o"), "--quality_threshold", "2")
    assert proc.returncode == 2 and "--quality_threshold" in proc.stderr


# --------------------------------------------------------------------------- compliance

def test_compliance_verdicts_from_the_official_checker(tmp_path):
    pytest.importorskip("mlperf_logging")
    good = good_run(tmp_path / "good", 60)
    crashed = write_run(tmp_path / "crashed", [train_record(1)], mlperf_lines(T0_MS, None, evals=[(2, 0.5)]))
    passed = check_compliance(str(good / "unet3d.log"))
    failed = check_compliance(str(crashed / "unet3d.log"))
    assert passed.checked and passed.passed and passed.verdict() == "PASS"
    assert failed.checked and not failed.passed
    assert "Required EXACTLY_ONE occurrence of 'run_stop' but found 0" in failed.problems
    assert any("eval_accuracy" in p and "0.908" in p for p in failed.problems)
    lines = (good / "unet3d.log").read_text().splitlines()
    lines.insert(10, lines[10][:40])
    (tmp_path / "cut.log").write_text("\n".join(lines) + "\n")
    cut = check_compliance(str(tmp_path / "cut.log"))
    assert not cut.passed and any(p.startswith("parse error:") for p in cut.problems)
    assert not list(tmp_path.rglob("compliance_checker.log"))  # the checker's own file stays in its temp dir


def test_report_lists_compliance_per_log(tmp_path):
    pytest.importorskip("mlperf_logging")
    good_run(tmp_path / "run", 60)
    result = make_report([str(tmp_path / "run")], str(tmp_path / "out"), draw=False, say=lambda line: None)
    assert [c.passed for c in result["runs"][0].compliance] == [True]
    assert "unet3d.log: PASS" in Path(result["summary_md"]).read_text()


def test_checker_output_parsing():
    output = ("INFO - Running compliance on file: x.log\n"
              "WARNING -  Found parsing errors:\n"
              "WARNING -   :::MLLOG {\"namespace\": \n"
              "WARNING -    ^^  Expecting value: line 1 column 2 (char 1)\n"
              "WARNING -  Required EXACTLY_ONE occurrence of 'run_stop' but found 0\n"
              "------------------------------\n"
              "CHECK for 'train_samples' failed in line 71:\n:::MLLOG {...}\nfailed test:  v['value'] == 168\n"
              "current context[s]={}\n"
              "------------------------------\n"
              "Failed checks for eval_accuracy :  v['value'] >= 0.908\n"
              "ERROR - FAILED\n")
    assert _checker_problems(output) == [
        "parse error: Expecting value: line 1 column 2 (char 1)",
        "Required EXACTLY_ONE occurrence of 'run_stop' but found 0",
        "CHECK for 'train_samples' failed in line 71: v['value'] == 168",
        "Failed checks for eval_accuracy : v['value'] >= 0.908"]


# --------------------------------------------------------------------------- the figure

def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def lines_by_gid(figure) -> dict[str, list]:
    found: dict[str, list] = {}
    for axis in figure.axes:
        for line in axis.get_lines():
            found.setdefault(line.get_gid(), []).append(line)
    return found


@needs_matplotlib
def test_figure_holds_one_line_per_run_with_its_points(tmp_path):
    from runtime.results.figure import build_figure

    good_run(tmp_path / "a", 60)
    write_run(tmp_path / "b", [train_record(1), train_record(2), eval_record(2, 0.3), train_record(3)],
              mlperf_lines(T0_MS, None, epochs=3))
    write_run(tmp_path / "c", [train_record(1), train_record(2, loss=math.nan)],
              mlperf_lines(T0_MS, T0_MS + 1000, "aborted"))
    runs, _ = collect_runs([str(tmp_path)])
    lines = lines_by_gid(build_figure(runs, 0.908))
    expected = {"a (seed 1)": (4, 2), "b (seed 1)": (3, 1), "c (seed 1)": (2, 0)}
    for label, (epochs, evals) in expected.items():
        for series in ("loss", "lr", "throughput", "loss_minutes"):
            assert [len(line.get_xdata()) for line in lines[f"run:{label}:{series}"]] == [epochs]
        for series in ("mean_dice", "l1_dice", "l2_dice", "mean_dice_minutes"):
            drawn = [len(line.get_xdata()) for line in lines.get(f"run:{label}:{series}", [])]
            assert drawn == ([evals] if evals else [])
    assert list(lines["run:a (seed 1):mean_dice"][0].get_xdata()) == [2, 4]
    assert list(lines["run:a (seed 1):mean_dice"][0].get_ydata()) == [0.5, 0.93]
    assert list(lines["run:a (seed 1):l1_dice"][0].get_ydata()) == pytest.approx([0.55, 0.98])
    assert list(lines["run:a (seed 1):loss_minutes"][0].get_xdata()) == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6])
    assert len(lines["reached:a (seed 1)"]) == 2 and list(lines["reached:a (seed 1)"][0].get_xdata()) == [4]
    assert "reached:b (seed 1)" not in lines
    assert list(lines["diverged:c (seed 1)"][0].get_xdata()) == [2]  # at the last finite loss
    assert list(lines["diverged:c (seed 1)"][0].get_ydata()) == [1.0]
    assert [list(line.get_ydata()) for line in lines["threshold"]] == [[0.908, 0.908]] * 2


@needs_matplotlib
def test_curves_png_is_a_png_of_the_stated_size(tmp_path):
    from runtime.results.figure import PNG_SIZE

    folder = good_run(tmp_path / "run", 60)
    path = write_curves(str(folder))
    assert path == str(folder / "curves.png") and png_size(Path(path)) == PNG_SIZE == (1200, 1000)
    assert sorted(p.name for p in folder.iterdir()) == ["curves.png", "log.json", "unet3d.log"]  # no temp left
    result = make_report([str(folder)], str(tmp_path / "out"), check=False, say=lambda line: None)
    assert png_size(Path(result["curves"])) == PNG_SIZE
    assert "![training curves](curves.png)" in Path(result["summary_md"]).read_text()


@needs_matplotlib
def test_failed_drawing_keeps_the_old_picture(tmp_path, monkeypatch):
    import runtime.results.figure as figure_module

    folder = good_run(tmp_path / "run", 60)
    (folder / "curves.png").write_bytes(b"old")

    class Broken:
        def savefig(self, handle, format):
            handle.write(b"half a picture")
            raise OSError("disk full")

    monkeypatch.setattr(figure_module, "build_figure", lambda runs, threshold: Broken())
    with pytest.raises(OSError):
        write_curves(str(folder))
    assert (folder / "curves.png").read_bytes() == b"old"
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def hide_matplotlib(monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.lines", "matplotlib.ticker",
                 "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of a None entry raises ImportError


def test_without_matplotlib_the_summary_is_still_written(tmp_path, monkeypatch):
    hide_matplotlib(monkeypatch)
    folder = good_run(tmp_path / "run", 60)
    said = []
    result = make_report([str(folder)], str(tmp_path / "out"), check=False, say=said.append)
    assert said == ["curves.png not written: matplotlib is not installed: pip install matplotlib"]
    assert result["curves"] is None and not (tmp_path / "out" / "curves.png").exists()
    assert "![" not in Path(result["summary_md"]).read_text()
    with pytest.raises(MissingMatplotlib, match="pip install matplotlib"):
        write_curves(str(folder))


# --------------------------------------------------------------------------- CurvePlotter

def test_plotter_request_never_blocks_and_coalesces():
    release, started = threading.Event(), threading.Event()
    calls = []

    def slow_write(log_dir, threshold):
        calls.append((log_dir, threshold))
        started.set()
        release.wait(10)

    plotter = CurvePlotter("dir", 0.5, write=slow_write, say=lambda line: None)
    plotter.request()
    assert started.wait(10)
    begin = time.perf_counter()
    for _ in range(50):  # while the first picture is being drawn
        plotter.request()
    assert time.perf_counter() - begin < 0.5
    release.set()
    plotter.close(timeout=10)
    assert calls == [("dir", 0.5), ("dir", 0.5)]  # the 50 requests became one more drawing
    assert plotter.drawn == 2 and not plotter._thread.is_alive()


def test_plotter_close_waits_for_the_last_picture():
    done = []
    plotter = CurvePlotter("dir", write=lambda d, t: (time.sleep(0.2), done.append(d)),
                             say=lambda line: None)
    plotter.request()
    plotter.close()
    assert done == ["dir"]
    plotter.request()  # after close: ignored, no new thread
    assert done == ["dir"]


def test_plotter_reports_the_first_error_once_as_one_line():
    said, attempts = [], []

    def failing(log_dir, threshold):
        attempts.append(1)
        raise ValueError("cannot draw\nsecond line of detail")

    plotter = CurvePlotter("runs/x", write=failing, say=said.append)
    for expected in (1, 2, 3):
        plotter.request()
        deadline = time.time() + 10
        while len(attempts) < expected and time.time() < deadline:
            time.sleep(0.01)
    plotter.close(timeout=10)
    assert len(attempts) == 3 and said == ["curves.png not written in runs/x: cannot draw"]


def test_plotter_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    hide_matplotlib(monkeypatch)
    said = []
    plotter = CurvePlotter(str(good_run(tmp_path / "run", 60)), say=said.append)
    plotter.request()
    plotter.close(timeout=30)
    assert said == [f"curves.png not written in {tmp_path / 'run'}: {MATPLOTLIB_HINT}"]
    assert MATPLOTLIB_HINT == "matplotlib is not installed: pip install matplotlib"


@needs_matplotlib
def test_plotter_draws_while_the_run_writes(tmp_path):
    folder = tmp_path / "run"
    records = [train_record(1)]
    write_run(folder, records, mlperf_lines(T0_MS, None, epochs=1))
    plotter = CurvePlotter(str(folder), say=pytest.fail)
    plotter.request()
    with open(folder / "log.json", "a") as handle:  # the next epochs arrive meanwhile
        for epoch in (2, 3):
            handle.write(json.dumps(train_record(epoch)) + "\n")
            handle.flush()
            plotter.request()
    plotter.close(timeout=60)
    assert plotter.drawn >= 1 and png_size(folder / "curves.png") == (1200, 1000)


@needs_matplotlib
def test_plotter_can_draw_in_a_child_process(tmp_path):
    folder = good_run(tmp_path / "run", 60)
    plotter = CurvePlotter(str(folder), write=write_curves_in_subprocess, say=pytest.fail)
    plotter.request()
    plotter.close(timeout=120)
    assert plotter.drawn == 1 and png_size(folder / "curves.png") == (1200, 1000)
    said = []
    plotter = CurvePlotter(str(tmp_path / "gone"), write=write_curves_in_subprocess, say=said.append)
    plotter.request()
    plotter.close(timeout=120)
    assert len(said) == 1 and said[0].startswith(f"curves.png not written in {tmp_path / 'gone'}: ")
    assert "\n" not in said[0] and "Traceback" not in said[0]
