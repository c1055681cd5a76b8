"""The driver owns the seeds, and a hand-given seed is said.

``python -m runtime.submission runs`` gives each run its own seed (drawn from the OS, kept in
seeds.json), folder and checkpoint: ``--seed``, ``--log_dir`` and ``--save_ckpt_path`` among the
flags after ``--`` are refused before any run (matched as main.py's own parser matches them,
abbreviations included). Every run is told where its seed came from (``UNET3D_SEED_SOURCE``), the
MLPerf log's ``seed`` event says it (metadata ``source``), a closed run with a hand-given seed says
in one line that the rules want clock or OS seeds (``training_rules.adoc`` v4.0, "Random numbers":
"Random number generators may be seeded from the following sources: Clock, System source of
randomness, ... Another random number generator initialized with an allowed seed"), and the
package report names such runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.arguments import parse_args
from runtime.distributed import DistInfo
from runtime.resolve import resolve
from runtime.run_log import MLPerfLogger
from runtime.submission.cli import main as submission_main
from runtime.submission.package import assemble
from test_every_attempt import write_log
from test_report import T0_MS
from test_submission import fake_repo  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
HOUR_MS = 3_600_000


@pytest.fixture
def seed_sources(fake_repo, monkeypatch):  # noqa: F811 - the fixture
    """The stand-in run_and_time.sh also records what it was told of its seed."""
    script = Path(os.environ["FAKE_RECORD"]).parent / "repo" / "run_and_time.sh"
    script.write_text(script.read_text().replace(
        'exit "$', 'echo "${UNET3D_SEED_SOURCE:-unset}" >> "$FAKE_RECORD.source"\nexit "$', 1))
    monkeypatch.setenv("UNET3D_SEED_SOURCE", "stale")  # the caller's environment never decides
    return fake_repo


@pytest.mark.parametrize("flags", [["--seed", "7"], ["--seed=7"], ["--log_dir", "elsewhere"],
                                   ["--save_ckpt_path", "one.pt"], ["--save_ckpt", "one.pt"], ["--see", "7"],
                                   ["--learning_rate", "2.0", "--seed", "7"]])
@pytest.mark.parametrize("mode", [[], ["--dry_run"], ["--slurm", "--dry_run"], ["--launcher", "main"]])
def test_runs_refuses_the_flags_it_owns_before_any_run(fake_repo, tmp_path, capsys, flags, mode):  # noqa: F811
    out = tmp_path / "runs"
    assert submission_main(["runs", "--output", str(out), "--runs", "2", *mode, "--", *flags]) == 1
    err = capsys.readouterr().err
    owned = [f for f in flags if f.startswith("--s") or f.startswith("--log")]
    assert err.count("\n") == 1 and f"-- {' '.join(owned)}" in err and "seeds.json" in err, err
    assert not fake_repo.exists() and not out.exists()  # nothing ran, nothing written


def test_flags_that_only_resemble_them_pass(fake_repo, tmp_path, capsys):  # noqa: F811
    """``--se`` is ambiguous for main.py's parser (--seed, --semantics, ...): not one of them;
    --semantics, --sw_batch_size are other flags."""
    out = tmp_path / "runs"
    assert submission_main(["runs", "--output", str(out), "--runs", "1", "--dry_run", "--", "--semantics", "reference",
                            "--sw_batch_size", "2", "--submission_division", "open"]) == 0
    assert "--semantics reference" in capsys.readouterr().out


def test_each_run_is_told_that_its_seed_came_from_the_os(seed_sources, tmp_path, capsys):
    out = tmp_path / "runs"
    assert submission_main(["runs", "--output", str(out), "--runs", "2"]) == 0
    assert Path(f"{seed_sources}.source").read_text().split() == ["os", "os"]
    seeds = json.loads((out / "seeds.json").read_text())
    assert [line.split()[0] for line in seed_sources.read_text().splitlines()] == [str(s) for s in seeds.values()]
    assert submission_main(["runs", "--output", str(tmp_path / "open"), "--runs", "1", "--first_seed", "5", "--",
                            "--submission_division", "open"]) == 0
    assert Path(f"{seed_sources}.source").read_text().split()[-1] == "given"  # chosen, not drawn
    assert submission_main(["runs", "--output", str(tmp_path / "slurm"), "--runs", "1", "--slurm", "--dry_run",
                            "--job_script", str(ROOT / "scripts" / "slurm" / "single_node.sbatch")]) == 0
    assert ",UNET3D_SEED_SOURCE=os" in capsys.readouterr().out


def logged_seed(tmp_path: Path, argv: list[str]) -> tuple[dict, str]:
    """The seed event main.py's logger writes for ``argv`` (resolved as a run resolves it), and
    what it printed."""
    plan = resolve(parse_args(["--data_dir", str(tmp_path), "--device", "cpu", *argv]), CPU)
    log = MLPerfLogger(str(tmp_path), enabled=True, name=f"{len(os.listdir(tmp_path))}.log")
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        log.submission_info(plan)
    log.close()
    records = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in open(log.path).read().splitlines()]
    (seed,) = [r for r in records if r["key"] == "seed"]
    return seed, printed.getvalue()


@pytest.mark.parametrize("argv, env, source, said", [
    (["--seed", "1", "--submission_division", "closed"], None, "given", True),
    (["--seed", "1", "--submission_division", "closed"], "os", "os", False),  # run_and_time.sh or runs drew it
    (["--seed", "1", "--submission_division", "closed"], "given", "given", True),  # runs --first_seed (open only)
    (["--seed", "-1", "--submission_division", "closed"], None, "os", False),  # main.py draws it from the OS
    (["--seed", "1", "--submission_division", "open"], None, "given", False),  # open: any seed
])
def test_a_closed_run_with_a_hand_given_seed_says_so_in_one_line(tmp_path, monkeypatch, argv, env, source, said):
    if env is None:
        monkeypatch.delenv("UNET3D_SEED_SOURCE", raising=False)
    else:
        monkeypatch.setenv("UNET3D_SEED_SOURCE", env)
    seed, printed = logged_seed(tmp_path, argv)
    assert seed["metadata"]["source"] == source and isinstance(seed["value"], int) and seed["value"] >= 0
    if said:
        assert printed.count("\n") == 1 and "given by hand" in printed and "the OS's randomness" in printed, printed
        assert "Random numbers" in printed
    else:
        assert "by hand" not in printed


@pytest.mark.skipif(sys.platform != "linux", reason="bash and od")
def test_run_and_time_says_it_drew_the_default_seed_and_not_a_given_one(tmp_path):
    """The reference's command lines: ``./run_and_time.sh`` (seed -1: drawn by the script from the
    OS) and ``./run_and_time.sh 1`` (given); a stand-in python records what main.py was told."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\necho "${{UNET3D_SEED_SOURCE:-unset}}" >> {tmp_path}/told\n')
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(python), "DATASET_DIR": str(tmp_path),
           "RESULTS_DIR": str(tmp_path / "r"), "CLEAR_CACHES": "0"}
    for seed in ([], ["1"]):
        proc = subprocess.run(["bash", str(ROOT / "run_and_time.sh"), *seed], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "told").read_text().split() == ["os", "unset"]


