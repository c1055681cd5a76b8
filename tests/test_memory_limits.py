"""The memory a process may use, from its job's own cgroup (v1 and v2), MemAvailable and
SLURM's --mem: fixture trees laid out as the kernel lays them out, with known answers, and
once under a real cgroup v1 limit made here (root, a memory controller mounted)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_loading.memory_limits import Memory, cgroup_folder, read_memory, slurm_memory

GIB = 1 << 30
MEMINFO = "MemTotal:       33554432 kB\nMemFree:         1000000 kB\nMemAvailable:   25165824 kB\n"  # 32 / 24 GiB


def files(root: Path, tree: dict[str, str]) -> Path:
    for name, text in tree.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2_tree(root: Path, job_max: str, step_max: str = "max", mount_root: str = "/") -> Path:
    """A SLURM step under cgroup v2: the job's limit on job_12, none on its step."""
    base = "/sys/fs/cgroup/system.slice/slurmstepd.scope"
    return files(root, {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_0\n",
        "/proc/self/mountinfo": ("24 30 0:22 / /sys rw,nosuid - sysfs sysfs rw\n"
                                 f"35 24 0:30 {mount_root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"),
        f"{base}/job_12/memory.max": f"{job_max}\n",
        f"{base}/job_12/memory.current": f"{3 * GIB}\n",
        f"{base}/job_12/memory.stat": f"anon {2 * GIB}\nfile {GIB}\ninactive_file {GIB}\n",
        f"{base}/job_12/step_0/memory.max": f"{step_max}\n",
        f"{base}/job_12/step_0/memory.current": f"{2 * GIB}\n",
        f"{base}/job_12/step_0/user/task_0/memory.max": "max\n",
        "/sys/fs/cgroup/memory.max": "max\n",   # the root has none (nor does it have the file, really)
    })


def test_cgroup_v2_limit_of_the_job_above_the_step(tmp_path):
    root = v2_tree(tmp_path, job_max=str(8 * GIB))
    assert cgroup_folder(str(root))[:2] == (
        "v2", "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_12/step_0/user/task_0")
    memory = read_memory(str(root), environ={})
    # limit: 8 GiB (not the 32 GiB machine); available: 8 GiB less the working set (3 - 1 GiB)
    assert memory == Memory(8 * GIB, "the cgroup v2 /sys/fs/cgroup/system.slice/slurmstepd.scope/job_12/memory.max "
                            "limit", 6 * GIB, "the cgroup v2 /sys/fs/cgroup/system.slice/slurmstepd.scope/job_12/"
                            "memory.max limit less its use")


def test_cgroup_v2_the_smaller_of_two_levels_and_slurms_mem(tmp_path):
    root = v2_tree(tmp_path, job_max=str(8 * GIB), step_max=str(4 * GIB))
    memory = read_memory(str(root), environ={})
    assert memory.limit == 4 * GIB and memory.available == 2 * GIB          # step: 4 GiB less 2 GiB used
    memory = read_memory(str(root), environ={"SLURM_MEM_PER_NODE": "1024"})
    assert (memory.limit, memory.limit_source) == (GIB, "SLURM's --mem")
    assert (memory.available, memory.available_source) == (GIB, "SLURM's --mem")


def test_cgroup_v2_inside_a_container_sees_its_own_part(tmp_path):
    """A cgroup namespace: /proc/self/cgroup says 0::/ and the mount's root is the job's folder."""
    root = files(tmp_path, {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": "0::/\n",
        "/proc/self/mountinfo": "35 24 0:30 /job_12 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n",
        "/sys/fs/cgroup/memory.max": f"{2 * GIB}\n",
        "/sys/fs/cgroup/memory.current": "0\n",
    })
    assert read_memory(str(root), environ={}).limit == 2 * GIB


