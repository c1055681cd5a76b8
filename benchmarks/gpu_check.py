"""``make gpu-check``: what one GPU says about this application, in one command and under 10 minutes.

On a CUDA GPU it runs, each step with its own time limit inside a 10-minute deadline:

1. the CUDA tests: every test of ``tests/`` that is skipped without a CUDA GPU (its ``skipif``
   names CUDA or a GPU), selected by this module as a pytest plugin;
2. a short convergence run: the demo's recipe (``scripts/demo.sh``: a synthetic KiTS19, a small
   network trained until a demo Dice target), its epochs and time;
3. the throughput ladder: ``python -m benchmarks.bench_throughput --rows ladder`` (plain, then each
   speed lever added), training and evaluation;
4. the predicted MLPerf time to train: ``main.py --benchmark`` on the ladder's synthetic volumes
   with the benchmark's model, bf16/fp16 autocast and a time budget.

Without CUDA (or with ``--smoke``) it runs its CPU smoke path instead and says so: the same four
steps on tiny shapes and a few tiny volumes, in about a minute (the CUDA tests only collected
and counted). Those
numbers say nothing about a GPU.

Every step's output goes to ``--out/<step>.log``; the numbers to ``--out/summary.md`` and
``--out/summary.json`` (written atomically). Exit code 0 when every step passed, else 1.

    python -m benchmarks.gpu_check --out gpu_check            # make gpu-check
    python -m benchmarks.gpu_check --out gpu_check --smoke    # the CPU smoke path anywhere
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 570.0  # the whole check; each step gets at most its own limit and what is left
SMOKE_NOTE = "CPU smoke path (no CUDA GPU, or --smoke): tiny shapes; these numbers say nothing about a GPU"
CUDA_WORDS = ("cuda", "gpu")

# one thread on a CPU: OpenMP threads of tiny convolutions on a shared CPU oversubscribe its cores
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# tiny network and shapes of the smoke path (batch norm: instance norm needs a bigger bottleneck)
TINY = ["--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32", "--val_input_shape", "32", "32",
        "32", "--normalization", "batchnorm", "--batch_size", "2", "--optimizer", "adam", "--learning_rate", "0.01",
        "--seed", "0", "--device", "cpu", "--num_workers", "0"]


# ------------------------------------------------------------------ the pytest plugin: CUDA tests

def is_cuda_test(item) -> bool:
    """A test that is skipped without CUDA: one of its ``skipif`` marks names CUDA or a GPU."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", "")).lower()
        if any(word in reason for word in CUDA_WORDS):
            return True
    return False


def pytest_collection_modifyitems(config, items) -> None:
    """With ``-p benchmarks.gpu_check``: keep the CUDA tests only."""
    kept = [item for item in items if is_cuda_test(item)]
    dropped = [item for item in items if not is_cuda_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def junit_counts(path: Path) -> dict:
    """tests, passed, failed, errors, skipped of a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


# ------------------------------------------------------------------------- parsing the outputs

def prediction_numbers(output: str) -> dict:
    """The throughputs and the predicted time to train that ``main.py --benchmark`` printed."""
    found = {}
    patterns = {
        "train_samples_per_s": r"^throughput_train: ([\d.]+) samples/s",
        "eval_seconds": r"^evaluation: ([\d.e+-]+) s per evaluation",
        "global_batch": r"time to train \(MLPerf, predicted\): global batch (\d+)",
        "rcp": r"RCP (unet3d_ref_\d+)",
        "one_run": r"one run: mean (.+?) \(5th-95th percentile (.+?)\)",
        "score": r"score \(.*?\): (.+?) expected \(5th-95th percentile (.+?)\)",
    }
    for name, pattern in patterns.items():
        match = re.search(pattern, output, re.MULTILINE)
        if match:
            groups = match.groups()
            value = groups[0] if len(groups) == 1 else {"mean": groups[0], "p5_p95": groups[1]}
            found[name] = float(value) if name in ("train_samples_per_s", "eval_seconds") else (
                int(value) if name == "global_batch" else value)
    return found


def result_numbers(output: str) -> dict:
    """The training run's ``RESULT,image_segmentation,seed,seconds,status,best_mean_dice=..,epochs=..`` line."""
    match = re.search(r"^RESULT,image_segmentation,(\d+),([\d.]+),(\w+),best_mean_dice=([\d.nan]+),epochs=(\d+)",
                      output, re.MULTILINE)
    if not match:
        return {}
    seed, seconds, status, dice, epochs = match.groups()
    return {"status": status, "seconds": float(seconds), "best_mean_dice": float(dice), "epochs": int(epochs)}


# ------------------------------------------------------------------------------------ the steps

@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: float
    env: dict = field(default_factory=dict)
    status: str = "not run"  # ok | failed | timed out | skipped
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)
    note: str = ""


