"""N timed runs, each in a folder of its own with a seed of its own: locally, one after the
other, or as one SLURM job each.

    RUNS/run_00 .. run_<N-1>/   each run's --log_dir (RESULTS_DIR of run_and_time.sh / the job)
    RUNS/run_<i>.console.txt    a local run's stdout and stderr (each attempt appended)
    RUNS/seeds.json             the seed of every run (drawn once, kept for a run not yet made)
    RUNS/jobs.json              --slurm: the job id of every run submitted
    RUNS/system-fields.json     a local sweep: the system description's fields machines cannot tell, to fill in

A run folder that holds a run (an MLPerf log that reached ``run_start``, in the folder or moved
aside into its ``previous-*``) is never run again: the same command continues an interrupted
sweep, and ``--runs`` larger than before adds runs. A folder without one (an attempt that failed
before the clock started) runs again: its files are moved aside by the training itself
(``previous-<time>/``), never deleted; under ``--slurm`` only once its job is no longer queued or
running (``squeue``).
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
from typing import Callable, Sequence

from runtime.results.runs import mlperf_logs, read_json_lines
from runtime.run_files import MLLOG_PREFIX, PREVIOUS_RUN_PREFIX, RUN_START, SEED_FROM_OS, SEED_GIVEN, SEED_SOURCE_ENV
from runtime.submission import system as S

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS_FILE = "seeds.json"
JOBS_FILE = "jobs.json"
SYSTEM_FIELDS_FILE = "system-fields.json"
LAUNCHERS = ("run_and_time", "main")
RECIPES_DIR = os.path.join(REPO, "scripts", "recipes")
REFERENCE_DATA_DIR = "/data"  # run_and_time.sh's dataset without DATASET_DIR, when it holds one


# main.py's flags that belong to the driver: each run's seed (drawn here, kept in seeds.json), its
# folder and its checkpoint (RUNS/run_<i>); given after --, every run would share them
DRIVER_FLAGS = ("seed", "log_dir", "save_ckpt_path")


class DriverError(Exception):
    """A user-facing problem: one line, exit code 1."""


def driver_flags(flags: Sequence[str]) -> list[str]:
    """The flags among ``flags`` (main.py's) that set :data:`DRIVER_FLAGS`, as given, matched as
    main.py's own parser matches them (an exact option, or the unique option it abbreviates)."""
    from runtime.arguments import build_parser

    options = build_parser()._option_string_actions
    found = []
    for token in flags:
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        matches = [name] if name in options else [o for o in options if o.startswith(name) and o.startswith("--")]
        if len(matches) == 1 and options[matches[0]].dest in DRIVER_FLAGS:
            found.append(token)
    return found


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


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise DriverError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise DriverError(f"cannot read {path}: not a JSON object")
    return data


def holds_a_run(folder: str) -> bool:
    """Whether ``folder`` holds a run: an MLPerf log of it (or of an attempt moved aside into its
    ``previous-*``) with a ``run_start`` event. An attempt that never reached it is not a run."""
    folders = [folder] + sorted(glob.glob(os.path.join(glob.escape(folder), PREVIOUS_RUN_PREFIX + "*")))
    for path in (log for f in folders if os.path.isdir(f) for log in mlperf_logs(f)):
        try:
            records, _ = read_json_lines(path, MLLOG_PREFIX)
        except OSError:
            return True  # unreadable: never run over it
        if any(record.get("key") == RUN_START for record in records):
            return True
    return False


def division_of(flags: Sequence[str]) -> str:
    """The ``--submission_division`` the flags give main.py (the last one wins; closed by default)."""
    division = "closed"
    for index, flag in enumerate(flags):
        if flag == "--submission_division" and index + 1 < len(flags):
            division = flags[index + 1]
        elif flag.startswith("--submission_division="):
            division = flag.split("=", 1)[1]
    return division


def job_state(job_id: str) -> str | None:
    """``squeue``'s state of a job ('' once it has left the queue), None when it cannot tell."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode == 0:
        return proc.stdout.strip()
    return "" if "invalid job id" in proc.stderr.lower() else None


def commands(output: str, names: Sequence[str], seeds: dict, flags: Sequence[str], launcher: str,
             slurm: bool, job_script: str, sbatch_args: Sequence[str],
             recipe: str = "", from_first_seed: bool = False) -> list[tuple[str, list[str], dict]]:
    """(name, command, extra environment) of every run."""
    planned = []
    # seeds drawn from the OS here: each run is told so (a --first_seed one is a hand-given seed)
    source = {SEED_SOURCE_ENV: SEED_GIVEN if from_first_seed else SEED_FROM_OS}
    for name in names:
        folder = os.path.join(output, name)
        seed = str(seeds[name])
        if slurm:
            # the job scripts take the run's seed, folder and recipe from the environment (common.sh)
            export = f"ALL,SEED={seed},RESULTS_DIR={folder}" + (f",RECIPE={recipe}" if recipe else "") + \
                "".join(f",{k}={v}" for k, v in source.items())
            command = ["sbatch", "--job-name", f"unet3d-{name}", "--export", export, *sbatch_args, job_script, *flags]
            planned.append((name, command, {}))
        elif launcher == "run_and_time":
            # this interpreter (a venv's, say) runs the training, not whichever python is on PATH; the
            # folder and checkpoint are the run's own, whatever the caller's environment says
            env = {"RESULTS_DIR": folder, "LOG_DIR": folder, "SAVE_CKPT_PATH": os.path.join(folder, "checkpoint.pt"),
                   "PYTHON": sys.executable, **source}
            if recipe:
                env["RECIPE"] = recipe
            planned.append((name, ["bash", os.path.join(REPO, "run_and_time.sh"), seed, *flags], env))
        else:
            planned.append((name, [sys.executable, os.path.join(REPO, "main.py"), "--seed", seed, "--log_dir", folder,
                                   *flags], dict(source)))
    return planned


def run_sweep(output: str, count: int, flags: Sequence[str] = (), launcher: str = "run_and_time",
              first_seed: int | None = None, slurm: bool = False, job_script: str = "",
              sbatch_args: Sequence[str] = (), dry_run: bool = False, say: Callable[[str], None] = print,
              recipe: str = "") -> int:
    """Run (or submit, or print with ``dry_run``) the runs of ``output`` not made yet. Returns 0
    when every run started here exited 0 (every job was submitted), else 4."""
    output = os.path.abspath(output)
    if count < 1:
        raise DriverError(f"--runs {count}: at least 1")
    if launcher not in LAUNCHERS:
        raise DriverError(f"--launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    if os.path.exists(output) and not os.path.isdir(output):
        raise DriverError(f"--output {output} is a file, not a folder")
    owned = driver_flags(flags)
    if owned:
        raise DriverError(f"-- {' '.join(owned)}: runs gives every run its own seed (drawn from the OS, kept in "
                          f"{SEEDS_FILE}), folder and checkpoint (RUNS/run_<i>); leave --seed, --log_dir and "
                          "--save_ckpt_path out of the flags after --")
    if first_seed is not None and division_of(flags) != "open":
        raise DriverError(f"--first_seed {first_seed}: seeds {first_seed}, {first_seed + 1}, ... are not allowed in "
                          "the closed division (the rules: from the clock, the OS's randomness or an RNG seeded "
                          "from them); leave it out, or give `-- --submission_division open`")
    if recipe:
        names_there = sorted(n[:-3] for n in os.listdir(RECIPES_DIR) if n.endswith(".sh"))
        if recipe not in names_there:
            raise DriverError(f"--recipe {recipe}: no such recipe in {RECIPES_DIR} ({', '.join(names_there)})")
        if launcher == "main" and not slurm:
            raise DriverError(f"--recipe {recipe}: recipes are run_and_time.sh's and the job scripts' "
                              "(--launcher run_and_time or --slurm)")
    if not slurm and launcher == "run_and_time":
        dataset = os.environ.get("DATASET_DIR", "")
        reference = os.environ.get("REFERENCE_DATA_DIR") or REFERENCE_DATA_DIR
        if not dataset and glob.glob(os.path.join(glob.escape(reference), "case_*_x.npy")):
            dataset = reference  # run_and_time.sh reads it, as the reference's script does
        if not dataset:
            raise DriverError(f"DATASET_DIR is not set and {reference} holds no preprocessed dataset: run_and_time.sh "
                              "would train every run on generated synthetic data; set it to the preprocessed KiTS19 "
                              "folder")
        if not os.path.isdir(dataset):
            raise DriverError(f"DATASET_DIR={dataset}: no such folder")
    job_script = os.path.abspath(job_script or os.path.join(REPO, "scripts", "slurm", "single_node.sbatch"))
    if slurm and not os.path.isfile(job_script):
        raise DriverError(f"--job_script {job_script} not found")
    if slurm and "," in output:
        raise DriverError(f"--output {output}: a comma in the path would break sbatch --export")
    seeds_path, jobs_path = os.path.join(output, SEEDS_FILE), os.path.join(output, JOBS_FILE)
    known, jobs = _read_json(seeds_path), _read_json(jobs_path)
    names = run_names(count)
    seeds = plan_seeds(names, known, first_seed)
    todo = []
    for name in names:
        folder = os.path.join(output, name)
        if not os.path.exists(folder):
            todo.append(name)
        elif holds_a_run(folder):
            say(f"{name}: {folder} holds a run, not run again")
        elif not slurm:
            say(f"{name}: {folder} holds no run (no run_start): run again, its files kept aside")
            todo.append(name)
        elif name not in jobs:
            say(f"{name}: {folder} holds no run yet and no job of it is known: not submitted again")
        else:
            state = job_state(str(jobs[name]))
            if state == "":
                say(f"{name}: {folder} holds no run and its job {jobs[name]} has left the queue: submitted again")
                todo.append(name)
            else:
                why = f"its job {jobs[name]} is {state.lower()}" if state else f"squeue cannot tell of job {jobs[name]}"
                say(f"{name}: {folder} holds no run yet, {why}: not submitted again")
    planned = commands(output, todo, seeds, flags, launcher, slurm, job_script, sbatch_args, recipe,
                       from_first_seed=first_seed is not None)
    if dry_run:
        for name, command, env in planned:
            say(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, command)]))
        return 0
    os.makedirs(output, exist_ok=True)
    _write_json(seeds_path, seeds)
    if not slurm and not os.path.exists(os.path.join(output, SYSTEM_FIELDS_FILE)):
        # only what machines cannot tell, to fill in: the rest comes from the runs' own records
        # (run_description.json), which `package` refuses to see contradicted
        described = S.describe("", "", "", "", storage_path=output)
        _write_json(os.path.join(output, SYSTEM_FIELDS_FILE), {key: described[key] for key in S.unfilled(described)
                                                                if key not in S.FROM_THE_LOGS})
    failed = 0
    for name, command, env in planned:
        if slurm:
            folder = os.path.join(output, name)
            made = not os.path.exists(folder)
            os.makedirs(folder, exist_ok=True)
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode != 0:
                if made:
                    os.rmdir(folder)  # empty, made just above: the run can be submitted again
                raise DriverError(f"sbatch for {name} failed (exit {proc.returncode}): "
                                  f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
            submitted = proc.stdout.strip().split()
            if submitted and submitted[-1].isdigit():
                jobs[name] = submitted[-1]
                _write_json(jobs_path, jobs)
            say(f"{name}: seed {seeds[name]}, {proc.stdout.strip()}")
            continue
        started = time.monotonic()
        # appended: an earlier attempt's console is kept
        with open(os.path.join(output, f"{name}.console.txt"), "a", encoding="utf-8") as console:
            console.write(f"=== {name}: seed {seeds[name]}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                          f"{shlex.join(command)}\n")
            console.flush()
            code = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, stdout=console,
                                  stderr=subprocess.STDOUT).returncode
        failed += code != 0
        say(f"{name}: seed {seeds[name]}, exit {code} in {time.monotonic() - started:.1f} s")
    if failed:
        say(f"{failed} of {len(planned)} run(s) exited non-zero (their consoles: {output}/<run>.console.txt); "
            "the package command says which runs count")
    return 4 if failed else 0
