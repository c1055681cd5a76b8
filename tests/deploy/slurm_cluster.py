"""Helpers of the SLURM job tests: the cluster's commands, job submission and waiting."""
from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# The suite's tiny network (tests/test_end_to_end.py), as main.py flags after the job's own.
SMALL = ["--filters", "4", "8", "16", "32", "32", "--input_shape", "32", "32", "64",
         "--val_input_shape", "32", "32", "64", "--seed", "3"]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def free_port_range(count: int) -> int:
    """A base port with ``count`` free ports after it (ours are bound only by the daemons)."""
    import socket

    for _ in range(50):
        base = random.randrange(20000, 30000)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range found")


class Cluster:
    def __init__(self, folder: Path, nodes: list[str]):
        self.folder, self.nodes = folder, nodes
        self.env = dict(os.environ, SLURM_CONF=str(folder / "etc" / "slurm.conf"))
        # The jobs run the host's Python: the venv that runs these tests, first on PATH.
        self.env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed: {proc.stdout}{proc.stderr}")
        return proc

    def submit(self, script: str, job_env: dict[str, str], args=(), sbatch=(), output: Path | None = None) -> int:
        """``sbatch [sbatch] scripts/slurm/<script> [args]`` from the repository root, as a user
        submits it, with ``job_env`` in the job's environment."""
        env = dict(self.env, **job_env)
        command = ["sbatch", "--parsable", *sbatch]
        if output is not None:
            command.append(f"--output={output}")
        command += [f"scripts/slurm/{script}", *args]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.run("scontrol", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, timeout: float, release_requeued: bool = True) -> dict[str, str]:
        """Wait for the job's final state. A requeued job is held ~2 minutes by SLURM before it
        may start again: with ``release_requeued`` its start is moved to now (an admin's
        `scontrol update`), which changes nothing else."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if release_requeued and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                self.run("scontrol", "update", f"jobid={job_id}", "starttime=now", check=False)
            time.sleep(1)
        self.run("scancel", str(job_id), check=False)
        raise AssertionError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s")

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"waited {timeout} s for {what}")



def job_env(tmp: Path, data: str, **settings) -> dict[str, str]:
    """The settings of a CPU job on the host's Python: no container, no GPU, one thread per
    process (two cores for both nodes), results and scratch in ``tmp``. EVALUATE_EVERY 1: every
    epoch from START_EVAL_AT evaluates (the jobs' default 20 with the reference's rule, epoch % 20
    == 0, would evaluate none of a short job's epochs)."""
    env = {"CONTAINER": "", "GPU_VENDOR": "none", "GPUS_PER_NODE": "1", "DATA_DIR": data,
           "SCRATCH": str(tmp / "scratch"), "RESULTS_DIR": str(tmp / "results"), "OMP_NUM_THREADS": "1",
           "OPTIMIZER": "adam", "LEARNING_RATE": "0.003", "NUM_WORKERS": "0", "PYTHONUNBUFFERED": "1",
           "EVALUATE_EVERY": "1"}
    env.update({k: str(v) for k, v in settings.items()})
    return env
