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

:func:`run_sweep` looks once (:func:`look`), checks every refusal before any run or file
(:func:`check_sweep`, pure: the problems, one line each), plans the sweep (:func:`plan_sweep`: a
frozen :class:`SweepPlan` of the runs, their seeds, folders and commands), then runs it
(:func:`launch`), as ``runtime.app.run`` does a mode.
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
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

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


def given_seed_clash(names: Sequence[str], known: Mapping[str, int], first_seed: int | None) -> str:
    """Why ``--first_seed``'s seeds cannot go to ``names`` ('': they can): one of them is already
    another run's in ``known`` (seeds.json)."""
    if first_seed is None:
        return ""
    used = set(known.values())
    clash = next((name for index, name in enumerate(names) if name not in known and first_seed + index in used), None)
    return f"seed {first_seed + names.index(clash)} for {clash} is already another run's (in {SEEDS_FILE})" \
        if clash else ""


def os_seed() -> int:
    """A seed from the OS's randomness, 1 .. 2**31 - 2."""
    return 1 + secrets.randbelow(2**31 - 2)


def plan_seeds(names: Sequence[str], known: Mapping[str, int], first_seed: int | None,
               draw: Callable[[], int] = os_seed) -> dict:
    """A distinct seed for every name: ``known`` ones kept, ``first_seed + index`` when given,
    else drawn (``draw``: from the OS), never one already used."""
    clash = given_seed_clash(names, known, first_seed)
    if clash:
        raise DriverError(clash)
    seeds = dict(known)
    used = set(seeds.values())
    for index, name in enumerate(names):
        if name in seeds:
            continue
        seed = first_seed + index if first_seed is not None else draw()
        while seed in used:
            seed = draw()
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


# -- check -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRequest:
    """What ``runs`` was asked (``output`` absolute; ``flags``: main.py's, after ``--``)."""
    output: str
    count: int
    flags: tuple[str, ...] = ()
    launcher: str = "run_and_time"
    first_seed: int | None = None
    slurm: bool = False
    job_script: str = ""
    sbatch_args: tuple[str, ...] = ()
    recipe: str = ""


@dataclass(frozen=True)
class Surroundings:
    """What the machine says that the checks and the plan need, looked at once (:func:`look`)."""
    output_is_file: bool = False
    recipes: tuple[str, ...] = ()    # scripts/recipes/<name>.sh (listed when --recipe is given)
    dataset: str = ""                # DATASET_DIR, else the reference's data folder when it holds a dataset
    dataset_found: bool = False      # ``dataset`` is a folder
    reference: str = REFERENCE_DATA_DIR
    job_script: str = ""             # --job_script or the default one, absolute
    job_script_found: bool = False
    seeds: Mapping[str, int] = field(default_factory=dict)   # the sweep's seeds.json
    jobs: Mapping[str, str] = field(default_factory=dict)    # the sweep's jobs.json
    unreadable: tuple[str, ...] = ()  # why seeds.json or jobs.json cannot be read


def look(request: SweepRequest, environ: Mapping[str, str]) -> Surroundings:
    """The output, the recipes, the dataset (``environ``'s DATASET_DIR), the job script and the
    sweep's files so far, as they are now; nothing judged (:func:`check_sweep` does)."""
    reference = environ.get("REFERENCE_DATA_DIR") or REFERENCE_DATA_DIR
    dataset = environ.get("DATASET_DIR", "")
    if not dataset and glob.glob(os.path.join(glob.escape(reference), "case_*_x.npy")):
        dataset = reference  # run_and_time.sh reads it, as the reference's script does
    job_script = os.path.abspath(request.job_script or os.path.join(REPO, "scripts", "slurm", "single_node.sbatch"))
    read, unreadable = {}, []
    for name in (SEEDS_FILE, JOBS_FILE):
        try:
            read[name] = _read_json(os.path.join(request.output, name))
        except DriverError as error:
            read[name], unreadable = {}, unreadable + [str(error)]
    recipes = sorted(n[:-3] for n in os.listdir(RECIPES_DIR) if n.endswith(".sh")) if request.recipe else []
    return Surroundings(os.path.exists(request.output) and not os.path.isdir(request.output), tuple(recipes),
                        dataset, os.path.isdir(dataset), reference, job_script, os.path.isfile(job_script),
                        read[SEEDS_FILE], read[JOBS_FILE], tuple(unreadable))


