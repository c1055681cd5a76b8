"""The project's own job scripts under a real SLURM (scripts/cluster/start.sh: slurmctld and two
slurmd on this host, which share one filesystem): unmodified, CONTAINER= empty, GPU_VENDOR=none,
the host's Python, a tiny synthetic dataset and the suite's tiny network."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from slurm_cluster import SMALL, job_env

from runtime.checkpoint import load_checkpoint

NO_TRACE = ("Traceback", "SignalException", "Exception raised from")


def log_records(results: Path, kind: str) -> list[dict]:
    lines = (results / "log.json").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def mlperf_value(log: Path, key: str):
    for line in log.read_text().splitlines():
        if f'"key": "{key}"' in line:
            return json.loads(line.split(":::MLLOG ", 1)[1])["value"]
    raise AssertionError(f"{key} not in {log}")


def mllog(log: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines()
            if line.startswith(":::MLLOG ")]


def trained_epochs(results: Path) -> list[int]:
    return [r["epoch"] for r in log_records(results, "train")] if (results / "log.json").exists() else []


def trained_epochs_in(output: str) -> int:
    """The epochs a pre-empted attempt finished (from its RESULT line)."""
    line = next(line for line in output.splitlines() if ",preempted," in line)
    return int(line.rsplit("epochs=", 1)[1])


def steps_in(output: str) -> int:
    """The batches of the unfinished epoch that a pre-empted attempt trained."""
    line = next(line for line in output.splitlines() if line.startswith("pre-empted ("))
    return int(line.split(" after ", 1)[1].split(" batches", 1)[0])


def assert_clean(output: str) -> None:
    for needle in NO_TRACE:
        assert needle not in output, output[-4000:]


def job_processes(job_id: int, node: str) -> list[int]:
    """pids of this job's training processes (main.py under torchrun) on ``node``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (any(arg.endswith(b"main.py") for arg in cmdline) and not any(arg.endswith(b"launch.py") for arg in cmdline)
                and f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURMD_NODENAME={node}".encode() in environ
                and any(e.startswith(b"LOCAL_RANK=") for e in environ)):
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def one_node_two_processes(cluster, dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_node")
    out = tmp / "job.out"
    job = cluster.submit("single_node.sbatch", job_env(tmp, dataset, GPUS_PER_NODE=2, MAX_EPOCHS=2,
                                                       START_EVAL_AT=2),
                         args=SMALL, output=out)
    return tmp, job, cluster.wait(job, 300), out.read_text()


def test_single_node_job_with_two_processes_completes(one_node_two_processes):
    tmp, job, info, output = one_node_two_processes
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output
    assert "RUN_SUMMARY,image_segmentation,3," in output and "8 cases, 8 samples/epoch" in output
    assert mlperf_value(tmp / "results" / "unet3d.log", "global_batch_size") == 4  # 2 ranks x 2
    assert load_checkpoint(str(tmp / "results" / "checkpoint.pt"))["epoch"] == 2
    # the timed mode: the checkpoint written after run_stop, nothing on the clock
    records = mllog(tmp / "results" / "unet3d.log")
    run_stop = next(r["time_ms"] for r in records if r["key"] == "run_stop")
    assert (tmp / "results" / "checkpoint.pt").stat().st_mtime * 1000 >= run_stop
    assert not any(r["key"] == "checkpoints_on_the_clock" for r in records)
    assert os.listdir(tmp / "scratch") == []                 # the job's staged copy is removed
    assert_clean(output)


def test_two_node_job_is_one_world_and_evaluates_as_one_node(cluster, dataset, tmp_path, one_node_two_processes):
    """One process on each node: one DDP world of 2 whose training and evaluation equal the
    one-node 2-process job of the same seed. SCRATCH is one folder both nodes see (they share
    this host's filesystem): one node copies, the other finds the copy."""
    out = tmp_path / "job.out"
    job = cluster.submit("multi_node.sbatch", job_env(tmp_path, dataset, MAX_EPOCHS=2, START_EVAL_AT=2),
                         args=SMALL, output=out)
    info = cluster.wait(job, 300)
    output = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output
    assert info["NodeList"] == f"{cluster.nodes[0][:-1]}[1-2]", info
    copied = [line for line in output.splitlines() if ": copied " in line]
    reused = [line for line in output.splitlines() if "already staged" in line]
    assert len(copied) == 1 and len(reused) == 1, output
    assert {copied[0].split(":")[0], reused[0].split(":")[0]} == set(cluster.nodes)
    results = tmp_path / "results"
    assert mlperf_value(results / "unet3d.log", "global_batch_size") == 4   # world size 2 x batch 2
    assert "8 cases, 8 samples/epoch" in output and output.count("RUN_SUMMARY,image_segmentation") == 1
    one_tmp = one_node_two_processes[0] / "results"
    for kind, keys in (("train", ("loss",)), ("eval", ("mean_dice", "l1_dice", "l2_dice", "eval_loss"))):
        two_nodes, one_node = log_records(results, kind), log_records(one_tmp, kind)
        assert len(two_nodes) == len(one_node) > 0
        for a, b in zip(two_nodes, one_node):
            for key in keys:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (kind, key)
    assert os.listdir(tmp_path / "scratch") == []
    assert_clean(output)


def test_requeue_of_a_running_job_resumes_from_its_checkpoint(cluster, dataset, tmp_path):
    """`scontrol requeue` (an administrator's, or a pre-emption): SIGTERM to every process, the
    run saves, the job says so in one line; the next attempt resumes on its own (no epoch
    twice), with an MLPerf log of its own, its output appended to the same file. Data-loading
    workers (--num_workers 1) get the SIGTERM too and must not break the save."""
    out = tmp_path / "job.out"
    results = tmp_path / "results"
    job = cluster.submit("single_node.sbatch", job_env(tmp_path, dataset, GPUS_PER_NODE=2, NUM_WORKERS=1,
                                                       MAX_EPOCHS=8, START_EVAL_AT=8),
                         args=SMALL, output=out)
    cluster.wait_for(lambda: trained_epochs(results), 240, "the first epoch")
    cluster.run("scontrol", "requeue", str(job))
    info = cluster.wait(job, 400)
    output = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", output
    stops = [line for line in output.splitlines() if "stopped by the scheduler" in line]
    assert stops == [f"job {job}: stopped by the scheduler (SIGTERM); its checkpoint is "
                     f"{results}/checkpoint.pt; a requeued job resumes from it"], output
    assert "resuming " in output and "pre-empted (SIGTERM)" in output
    assert output.count(f"job {job}: 1 node(s)") == 2                  # both attempts, appended
    assert trained_epochs(results) == list(range(1, 9))               # no epoch twice
    assert (results / "unet3d.log").exists() and len(list(results.glob("unet3d.resumed-*.log"))) == 1
    # the resumed attempt says so (not a result); the first one does not
    (resumed,) = [r for r in mllog(next(results.glob("unet3d.resumed-*.log"))) if r["key"] == "resumed_from_checkpoint"]
    assert resumed["value"] == f"{results}/checkpoint.pt" and resumed["metadata"]["epoch"] >= 0
    assert not any(r["key"] == "resumed_from_checkpoint" for r in mllog(results / "unet3d.log"))
    assert_clean(output)


def test_time_limit_warning_saves_requeues_and_the_job_finishes(cluster, dataset, tmp_path):
    """A job that cannot finish within its --time: SIGUSR1 before the limit, the run saves, the
    job requeues itself and its next attempt resumes. The test then gives the pending job the
    time to finish (as a user who asked for too little would, with `scontrol update`).

    slurmctld checks time limits every 30 s and may send the warning up to 60 s early: asked
    for 160 s before a 3-minute limit, it comes in the job's first ~30 s, while Python and
    torch may still be loading (the scripts must keep it until the training can take it), and
    leaves 2.5 minutes to save and requeue however loaded the machine is. An epoch of this
    tiny run costs about 1 s of CPU time (0.8 s wall idle, 1.4 s on a loaded 2-core machine):
    72 epochs outlast that first half-minute with a margin, so the first attempt is always
    interrupted mid-run, and the whole test stays near 1.5 minutes idle."""
    out = tmp_path / "job.out"
    results = tmp_path / "results"
    epochs = 72
    job = cluster.submit("single_node.sbatch", job_env(tmp_path, dataset, MAX_EPOCHS=epochs, START_EVAL_AT=epochs),
                         args=SMALL, sbatch=["--time=3:00", "--signal=B:USR1@160"], output=out)
    cluster.wait_for(lambda: cluster.job(job).get("Restarts") == "1", 240, "the job's requeue")
    first = out.read_text()
    cluster.run("scontrol", "update", f"jobid={job}", "timelimit=10")
    info = cluster.wait(job, 420)
    output = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", output
    warned = [line for line in first.splitlines() if "stopped before its time limit (SIGUSR1)" in line]
    assert warned == [f"job {job}: stopped before its time limit (SIGUSR1); its checkpoint is "
                      f"{results}/checkpoint.pt; requeued, it will resume from it"], first
    assert "pre-empted (SIGUSR1)" in first
    assert [line for line in output.splitlines() if line.startswith("resuming ")] == [
        f"resuming {results}/checkpoint.pt after epoch {trained_epochs_in(first)}"
        + (f" + {steps_in(first)} batches" if steps_in(first) else "")]
    assert trained_epochs(results) == list(range(1, epochs + 1))       # no epoch twice
    assert len(list(results.glob("unet3d.resumed-*.log"))) == 1
    assert_clean(output)


def test_scancel_mid_run_keeps_the_checkpoint_and_removes_the_staged_data(cluster, dataset, tmp_path):
    out = tmp_path / "job.out"
    results = tmp_path / "results"
    job = cluster.submit("single_node.sbatch", job_env(tmp_path, dataset, GPUS_PER_NODE=2, NUM_WORKERS=1,
                                                       MAX_EPOCHS=500, START_EVAL_AT=500),
                         args=SMALL, output=out)
    cluster.wait_for(lambda: trained_epochs(results), 240, "the first epoch")
    assert (tmp_path / "scratch" / f"unet3d-job-{job}" / "kits19" / ".staged").exists()
    cluster.run("scancel", str(job))
    info = cluster.wait(job, 120, release_requeued=False)
    output = out.read_text()
    assert info["JobState"] == "CANCELLED", output
    state = load_checkpoint(str(results / "checkpoint.pt"))
    assert state["status"] == "preempted" and state["epoch"] >= 1
    assert os.listdir(tmp_path / "scratch") == []
    assert "stopped by the scheduler (SIGTERM); its checkpoint is" in output
    assert_clean(output)


def test_bad_data_dir_fails_the_job_with_one_line(cluster, tmp_path):
    out = tmp_path / "job.out"
    job = cluster.submit("single_node.sbatch", job_env(tmp_path, str(tmp_path / "missing")), output=out)
    info = cluster.wait(job, 60, release_requeued=False)
    output = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert errors == [f"error: DATA_DIR={tmp_path / 'missing'} is not a folder: set it to the preprocessed dataset"]


def test_a_dead_process_on_one_node_stops_the_whole_job(cluster, dataset, tmp_path):
    """kill -9 of the training process on the second node: its torchrun fails, srun
    (--kill-on-bad-exit=1) stops the first node's, the job FAILS at once instead of hanging."""
    out = tmp_path / "job.out"
    results = tmp_path / "results"
    job = cluster.submit("multi_node.sbatch", job_env(tmp_path, dataset, MAX_EPOCHS=500, START_EVAL_AT=500),
                         args=SMALL, output=out)
    cluster.wait_for(lambda: trained_epochs(results), 240, "the first epoch")
    victims = cluster.wait_for(lambda: job_processes(job, cluster.nodes[1]), 30, "the process on node 2")
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    info = cluster.wait(job, 120, release_requeued=False)
    output = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", output
    assert "was killed by SIGKILL" in output, output
    assert os.listdir(tmp_path / "scratch") == []


def test_gpu_gres_is_the_sites_choice(cluster):
    """The headers ask for no GPU: on this cluster without GPUs the jobs above are accepted,
    and asking for GPUs (what the headers used to do) is what sbatch refuses."""
    for script in ("single_node.sbatch", "multi_node.sbatch"):
        header = [line for line in (Path("scripts/slurm") / script).read_text().splitlines()
                  if line.startswith("#SBATCH")]
        assert not any("--gres" in line or "--cpus-per-task" in line for line in header), header
    refused = subprocess.run(["sbatch", "--test-only", "--gres=gpu:4", "scripts/slurm/single_node.sbatch"],
                             env=cluster.env, capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[2])
    assert refused.returncode != 0 and "gres" in refused.stderr.lower(), refused.stderr
