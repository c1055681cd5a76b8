"""python -m runtime.submission: the runs, the package the official checkers judge, and the one
rule of which runs count (in the package and in the report's score).

Oracles: mlperf_logging's own package_checker, system_desc_checker and compliance checker (run
as their command lines, or their functions); the runs are this project's own tiny open-division
runs (main.py's code in this process, or main.py as a subprocess)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import easy_data
import run_records
from runtime.app import run as run_main
from runtime.arguments import parse_args
from runtime.results import validity as V
from runtime.report.cli import make_report
from runtime.submission.cli import main as submission_main
from runtime.submission.driver import (REPO, Found, SweepRequest, Surroundings, check_sweep, next_step, plan_seeds,
                                       plan_sweep, run_names, run_sweep)
from runtime.submission.package import CHECKERS, SEED_CHECKER, Checked, assemble
from runtime.submission.system import REQUIRED_FIELDS, describe

ROOT = Path(__file__).resolve().parent.parent
# ids 0..3: evaluation ids 00000 and 00003, training 00001 and 00002; 32³ patches, filters 2-8:
# one epoch of one step and one evaluation, a third of a second in this process
TINY = ["--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32", "--val_input_shape", "32", "32", "32",
        "--normalization", "batchnorm", "--batch_size", "2", "--optimizer", "adam", "--learning_rate", "0.01",
        "--device", "cpu", "--num_workers", "0", "--epochs", "1", "--start_eval_at", "1", "--evaluate_every", "1",
        "--quality_threshold", "0.001", "--submission_division", "open", "--submission_org", "TinyOrg",
        "--submission_platform", "cpu-tiny"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return easy_data.write_dataset(str(tmp_path_factory.mktemp("easy") / "data"), range(4))


def tiny_run(data: str, log_dir: Path, seed: int, *more: str) -> int:
    """One tiny training run of main.py's code in this process, its console swallowed; its
    record says it ran this checkout's HEAD."""
    argv = ["--data_dir", data, "--log_dir", str(log_dir), "--seed", str(seed), *TINY, *more]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = run_main(parse_args(argv))
    run_records.as_committed(log_dir)  # as if from a clean checkout (the code packed: HEAD's)
    return code


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def without(path: Path, key: str) -> None:
    """``path`` (an MLPerf log) with its ``key`` events removed: a run that crashed before it."""
    path.write_text("\n".join(line for line in lines(path) if f'"key": "{key}"' not in line) + "\n")


