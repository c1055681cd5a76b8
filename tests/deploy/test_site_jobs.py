"""The job scripts as real sites run them (issue "Real sites"), under the real two-node SLURM:
a user's own persistent $SCRATCH shared by all of that user's jobs, a dataset kept there, a
sweep, and hard kills (SIGKILL of every process of the job, lock files left as a lost node
leaves them) each followed by a requeue."""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch
from slurm_cluster import ROOT, SMALL, job_env
from test_slurm_jobs import assert_clean

from runtime.checkpoint import load_checkpoint
from runtime.outputs import LOCK_NAME


def digest_tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def own_folder(path: Path) -> Path:
    """A user's own folder that happens to be called kits19 on their scratch."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("my own data, not the job's\n")
    (path / "case_00000_x.npy").write_bytes(b"\x93NUMPY not really")
    return path


def test_a_dataset_kept_on_scratch_is_read_in_place_and_left_byte_identical(cluster, dataset, tmp_path):
    scratch = tmp_path / "scratch"
    data = scratch / "kits19"
    shutil.copytree(dataset, data)
    before = digest_tree(data)
    out = tmp_path / "job.out"
    job = cluster.submit("single_node.sbatch", job_env(tmp_path, str(data), MAX_EPOCHS=1, START_EVAL_AT=1),
                         args=SMALL, output=out)
    info = cluster.wait(job, 300)
    output = out.read_text()
    assert info["JobState"] == "COMPLETED", output
    assert f"data {data} used in place (it is already under SCRATCH={scratch})" in output
    assert digest_tree(data) == before and os.listdir(scratch) == ["kits19"]
    assert_clean(output)


def test_two_jobs_on_one_scratch_the_short_one_ending_first_both_complete(cluster, dataset, tmp_path):
    """Two jobs of one user stage into one persistent $SCRATCH, which also holds the user's own
    kits19: the short job's end removes only its own copy; the long one evaluates from its own
    copy after that; the user's folder is untouched."""
    scratch = tmp_path / "scratch"
    own = own_folder(scratch / "kits19")
    before = digest_tree(own)
    jobs = {}
    for name, epochs in (("long", 6), ("short", 1)):
        env = job_env(tmp_path / name, dataset, MAX_EPOCHS=epochs, START_EVAL_AT=epochs, SCRATCH=str(scratch))
        jobs[name] = cluster.submit("single_node.sbatch", env, args=SMALL, output=tmp_path / f"{name}.out")
    infos = {name: cluster.wait(job, 400) for name, job in jobs.items()}
    outputs = {name: (tmp_path / f"{name}.out").read_text() for name in jobs}
    for name in jobs:
        assert infos[name]["JobState"] == "COMPLETED", outputs[name]
        assert "RUN_SUMMARY,image_segmentation" in outputs[name]
        assert_clean(outputs[name])
    assert infos["short"]["EndTime"] <= infos["long"]["EndTime"], infos
    assert digest_tree(own) == before and os.listdir(scratch) == ["kits19"]


def test_a_sweep_of_three_jobs_on_one_scratch_completes(cluster, dataset, tmp_path):
    """scripts/slurm/sweep.sh for real: three jobs submitted at once, one $SCRATCH."""
    scratch = tmp_path / "scratch"
    env = dict(cluster.env, **job_env(tmp_path, dataset, MAX_EPOCHS=2, START_EVAL_AT=2, SCRATCH=str(scratch)),
               LEARNING_RATES="0.003", SEEDS="1 2 3", REPO_DIR=str(ROOT),
               SBATCH_ARGS=f"--output={tmp_path}/sweep-%j.out")
    del env["RESULTS_DIR"]                  # each job's own results/<job id> under the submit folder
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "sweep.sh"), *SMALL[:-2]], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    jobs = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("Submitted batch job")]
    assert len(jobs) == 3, proc.stdout
    for job in jobs:
        info = cluster.wait(job, 500)
        output = (tmp_path / f"sweep-{job}.out").read_text()
        assert info["JobState"] == "COMPLETED", output
        assert load_checkpoint(str(tmp_path / "results" / str(job) / "checkpoint.pt"))["epoch"] == 2
        assert_clean(output)
    assert os.listdir(scratch) == []


# ------------------------------------------------------------------------------------- chaos