class Check:
    def __init__(self, out: Path, python: str):
        self.out, self.python, self.start = out, python, time.monotonic()
        self.steps: list[Step] = []
        self.tiny_data = out / "tiny_data"  # the smoke path's data (write_tiny_data)

    def left(self) -> float:
        return DEADLINE_S - (time.monotonic() - self.start)

    def run(self, step: Step) -> str:
        """Run ``step`` (output to ``<out>/<name>.log``); its output text."""
        self.steps.append(step)
        limit = min(step.limit_s, self.left())
        if limit < 5:
            step.status, step.note = "skipped", "no time left inside the 10-minute deadline"
            return ""
        print(f"gpu-check: {step.name} (at most {limit:.0f} s) ...", flush=True)
        tick = time.monotonic()
        # a session of its own: a step that runs out of time is stopped with every process it
        # started (the demo's bash and its pythons, pytest's workers)
        proc = subprocess.Popen(step.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **step.env}, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit)
            step.status = "ok" if proc.returncode == 0 else "failed"
            if proc.returncode:
                step.note = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            step.status, step.note = "timed out", f"stopped after {limit:.0f} s"
        step.seconds = time.monotonic() - tick
        (self.out / f"{step.name}.log").write_text(output)
        print(f"gpu-check: {step.name}: {step.status} in {step.seconds:.1f} s", flush=True)
        return output


def cuda_test_files() -> list[str]:
    """The test files that can hold a CUDA test (they name CUDA): collecting only these is quicker."""
    return [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))
            if "cuda" in path.read_text(encoding="utf-8", errors="replace").lower()]


def cuda_tests(check: Check, smoke: bool) -> None:
    base = [check.python, "-m", "pytest", "-p", "benchmarks.gpu_check", "-q", "-p", "no:cacheprovider",
            *cuda_test_files()]
    if smoke:
        step = Step("cuda_tests", base + ["--collect-only"], 120)
        output = check.run(step)
        count = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
        step.numbers = {"collected": int(count.group(1)) if count else 0}
        step.note = (step.note + "; " if step.note else "") + "not run: no CUDA GPU (collected and counted only)"
        return
    junit = check.out / "cuda_tests.xml"
    step = Step("cuda_tests", base + ["-rs", f"--junitxml={junit}"], 240)
    check.run(step)
    if junit.is_file():
        step.numbers = junit_counts(junit)


def write_tiny_data(folder: Path, train: int = 4, evaluate: int = 2, shape=(40, 40, 40)) -> Path:
    """A preprocessed-looking dataset of a few tiny volumes (a kidney sphere with a tumour in
    noise): ``train`` training cases and ``evaluate`` of the evaluation ids."""
    import numpy as np

    from data_loading.dataset import read_evaluation_ids

    folder.mkdir(parents=True, exist_ok=True)
    evaluation = read_evaluation_ids()
    training = [f"{i:05d}" for i in range(210) if f"{i:05d}" not in set(evaluation)]
    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    distance = np.sqrt(sum((g - s / 2) ** 2 for g, s in zip(grid, shape)))
    for n, case_id in enumerate(training[:train] + evaluation[:evaluate]):
        label = np.zeros(shape, np.uint8)
        label[distance < min(shape) / 4] = 1
        label[distance < min(shape) / 8] = 2
        image = (1.5 * label + np.random.default_rng(n).normal(0, 0.3, shape)).astype(np.float32)
        np.save(folder / f"case_{case_id}_x.npy", image[None])
        np.save(folder / f"case_{case_id}_y.npy", label[None])
    return folder


def convergence(check: Check, smoke: bool) -> None:
    if smoke:
        step = Step("convergence", [check.python, "main.py", "--data_dir", str(check.tiny_data), *TINY,
                                    "--epochs", "2", "--start_eval_at", "1", "--evaluate_every", "1", "--log_dir",
                                    str(check.out / "convergence")], 120, env=ONE_THREAD)
        step.note = "smoke: 2 epochs on 4 tiny volumes, not meant to converge"
    else:
        step = Step("convergence", ["bash", "scripts/demo.sh", check.python, str(check.out / "demo")], 240,
                    env={"DEMO_CASES": "24", "DEMO_EPOCHS": "60", "DEMO_TARGET": "0.6"})
    step.numbers = result_numbers(check.run(step))


