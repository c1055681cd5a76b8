"""The cold start (scripts/lib/drop_page_cache.sh, scripts/slurm/stage.sh, runtime.run_log): the
MLPerf log's cache_clear is true only when the page cache was dropped after the last write to the
data the run reads, and that data is not in RAM.

"You must flush the cache or restart the system prior to benchmarking. Data can start on any
durable storage system ... This explicitly excludes RAM." (training_rules.adoc v4.0, "Data State
at Start of Run"). Each way is tried: root (a real drop: root only), `sudo -n` (a stand-in sudo
that records its command), the SLURM prolog with the data in place and with a staged copy, the host
side of a container, and data or a staging folder on tmpfs. The scripts run as the unprivileged
user nobody (setpriv), from a copy in a folder nobody can read (a checkout may be private, mode
700); besides the root test nothing here drops this machine's cache. The change times the scripts
compare are the file system's own (the oracle: each test makes the data before or after the drop
it names)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from runtime.run_log import cache_cleared, filesystem_type

ROOT = Path(__file__).resolve().parent.parent
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
STANDARD_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"

as_root_with_setpriv = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                          reason="runs the scripts as the user nobody: needs root and setpriv")


def public_folder(mode: int = 0o755) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="unet3d-cache-"))
    os.chmod(folder, mode)
    return folder


@pytest.fixture(scope="module")
def scripts():
    """The scripts, copied where nobody can read them (this checkout may be private)."""
    folder = public_folder()
    for part in ("lib", "slurm"):
        shutil.copytree(ROOT / "scripts" / part, folder / "scripts" / part)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    yield folder / "scripts"
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def source():
    """The shared dataset, made once (its drops then need no wait for the next second)."""
    folder = public_folder()
    yield dataset(folder / "shared" / "kits19")
    shutil.rmtree(folder)


@pytest.fixture
def place():
    """A folder everyone may write (sticky, as /tmp): the tests' data, staging and marks."""
    folder = public_folder(0o1777)
    yield folder
    shutil.rmtree(folder)


def dataset(folder: Path) -> Path:
    """A tiny 'preprocessed dataset' that nobody can read."""
    folder.mkdir(parents=True)
    for name in ("case_00000_x.npy", "case_00000_y.npy"):
        (folder / name).write_bytes(b"\0" * 64)
    os.chmod(folder, 0o755)
    return folder


def drop_after(*paths: Path) -> int:
    """A drop time (Unix seconds) after the last change of ``paths``: the next whole second."""
    last = max(int(os.stat(p).st_ctime) for p in paths)
    while int(time.time()) <= last:
        time.sleep(0.05)
    return int(time.time())


def environment(place: Path, **env: str) -> dict:
    return {"PATH": STANDARD_PATH, "HOME": "/", "UNET3D_CACHE_DROPS_USED": str(place / "drops-used"),
            "UNET3D_PROLOG_DIR": str(place / "prolog"), **env}


def as_user(user: list[str], argv: list, env: dict) -> subprocess.CompletedProcess:
    """``argv`` as ``user`` (root: ``[]``), from a folder every user can enter (not this checkout's)."""
    return subprocess.run([*user, *map(str, argv)], env=env, capture_output=True, text=True, timeout=60, cwd="/")


def drop(scripts: Path, place: Path, *data: Path, user=NOBODY, **env: str) -> subprocess.CompletedProcess:
    return as_user(user, ["bash", scripts / "lib" / "drop_page_cache.sh", "node1", *data], environment(place, **env))