def test_cgroup_v1_memory_controller_beside_others_and_no_limit(tmp_path):
    tree = {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": ("12:cpu,cpuacct:/slurm/uid_0/job_5/step_0\n"
                              "4:memory:/slurm/uid_0/job_5/step_0\n0::/\n"),
        "/proc/self/mountinfo": ("32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                                 "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                                 "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"),
        "/sys/fs/cgroup/memory/slurm/uid_0/job_5/memory.limit_in_bytes": f"{3 * GIB}\n",
        "/sys/fs/cgroup/memory/slurm/uid_0/job_5/memory.usage_in_bytes": f"{2 * GIB}\n",
        "/sys/fs/cgroup/memory/slurm/uid_0/job_5/memory.stat": f"cache {GIB}\ntotal_inactive_file {GIB // 2}\n",
        "/sys/fs/cgroup/memory/slurm/uid_0/job_5/step_0/memory.limit_in_bytes": "9223372036854771712\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
    }
    root = files(tmp_path, tree)
    assert cgroup_folder(str(root)) == ("v1", "/sys/fs/cgroup/memory/slurm/uid_0/job_5/step_0", "/sys/fs/cgroup/memory")
    memory = read_memory(str(root), environ={})
    assert memory.limit == 3 * GIB and memory.available == 3 * GIB - (2 * GIB - GIB // 2)
    # no limit anywhere: the machine's memory, and MemAvailable
    (root / "sys/fs/cgroup/memory/slurm/uid_0/job_5/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert read_memory(str(root), environ={}) == Memory(32 * GIB, "physical memory", 24 * GIB, "MemAvailable")


def test_nothing_readable_and_slurms_per_cpu_memory(tmp_path):
    assert read_memory(str(tmp_path), environ={}) == Memory(None, "", None, "")
    assert slurm_memory({"SLURM_MEM_PER_CPU": "2000", "SLURM_CPUS_ON_NODE": "4"}) == 8000 << 20
    assert slurm_memory({"SLURM_MEM_PER_NODE": "0"}) is None and slurm_memory({}) is None


def own_v1_memory_cgroup() -> Path | None:
    try:
        line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if "memory" in line.split(":")[1].split(","))
    except (OSError, StopIteration, IndexError):
        return None
    folder = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
    return folder if os.access(folder, os.W_OK) else None


@pytest.mark.skipif(own_v1_memory_cgroup() is None, reason="needs root and a writable cgroup v1 memory controller")
def test_a_real_cgroup_v1_limit_is_read_by_a_process_inside_it(tmp_path):
    """The kernel's own cgroup: a child of this process's memory cgroup limited to 768 MiB,
    a Python process moved into it, and what it reads of itself."""
    folder = own_v1_memory_cgroup() / f"unet3d-test-{os.getpid()}"
    folder.mkdir()
    try:
        (folder / "memory.limit_in_bytes").write_text(str(768 << 20))
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from data_loading.memory_limits import read_memory; m = read_memory();"
                "print(m.limit, m.limit_source)")
        out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, SLURM_MEM_PER_NODE=""))
        assert out.returncode == 0, out.stderr
        limit, source = out.stdout.split(" ", 1)
        assert int(limit) == 768 << 20 and str(folder) in source
    finally:
        folder.rmdir()


def test_preprocessing_runs_as_many_workers_as_the_largest_case_fits(tmp_path, capsys):
    import nibabel
    import numpy as np

    import preprocess_dataset
    from data_loading.preprocessing import RawCase
    from data_loading.scan_checks import predict_bytes

    cases = []
    for i, slices in enumerate((20, 40, 30)):
        path = tmp_path / f"case_{i:05d}.nii.gz"
        image = nibabel.Nifti1Image(np.zeros((slices, 16, 16), np.int16), np.diag([3.0, 0.8, 0.8, 1]))
        nibabel.save(image, str(path))
        cases.append(RawCase(i, str(path), None))
    need = predict_bytes((40, 16, 16), (3.0, 0.8, 0.8))           # the largest case's
    memory = Memory(None, "", int(2.5 * need), "the cgroup v2 /x/memory.max limit less its use")
    assert preprocess_dataset.workers_within_memory(cases, 4, memory) == 2
    assert "2 worker(s) instead of 4" in capsys.readouterr().out
    assert preprocess_dataset.workers_within_memory(cases, 4, Memory(None, "", 10 * need, "MemAvailable")) == 4
    assert preprocess_dataset.workers_within_memory(cases, 4, Memory(None, "", need // 2, "MemAvailable")) == 1
    assert preprocess_dataset.workers_within_memory(cases, 4, Memory(None, "", None, "")) == 4


def test_predicts_window_batch_is_bounded_by_the_jobs_cgroup(tmp_path, monkeypatch):
    """Without --max_memory_gb the limit is what read_memory says is available (the job's
    cgroup here, far below the machine's MemAvailable): the batch is lowered to what fits and
    the line names the cgroup."""
    from runtime.arguments import parse_args, replace
    from runtime.inference import memory_budget

    config = parse_args(["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                         "--load_ckpt_path", __file__, "--val_input_shape", "128", "128", "128", "--sw_batch_size", "4"])
    config = replace(config, filters=(32, 64, 128, 256, 320))
    two = memory_budget.estimate_bytes(config.filters, config.val_input_shape, "torch", 2)
    source = "the cgroup v1 /sys/fs/cgroup/memory/slurm/job_5/memory.limit_in_bytes limit less its use"
    monkeypatch.setattr(memory_budget, "read_memory", lambda: Memory(None, "", int(two * 1.01), source))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    lines = []
    assert memory_budget.bounded_window_batch(config.sw_batch_size, config.max_memory_gb, config.filters,
                                              config.val_input_shape, "torch", lines.append) == 2
    assert len(lines) == 1 and "lowered to 2" in lines[0] and source in lines[0]
