"""The run's own record of what it ran on (run_description.json) and the package built from it:
the system description of the runs' machines (not the packing host's), runs that disagree or ran
uncommitted code refused, the code packed at the commit the runs logged, the implementation's
README and launch script carrying the recipe, the default organisation refused.

Oracles: git itself (HEAD, status, ls-tree, the files of a commit), the MLPerf log's own
run_start, main.py's parser (the recorded flags parse back to the run's values), mlperf_logging's
system_desc_checker, bash running the launch script against a stand-in run_and_time.sh."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import easy_data
import run_records as R
from runtime import host as H
from runtime.app import run as run_main
from runtime.arguments import Config, parse_args
from runtime.results.validity import read_events
from runtime.submission import package as P
from runtime.submission import what_ran as W
from runtime.submission.cli import main as submission_main
from test_submission import TINY  # the same tiny run

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"UNET3D_RECIPE": "gbs28", "NCCL_ALGO": "Ring", "GA_STEPS": "1", "SLURM_JOB_ID": "4242"}
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="no git checkout")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run with the recipe's settings in its environment; its argv kept."""
    folder = tmp_path_factory.mktemp("run") / "run"
    data = easy_data.write_dataset(str(tmp_path_factory.mktemp("easy") / "data"), range(4))
    argv = ["--data_dir", data, "--log_dir", str(folder), "--seed", "7", *TINY]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in SETTINGS.items():
            patch.setenv(name, value)
        patch.delenv("UNET3D_CACHE_CLEARED", raising=False)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert run_main(parse_args(argv)) in (0, 3)
    return folder, argv


def committed_copy(run_folder: Path, target: Path) -> Path:
    shutil.copytree(run_folder, target)
    if (ROOT / ".git").exists():
        R.as_committed(target)
    return target


