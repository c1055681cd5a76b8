"""``make gpu-check``: what one GPU says about this application, in one command and under 10 minutes.

Each step under its own time limit, in order: the CUDA tests, the throughput ladder (given what the later steps
leave), the predicted MLPerf time to train (``main.py --benchmark``), a short convergence run (scripts/demo.sh);
without CUDA on tiny CPU shapes, which say so. Logs, summary.md and summary.json in ``--out``; exit 0: all ok."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import ROOT, result_numbers, run_child, table, training_ids, write_blob_cases
from data_loading.atomic import atomic_write
from data_loading.dataset import read_evaluation_ids

DEADLINE_S = 570.0  # the whole check (--deadline); each step gets at most its own limit and what is left
AFTER_LADDER_S = 240.0  # what the ladder leaves for the steps after it (time to train, convergence), on a GPU
SMOKE_NOTE = "CPU smoke path (no CUDA GPU): tiny shapes; these numbers say nothing about a GPU"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # tiny convolutions' OpenMP threads oversubscribe a shared CPU
# the fastest settings on one H100 (docs/performance.md); bf16 named: fp16 (--amp on CUDA) keeps CUDA graphs off
FASTEST_GPU = ["--amp", "--amp_dtype", "bf16", "--channels_last", "--compile", "--cuda_graphs", "--cudnn_benchmark"]
# tiny network and shapes of the smoke path (batch norm: instance norm needs a bigger bottleneck)
TINY = ["--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32", "--val_input_shape", "32", "32",
        "32", "--normalization", "batchnorm", "--batch_size", "2", "--optimizer", "adam", "--learning_rate", "0.01",
        "--seed", "0", "--device", "cpu", "--num_workers", "0"]


def is_cuda_test(item) -> bool:
    """A test that is skipped without CUDA: one of its ``skipif`` marks names CUDA or a GPU."""
    return any(word in str(mark.kwargs.get("reason", "")).lower()
               for mark in item.iter_markers("skipif") for word in ("cuda", "gpu"))


def pytest_collection_modifyitems(config, items) -> None:
    """With ``-p benchmarks.gpu_check`` (as this check runs them): keep the CUDA tests only."""
    dropped = [item for item in items if not is_cuda_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = [item for item in items if is_cuda_test(item)]


def junit_counts(path: Path) -> dict:
    """tests, passed, failed, errors, skipped of a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def prediction_numbers(output: str) -> dict:
    """The throughputs and the predicted time to train that ``main.py --benchmark`` printed."""
    patterns = {"train_samples_per_s": (r"^throughput_train: ([\d.]+) samples/s", float),
                "eval_seconds": (r"^evaluation: ([\d.e+-]+) s per evaluation", float),
                "global_batch": (r"time to train \(MLPerf, predicted\): global batch (\d+)", int),
                "rcp": (r"RCP (unet3d_ref_\d+)", str),
                "one_run": (r"one run: mean (.+?) \(5th-95th percentile (.+?)\)", None),
                "score": (r"score \(.*?\): (.+?) expected \(5th-95th percentile (.+?)\)", None)}
    found = {}
    for name, (pattern, kind) in patterns.items():
        match = re.search(pattern, output, re.MULTILINE)
        if match:
            found[name] = kind(match.group(1)) if kind else {"mean": match.group(1), "p5_p95": match.group(2)}
    return found


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
    def __init__(self, out: Path, python: str, deadline_s: float = DEADLINE_S):
        self.out, self.python, self.start, self.deadline_s = out, python, time.monotonic(), deadline_s
        self.steps: list[Step] = []
        self.tiny_data = out / "tiny_data"  # the smoke path's data

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def run(self, step: Step) -> str:
        """Run ``step`` (output to ``<out>/<name>.log``, stopped at its limit); its output."""
        self.steps.append(step)
        limit = min(step.limit_s, self.left())
        if limit < 5:
            step.status, step.note = "skipped", f"no time left inside the {self.deadline_s:.0f} s deadline"
            return ""
        print(f"gpu-check: {step.name} (at most {limit:.0f} s) ...", flush=True)
        step.seconds, _, code, output = run_child(step.command, self.out / f"{step.name}.log",
                                                  {**os.environ, **step.env}, timeout=limit)
        step.status = "ok" if code == 0 else "timed out" if code == 124 else "failed"
        step.note = f"stopped after {limit:.0f} s" if code == 124 else f"exit code {code}" if code else ""
        print(f"gpu-check: {step.name}: {step.status} in {step.seconds:.1f} s", flush=True)
        return output


def cuda_tests(check: Check, smoke: bool) -> None:
    files = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))  # those naming CUDA
             if "cuda" in path.read_text(encoding="utf-8", errors="replace").lower()]
    base = [check.python, "-m", "pytest", "-p", "benchmarks.gpu_check", "-q", "-p", "no:cacheprovider", *files]
    if smoke:
        step = Step("cuda_tests", base + ["--collect-only"], 120)
        count = re.search(r"(\d+)(?:/\d+)? tests? collected", check.run(step))
        step.numbers = {"collected": int(count.group(1)) if count else 0}
        step.note = (step.note + "; " if step.note else "") + "not run: no CUDA GPU (collected and counted only)"
        return
    junit = check.out / "cuda_tests.xml"
    step = Step("cuda_tests", base + ["-rs", f"--junitxml={junit}"], 150)
    check.run(step)
    if junit.is_file():
        step.numbers = junit_counts(junit)