@pytest.fixture(scope="module")
def one_run(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one") / "run"
    assert tiny_run(data, folder, 5) in (0, 3)  # 3: diverged (a Dice of 0 after one step), still a timed run
    return folder


# -- the rule ---------------------------------------------------------------------------------------------------


def test_a_complete_run_counts_a_crashed_one_fails_and_a_resumed_one_is_not_a_result(one_run, tmp_path):
    events = V.read_events(str(one_run / "unet3d.log"))
    verdict = V.judge_events(events)
    assert verdict.counts and verdict.kind in (V.RESULT, V.NOT_CONVERGED)
    assert "cache_clear false" in verdict.note  # an open run: said, still counted
    no_stop = [e for e in events if e["key"] != "run_stop"]  # killed after run_start: a failed run
    assert V.judge_events(no_stop).kind == V.FAILED and V.judge_events(no_stop).counts
    assert V.judge_events(no_stop).infinite and "no run_stop" in V.judge_events(no_stop).reason
    no_start = V.judge_events([e for e in events if e["key"] not in ("run_start", "run_stop")])
    assert no_start.kind == V.NOT_A_RESULT and "no run_start: not a run" in no_start.reason
    start = next(i for i, e in enumerate(events) if e["key"] == "run_start")
    resumed = events[:start] + [{"key": "resumed_from_checkpoint", "value": "/c.pt", "metadata": {"epoch": 3}}] \
        + events[start:]
    assert V.judge_events(resumed).kind == V.NOT_A_RESULT and "/c.pt" in V.judge_events(resumed).reason
    on_clock = events[:start] + [{"key": "checkpoints_on_the_clock", "value": "/r/c.pt"}] + events[start:]
    assert V.judge_events(on_clock).kind == V.NOT_A_RESULT and "checkpoints" in V.judge_events(on_clock).reason


def test_a_run_that_missed_the_target_counts_as_failed_unless_the_checker_finds_more():
    assert V.classify("aborted").kind == V.NOT_CONVERGED
    # the closed checker's target test, which such a run fails by definition (closed_unet3d.yaml)
    target = "Failed checks for eval_accuracy : v['value'] >= 0.908"
    assert V.classify("aborted", compliance_problems=[target]).kind == V.NOT_CONVERGED
    other = "CHECK for 'init_stop' failed in line 57"
    assert V.classify("aborted", compliance_problems=[target, other]).kind == V.NOT_A_RESULT
    assert V.classify("success", compliance_problems=[other]).kind == V.NOT_A_RESULT
    assert V.classify("success", compliance_problems=[]).kind == V.RESULT
    assert V.classify("success", attempts=2).kind == V.NOT_A_RESULT


def test_the_reports_score_counts_a_run_without_run_stop_as_failed(one_run, tmp_path):
    """The report's score applies the package's rule: a run that crashed after run_start (no
    run_stop) is a failed run (infinite), where it used to be left out."""
    sweep = tmp_path / "sweep"
    for name in ("a", "b", "c", "crashed"):
        shutil.copytree(one_run, sweep / name)
    without(sweep / "crashed" / "unet3d.log", "run_stop")
    report = make_report([str(sweep)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None,
                         drop=1)
    score = report["score"]
    assert score.successful + score.failed == 4 and "crashed (seed 5)" in score.scored, score.text
    (crashed,) = [s for s in report["runs"] if s.label.startswith("crashed")]
    assert crashed.time_to_target_s is None and crashed.mlperf_status is None


# -- the system description ----------------------------------------------------------------------------------


def test_the_system_description_passes_the_official_checker(tmp_path):
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    description = describe("TinyOrg", "cpu-tiny", "open", "onprem")
    assert set(REQUIRED_FIELDS) <= set(description)
    assert description["host_processor_vcpu_count"] == str(os.cpu_count())
    path = tmp_path / "cpu-tiny.json"
    path.write_text(json.dumps(description))
    valid, name, _, _ = check_system_desc(str(path), "training", "4.0.0")
    assert valid and name == "cpu-tiny"
    description["status"] = "onprem"  # the log's word, not the description's: the checker refuses it
    path.write_text(json.dumps(description))
    assert not check_system_desc(str(path), "training", "4.0.0")[0]


def test_the_accelerators_are_described_from_torch(monkeypatch):
    """On a GPU machine (torch.cuda stood in for here): count, name and memory from torch, and
    the accelerator fields the machine cannot tell left to fill, not "N/A"."""
    import torch

    class Props:
        total_memory = 141 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: Props())
    description = describe("TinyOrg", "gpu-box", "closed", "cloud")
    assert (description["accelerators_per_node"], description["accelerator_model_name"],
            description["accelerator_memory_capacity"]) == ("8", "NVIDIA H200", "141 GiB")
    assert description["status"] == "Available cloud" and description["accelerator_interconnect"] == ""


# -- the driver ------------------------------------------------------------------------------------------------


def test_dry_run_gives_every_run_its_folder_and_seed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DATASET_DIR", str(tmp_path))
    assert submission_main(["runs", "--output", str(tmp_path / "runs"), "--runs", "3", "--dry_run",
                            "--", "--data_dir", "/d"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and not (tmp_path / "runs").exists()
    for name, line in zip(run_names(3), printed):
        assert f"RESULTS_DIR={tmp_path / 'runs' / name} " in line and "run_and_time.sh" in line
        assert line.endswith("--data_dir /d")
    seeds = [line.split("run_and_time.sh ")[1].split()[0] for line in printed]
    assert len(set(seeds)) == 3


def test_slurm_submits_one_job_per_run_with_its_seed_and_folder(tmp_path, monkeypatch):
    """A stand-in sbatch records its arguments: one job per run, each with SEED and RESULTS_DIR
    of its own; a second call submits nothing again."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch.txt"
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {record}\necho "Submitted batch job 7"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "runs"
    said = []
    flags = ["--epochs", "9", "--submission_division", "open"]  # --first_seed: open division only
    assert run_sweep(str(out), 2, flags, slurm=True, first_seed=11, sbatch_args=["-p", "gpu"],
                     say=said.append) == 0
    jobs = lines(record)
    assert len(jobs) == 2
    for name, seed, job in zip(run_names(2), (11, 12), jobs):
        assert f"--export ALL,SEED={seed},RESULTS_DIR={out / name},UNET3D_SEED_SOURCE=given -p gpu " in job
        assert job.endswith("single_node.sbatch --epochs 9 --submission_division open")
    assert json.loads((out / "seeds.json").read_text()) == {"run_00": 11, "run_01": 12}
    assert json.loads((out / "jobs.json").read_text()) == {"run_00": "7", "run_01": "7"}
    # the jobs are still queued (squeue knows them): nothing is submitted again
    (bin_dir / "squeue").write_text('#!/bin/sh\necho PENDING\n')
    (bin_dir / "squeue").chmod(0o755)
    run_sweep(str(out), 2, slurm=True, say=said.append)
    assert len(lines(record)) == 2 and sum("its job 7 is pending: not submitted again" in s for s in said) == 2
    # one ran (its log reached run_start), the other's job left the queue without: that one again
    (out / "run_00" / "unet3d.log").write_text(':::MLLOG {"key": "run_start", "value": null}\n')
    (bin_dir / "squeue").write_text('#!/bin/sh\necho "slurm_load_jobs error: Invalid job id specified" >&2\nexit 1\n')
    run_sweep(str(out), 2, slurm=True, recipe="gbs28", say=said.append)
    assert len(lines(record)) == 3 and f"RESULTS_DIR={out / 'run_01'},RECIPE=gbs28,UNET3D_SEED_SOURCE=os " in lines(record)[-1]
    assert any("run_00" in s and "holds a run, not run again" in s for s in said)


def test_local_runs_each_in_its_folder_with_its_seed(data, tmp_path):
    """Two runs of main.py as subprocesses: two folders, two MLPerf logs, the seeds planned."""
    out = tmp_path / "runs"
    code = submission_main(["runs", "--output", str(out), "--runs", "2", "--launcher", "main", "--",
                            "--data_dir", data, *TINY])
    assert code in (0, 4)
    seeds = json.loads((out / "seeds.json").read_text())
    assert len(set(seeds.values())) == 2
    for name in run_names(2):
        logged = [e["value"] for e in V.read_events(str(out / name / "unet3d.log")) if e["key"] == "seed"]
        assert logged == [seeds[name]], (out / f"{name}.console.txt").read_text()[-2000:]
    # only the fields machines cannot tell: the counts and models come from the runs' records
    to_fill = json.loads((out / "system-fields.json").read_text())
    assert to_fill and set(to_fill) <= set(REQUIRED_FIELDS)
    assert not {"submitter", "system_name", "division", "status", "number_of_nodes", "accelerators_per_node",
                "host_processor_model_name"} & set(to_fill)


FAKE_RUN_AND_TIME = """#!/usr/bin/env bash
# stands in for run_and_time.sh: what reached it, then the exit status asked for
printf '%s %s %s %s\\n' "$1" "$PYTHON" "$RESULTS_DIR" "${RECIPE:-}" >> "$FAKE_RECORD"
exit "${FAKE_EXIT:-0}"
"""


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """The driver's checkout replaced by one whose run_and_time.sh records its arguments and
    environment (``FAKE_RECORD``); DATASET_DIR set to a folder."""
    from runtime.submission import driver

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "run_and_time.sh").write_text(FAKE_RUN_AND_TIME)
    monkeypatch.setattr(driver, "REPO", str(repo))
    record = tmp_path / "record.txt"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("DATASET_DIR", str(tmp_path))
    monkeypatch.setenv("REFERENCE_DATA_DIR", str(tmp_path / "no-data"))  # not this machine's /data
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no venv's python on PATH: the driver must say which
    return record


def test_local_runs_get_the_drivers_own_interpreter_and_recipe(fake_repo, tmp_path):
    out = tmp_path / "runs"
    assert run_sweep(str(out), 2, recipe="gbs56", say=lambda line: None) == 0
    recorded = [line.split() for line in lines(fake_repo)]
    assert [r[1] for r in recorded] == [sys.executable] * 2 and [r[3] for r in recorded] == ["gbs56"] * 2
    assert [r[2] for r in recorded] == [str(out / n) for n in run_names(2)]


@pytest.mark.parametrize("dataset, message", [(None, "DATASET_DIR is not set"),
                                              ("nowhere", "DATASET_DIR=.*nowhere: no such folder")])
def test_a_missing_dataset_is_refused_before_the_first_run(fake_repo, tmp_path, monkeypatch, capsys, dataset, message):
    if dataset is None:
        monkeypatch.delenv("DATASET_DIR")
    else:
        monkeypatch.setenv("DATASET_DIR", str(tmp_path / dataset))
    for dry in ([], ["--dry_run"]):
        assert submission_main(["runs", "--output", str(tmp_path / "runs"), "--runs", "2", *dry]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(message, err), err
    assert not fake_repo.exists() and not (tmp_path / "runs").exists()


def test_without_dataset_dir_the_references_data_folder_is_used_when_it_holds_a_dataset(fake_repo, tmp_path,
                                                                                      monkeypatch):
    """run_and_time.sh reads /data (here REFERENCE_DATA_DIR) when no DATASET_DIR is given and it
    holds a preprocessed dataset: the driver lets the runs go."""
    monkeypatch.delenv("DATASET_DIR")
    (tmp_path / "no-data").mkdir()
    (tmp_path / "no-data" / "case_00000_x.npy").write_bytes(b"")
    assert submission_main(["runs", "--output", str(tmp_path / "runs"), "--runs", "1"]) == 0
    assert len(lines(fake_repo)) == 1


def test_a_folder_without_run_start_runs_again_and_its_files_are_kept(fake_repo, tmp_path):
    """run_00: an attempt that failed before the clock (a log without run_start) runs again;
    run_01: a run (run_start in its log) and run_02: a run moved aside into previous-* are kept."""
    out = tmp_path / "runs"
    for name in run_names(3):
        (out / name).mkdir(parents=True)
    (out / "run_00" / "unet3d.log").write_text(':::MLLOG {"key": "init_start", "value": null}\n')
    (out / "run_00.console.txt").write_text("the first attempt's console\n")
    (out / "run_01" / "unet3d.log").write_text(':::MLLOG {"key": "run_start", "value": null}\n')
    (out / "run_02" / "previous-20260101-000000").mkdir()
    (out / "run_02" / "previous-20260101-000000" / "unet3d.log").write_text(':::MLLOG {"key": "run_start"}\n')
    said = []
    assert run_sweep(str(out), 3, say=said.append) == 0
    assert [line.split()[2] for line in lines(fake_repo)] == [str(out / "run_00")]
    assert (out / "run_00" / "unet3d.log").exists()  # the training moves it aside; the driver never deletes
    console = lines(out / "run_00.console.txt")
    assert console[0] == "the first attempt's console" and console[1].startswith("=== run_00: seed ")
    assert sum("holds a run, not run again" in line for line in said) == 2


def test_first_seed_is_refused_for_a_closed_submission(fake_repo, tmp_path, capsys):
    out = str(tmp_path / "runs")
    assert submission_main(["runs", "--output", out, "--runs", "2", "--first_seed", "5"]) == 1
    assert "--first_seed 5" in capsys.readouterr().err and not fake_repo.exists()  # nothing ran
    assert submission_main(["runs", "--output", out, "--runs", "2", "--first_seed", "5", "--",
                            "--submission_division", "closed"]) == 1
    assert "not allowed in the closed division" in capsys.readouterr().err
    assert submission_main(["runs", "--output", out, "--runs", "2", "--first_seed", "5", "--",
                            "--submission_division", "open"]) == 0
    assert [line.split()[0] for line in lines(fake_repo)] == ["5", "6"]


@pytest.mark.parametrize("args, message", [(["--recipe", "gbs99"], "--recipe gbs99: no such recipe"),
                                           (["--recipe", "gbs28", "--launcher", "main"], "--launcher run_and_time")])
def test_a_recipe_that_cannot_apply_is_refused(fake_repo, tmp_path, capsys, args, message):
    assert submission_main(["runs", "--output", str(tmp_path / "runs"), *args]) == 1
    assert message in capsys.readouterr().err and not fake_repo.exists()


# -- the driver's check and plan: pure, known answers ------------------------------------------------------------

GOOD = SweepRequest("/sweep", 2)
HERE = Surroundings(dataset="/kits19", dataset_found=True, job_script="/jobs/one.sbatch", job_script_found=True,
                    recipes=("gbs28", "gbs56"))


@pytest.mark.parametrize("asked, there, problem", [
    (dict(count=0), {}, "--runs 0: at least 1"),
    (dict(launcher="srun"), {}, "--launcher 'srun': one of run_and_time, main"),
    ({}, dict(output_is_file=True), "--output /sweep is a file, not a folder"),
    (dict(flags=("--epochs", "9", "--seed=7")), {}, "-- --seed=7: runs gives every run its own seed"),
    (dict(first_seed=5), {}, "--first_seed 5: seeds 5, 6, ... are not allowed in the closed division"),
    (dict(recipe="gbs99"), {}, "--recipe gbs99: no such recipe in "),
    (dict(recipe="gbs28", launcher="main"), {}, "--recipe gbs28: recipes are run_and_time.sh's"),
    ({}, dict(dataset=""), "DATASET_DIR is not set and /data holds no preprocessed dataset"),
    ({}, dict(dataset="/nowhere", dataset_found=False), "DATASET_DIR=/nowhere: no such folder"),
    (dict(slurm=True), dict(job_script_found=False), "--job_script /jobs/one.sbatch not found"),
    (dict(slurm=True, output="/a,b"), {}, "--output /a,b: a comma in the path would break sbatch --export"),
    ({}, dict(unreadable=("cannot read /sweep/seeds.json: not a JSON object",)), "cannot read /sweep/seeds.json"),
    (dict(first_seed=5, flags=("--submission_division", "open")), dict(seeds={"run_00": 6}),
     "seed 6 for run_01 is already another run's (in seeds.json)"),
])
def test_check_sweep_names_each_refusal_in_one_line(asked, there, problem):
    problems = check_sweep(dataclasses.replace(GOOD, **asked), dataclasses.replace(HERE, **there))
    assert len(problems) == 1 and problems[0].startswith(problem) and "\n" not in problems[0], problems


def test_check_sweep_passes_a_good_request_and_tells_every_problem_in_order():
    assert check_sweep(GOOD, HERE) == []
    # SLURM runs read the dataset on the cluster; --recipe with --launcher main is fine under --slurm
    assert check_sweep(dataclasses.replace(GOOD, slurm=True, launcher="main", recipe="gbs28"),
                       dataclasses.replace(HERE, dataset="")) == []
    assert check_sweep(dataclasses.replace(GOOD, count=0), dataclasses.replace(HERE, dataset="", output_is_file=True)) \
        == ["--runs 0: at least 1", "--output /sweep is a file, not a folder",
            "DATASET_DIR is not set and /data holds no preprocessed dataset: run_and_time.sh would train every run on "
            "generated synthetic data; set it to the preprocessed KiTS19 folder"]


@pytest.mark.parametrize("found, slurm, runs, said", [
    (Found(), False, True, ""),
    (Found(exists=True, holds_a_run=True), True, False, "run_03: /s/run_03 holds a run, not run again"),
    (Found(exists=True), False, True, "run_03: /s/run_03 holds no run (no run_start): run again, its files kept aside"),
    (Found(exists=True), True, False, "run_03: /s/run_03 holds no run yet and no job of it is known: not submitted "
                                      "again"),
    (Found(True, False, "7", ""), True, True, "run_03: /s/run_03 holds no run and its job 7 has left the queue: "
                                              "submitted again"),
    (Found(True, False, "7", "PENDING"), True, False, "run_03: /s/run_03 holds no run yet, its job 7 is pending: not "
                                                      "submitted again"),
    (Found(True, False, "7", None), True, False, "run_03: /s/run_03 holds no run yet, squeue cannot tell of job 7: "
                                                 "not submitted again"),
])
def test_next_step_of_a_run_folder(found, slurm, runs, said):
    assert next_step("run_03", "/s/run_03", found, slurm) == (runs, said)


def test_plan_seeds_keeps_known_seeds_and_never_reuses_one():
    draws = iter([3, 3, 4, 9])
    assert plan_seeds(run_names(3), {"run_00": 3}, None, draw=lambda: next(draws)) == {
        "run_00": 3, "run_01": 4, "run_02": 9}
    assert plan_seeds(run_names(3), {"run_01": 50}, 10) == {"run_00": 10, "run_01": 50, "run_02": 12}


def test_plan_sweep_launches_the_runs_not_made_yet_with_their_seeds_and_folders():
    asked = SweepRequest("/s", 3, ("--epochs", "9", "--submission_division", "open"), "main", first_seed=10)
    found = {"run_00": Found(), "run_01": Found(exists=True, holds_a_run=True), "run_02": Found(exists=True)}
    plan = plan_sweep(asked, dataclasses.replace(HERE, seeds={"run_01": 50}), found)
    assert plan.seeds == {"run_00": 10, "run_01": 50, "run_02": 12} and not plan.slurm
    assert [(run.name, run.folder, run.seed) for run in plan.launches] == [("run_00", "/s/run_00", 10),
                                                                        ("run_02", "/s/run_02", 12)]
    assert plan.launches[1].command == (sys.executable, os.path.join(REPO, "main.py"), "--seed", "12", "--log_dir",
                                        "/s/run_02", "--epochs", "9", "--submission_division", "open")
    assert plan.launches[1].env == {"UNET3D_SEED_SOURCE": "given"}
    assert plan.notes == ("run_01: /s/run_01 holds a run, not run again",
                          "run_02: /s/run_02 holds no run (no run_start): run again, its files kept aside")
    # under --slurm: one sbatch per run, its seed, folder and recipe exported; a job still queued waits
    asked = SweepRequest("/s", 2, ("--epochs", "9"), slurm=True, sbatch_args=("-p", "gpu"), recipe="gbs28")
    plan = plan_sweep(asked, dataclasses.replace(HERE, seeds={"run_00": 4, "run_01": 5}, jobs={"run_01": "8"}),
                      {"run_00": Found(True, False, "7", ""), "run_01": Found(True, False, "8", "RUNNING")})
    (run,) = plan.launches
    assert run.command == ("sbatch", "--job-name", "unet3d-run_00", "--export",
                           "ALL,SEED=4,RESULTS_DIR=/s/run_00,RECIPE=gbs28,UNET3D_SEED_SOURCE=os", "-p", "gpu",
                           "/jobs/one.sbatch", "--epochs", "9") and run.env == {}
    assert plan.jobs == {"run_01": "8"} and plan.notes[1].endswith("its job 8 is running: not submitted again")


# -- the package ------------------------------------------------------------------------------------------------


def test_package_refuses_a_used_output_folder_and_runs_of_two_systems(one_run, tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("keep")
    assert submission_main(["package", str(one_run), "--output", str(used), "--no_check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(used) in err and (used / "mine.txt").read_text() == "keep"
    other = tmp_path / "other"
    shutil.copytree(one_run, other)
    log = other / "unet3d.log"
    log.write_text(log.read_text().replace('"cpu-tiny"', '"cpu-big"'))
    assert submission_main(["package", str(one_run), str(other), "--output", str(tmp_path / "p"), "--no_check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "submission_platform" in err and "cpu-big" in err
    assert not (tmp_path / "p").exists()


def test_the_checkers_table_builds_each_command_and_reads_each_verdict(tmp_path):
    """One row per official checker: its command line and how its verdict reads, known answers on
    canned outputs (the real checkers run in the next test)."""
    results = tmp_path / "org" / "results" / "sys" / "unet3d"
    results.mkdir(parents=True)
    for name in ("result_1.txt", "result_0.txt", "run_description_0.json"):
        (results / name).write_text("")
    package = Checked(str(tmp_path / "org"), str(results), "4.0.0")
    table = {checker.name: checker for checker in CHECKERS}
    assert list(table) == ["package_checker", "rcp_checker", "seed_checker"]
    assert table["package_checker"].arguments(package, "L") == [
        "-m", "mlperf_logging.package_checker", str(tmp_path / "org"), "training", "4.0.0", "--log_output", "L"]
    assert table["rcp_checker"].arguments(package, "L") == [
        "-m", "mlperf_logging.rcp_checker", str(results), "--rcp_usage", "training", "--rcp_version", "4.0.0",
        "--log_output", "L"]
    assert table["seed_checker"].arguments(package, "L") == ["-c", SEED_CHECKER, "4.0.0", str(results / "result_0.txt"),
                                                             str(results / "result_1.txt")]
    assert [checker.writes_its_log for checker in CHECKERS] == [True, True, False]

    def verdict(name, code, text, stderr=""):
        return table[name].verdict(subprocess.CompletedProcess([], code, text, stderr), text)

    assert verdict("package_checker", 0, "INFO - x\nPACKAGE CHECKER FOUND NO ERRORS, SUCCESS\n") == {
        "passed": True, "summary": "no errors, SUCCESS", "errors": [], "warnings": []}
    assert verdict("package_checker", 0, "ERROR - expected 40 files\nWARNING - odd file\n") == {
        "passed": False, "summary": "found errors", "errors": ["expected 40 files"], "warnings": ["odd file"]}
    assert verdict("package_checker", 1, "", "Traceback\nImportError: no module") == {
        "passed": False, "summary": "found errors", "errors": ["ImportError: no module"], "warnings": []}
    assert verdict("rcp_checker", 0, "INFO - RCP Record: 1\nINFO - Submission mean 2\nINFO - RCP Test Passed\n") == {
        "passed": True, "summary": "RCP Test Passed", "errors": [], "warnings": [],
        "details": ["RCP Record: 1", "Submission mean 2"]}
    assert verdict("rcp_checker", 1, "", "  no such folder \n")["summary"] == "no such folder"
    assert verdict("seed_checker", 0, "INFO - fine\n") == {
        "passed": True, "summary": "every run logs its own seed", "errors": [], "warnings": []}
    assert verdict("seed_checker", 1, "ERROR - the same seed\n") == {
        "passed": False, "summary": "failed", "errors": ["the same seed"], "warnings": []}


def test_two_runs_with_one_seed_fail_the_official_seed_checker(one_run, tmp_path, capsys):
    """The same run twice (one seed logged on the same line by both): mlperf_logging's seed
    checker fails the package, and the report says so; the package checker, which wants 40
    result files, refuses 2: exit code 4."""
    for name in ("a", "b"):
        shutil.copytree(one_run, tmp_path / "sweep" / name)
    assert submission_main(["package", str(tmp_path / "sweep"), "--output", str(tmp_path / "package"),
                            "--expected_runs", "2", "--no_code"]) == 4
    assert "seed_checker**: FAIL" in capsys.readouterr().out
    report = json.loads((tmp_path / "package" / "report.json").read_text())
    seeds = report["checkers"]["seed_checker"]
    assert not seeds["passed"] and "already logs the same seed on the same line" in " ".join(seeds["errors"])
    package = report["checkers"]["package_checker"]
    assert not package["passed"] and any("expected 40" in e for e in package["errors"])
    assert not report["accepted"] and "seed_checker**: FAIL" in (tmp_path / "package" / "report.md").read_text()


@pytest.mark.slow
def test_the_official_package_checker_accepts_a_package_of_the_projects_own_runs(data, tmp_path):
    """39 tiny open-division runs (each in its own folder, its own seed), one of them killed
    after run_start (its log cut before run_stop) and run again in the same folder, which moves
    the killed attempt into previous-<time>/; plus a run that wrote checkpoints on the clock.
    The package holds the 40 attempts, the killed one as a failed run; the report names the one
    left out and why; mlperf_logging's package checker, run as its command line on the package,
    accepts it (a non-compliant file is a failed run, up to 4 for unet3d)."""
    sweep = tmp_path / "sweep"
    for index in range(39):
        if index == 7:  # the attempt SIGKILLed after run_start, then the rerun
            tiny_run(data, sweep / "run_07", 300)
            without(sweep / "run_07" / "unet3d.log", "run_stop")
        tiny_run(data, sweep / f"run_{index:02d}", 100 + index)
    (killed,) = [p for p in (sweep / "run_07").iterdir() if p.name.startswith("previous-")]
    tiny_run(data, sweep / "on_the_clock", 200, "--save_ckpt_path", str(tmp_path / "c.pt"), "--ckpt_during_run")
    out = tmp_path / "package"
    report = assemble([str(sweep)], str(out), say=lambda _: None)

    results = out / "TinyOrg" / "results" / "cpu-tiny" / "unet3d"
    assert sorted(os.listdir(results)) == sorted([f"result_{i}.txt" for i in range(40)]
                                                 + [f"run_description_{i}.json" for i in range(40)])
    runs = {Path(r["folder"]).name: r for r in report["runs"]}
    assert runs["on_the_clock"]["packed_as"] is None and "checkpoints" in runs["on_the_clock"]["reason"]
    assert runs[killed.name]["kind"] == V.FAILED and runs[killed.name]["packed_as"]
    assert (results / runs[killed.name]["packed_as"]).read_bytes() == (killed / "unet3d.log").read_bytes()
    assert (results / runs["run_08"]["packed_as"]).read_bytes() == (sweep / "run_08" / "unet3d.log").read_bytes()

    # the oracle, independently: the official package checker's command line on the package
    log = tmp_path / "checker.log"
    subprocess.run([sys.executable, "-m", "mlperf_logging.package_checker", str(out / "TinyOrg"), "training",
                    "4.0.0", "--log_output", str(log)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    text = log.read_text()
    assert "PACKAGE CHECKER FOUND NO ERRORS, SUCCESS" in text, text[-3000:]
    assert "System description checker passed for cpu-tiny" in text and text.count("Running compliance on file") == 40
    assert "accepting this under olympic scoring" in text  # the killed attempt: a failed run
    assert report["accepted"] and report["checkers"]["package_checker"]["passed"]
    # what the checker could not check is said; for an open package the seed and RCP checks are not its
    markdown = (out / "report.md").read_text()
    assert "## What the checkers could not check" in markdown and "closed-division packages only" in markdown
    assert "on_the_clock" in markdown and f"run_07/{killed.name}" in markdown