def check_sweep(request: SweepRequest, there: Surroundings) -> list[str]:
    """Every reason to refuse ``request`` before any run or file, one line each, in the order
    they are told ([]: none). Pure: ``there`` is what the machine said."""
    r, problems = request, []
    if r.count < 1:
        problems.append(f"--runs {r.count}: at least 1")
    if r.launcher not in LAUNCHERS:
        problems.append(f"--launcher {r.launcher!r}: one of {', '.join(LAUNCHERS)}")
    if there.output_is_file:
        problems.append(f"--output {r.output} is a file, not a folder")
    owned = driver_flags(r.flags)
    if owned:
        problems.append(f"-- {' '.join(owned)}: runs gives every run its own seed (drawn from the OS, kept in "
                        f"{SEEDS_FILE}), folder and checkpoint (RUNS/run_<i>); leave --seed, --log_dir and "
                        "--save_ckpt_path out of the flags after --")
    if r.first_seed is not None and division_of(r.flags) != "open":
        problems.append(f"--first_seed {r.first_seed}: seeds {r.first_seed}, {r.first_seed + 1}, ... are not allowed "
                        "in the closed division (the rules: from the clock, the OS's randomness or an RNG seeded "
                        "from them); leave it out, or give `-- --submission_division open`")
    if r.recipe and r.recipe not in there.recipes:
        problems.append(f"--recipe {r.recipe}: no such recipe in {RECIPES_DIR} ({', '.join(there.recipes)})")
    if r.recipe and r.launcher == "main" and not r.slurm:
        problems.append(f"--recipe {r.recipe}: recipes are run_and_time.sh's and the job scripts' "
                        "(--launcher run_and_time or --slurm)")
    here_by_script = not r.slurm and r.launcher == "run_and_time"  # run_and_time.sh reads DATASET_DIR
    if here_by_script and not there.dataset:
        problems.append(f"DATASET_DIR is not set and {there.reference} holds no preprocessed dataset: "
                        "run_and_time.sh would train every run on generated synthetic data; set it to the "
                        "preprocessed KiTS19 folder")
    elif here_by_script and not there.dataset_found:
        problems.append(f"DATASET_DIR={there.dataset}: no such folder")
    if r.slurm and not there.job_script_found:
        problems.append(f"--job_script {there.job_script} not found")
    if r.slurm and "," in r.output:
        problems.append(f"--output {r.output}: a comma in the path would break sbatch --export")
    clash = given_seed_clash(run_names(r.count), there.seeds, r.first_seed)
    return problems + list(there.unreadable) + ([clash] if clash else [])