def job_processes(job: int) -> list[int]:
    """Every process of the job that SLURM started (the batch script and all below it)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def kill_hard(job: int) -> int:
    """SIGKILL every process of the job until none is left (no process can clean up)."""
    killed = set()
    for _ in range(50):
        pids = job_processes(job)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return len(killed)


def as_if_lost(results: Path) -> list[Path]:
    """Rewrite the locks a killed attempt left so that they name another machine, as when the
    node it ran on is lost (nothing there can be asked whether the holder still runs)."""
    locks = [p for p in results.iterdir() if p.name == LOCK_NAME or p.name.endswith(".pt.lock")]
    for lock in locks:
        lock.write_text(lock.read_text().replace(socket.gethostname(), "lost-node"))
    return locks


def released(cluster, job: int) -> None:
    """A requeued job waits ~2 minutes (BeginTime) before it may start again: start it now, as
    an administrator's `scontrol update` would (it changes nothing else)."""
    info = cluster.job(job)
    if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
        cluster.run("scontrol", "update", f"jobid={job}", "starttime=now", check=False)


def checkpoint_epoch(path: Path) -> int:
    try:
        return load_checkpoint(str(path))["epoch"]
    except Exception:   # noqa: BLE001 - not written yet
        return 0


def test_three_hard_kills_each_requeued_end_completed_with_the_uninterrupted_weights(cluster, dataset, tmp_path):
    """SIGKILL of every process of the job at a random point after a periodic checkpoint,
    three times, each followed by `scontrol requeue` (as after a node failure or an OOM kill):
    the locks name a lost node and the staged copy and its sign-ins are left behind. The job
    ends COMPLETED and its final weights equal, bit for bit, those of the same job never
    interrupted."""
    epochs = 24  # room for three kills 2 epochs apart, each up to a second late (0.4-1 s an epoch)
    args = [*SMALL, "--ckpt_every_epochs", "1", "--ckpt_every_minutes", "0"]
    runs = {}
    for name in ("calm", "chaos"):
        env = job_env(tmp_path / name, dataset, MAX_EPOCHS=epochs, START_EVAL_AT=epochs,
                      SCRATCH=str(tmp_path / "scratch"))
        runs[name] = cluster.submit("single_node.sbatch", env, args=args, output=tmp_path / f"{name}.out")
    job, results = runs["chaos"], tmp_path / "chaos" / "results"
    rng = random.Random(20261124)
    after = 0
    for kill in range(3):
        target = after + 2
        after = cluster.wait_for(lambda: released(cluster, job) or
                                 ((e := checkpoint_epoch(results / "checkpoint.pt")) >= target and e), 300,
                                 f"the checkpoint of epoch {target} (kill {kill + 1})")
        time.sleep(rng.uniform(0.0, 1.0))           # somewhere in the next epoch or two
        assert kill_hard(job) > 0
        cluster.wait_for(lambda: cluster.job(job).get("JobState") not in ("RUNNING", "COMPLETING"), 120,
                         "the killed attempt's end")
        assert cluster.job(job)["JobState"] != "COMPLETED", "the job ended before it could be killed"
        assert as_if_lost(results), "the killed attempt left no lock"
        assert (tmp_path / "scratch" / f"unet3d-job-{job}" / "kits19" / ".staged").exists()
        # the next kill waits for the requeued attempt's own progress: on a fast CPU the killed one
        # wrote more epochs after the one waited for (before the kill landed)
        after = checkpoint_epoch(results / "checkpoint.pt")
        cluster.run("scontrol", "requeue", str(job))
    info = cluster.wait(job, 600)
    output = (tmp_path / "chaos.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "3", output
    assert output.count("resuming ") >= 3 and "is using --log_dir" not in output
    calm = cluster.wait(runs["calm"], 300)
    assert calm["JobState"] == "COMPLETED", (tmp_path / "calm.out").read_text()
    a = load_checkpoint(str(tmp_path / "calm" / "results" / "checkpoint.pt"))
    b = load_checkpoint(str(results / "checkpoint.pt"))
    assert a["epoch"] == b["epoch"] == epochs
    for key in a["last_model_state_dict"]:
        assert torch.equal(a["last_model_state_dict"][key], b["last_model_state_dict"][key]), key
    assert os.listdir(tmp_path / "scratch") == []
