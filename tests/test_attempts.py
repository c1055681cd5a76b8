"""What makes an attempt an MLPerf result, and one folder one run (issue 41, items 4 and 5).

- A timed run writes its checkpoint once, after ``run_stop`` (the reference's timed run writes
  none on the clock); ``--ckpt_during_run`` writes them during the run and its log then says
  ``checkpoints_on_the_clock``.
- An attempt that started from a checkpoint says ``resumed_from_checkpoint`` in its MLPerf log.
- The report and its score leave both out and say why.
- A new run in a used ``--log_dir`` moves every file of the last run (and its checkpoint) into a
  ``previous-<time>`` folder: nothing deleted, nothing stitched onto the new run.

The times are checked against the MLPerf log's own ``time_ms`` (the oracle is the log and the
file system, not the code that decides when to save).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest

import fake_data
from main_runs import TINY, TRAINED, call
from runtime.report.cli import make_report
from runtime.results.runs import find_runs
from runtime.run_files import CHECKPOINTS_ON_THE_CLOCK, PREVIOUS_RUN_PREFIX, RESUMED_FROM_CHECKPOINT

EVAL_EVERY_EPOCH = ["--start_eval_at", "1", "--evaluate_every", "1", "--quality_threshold", "1.0"]
# Runs that several tests read (the shared_runs fixture: one run each per session).
CKPT_DURING_RUN = TINY + EVAL_EVERY_EPOCH + ["--epochs", "2", "--log_dir", "{run}/l", "--save_ckpt_path", "{run}/c.pt",
                                             "--ckpt_during_run"]


def events(path) -> list[dict]:
    """The ``:::MLLOG`` records of an MLPerf log, read with json only."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in handle if line.startswith(":::MLLOG ")]


def event_time(records, key) -> int:
    (found,) = [r["time_ms"] for r in records if r["key"] == key]
    return found


@pytest.fixture
def save_times(monkeypatch):
    """time.time() at the start and end of every checkpoint write."""
    import runtime.checkpoint as ckpt

    original, times = ckpt.atomic_save, []

    def timed(obj, path):
        start = time.time()
        original(obj, path)
        times.append((start, time.time()))

    monkeypatch.setattr(ckpt, "atomic_save", timed)
    return times


def test_a_timed_run_writes_its_checkpoint_after_run_stop_only(tmp_path, capsys, save_times):
    ckpt = tmp_path / "c.pt"
    argv = TINY + EVAL_EVERY_EPOCH + ["--epochs", "3", "--log_dir", str(tmp_path / "l"), "--save_ckpt_path", str(ckpt)]
    code, out, _ = call(argv, capsys, fake_data.FakeData())
    assert code == 0
    log = events(tmp_path / "l" / "unet3d.log")
    stop_ms = event_time(log, "run_stop")
    assert len([r for r in log if r["key"] == "eval_accuracy"]) == 3  # three evaluations, none saved on the clock
    assert len(save_times) == 1 and save_times[0][0] * 1000 >= stop_ms
    assert os.path.getmtime(ckpt) * 1000 >= stop_ms
    assert not any(r["key"] in (CHECKPOINTS_ON_THE_CLOCK, RESUMED_FROM_CHECKPOINT) for r in log)
    assert "not an MLPerf result" not in out


def test_checkpoints_during_the_run_are_asked_for_and_marked(tmp_path, capsys, shared_runs):
    run = shared_runs.run(CKPT_DURING_RUN, capsys)
    ckpt = run.folder / "c.pt"
    assert run.code == 0 and "not an MLPerf result" in run.out
    log = events(run.folder / "l" / "unet3d.log")
    start_ms, stop_ms = event_time(log, "run_start"), event_time(log, "run_stop")
    assert any(start_ms <= t * 1000 < stop_ms for t, _ in run.save_times)  # written on the clock, as asked
    (marker,) = [r for r in log if r["key"] == CHECKPOINTS_ON_THE_CLOCK]
    assert marker["value"] == str(ckpt) and marker["time_ms"] <= start_ms
    report = make_report([str(run.folder / "l")], str(tmp_path / "report"), check=False, draw=False,
                         say=lambda _: None)
    (summary,) = report["runs"]
    assert not summary.is_result and "checkpoints between run_start and run_stop" in summary.not_a_result[0]
    assert "left out, not MLPerf results" in report["score"].text


def test_ckpt_every_epochs_asks_for_checkpoints_on_the_clock(tmp_path, capsys):
    argv = TINY + ["--start_eval_at", "10", "--epochs", "2", "--ckpt_every_epochs", "1", "--ckpt_every_minutes", "0",
                   "--log_dir", str(tmp_path / "l"), "--save_ckpt_path", str(tmp_path / "c.pt")]
    assert call(argv, capsys, fake_data.FakeData())[0] == 0
    assert [r["key"] for r in events(tmp_path / "l" / "unet3d.log")].count(CHECKPOINTS_ON_THE_CLOCK) == 1