# -- plan --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A run's folder as it is now: absent, holding a run (run_start logged) or not; under
    ``--slurm`` its job in jobs.json and squeue's state of it ('': gone from the queue; None:
    squeue cannot tell)."""
    exists: bool = False
    holds_a_run: bool = False
    job: str | None = None
    job_state: str | None = None


def survey(request: SweepRequest, jobs: Mapping[str, str]) -> dict[str, Found]:
    """Every run's folder of ``request`` as it is now (and squeue's word on its job, when needed)."""
    found = {}
    for name in run_names(request.count):
        folder = os.path.join(request.output, name)
        if not os.path.exists(folder):
            found[name] = Found()
        elif holds_a_run(folder):
            found[name] = Found(exists=True, holds_a_run=True)
        else:
            job = str(jobs[name]) if name in jobs else None
            found[name] = Found(True, False, job, job_state(job) if request.slurm and job is not None else None)
    return found


def next_step(name: str, folder: str, found: Found, slurm: bool) -> tuple[bool, str]:
    """Whether the run ``name`` (in ``folder``) runs, or is submitted, now, and what is said of
    it ('': nothing)."""
    if not found.exists:
        return True, ""
    if found.holds_a_run:
        return False, f"{name}: {folder} holds a run, not run again"
    if not slurm:
        return True, f"{name}: {folder} holds no run (no run_start): run again, its files kept aside"
    if found.job is None:
        return False, f"{name}: {folder} holds no run yet and no job of it is known: not submitted again"
    if found.job_state == "":
        return True, f"{name}: {folder} holds no run and its job {found.job} has left the queue: submitted again"
    why = f"its job {found.job} is {found.job_state.lower()}" if found.job_state else \
        f"squeue cannot tell of job {found.job}"
    return False, f"{name}: {folder} holds no run yet, {why}: not submitted again"


@dataclass(frozen=True)
class Launch:
    """One run to start now: its folder, its seed, its command and the environment added to ours."""
    name: str
    folder: str
    seed: int
    command: tuple[str, ...]
    env: Mapping[str, str]

    def shell_line(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shlex.quote, self.command)])


@dataclass(frozen=True)
class SweepPlan:
    """The sweep: every run's seed (seeds.json), the runs to launch now in order, what is said
    of the others, and the jobs submitted so far (jobs.json)."""
    output: str
    slurm: bool
    seeds: Mapping[str, int]
    launches: tuple[Launch, ...]
    notes: tuple[str, ...]
    jobs: Mapping[str, str]


def launches(request: SweepRequest, names: Sequence[str], seeds: Mapping[str, int],
             job_script: str) -> tuple[Launch, ...]:
    """The launch of every run of ``names``: its command and the environment added to ours."""
    planned = []
    # seeds drawn from the OS here: each run is told so (a --first_seed one is a hand-given seed)
    source = {SEED_SOURCE_ENV: SEED_GIVEN if request.first_seed is not None else SEED_FROM_OS}
    recipe, flags = request.recipe, request.flags
    for name in names:
        folder = os.path.join(request.output, name)
        seed = str(seeds[name])
        if request.slurm:
            # the job scripts take the run's seed, folder and recipe from the environment (common.sh)
            export = f"ALL,SEED={seed},RESULTS_DIR={folder}" + (f",RECIPE={recipe}" if recipe else "") + \
                "".join(f",{k}={v}" for k, v in source.items())
            command, env = ["sbatch", "--job-name", f"unet3d-{name}", "--export", export, *request.sbatch_args,
                            job_script, *flags], {}
        elif request.launcher == "run_and_time":
            # this interpreter (a venv's, say) runs the training, not whichever python is on PATH; the
            # folder and checkpoint are the run's own, whatever the caller's environment says
            env = {"RESULTS_DIR": folder, "LOG_DIR": folder, "SAVE_CKPT_PATH": os.path.join(folder, "checkpoint.pt"),
                   "PYTHON": sys.executable, **source, **({"RECIPE": recipe} if recipe else {})}
            command = ["bash", os.path.join(REPO, "run_and_time.sh"), seed, *flags]
        else:
            command, env = [sys.executable, os.path.join(REPO, "main.py"), "--seed", seed, "--log_dir", folder,
                            *flags], dict(source)
        planned.append(Launch(name, folder, seeds[name], tuple(command), env))
    return tuple(planned)


def plan_sweep(request: SweepRequest, there: Surroundings, found: Mapping[str, Found]) -> SweepPlan:
    """The sweep ``request`` asks for, given what is ``there`` and ``found`` in its folders
    (checked first: :func:`check_sweep`). Pure but for the seeds drawn from the OS."""
    names = run_names(request.count)
    seeds = plan_seeds(names, there.seeds, request.first_seed)
    steps = [(name, *next_step(name, os.path.join(request.output, name), found[name], request.slurm))
             for name in names]
    todo = [name for name, runs, _ in steps if runs]
    return SweepPlan(request.output, request.slurm, seeds, launches(request, todo, seeds, there.job_script),
                     tuple(note for *_, note in steps if note), dict(there.jobs))


# -- run ---------------------------------------------------------------------------------------------------------


def run_sweep(output: str, count: int, flags: Sequence[str] = (), launcher: str = "run_and_time",
              first_seed: int | None = None, slurm: bool = False, job_script: str = "",
              sbatch_args: Sequence[str] = (), dry_run: bool = False, say: Callable[[str], None] = print,
              recipe: str = "") -> int:
    """Run (or submit, or print with ``dry_run``) the runs of ``output`` not made yet: check
    everything first (:func:`check_sweep`; the first problem is a :class:`DriverError`), plan
    (:func:`plan_sweep`), then run (:func:`launch`). Returns 0 when every run started here exited
    0 (every job was submitted), else 4."""
    request = SweepRequest(os.path.abspath(output), count, tuple(flags), launcher, first_seed, slurm, job_script,
                           tuple(sbatch_args), recipe)
    there = look(request, os.environ)
    problems = check_sweep(request, there)
    if problems:
        raise DriverError(problems[0])
    plan = plan_sweep(request, there, survey(request, there.jobs))
    for line in plan.notes + (tuple(run.shell_line() for run in plan.launches) if dry_run else ()):
        say(line)
    return 0 if dry_run else launch(plan, say)


def launch(plan: SweepPlan, say: Callable[[str], None] = print) -> int:
    """Write the sweep's files and start its runs one after the other (``--slurm``: submit them):
    0 when every run exited 0 (every job was submitted), else 4."""
    os.makedirs(plan.output, exist_ok=True)
    _write_json(os.path.join(plan.output, SEEDS_FILE), dict(plan.seeds))
    if not plan.slurm and not os.path.exists(os.path.join(plan.output, SYSTEM_FIELDS_FILE)):
        # only what machines cannot tell, to fill in: the rest comes from the runs' own records
        # (run_description.json), which `package` refuses to see contradicted
        described = S.describe("", "", "", "", storage_path=plan.output)
        _write_json(os.path.join(plan.output, SYSTEM_FIELDS_FILE),
                    {key: described[key] for key in S.unfilled(described) if key not in S.FROM_THE_LOGS})
    if plan.slurm:
        jobs = dict(plan.jobs)
        for run in plan.launches:
            submit(run, jobs, os.path.join(plan.output, JOBS_FILE), say)
        return 0
    failed = sum(run_here(run, plan.output, say) != 0 for run in plan.launches)
    if failed:
        say(f"{failed} of {len(plan.launches)} run(s) exited non-zero (their consoles: "
            f"{plan.output}/<run>.console.txt); the package command says which runs count")
    return 4 if failed else 0


def submit(run: Launch, jobs: dict, jobs_path: str, say: Callable[[str], None]) -> None:
    """``sbatch`` of ``run``: its job id kept in ``jobs`` and ``jobs_path``; a refusal is a DriverError."""
    made = not os.path.exists(run.folder)
    os.makedirs(run.folder, exist_ok=True)
    proc = subprocess.run(list(run.command), capture_output=True, text=True)
    if proc.returncode != 0:
        if made:
            os.rmdir(run.folder)  # empty, made just above: the run can be submitted again
        raise DriverError(f"sbatch for {run.name} failed (exit {proc.returncode}): "
                          f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
    submitted = proc.stdout.strip().split()
    if submitted and submitted[-1].isdigit():
        jobs[run.name] = submitted[-1]
        _write_json(jobs_path, jobs)
    say(f"{run.name}: seed {run.seed}, {proc.stdout.strip()}")


def run_here(run: Launch, output: str, say: Callable[[str], None]) -> int:
    """``run`` on this machine, its console appended to ``<output>/<name>.console.txt``: its exit code."""
    started = time.monotonic()
    # appended: an earlier attempt's console is kept
    with open(os.path.join(output, f"{run.name}.console.txt"), "a", encoding="utf-8") as console:
        console.write(f"=== {run.name}: seed {run.seed}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{shlex.join(run.command)}\n")
        console.flush()
        code = subprocess.run(list(run.command), cwd=REPO, env={**os.environ, **run.env}, stdout=console,
                              stderr=subprocess.STDOUT).returncode
    say(f"{run.name}: seed {run.seed}, exit {code} in {time.monotonic() - started:.1f} s")
    return code