def ladder(check: Check, smoke: bool, data_dir: Path, reserve_s: float) -> None:
    table = check.out / "ladder.md"
    command = [check.python, "-m", "benchmarks.bench_throughput", "--data_dir", str(data_dir), "--out", str(table)]
    if smoke:
        command += ["--smoke", "--rows", "", "--no_eval", "--threads", "1", "--filters", "2", "4", "4", "8", "8",
                    "--patch", "64", "32", "32", "--steps", "2", "--warmup", "1"]
        limit = 120
    else:
        command += ["--rows", "ladder", "--steps", "20", "--warmup", "5", "--eval_volumes", "8"]
        limit = max(30.0, check.left() - reserve_s)
    step = Step("ladder", command, limit)
    check.run(step)
    if table.is_file():
        rows = [line for line in table.read_text().splitlines() if line.startswith("| ") and "---" not in line]
        step.numbers = {"rows": len(rows) - 1, "table": str(table.relative_to(check.out))}


def prediction(check: Check, smoke: bool, data_dir: Path) -> None:
    env = {}
    if smoke:
        command = [check.python, "main.py", "--data_dir", str(check.tiny_data), *TINY, "--benchmark",
                   "--benchmark_steps", "3", "--warmup_steps", "1"]
        env = ONE_THREAD
    else:
        data = ["--data_dir", str(data_dir)] if (data_dir / "case_00000_x.npy").exists() or any(
            data_dir.glob("case_*_x.npy")) else ["--loader", "synthetic"]
        command = [check.python, "main.py", *data, "--benchmark", "--amp", "--cudnn_benchmark",
                   "--benchmark_seconds", "30", "--warmup_steps", "5", "--num_workers", "8"]
    step = Step("time_to_train", command + ["--log_dir", str(check.out / "benchmark")], 150, env=env)
    step.numbers = prediction_numbers(check.run(step))
    if step.status == "ok" and "score" not in step.numbers:
        step.status, step.note = "failed", "no predicted time to train in the output"


# ------------------------------------------------------------------------------------ summary

def device_line(smoke: bool) -> str:
    import torch

    torch_text = f"torch {torch.__version__}, Python {platform.python_version()}"
    if not smoke:
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}); {torch_text}"
    return f"CPU ({platform.machine()}, {os.cpu_count()} logical CPUs); {torch_text}"


def write_atomic(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(text)
    os.replace(handle.name, path)


def number_text(value) -> str:
    """A number, or a band ``{"mean", "p5_p95"}`` as "mean (5th-95th percentile)"."""
    if isinstance(value, dict) and set(value) == {"mean", "p5_p95"}:
        return f"{value['mean']} ({value['p5_p95']})"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(steps: list[Step], smoke: bool, device: str, seconds: float) -> str:
    lines = ["# gpu-check", "", f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}", f"- device: {device}",
             f"- {SMOKE_NOTE}" if smoke else "- CUDA path", f"- total {seconds:.0f} s (deadline {DEADLINE_S:.0f} s)",
             "", "| step | status | seconds | numbers | note |", "|---|---|---:|---|---|"]
    for step in steps:
        numbers = ", ".join(f"{k} {number_text(v)}" for k, v in step.numbers.items()) or "-"
        lines.append(f"| {step.name} | {step.status} | {step.seconds:.1f} | {numbers.replace('|', '/')} "
                     f"| {step.note or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the logs, summary.md and summary.json")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke path even where CUDA is available")
    args = parser.parse_args(argv)
    import torch

    smoke = args.smoke or not torch.cuda.is_available()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if smoke:
        print(f"gpu-check: {SMOKE_NOTE}", flush=True)
    check = Check(out, sys.executable)
    data_dir = out / "data"
    if smoke:
        check.tiny_data = write_tiny_data(out / "tiny_data")
    cuda_tests(check, smoke)
    convergence(check, smoke)
    ladder(check, smoke, data_dir, reserve_s=100.0)
    prediction(check, smoke, data_dir)
    seconds = time.monotonic() - check.start
    device = device_line(smoke)
    write_atomic(out / "summary.md", summary_markdown(check.steps, smoke, device, seconds))
    write_atomic(out / "summary.json", json.dumps(
        {"smoke": smoke, "device": device, "seconds": seconds, "steps": [asdict(s) for s in check.steps]},
        indent=2) + "\n")
    failed = [s.name for s in check.steps if s.status != "ok"]
    print(f"gpu-check: {'smoke path ' if smoke else ''}done in {seconds:.0f} s: "
          + (f"{', '.join(failed)} not ok" if failed else "every step ok") + f"; {out / 'summary.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