def package(*args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = submission_main(["package", *map(str, args)])
    return code, err.getvalue()


def one_line(code: int, err: str, *named: str) -> None:
    assert code == 1 and err.count("\n") == 1, err
    for name in named:
        assert name in err, (name, err)


# -- the record -----------------------------------------------------------------------------------------------------


def test_a_run_records_its_machine_software_code_and_recipe_before_run_start(run):
    folder, argv = run
    record = R.record(folder)
    run_start = next(e for e in read_events(str(folder / "unet3d.log")) if e["key"] == "run_start")
    assert record["time"] < run_start["time_ms"] / 1000  # written before the clock started
    assert (record["nodes"], record["world_size"], record["processes_per_node"], record["device"]) == (1, 1, 1, "cpu")
    (host,) = record["hosts"]
    assert host["ranks"] == [0] and host["logical_cpus"] == os.cpu_count() and host["accelerators_used"] == 0
    assert record["software"]["Python"] == ".".join(map(str, sys.version_info[:3]))
    import torch
    assert record["software"]["PyTorch"] == torch.__version__
    environment = record["recipe"]["environment"]
    assert {k: environment.get(k) for k in SETTINGS} == SETTINGS and "PATH" not in environment
    # the flags rebuilt from the parsed config parse back to the same run (the parser is the oracle)
    again = parse_args(record["recipe"]["flags"])
    first = parse_args(argv)
    for name in ("filters", "input_shape", "learning_rate", "optimizer", "batch_size", "seed", "data_dir",
                 "submission_platform", "normalization", "epochs", "quality_threshold"):
        assert getattr(again, name) == getattr(first, name), name
    assert record["recipe"]["launcher"] == "python" and record["recipe"]["argv"] is None  # not main.py: in-process
    if (ROOT / ".git").exists():  # git's own answer
        assert record["code"]["commit"] == R.git("rev-parse", "HEAD").strip()
        assert record["code"]["dirty"] == bool(R.git("status", "--porcelain", "--", *H.CODE_PATHS).strip())


def test_the_record_gathers_every_process_by_node():
    """Four processes on two hosts (each process's own facts, as all_gather_object hands them to
    rank 0): two nodes of two processes, each using two accelerators."""
    def process(rank, hostname):
        host = {"hostname": hostname, "cpu_model": "AMD EPYC 9654", "sockets": 2,
                "accelerators": {"visible": 8, "model": "NVIDIA H200", "memory": "141 GiB"}}
        return {"rank": rank, "device": f"cuda:{rank % 2}", "host": host, "software": {"PyTorch": "2.3.0"}}

    record = H.run_description([process(3, "b"), process(0, "a"), process(1, "a"), process(2, "b")],
                               ["--batch_size", "7"], None, "torchrun")
    assert (record["nodes"], record["world_size"], record["processes_per_node"]) == (2, 4, 2)
    assert [(h["hostname"], h["ranks"], h["accelerators_used"]) for h in record["hosts"]] == [
        ("a", [0, 1], 2), ("b", [2, 3], 2)]


def test_the_code_paths_are_in_the_image():
    """What the fingerprint hashes is in every image: .dockerignore's allow-list (apptainer.def
    copies the same, tests/test_scripts.py checks)."""
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert set(H.CODE_PATHS) <= allowed


def test_the_default_organisation_is_main_pys_default():
    assert P.DEFAULT_ORG == Config().submission_org


# -- the package --------------------------------------------------------------------------------------------------


def other_machines(record: dict) -> None:
    """The record of a run on two nodes of eight H200s each, not this machine."""
    def host(name, ranks):
        return {"hostname": name, "cpu_model": "AMD EPYC 9654 96-Core Processor", "sockets": 2, "cores_per_socket": "96",
                "logical_cpus": 384, "cpu_frequency": "3700 MHz (maximum)", "cpu_caches": "L1d 32K, L2 1024K",
                "memory": "1511.6 GiB", "operating_system": "Rocky Linux 9.3 (kernel 5.14.0)", "container": "",
                "accelerators": {"visible": 8, "model": "NVIDIA H200", "memory": "141 GiB"},
                "ranks": ranks, "devices": [f"cuda:{i}" for i in range(8)], "accelerators_used": 8}

    record.update(nodes=2, world_size=16, processes_per_node=8, device="cuda",
                  hosts=[host("gpu-a", list(range(8))), host("gpu-b", list(range(8, 16)))],
                  software={"Python": "3.10.12", "PyTorch": "2.3.0", "CUDA": "12.1", "cuDNN": "8902",
                            "NCCL": "2.20.5", "mlperf-logging": "4.0.0"})


def test_the_package_describes_the_runs_machines_not_the_packing_host(run, tmp_path):
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc
    import torch

    sweep = tmp_path / "sweep"
    for name in ("a", "b"):
        R.rewrite(committed_copy(run[0], sweep / name), other_machines)
    code, err = package(sweep, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "2")
    assert code == 0, err
    path = tmp_path / "p" / "TinyOrg" / "systems" / "cpu-tiny.json"
    described = json.loads(path.read_text())
    assert torch.cuda.device_count() != 8  # the packing host is not the runs' machine
    assert (described["number_of_nodes"], described["accelerators_per_node"], described["accelerator_model_name"],
            described["host_processor_model_name"], described["host_processors_per_node"],
            described["host_memory_capacity"]) == ("2", "8", "NVIDIA H200", "AMD EPYC 9654 96-Core Processor", "2",
                                                   "1511.6 GiB")
    assert "CUDA 12.1" in described["other_software_stack"] and described["framework"] == "PyTorch 2.3.0"
    assert described["operating_system"] == "Rocky Linux 9.3 (kernel 5.14.0)"
    assert check_system_desc(str(path), "training", "4.0.0")[0]  # the official checker accepts it
    # --nodes that contradicts the runs, and --system_fields that does: refused in one line
    one_line(*package(sweep, "--output", tmp_path / "q", "--no_check", "--no_code", "--nodes", "1"), "--nodes")
    fields = tmp_path / "fields.json"
    fields.write_text(json.dumps({"accelerators_per_node": "4", "cooling": "liquid"}))
    one_line(*package(sweep, "--output", tmp_path / "q", "--no_check", "--no_code", "--system_fields", fields),
             "accelerators_per_node", "--system_fields")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("what, change", [
    ("number of nodes", lambda r: r.update(nodes=2, world_size=2, hosts=r["hosts"] + [
        {**r["hosts"][0], "hostname": "another", "ranks": [1]}])),
    ("accelerators per node", lambda r: r["hosts"][0].update(accelerators_used=1, devices=["cuda:0"])),
    ("software", lambda r: r["software"].update(PyTorch="2.4.0")),
    ("code", lambda r: r["code"].update(commit="0" * 40)),
    ("main.py flags", lambda r: r["recipe"].update(flags=r["recipe"]["flags"] + ["--momentum", "0.5"])),
])
def test_runs_that_disagree_are_refused_naming_the_run(run, tmp_path, what, change):
    sweep = tmp_path / "sweep"
    committed_copy(run[0], sweep / "a")
    R.rewrite(committed_copy(run[0], sweep / "b"), change)
    b = sweep / "b"  # the same start time: b comes second by name
    code, err = package(sweep, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "2")
    one_line(code, err, what, str(b))
    assert not (tmp_path / "p").exists()


def test_only_the_packed_window_must_agree(run, tmp_path):
    """Of three runs a package of two holds the rules' window (equal times: the first two): a run
    outside it that ran other software is not in the package, so it does not stop it."""
    sweep = tmp_path / "sweep"
    committed_copy(run[0], sweep / "a")
    committed_copy(run[0], sweep / "b")
    R.rewrite(committed_copy(run[0], sweep / "c"), lambda r: r["software"].update(PyTorch="2.4.0"))
    code, err = package(sweep, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "2")
    assert code == 0, err
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    assert {os.path.basename(r["folder"]): r["packed_as"] for r in report["runs"]} == {
        "a": "result_0.txt", "b": "result_1.txt", "c": None}


def test_a_run_without_a_record_is_refused_unless_the_packing_host_is_asked_for(run, tmp_path):
    folder = committed_copy(run[0], tmp_path / "old")
    (folder / "run_description.json").unlink()
    one_line(*package(folder, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "1"),
             str(folder), "--system_from_packing_host")
    assert not (tmp_path / "p").exists()
    code, err = package(folder, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "1",
                        "--system_from_packing_host")
    assert code == 0, err
    described = json.loads((tmp_path / "p" / "TinyOrg" / "systems" / "cpu-tiny.json").read_text())
    assert "packing host" in described["sw_notes"] and described["host_processor_vcpu_count"] == str(os.cpu_count())
    readme = (tmp_path / "p" / "TinyOrg" / "benchmarks" / "unet3d" / "implementations" / "cpu-tiny" / "README.md")
    assert "packing host" in readme.read_text()


@needs_git
@pytest.mark.parametrize("change, named", [
    (lambda c: c.update(dirty=True), "uncommitted changes"),
    (lambda c: c.update(commit="f" * 40), "f" * 40),
    (lambda c: c.update(fingerprint="sha256:0"), "are not those of commit"),
])
def test_a_dirty_tree_an_unknown_commit_or_other_files_are_refused(run, tmp_path, change, named):
    folder = committed_copy(run[0], tmp_path / "run")
    R.rewrite(folder, lambda r: change(r["code"]))
    code, err = package(folder, "--output", tmp_path / "p", "--no_check", "--expected_runs", "1")
    one_line(code, err, named, str(folder))
    assert not (tmp_path / "p").exists()


def write_files(root: Path, files: dict) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@needs_git
def test_the_code_packed_is_the_commit_the_runs_logged_not_the_checkout(run, tmp_path):
    """A checkout that moved on since the runs (commit A ran, B is checked out): A's files are
    packed; an image's copy without git (no commit, only the files' hash) packs HEAD when its
    files are HEAD's and is refused when they are not."""
    repo = tmp_path / "repo"
    repo.mkdir()
    R.git("init", "-q", cwd=repo)
    write_files(repo, {"main.py": "print('A')\n", "runtime/x.py": "A = 1\n", "docs/a.md": "a\n"})
    R.git("add", "-A", cwd=repo)
    R.git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "A", cwd=repo)
    commit_a = R.git("rev-parse", "HEAD", cwd=repo).strip()
    fingerprint_a = R.fingerprint_of(commit_a, repo)
    write_files(repo, {"main.py": "print('B')\n", "runtime/y.py": "B = 2\n"})
    R.git("add", "-A", cwd=repo)
    R.git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "B", cwd=repo)
    (repo / "main.py").write_text("print('uncommitted')\n")

    folder = committed_copy(run[0], tmp_path / "run")
    R.rewrite(folder, lambda r: r["code"].update(commit=commit_a, dirty=False, fingerprint=fingerprint_a))
    out = tmp_path / "p"
    report = P.assemble([str(folder)], str(out), expected=1, check=False, repo=str(repo), say=lambda _: None)
    code = out / "TinyOrg" / "benchmarks" / "unet3d" / "implementations" / P.IMPLEMENTATION
    packed = sorted(str(p.relative_to(code)) for p in code.rglob("*") if p.is_file())
    assert packed == sorted(R.git("ls-tree", "-r", "--name-only", commit_a, cwd=repo).split())
    assert (code / "main.py").read_text() == R.git("show", f"{commit_a}:main.py", cwd=repo) == "print('A')\n"
    assert commit_a in report["code"]

    head = R.git("rev-parse", "HEAD", cwd=repo).strip()
    R.git("stash", "-q", cwd=repo)  # the checkout clean at B
    image = lambda fingerprint: lambda r: r["code"].update(commit=None, dirty=None, fingerprint=fingerprint)
    R.rewrite(folder, image(R.fingerprint_of(head, repo)))
    report = P.assemble([str(folder)], str(tmp_path / "q"), expected=1, check=False, repo=str(repo),
                        say=lambda _: None)
    assert head in report["code"]
    R.rewrite(folder, image(fingerprint_a))
    with pytest.raises(P.PackageError, match="not those of commit"):
        P.assemble([str(folder)], str(tmp_path / "r"), expected=1, check=False, repo=str(repo), say=lambda _: None)