def test_a_resumed_attempt_says_so_and_is_not_counted(tmp_path, capsys):
    ckpt, log_dir = tmp_path / "c.pt", tmp_path / "l"
    argv = TINY + ["--start_eval_at", "10", "--log_dir", str(log_dir), "--save_ckpt_path", str(ckpt)]
    assert call(argv + ["--epochs", "2"], capsys, fake_data.FakeData())[0] == 0  # finished: resumable
    code, out, _ = call(argv + ["--epochs", "3", "--resume"], capsys, fake_data.FakeData())
    assert code == 0 and "resuming" in out
    (resumed_log,) = [p for p in os.listdir(log_dir) if p.startswith("unet3d.resumed-")]
    records = events(log_dir / resumed_log)
    (marker,) = [r for r in records if r["key"] == RESUMED_FROM_CHECKPOINT]
    assert marker["value"] == str(ckpt) and marker["metadata"]["epoch"] == 2
    assert marker["time_ms"] <= event_time(records, "run_start")
    assert not any(r["key"] == RESUMED_FROM_CHECKPOINT for r in events(log_dir / "unet3d.log"))
    report = make_report([str(log_dir)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    (summary,) = report["runs"]
    assert not summary.is_result
    assert any(resumed_log in why and "resumed from the checkpoint" in why and "after epoch 2" in why
               for why in summary.not_a_result)
    assert report["score"].successful == 0 and report["score"].failed == 0
    with open(report["summary_json"], encoding="utf-8") as handle:
        assert json.load(handle)["runs"][0]["is_result"] is False


def test_a_new_run_moves_every_file_of_the_last_run_out_of_its_way(tmp_path, capsys):
    """The issue's case: the last run's resumed log (a success) stayed in the folder and the
    report stitched it onto a new run that never evaluated ("success, time to target 45 s")."""
    log_dir, ckpt = tmp_path / "l", tmp_path / "l" / "checkpoint.pt"
    argv = TINY + ["--log_dir", str(log_dir), "--save_ckpt_path", str(ckpt)]
    assert call(argv + EVAL_EVERY_EPOCH + ["--epochs", "1"], capsys, fake_data.FakeData())[0] == 0
    # what a resumed attempt, evaluate and --plot leave
    (log_dir / "unet3d.resumed-20260101-000000.log").write_text((log_dir / "unet3d.log").read_text())
    (log_dir / "eval_cases.csv").write_text("case\n")
    (log_dir / "curves.png").write_bytes(b"png")
    (log_dir / "notes.txt").write_text("the user's own")
    old = {name: (log_dir / name).read_bytes() for name in os.listdir(log_dir) if not name.startswith(".")}
    code, out, _ = call(argv + ["--start_eval_at", "10", "--epochs", "1"], capsys, fake_data.FakeData())
    assert code == 0
    (previous,) = [p for p in os.listdir(log_dir) if p.startswith(PREVIOUS_RUN_PREFIX)]
    moved = {name: (log_dir / previous / name).read_bytes() for name in os.listdir(log_dir / previous)}
    assert moved == {name: data for name, data in old.items() if name != "notes.txt"}  # byte for byte
    assert (log_dir / "notes.txt").read_text() == "the user's own"  # not a run's file: left alone
    assert sorted(p for p in os.listdir(log_dir) if not p.startswith(".")) == sorted(
        ["checkpoint.pt", "log.json", "notes.txt", "run_description.json", "unet3d.log", previous])
    assert sum(line.startswith("--log_dir: moved the previous run's files") for line in out.splitlines()) == 1
    report = make_report([str(log_dir)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    earlier, summary = report["runs"]  # the moved run is listed as an attempt of the folder, apart
    assert earlier.folder == str(log_dir / previous) and earlier.attempts == 2 and not earlier.is_result
    assert summary.attempts == 1 and summary.status != "success" and summary.time_to_target_s is None
    assert find_runs(str(tmp_path)) == [str(log_dir)]  # previous-* is read with its folder, not as one more


def test_a_new_run_keeps_the_last_runs_checkpoint_elsewhere_aside(tmp_path, capsys, shared_runs):
    ckpt = tmp_path / "weights" / "c.pt"
    argv = TINY + ["--start_eval_at", "10", "--epochs", "1", "--save_ckpt_path", str(ckpt)]
    first = shared_runs.run(TRAINED, capsys)  # the last run, its checkpoint where this run writes its own
    assert first.code == 0
    ckpt.parent.mkdir()
    shutil.copy2(first.folder / "c.pt", ckpt)
    before = ckpt.read_bytes()
    code, out, _ = call(argv + ["--log_dir", str(tmp_path / "b")], capsys, fake_data.FakeData())
    assert code == 0
    (kept,) = [p for p in os.listdir(ckpt.parent) if p.startswith("c." + PREVIOUS_RUN_PREFIX) and p.endswith(".pt")]
    assert (ckpt.parent / kept).read_bytes() == before and ckpt.read_bytes() != before
    assert f"kept the previous run's checkpoint as {ckpt.parent / kept}" in out


def test_move_previous_run_never_overwrites(tmp_path):
    from runtime.outputs import move_previous_run

    stamp = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    for round_ in range(3):
        (tmp_path / "unet3d.log").write_text(f"run {round_}")
        os.utime(tmp_path / "unet3d.log", (stamp, stamp))
        (line,) = move_previous_run(str(tmp_path))
        assert "unet3d.log" in line
    folders = sorted(p for p in os.listdir(tmp_path) if p.startswith(PREVIOUS_RUN_PREFIX))
    assert folders == ["previous-20260102-030405", "previous-20260102-030405.1", "previous-20260102-030405.2"]
    assert sorted((tmp_path / f / "unet3d.log").read_text() for f in folders) == ["run 0", "run 1", "run 2"]
    assert move_previous_run(str(tmp_path)) == []  # nothing left to move


def test_the_markers_keep_the_official_checker_reading_the_log(tmp_path, capsys, shared_runs):
    """mlperf_logging's compliance checker allows keys it does not know: a marked log gets the
    same verdict as the log without the marker lines."""
    from runtime.results.compliance import check_compliance

    run = shared_runs.run(CKPT_DURING_RUN, capsys)
    assert run.code == 0
    marked = run.folder / "l" / "unet3d.log"
    plain = tmp_path / "plain.log"
    plain.write_text("".join(line for line in marked.read_text().splitlines(keepends=True)
                             if CHECKPOINTS_ON_THE_CLOCK not in line))
    assert CHECKPOINTS_ON_THE_CLOCK in marked.read_text()
    with_marker, without = check_compliance(str(marked)), check_compliance(str(plain))

    def problems(verdict):  # the marked log has one more line: the same problems one line later
        return [re.sub(r"in line \d+", "in line N", problem) for problem in verdict.problems]

    assert with_marker.checked and problems(with_marker) == problems(without)
    assert not any("parse error" in problem for problem in with_marker.problems)


def test_the_report_never_stitches_an_earlier_runs_resumed_log_onto_a_later_run(tmp_path, capsys, shared_runs):
    """A folder reused by an older version (nothing moved): the earlier run's resumed attempt
    (a success) started before the folder's unet3d.log, so it is not this run's."""
    run = shared_runs.run(TRAINED, capsys)
    assert run.code == 0
    log_dir = tmp_path / "l"
    shutil.copytree(run.folder / "l", log_dir)
    lines = (log_dir / "unet3d.log").read_text().splitlines()
    earlier = []
    for line in lines:  # the same run 100 s earlier, ending in success
        record = json.loads(line.split(":::MLLOG ", 1)[1])
        record["time_ms"] -= 100_000
        if record["key"] == "run_stop":
            record["metadata"]["status"] = "success"
        earlier.append(":::MLLOG " + json.dumps(record))
    (log_dir / "unet3d.resumed-20200101-000000.log").write_text("\n".join(earlier) + "\n")
    report = make_report([str(log_dir)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)
    (summary,) = report["runs"]
    assert summary.attempts == 1 and summary.status != "success" and summary.time_to_target_s is None
    assert any("an earlier run's attempt, left out" in note for note in summary.notes)


def test_a_warm_start_from_trained_weights_says_so_and_is_not_counted(tmp_path, capsys, shared_runs):
    """--load_ckpt_path in training: the weights of another run, not the benchmark's
    initialisation; the log says so (resumed_from_checkpoint, weights_only) and the report
    leaves the run out."""
    base = TINY + ["--start_eval_at", "10", "--epochs", "1"]
    first = shared_runs.run(TRAINED, capsys)  # a training's weights
    assert first.code == 0
    weights = first.folder / "c.pt"
    assert call(base + ["--log_dir", str(tmp_path / "b"), "--load_ckpt_path", str(weights)], capsys,
                fake_data.FakeData())[0] == 0
    (marker,) = [r for r in events(tmp_path / "b" / "unet3d.log") if r["key"] == RESUMED_FROM_CHECKPOINT]
    assert marker["value"] == str(weights) and marker["metadata"]["weights_only"] is True
    report = make_report([str(tmp_path / "b")], str(tmp_path / "report"), check=False, draw=False,
                         say=lambda _: None)
    (summary,) = report["runs"]
    assert not summary.is_result and "started from the trained weights" in summary.not_a_result[0]