def staged_run(scripts: Path, place: Path, how: str, source: Path, stage: Path | None = None, user=NOBODY,
               **env: str) -> tuple[str, subprocess.CompletedProcess]:
    """stage.sh around/in-place with a command that prints what it was told: UNET3D_CACHE_CLEARED."""
    where = ["around", source, stage, "--"] if how == "around" else ["in-place", source, "--"]
    proc = as_user(user, ["bash", scripts / "slurm" / "stage.sh", *where, "bash", "-c",
                          'echo "cleared=$UNET3D_CACHE_CLEARED"'], environment(place, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cleared = [line for line in proc.stdout.splitlines() if line.startswith("cleared=")]
    return cleared[0].split("=")[1], proc


def prolog_mark(place: Path, job: str, when: int) -> None:
    """What the prolog leaves, as root wrote it."""
    (place / "prolog").mkdir(exist_ok=True)
    os.chmod(place / "prolog", 0o755)
    (place / "prolog" / job).write_text(f"{when}\n")


def cache_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("node1:") or "cache" in line]


def in_ram_folder() -> Path:
    """A folder on tmpfs (/dev/shm), or the test skips."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"], capture_output=True, text=True).stdout.strip()
    if kind != "tmpfs":
        pytest.skip(f"/dev/shm is {kind or 'missing'}, not tmpfs")
    folder = Path(tempfile.mkdtemp(prefix="unet3d-ram-", dir="/dev/shm"))
    os.chmod(folder, 0o1777)
    return folder


# -- the paths, one by one -------------------------------------------------------------------------------------------


@as_root_with_setpriv
def test_without_any_drop_one_line_names_the_fixes(scripts, place):
    proc = drop(scripts, place)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    for fix in ("sudo -n", "Prolog=", "STAGE=0", "UNET3D_CACHE_DROPPED_AT", "cache_clear is false"):
        assert fix in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/sys/vm/drop_caches", os.W_OK),
                    reason="root's path drops this machine's page cache: needs root")
def test_root_drops_the_cache_after_the_staged_copy(scripts, place, source):
    """root: stage.sh copies, then drops (for real), and the run is told its data is cold."""
    cleared, proc = staged_run(scripts, place, "around", source, place / "scratch" / "unet3d-job-1", user=[],
                               SLURM_JOB_ID="1")
    assert cleared == "1" and "node1" not in proc.stderr  # the NODE is the host here
    assert "copied" in proc.stdout and proc.stderr.strip().endswith("page cache dropped"), proc.stderr


@as_root_with_setpriv
def test_sudo_drops_the_cache_after_the_staged_copy(scripts, place, source):
    """A user allowed `sudo -n sysctl` (a stand-in sudo records its command and whether the copy
    was there): the drop comes after the copy, and counts."""
    bin_dir = place / "bin"
    bin_dir.mkdir()
    stage = place / "scratch" / "unet3d-job-2"
    (bin_dir / "sudo").write_text(f'#!/bin/bash\necho "$* copy=$(ls {stage}/kits19 2>/dev/null | wc -l)" '
                                  f'>> {place}/sudo.log\n')
    os.chmod(bin_dir / "sudo", 0o755)
    cleared, proc = staged_run(scripts, place, "around", source, stage, PATH=f"{bin_dir}:{STANDARD_PATH}",
                               SLURM_JOB_ID="2")
    assert cleared == "1", proc.stderr
    assert (place / "sudo.log").read_text() == "-n /sbin/sysctl -q vm.drop_caches=3 copy=2\n"
    assert not stage.exists()  # the job's copy removed after the run


@as_root_with_setpriv
def test_a_prologs_drop_counts_for_data_read_in_place(scripts, place, source):
    prolog_mark(place, "4242", drop_after(source))
    cleared, proc = staged_run(scripts, place, "in-place", source, SLURM_JOB_ID="4242")
    assert cleared == "1" and "dropped by the SLURM prolog" in proc.stderr, proc.stderr


@as_root_with_setpriv
def test_a_prologs_drop_does_not_count_for_a_copy_staged_after_it(scripts, place, source):
    """The documented prolog and the default staging (STAGE=1): the copy is made after the
    prolog's drop, so the data is in the page cache: cleared 0, one line with the reason and the
    fix, and the drop is not used up."""
    prolog_mark(place, "4242", drop_after(source))
    cleared, proc = staged_run(scripts, place, "around", source, place / "scratch" / "unet3d-job-4242",
                               SLURM_JOB_ID="4242")
    (line,) = cache_lines(proc)
    assert cleared == "0" and "written after it" in line and "STAGE=0" in line and "sudo -n" in line, proc.stderr
    assert "unet3d-job-4242/kits19" in line and "cache_clear is false" in line
    in_place, proc = staged_run(scripts, place, "in-place", source, SLURM_JOB_ID="4242")
    assert in_place == "1", proc.stderr  # the same drop still counts for the data it did evict


@as_root_with_setpriv
def test_a_prologs_drop_counts_for_its_job_only(scripts, place, source):
    prolog_mark(place, "4242", drop_after(source))
    proc = drop(scripts, place, source, SLURM_JOB_ID="4242")
    assert proc.returncode == 0 and "SLURM prolog" in proc.stderr, proc.stderr
    assert drop(scripts, place, source, SLURM_JOB_ID="4243").returncode == 1  # another job's
    prolog_mark(place, "4244", drop_after(source))
    os.chown(place / "prolog" / "4244", 65534, 65534)  # a file the user could have written: not trusted
    assert drop(scripts, place, source, SLURM_JOB_ID="4244").returncode == 1


@as_root_with_setpriv
def test_the_container_hosts_drop_counts_only_for_data_written_before_it(scripts, place, source):
    old = source
    dropped = drop_after(old)
    proc = drop(scripts, place, old, UNET3D_CACHE_DROPPED_AT=str(dropped))
    assert proc.returncode == 0 and "dropped by the caller" in proc.stderr, proc.stderr
    host_drop = drop_after(old)
    new = dataset(place / "new")  # made after the host's drop (data generated in the container, say)
    later = drop(scripts, place, new, UNET3D_CACHE_DROPPED_AT=str(host_drop))
    (line,) = cache_lines(later)
    assert later.returncode == 1 and "written after it" in line and str(new) in line, later.stderr
    stale = drop(scripts, place, old, UNET3D_CACHE_DROPPED_AT=str(int(time.time()) - 3600))  # one drop, a sweep
    assert stale.returncode == 1 and "not counted" in stale.stderr
    assert drop(scripts, place, old, UNET3D_CACHE_DROPPED_AT="yes").returncode == 1


@as_root_with_setpriv
def test_one_drop_counts_for_one_run_only(scripts, place, source):
    """A second run started within the age limit with the same drop runs on a warm cache."""
    dropped = str(drop_after(source))
    assert drop(scripts, place, source, UNET3D_CACHE_DROPPED_AT=dropped).returncode == 0
    again = drop(scripts, place, source, UNET3D_CACHE_DROPPED_AT=dropped)
    assert again.returncode == 1 and "counted for an earlier run already" in again.stderr, again.stderr
    prolog_mark(place, "4242", int(dropped))
    assert drop(scripts, place, source, SLURM_JOB_ID="4242").returncode == 0
    assert drop(scripts, place, source, SLURM_JOB_ID="4242").returncode == 1
    unwritable = drop(scripts, place, source, UNET3D_CACHE_DROPPED_AT=str(drop_after(source)),
                      UNET3D_CACHE_DROPS_USED="/proc/nowhere")
    assert unwritable.returncode == 1 and "cannot note the drop" in unwritable.stderr


@as_root_with_setpriv
def test_data_or_a_staging_folder_in_ram_is_never_cold(scripts, place, source):
    """tmpfs: a fresh drop by the caller, a permitted sudo, root itself: none makes it cold."""
    ram = in_ram_folder()
    try:
        data = dataset(ram / "kits19")
        proc = drop(scripts, place, data, UNET3D_CACHE_DROPPED_AT=str(drop_after(data)))
        (line,) = cache_lines(proc)
        assert proc.returncode == 1 and "on tmpfs, in RAM" in line and "cache_clear is false" in line, proc.stderr
        as_root = drop(scripts, place, data, user=[])  # root: not dropped, nothing to gain
        assert as_root.returncode == 1 and "on tmpfs" in as_root.stderr and "dropped\n" not in as_root.stderr
        bin_dir = place / "bin"
        bin_dir.mkdir()
        (bin_dir / "sudo").write_text(f"#!/bin/bash\necho \"$*\" >> {place}/sudo.log\n")
        os.chmod(bin_dir / "sudo", 0o755)
        cleared, staged = staged_run(scripts, place, "around", source, ram / "scratch" / "unet3d-job-5",
                                     PATH=f"{bin_dir}:{STANDARD_PATH}", SLURM_JOB_ID="5")
        assert cleared == "0" and "on tmpfs, in RAM" in staged.stderr, staged.stderr
        assert not (place / "sudo.log").exists()  # not even tried
    finally:
        shutil.rmtree(ram)


@as_root_with_setpriv
def test_the_prolog_never_fails_a_job_and_its_epilog_removes_the_mark(scripts, place):
    env = {"PATH": STANDARD_PATH, "UNET3D_PROLOG_DIR": str(place / "prolog"), "SLURM_JOB_ID": "7"}
    (place / "prolog").mkdir()
    prolog = scripts / "slurm" / "prolog_drop_caches.sh"
    proc = as_user(NOBODY, ["bash", prolog], env)
    assert proc.returncode == 0 and "not dropped" in proc.stderr and not (place / "prolog" / "7").exists()
    (place / "prolog" / "7").write_text("1\n")
    epilog = as_user([], ["bash", prolog], {**env, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"})
    assert epilog.returncode == 0 and not (place / "prolog" / "7").exists()


# -- the program's own check -----------------------------------------------------------------------------------------

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
26 22 0:22 / /scratch\\040fast rw shared:4 - ramfs none rw
27 22 8:2 / /dev/shm/disk rw shared:5 - xfs /dev/sdb1 rw
"""


@pytest.mark.parametrize("path, kind", [("/data/kits19", "ext4"), ("/dev/shm/kits19", "tmpfs"),
                                        ("/dev/shmx/kits19", "ext4"), ("/scratch fast/kits19", "ramfs"),
                                        ("/dev/shm/disk/kits19", "xfs"), ("/dev/shm", "tmpfs")])
def test_the_file_system_of_a_path_is_found_by_its_name(path, kind):
    assert filesystem_type(path, MOUNTINFO) == kind


def test_main_logs_cache_clear_false_for_data_in_ram_whatever_its_launcher_says(monkeypatch, tmp_path):
    """The program's own check: the launcher's word (UNET3D_CACHE_CLEARED=1) does not make data on
    tmpfs cold. The oracle for this machine's mounts: stat -f."""
    monkeypatch.setenv("UNET3D_CACHE_CLEARED", "1")
    assert cache_cleared(str(tmp_path), MOUNTINFO.replace("ext4", "ext4")) == (True, "")
    cleared, why = cache_cleared("/dev/shm/kits19", MOUNTINFO)
    assert not cleared and "--data_dir /dev/shm/kits19 is on tmpfs" in why and why.count("\n") == 0
    real = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    assert cache_cleared(str(tmp_path))[0] == (real not in ("tmpfs", "ramfs"))
    if stat.S_ISDIR(os.stat("/dev/shm").st_mode):
        shm = subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"], capture_output=True, text=True).stdout.strip()
        assert filesystem_type("/dev/shm/x") == shm
    monkeypatch.setenv("UNET3D_CACHE_CLEARED", "0")
    assert cache_cleared(str(tmp_path), MOUNTINFO) == (False, "")