def test_the_readme_and_launch_script_carry_the_recipe(run, tmp_path):
    folder = committed_copy(run[0], tmp_path / "run")
    code, err = package(folder, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "1")
    assert code == 0, err
    here = tmp_path / "p" / "TinyOrg" / "benchmarks" / "unet3d" / "implementations" / "cpu-tiny"
    readme = (here / "README.md").read_text()
    for text in ("1 node(s) x 1 process(es)", "UNET3D_RECIPE=gbs28", "NCCL_ALGO=Ring", "--learning_rate 0.01",
                 "--filters 2 4 4 8 8", "Global batch size: 2", "recipe `gbs28`"):
        assert text in readme, text
    lines = readme.splitlines()
    flags = lines[lines.index("main.py's flags (the same in every run, but the seed and the paths):") + 2]
    assert "--learning_rate 0.01" in flags and "--seed" not in flags and "--data_dir" not in flags  # per run
    assert "SLURM_JOB_ID" not in readme
    recipe = json.loads((here / "cpu-tiny_pytorch-unet3d-kits19.json").read_text())
    assert recipe["settings"] == {k: v for k, v in SETTINGS.items() if k != "SLURM_JOB_ID"}

    # the launch script, run by bash against a stand-in run_and_time.sh that prints what it got
    stand_in = tmp_path / "code"
    stand_in.mkdir()
    (stand_in / "run_and_time.sh").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n'
                                              'echo "ENV $UNET3D_RECIPE $NCCL_ALGO $NPROC_PER_NODE"\n')
    (stand_in / "run_and_time.sh").chmod(0o755)
    proc = subprocess.run(["bash", str(here / "run_and_time.sh"), "11"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CODE_DIR": str(stand_in), "DATASET_DIR": run[1][1]})
    assert proc.returncode == 0, proc.stderr
    *args, env_line = proc.stdout.splitlines()
    assert env_line == "ENV gbs28 Ring 1" and args[0] == "11"
    # the flags it passes make main.py's config of the run, but the seed and paths
    again, first = parse_args(["--data_dir", run[1][1], *args[1:]]), parse_args(run[1])
    differ = [f for f in ("filters", "input_shape", "learning_rate", "optimizer", "batch_size", "epochs",
                          "normalization", "submission_org", "submission_platform", "evaluate_every", "device")
              if getattr(again, f) != getattr(first, f)]
    assert differ == [] and again.seed != first.seed


def test_a_recipe_runs_launch_script_runs_the_real_run_and_time(run, tmp_path):
    """The packed script of a run made with RECIPE=gbs28 on 4 processes (batch 7 each), against
    the real run_and_time.sh (DRY_RUN=1: the commands printed): the recipe takes its own derived
    --batch_size back, and main.py gets the run's flags."""
    record = R.record(run[0])
    record["recipe"]["environment"] = {**record["recipe"]["environment"], "RECIPE": "gbs28"}
    record["processes_per_node"] = 4
    flags = W.recipe_flags(record)
    record["recipe"]["flags"] = [*flags[:flags.index("--batch_size") + 1], "7", *flags[flags.index("--batch_size") + 2:]]
    script = tmp_path / "run_and_time.sh"
    script.write_text(W.launch_script(record, P.IMPLEMENTATION))
    proc = subprocess.run(["bash", str(script), "11"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "CODE_DIR": str(ROOT), "DATASET_DIR": run[1][1], "DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip().splitlines()[-1]
    assert "--nproc_per_node 4" in command and "--batch_size 7" in command and "--learning_rate 0.01" in command


def test_the_multi_node_launch_script_is_valid_bash(run):
    record = R.record(run[0])
    other_machines(record)
    script = W.launch_script(record, P.IMPLEMENTATION)
    assert "torchrun --nnodes 2 --nproc_per_node 8" in script and "--learning_rate 0.01" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0


def test_the_default_organisation_is_refused_naming_the_flag(run, tmp_path):
    folder = committed_copy(run[0], tmp_path / "run")
    log = folder / "unet3d.log"
    log.write_text(log.read_text().replace('"TinyOrg"', f'"{P.DEFAULT_ORG}"'))
    one_line(*package(folder, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "1"),
             "--submission_org", P.DEFAULT_ORG)
    assert not (tmp_path / "p").exists()


# -- --system_fields: the system that ran, and what was changed -------------------------------------------------------


def described(out: Path) -> dict:
    return json.loads((out / "TinyOrg" / "systems" / "cpu-tiny.json").read_text())


@pytest.mark.parametrize("field, value, named", [
    ("accelerator_model_name", "NVIDIA H100 80GB HBM3", "no accelerator"),
    ("accelerator_memory_capacity", "80 GiB", "no accelerator"),
    ("accelerators_per_node", "8", "the runs' records say"),
    ("host_processor_core_count", "56", "the runs' records say"),
    ("host_processor_vcpu_count", "224", "the runs' records say"),
    ("host_memory_capacity", "2 TB", "the memory their kernel saw"),
    ("framework", "TensorFlow 2.15", "did not run TensorFlow"),
    ("framework", "PyTorch 1.0.0", "the runs ran PyTorch"),
    ("framework", "JAX", "did not run JAX"),
    ("other_software_stack", "Python 3.10.12, CUDA 12.1, cuDNN 8902", "the runs ran Python"),
    ("other_software_stack", "CUDA 9.0", "did not run CUDA"),
])
def test_system_fields_that_contradict_the_runs_are_refused_in_one_line(run, tmp_path, field, value, named):
    """The records of a CPU run: no accelerator, this machine's cores and memory, this PyTorch."""
    sweep = tmp_path / "sweep"
    committed_copy(run[0], sweep / "a")
    fields = tmp_path / "fields.json"
    fields.write_text(json.dumps({field: value, "cooling": "air"}))
    one_line(*package(sweep, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "1",
                      "--system_fields", fields), field, named, "--system_fields", str(sweep / "a"))
    assert not (tmp_path / "p").exists()


def test_system_fields_that_reword_are_listed_measured_beside_given_and_the_records_packed(run, tmp_path):
    """A processor's marketing name, the memory installed (a little above what the kernel saw),
    the framework's version without its local part, and the fields machines cannot tell: packed;
    every field that replaced a measured value is listed in report.md, report.json and the
    description's notes, measured beside given; an empty field filled in is no change. Each run's
    record is packed beside its result."""
    sweep = tmp_path / "sweep"
    committed_copy(run[0], sweep / "a")
    record = R.record(sweep / "a")
    host, software = record["hosts"][0], record["software"]
    measured_memory = W.memory_bytes(host["memory"])
    given = {"host_processor_model_name": "Marketing Name 9000", "host_memory_capacity":
             f"{measured_memory * 1.05 / 1e9:.0f} GB", "framework": f"PyTorch {software['PyTorch'].split('+')[0]}",
             "cooling": "air", "host_processor_core_count": str(host["cores_per_socket"])}
    fields = tmp_path / "fields.json"
    fields.write_text(json.dumps(given))
    out = tmp_path / "p"
    code, err = package(sweep, "--output", out, "--no_check", "--no_code", "--expected_runs", "1",
                        "--system_fields", fields)
    assert code == 0, err
    description = described(out)
    assert all(description[k] == v for k, v in given.items())
    report = json.loads((out / "report.json").read_text())
    changed = {c["field"]: (c["measured"], c["given"]) for c in report["system_fields_changed"]}
    assert changed == {"host_processor_model_name": (host["cpu_model"], "Marketing Name 9000"),
                       "host_memory_capacity": (host["memory"], given["host_memory_capacity"]),
                       "framework": (f"PyTorch {software['PyTorch']}", given["framework"])}  # cooling was empty
    markdown = (out / "report.md").read_text()
    assert "`--system_fields` changed 3 field(s)" in markdown
    assert f"| `host_processor_model_name` | {host['cpu_model']} | Marketing Name 9000 |" in markdown
    assert f"host_processor_model_name: given 'Marketing Name 9000', measured {host['cpu_model']!r}" in \
        description["hw_notes"]
    assert "framework: given" in description["sw_notes"] and "framework" not in description["hw_notes"]
    packed = out / "TinyOrg" / "results" / "cpu-tiny" / "unet3d" / "run_description_0.json"
    assert json.loads(packed.read_text()) == record and report["run_descriptions"] == ["run_description_0.json"]


def test_the_readme_lists_the_recipe_values_the_runs_overrode(run, tmp_path):
    """A run whose launcher said it overrode recipe values (UNET3D_RECIPE_OVERRIDES, recorded with
    its environment): the package's README and recipe file list them; the launch script does not
    export the list (its run_and_time.sh says them again)."""
    folder = committed_copy(run[0], tmp_path / "run")
    said = "LR_WARMUP_EPOCHS=500 (the recipe: 1000); --learning_rate 3.0 (was 2.0)"
    R.rewrite(folder, lambda r: r["recipe"]["environment"].update(UNET3D_RECIPE_OVERRIDES=said))
    code, err = package(folder, "--output", tmp_path / "p", "--no_check", "--no_code", "--expected_runs", "1")
    assert code == 0, err
    here = tmp_path / "p" / "TinyOrg" / "benchmarks" / "unet3d" / "implementations" / "cpu-tiny"
    readme = (here / "README.md").read_text()
    assert "overrode 2 value(s) of the recipe `gbs28`" in readme
    assert "- `LR_WARMUP_EPOCHS=500 (the recipe: 1000)`" in readme and "- `--learning_rate 3.0 (was 2.0)`" in readme
    recipe = json.loads((here / "cpu-tiny_pytorch-unet3d-kits19.json").read_text())
    assert recipe["recipe_overrides"] == ["LR_WARMUP_EPOCHS=500 (the recipe: 1000)", "--learning_rate 3.0 (was 2.0)"]
    assert "UNET3D_RECIPE_OVERRIDES" not in (here / "run_and_time.sh").read_text()
    assert "UNET3D_RECIPE_OVERRIDES" not in recipe["settings"]