def test_the_package_report_names_closed_runs_whose_seed_was_not_drawn(tmp_path):
    def run(folder: Path, start_ms: int, seed: int, source: str | None) -> None:
        log = write_log(folder, start_ms, 30, seed=seed)
        lines = []
        for line in log.read_text().splitlines():
            record = json.loads(line.split(":::MLLOG ", 1)[1])
            if record["key"] == "seed" and source is not None:
                record["metadata"] = {**(record.get("metadata") or {}), "source": source}
            lines.append(":::MLLOG " + json.dumps(record))
        log.write_text("\n".join(lines) + "\n")

    run(tmp_path / "runs" / "run_00", T0_MS, 1111, "os")
    run(tmp_path / "runs" / "run_01", T0_MS + HOUR_MS, 1, "given")
    run(tmp_path / "runs" / "run_02", T0_MS + 2 * HOUR_MS, 2, None)  # a log older than the source
    report = assemble([str(tmp_path / "runs")], str(tmp_path / "package"), expected=3, check=False, code=False,
                      packing_host=True, say=lambda _: None)
    assert report["division"] == "closed" and report["hand_seeded"] == ["result_1.txt", "result_2.txt"]
    text = (tmp_path / "package" / "report.md").read_text()
    assert "Seeds not drawn from the OS** (2 closed run(s))" in text
    assert "result_1.txt (run_01, seed 1, given by hand)" in text and "run_02, seed 2, its source not logged" in text
    assert "run_00, seed 1111" not in text
