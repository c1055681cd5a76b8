"""``make gpu-check``: its CPU smoke path end to end, which tests it counts as CUDA tests, and the
numbers it reads from the outputs of its steps (known texts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def gpu_check(function: str, *args):
    """``benchmarks.gpu_check.<function>(*args)`` run in a child process (no test imports the
    benchmarks), its result through JSON."""
    code = (f"import json, sys; from benchmarks.gpu_check import {function}; "
            f"print(json.dumps({function}(*json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def prediction_numbers(text):
    return gpu_check("prediction_numbers", text)


def result_numbers(text):
    return gpu_check("result_numbers", text)


def junit_counts(path):
    return gpu_check("junit_counts", str(path))


@pytest.mark.slow
def test_without_cuda_it_runs_its_cpu_smoke_path_and_says_so(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=NO_CUDA)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU smoke path" in proc.stdout.splitlines()[0] and "every step ok" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["smoke"] is True and summary["seconds"] < 570
    steps = {step["name"]: step for step in summary["steps"]}
    assert list(steps) == ["cuda_tests", "ladder", "time_to_train", "convergence"]
    assert all(step["status"] == "ok" for step in steps.values()), steps
    assert steps["cuda_tests"]["numbers"]["collected"] >= 9 and "not run: no CUDA GPU" in steps["cuda_tests"]["note"]
    assert steps["convergence"]["numbers"]["epochs"] == 2
    assert steps["ladder"]["numbers"]["rows"] == 1 and (out / "ladder.md").is_file()
    numbers = steps["time_to_train"]["numbers"]
    assert numbers["global_batch"] == 2 and numbers["rcp"] == "unet3d_ref_28" and numbers["train_samples_per_s"] > 0
    assert "CPU smoke path" in (out / "summary.md").read_text()
    for name in steps:
        assert (out / f"{name}.log").is_file()


def test_a_spent_deadline_skips_the_steps_and_says_so(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out), "--deadline", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=NO_CUDA)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 1 and summary["deadline_s"] == 1
    assert [s["status"] for s in summary["steps"]] == ["skipped"] * 4, summary["steps"]
    assert all("1 s deadline" in s["note"] for s in summary["steps"])
    assert "(deadline 1 s)" in (out / "summary.md").read_text()


def test_the_cuda_tests_are_those_skipped_without_cuda(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_plain(): pass\n"
        "@pytest.mark.skipif(True, reason='needs CUDA')\ndef test_a(): pass\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA GPU')\n@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_b(x): pass\n"
        "@pytest.mark.skipif(True, reason='needs SimpleITK')\ndef test_c(): pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.gpu_check", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_some.py")],
                          cwd=ROOT, capture_output=True, text=True, env=NO_CUDA, timeout=120)
    listed = [line for line in proc.stdout.splitlines() if "::" in line]
    assert [line.split("::")[1] for line in listed] == ["test_a", "test_b[1]", "test_b[2]"], proc.stdout


BENCHMARK_OUTPUT = """\
throughput_train: 608.00 samples/s | latency mean 92.1 ms, p90 93.0 ms, p95 93.5 ms, p99 94.0 ms (40 timed iterations)
benchmark budget: timing stopped after 40 timed steps (--benchmark_seconds 30)
evaluation: 1.67 s per evaluation on 8 rank(s) (42 of 42 evaluation volumes timed)
time to train (MLPerf, predicted): global batch 56 on 8 rank(s), 608 samples/s, 1.67 s per evaluation of the 42 cases
  RCP unet3d_ref_56 (197 reference runs, mlperf-logging training_4.0.0): epochs to converge mean 2140
  one run: mean 11.47 min (5th-95th percentile 7.63 min - 17.03 min) = training 9.85 min + 58.0 evaluations
  score (mean of 40 runs less the 4 fastest and 4 slowest): 11.26 min expected (5th-95th percentile 10.56 min - 11.99 min)
"""


def test_the_prediction_is_read_from_the_benchmarks_output():
    assert prediction_numbers(BENCHMARK_OUTPUT) == {
        "train_samples_per_s": 608.0, "eval_seconds": 1.67, "global_batch": 56, "rcp": "unet3d_ref_56",
        "one_run": {"mean": "11.47 min", "p5_p95": "7.63 min - 17.03 min"},
        "score": {"mean": "11.26 min", "p5_p95": "10.56 min - 11.99 min"}}
    assert prediction_numbers("throughput_train: 1.00 samples/s | ...\ntime to train: not predicted: x") == {
        "train_samples_per_s": 1.0}


def test_the_result_line_and_junit_counts():
    line = "epoch 9/60 ...\nRUN_SUMMARY,image_segmentation,0,83.2,success,best_mean_dice=0.6123,epochs=14\n"
    assert result_numbers(line) == {"status": "success", "seconds": 83.2, "best_mean_dice": 0.6123, "epochs": 14}
    assert result_numbers("no result") == {}


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
                   'skipped="3" tests="10"></testsuite></testsuites>')
    assert junit_counts(xml) == {"tests": 10, "failures": 2, "errors": 1, "skipped": 3, "passed": 4}


def test_make_gpu_check_runs_it():
    proc = subprocess.run(["make", "-n", "gpu-check", "GPU_CHECK_DIR=somewhere"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and '-m benchmarks.gpu_check --out "somewhere"' in proc.stdout
