"""N timed runs, each in a folder of its own with a seed of its own: locally, one after the
other, or as one SLURM job each.

    RUNS/run_00 .. run_<N-1>/   each run's --log_dir (RESULTS_DIR of run_and_time.sh / the job)
    RUNS/run_<i>.console.txt    a local run's stdout and stderr
    RUNS/seeds.json             the seed of every run (drawn once, kept for a run not yet made)
    RUNS/system-fields.json     a local sweep: the system description's fields of this machine

A run folder that exists is never run again: the same command continues an interrupted sweep,
and ``--runs`` larger than before adds runs.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
import time
from typing import Callable, Sequence

from runtime.submission import system as S

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS_FILE = "seeds.json"
SYSTEM_FIELDS_FILE = "system-fields.json"
LAUNCHERS = ("run_and_time", "main")


class DriverError(Exception):
    """A user-facing problem: one line, exit code 1."""


def run_names(count: int) -> list[str]:
    width = max(2, len(str(count - 1)))
    return [f"run_{i:0{width}d}" for i in range(count)]


def plan_seeds(names: Sequence[str], known: dict, first_seed: int | None) -> dict:
    """A distinct seed for every name: ``known`` ones kept, ``first_seed + index`` when given,
    else drawn from the OS (never one already used)."""
    seeds = dict(known)
    used = set(seeds.values())
    for index, name in enumerate(names):
        if name in seeds:
            continue
        seed = first_seed + index if first_seed is not None else None
        while seed is None or seed in used:
            if first_seed is not None and seed in used:
                raise DriverError(f"seed {seed} for {name} is already another run's (in {SEEDS_FILE})")
            seed = 1 + secrets.randbelow(2**31 - 2)
        seeds[name] = seed
        used.add(seed)
    return seeds


def _write_json(path: str, data: dict) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")
    os.replace(temporary, path)


def commands(output: str, names: Sequence[str], seeds: dict, flags: Sequence[str], launcher: str,
             slurm: bool, job_script: str, sbatch_args: Sequence[str]) -> list[tuple[str, list[str], dict]]:
    """(name, command, extra environment) of every run."""
    planned = []
    for name in names:
        folder = os.path.join(output, name)
        seed = str(seeds[name])
        if slurm:
            # the job scripts take the run's seed and folder from the environment (common.sh)
            command = ["sbatch", "--job-name", f"unet3d-{name}", "--export", f"ALL,SEED={seed},RESULTS_DIR={folder}",
                       *sbatch_args, job_script, *flags]
            planned.append((name, command, {}))
        elif launcher == "run_and_time":
            planned.append((name, ["bash", os.path.join(REPO, "run_and_time.sh"), seed, *flags],
                            {"RESULTS_DIR": folder, "LOG_DIR": folder}))
        else:
            planned.append((name, [sys.executable, os.path.join(REPO, "main.py"), "--seed", seed, "--log_dir", folder,
                                   *flags], {}))
    return planned


def run_sweep(output: str, count: int, flags: Sequence[str] = (), launcher: str = "run_and_time",
              first_seed: int | None = None, slurm: bool = False, job_script: str = "",
              sbatch_args: Sequence[str] = (), dry_run: bool = False, say: Callable[[str], None] = print) -> int:
    """Run (or submit, or print with ``dry_run``) the runs of ``output`` not made yet. Returns 0
    when every run started here exited 0 (every job was submitted), else 4."""
    output = os.path.abspath(output)
    if count < 1:
        raise DriverError(f"--runs {count}: at least 1")
    if launcher not in LAUNCHERS:
        raise DriverError(f"--launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    if os.path.exists(output) and not os.path.isdir(output):
        raise DriverError(f"--output {output} is a file, not a folder")
    job_script = os.path.abspath(job_script or os.path.join(REPO, "scripts", "slurm", "single_node.sbatch"))
    if slurm and not os.path.isfile(job_script):
        raise DriverError(f"--job_script {job_script} not found")
    if slurm and "," in output:
        raise DriverError(f"--output {output}: a comma in the path would break sbatch --export")
    seeds_path = os.path.join(output, SEEDS_FILE)
    known = {}
    if os.path.isfile(seeds_path):
        try:
            with open(seeds_path, encoding="utf-8") as handle:
                known = json.load(handle)
        except (OSError, ValueError) as error:
            raise DriverError(f"cannot read {seeds_path}: {error}") from None
    names = run_names(count)
    seeds = plan_seeds(names, known, first_seed)
    todo = [n for n in names if not os.path.exists(os.path.join(output, n))]
    for name in names:
        if name not in todo:
            say(f"{name}: {os.path.join(output, name)} exists, not run again")
    planned = commands(output, todo, seeds, flags, launcher, slurm, job_script, sbatch_args)
    if dry_run:
        for name, command, env in planned:
            say(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, command)]))
        return 0
    os.makedirs(output, exist_ok=True)
    _write_json(seeds_path, seeds)
    if not slurm and not os.path.exists(os.path.join(output, SYSTEM_FIELDS_FILE)):
        fields = S.describe("", "", "", "", storage_path=output)
        for key in ("submitter", "system_name", "division", "status"):  # these come from the runs' logs
            fields.pop(key)
        _write_json(os.path.join(output, SYSTEM_FIELDS_FILE), fields)
    failed = 0
    for name, command, env in planned:
        if slurm:
            os.makedirs(os.path.join(output, name))
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode != 0:
                os.rmdir(os.path.join(output, name))  # empty, made just above: the run can be submitted again
                raise DriverError(f"sbatch for {name} failed (exit {proc.returncode}): "
                                  f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
            say(f"{name}: seed {seeds[name]}, {proc.stdout.strip()}")
            continue
        started = time.monotonic()
        with open(os.path.join(output, f"{name}.console.txt"), "w", encoding="utf-8") as console:
            code = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, stdout=console,
                                  stderr=subprocess.STDOUT).returncode
        failed += code != 0
        say(f"{name}: seed {seeds[name]}, exit {code} in {time.monotonic() - started:.1f} s")
    if failed:
        say(f"{failed} of {len(planned)} run(s) exited non-zero (their consoles: {output}/<run>.console.txt); "
            "the package command says which runs count")
    return 4 if failed else 0