def convergence(check: Check, smoke: bool) -> None:
    if smoke:
        step = Step("convergence", [check.python, "main.py", "--data_dir", str(check.tiny_data), *TINY,
                                    "--epochs", "2", "--start_eval_at", "1", "--evaluate_every", "1", "--log_dir",
                                    str(check.out / "convergence")], 120, env=ONE_THREAD)
        step.note = "smoke: 2 epochs on 4 tiny volumes, not meant to converge"
    else:
        step = Step("convergence", ["bash", "scripts/demo.sh", check.python, str(check.out / "demo")], 240,
                    env={"DEMO_CASES": "24", "DEMO_EPOCHS": "60", "DEMO_TARGET": "0.6"})
        step.note = "the demo: 24 small synthetic cases, until mean Dice 0.6 or 60 epochs"
    step.numbers = result_numbers(check.run(step))


def ladder(check: Check, smoke: bool, data_dir: Path, reserve_s: float) -> None:
    out = check.out / "ladder.md"
    command = [check.python, "-m", "benchmarks.bench_throughput", "--data_dir", str(data_dir), "--out", str(out)]
    if smoke:
        command += ["--smoke", "--rows", "", "--no_eval", "--threads", "1", "--filters", "2", "4", "4", "8", "8",
                    "--patch", "64", "32", "32", "--steps", "2", "--warmup", "1"]
    else:
        command += ["--rows", "ladder", "--steps", "20", "--warmup", "5", "--eval_volumes", "8"]
    step = Step("ladder", command, 120 if smoke else max(30.0, check.left() - reserve_s))
    check.run(step)
    if out.is_file():
        rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
        step.numbers = {"rows": len(rows) - 1, "table": str(out.relative_to(check.out))}


def prediction(check: Check, smoke: bool, data_dir: Path) -> None:
    if smoke:
        command = [check.python, "main.py", "--data_dir", str(check.tiny_data), *TINY, "--benchmark",
                   "--benchmark_steps", "3", "--warmup_steps", "1"]
    else:
        data = ["--data_dir", str(data_dir)] if any(data_dir.glob("case_*_x.npy")) else ["--loader", "synthetic"]
        command = [check.python, "main.py", *data, "--benchmark", *FASTEST_GPU,
                   "--benchmark_seconds", "30", "--warmup_steps", "5", "--num_workers", "8"]
    step = Step("time_to_train", command, 150 if smoke else 90,  # --benchmark writes no log: no --log_dir
                env=ONE_THREAD if smoke else {})
    step.numbers = prediction_numbers(check.run(step))
    if step.status == "ok" and "score" not in step.numbers:
        step.status, step.note = "failed", "no predicted time to train in the output"


def number_text(value) -> str:
    """A number, or a band ``{"mean", "p5_p95"}`` as "mean (5th-95th percentile)"."""
    if isinstance(value, dict) and set(value) == {"mean", "p5_p95"}:
        return f"{value['mean']} ({value['p5_p95']})"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(steps: list[Step], smoke: bool, device: str, seconds: float, deadline_s: float) -> str:
    rows = [[s.name, s.status, f"{s.seconds:.1f}", (", ".join(f"{k} {number_text(v)}" for k, v in s.numbers.items())
                                                    or "-").replace("|", "/"), s.note or "-"] for s in steps]
    return "\n".join(["# gpu-check", "", f"- date: {time.strftime('%Y-%m-%d %H:%M')}", f"- device: {device}",
                      f"- {SMOKE_NOTE}" if smoke else "- CUDA path",
                      f"- total {seconds:.0f} s (deadline {deadline_s:.0f} s)", "",
                      table(["step", "status", "seconds", "numbers", "note"], rows)]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the logs, summary.md and summary.json")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole check")
    args = parser.parse_args(argv)
    smoke = not torch.cuda.is_available()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, sys.executable, args.deadline)
    if smoke:   # 4 training and 2 evaluation cases: tiny blob volumes
        print(f"gpu-check: {SMOKE_NOTE}", flush=True)
        check.tiny_data.mkdir(exist_ok=True)
        write_blob_cases(check.tiny_data, training_ids(4) + read_evaluation_ids()[:2], (40, 40, 40), np.random.default_rng(0))
    cuda_tests(check, smoke)
    ladder(check, smoke, out / "data", reserve_s=AFTER_LADDER_S)
    prediction(check, smoke, out / "data")
    convergence(check, smoke)
    seconds = time.monotonic() - check.start
    device = (f"CPU ({platform.machine()}, {os.cpu_count()} logical CPUs)" if smoke else
              f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})") + \
        f"; torch {torch.__version__}, Python {platform.python_version()}"
    summary = json.dumps({"smoke": smoke, "device": device, "seconds": seconds, "deadline_s": check.deadline_s,
                          "steps": [asdict(s) for s in check.steps]}, indent=2) + "\n"
    for name, text in [("summary.md", summary_markdown(check.steps, smoke, device, seconds, check.deadline_s)), ("summary.json", summary)]:
        atomic_write(str(out / name), lambda handle: handle.write(text.encode()))
    failed = [s.name for s in check.steps if s.status != "ok"]
    print(f"gpu-check: {'smoke path ' if smoke else ''}done in {seconds:.0f} s: "
          + (f"{', '.join(failed)} not ok" if failed else "every step ok") + f"; {out / 'summary.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
