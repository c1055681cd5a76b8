"""scripts/lib/drop_page_cache.sh where the job may not drop the cache itself (issue 48, item 3).

"You must flush the cache or restart the system prior to benchmarking": a drop made just before
by a process with the right (a SLURM prolog, the host side of a container) counts, a stale one
does not, and without any the one line names the fixes. The script runs as the unprivileged user
nobody (setpriv), so nothing here drops this machine's cache; the root path is not exercised."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "lib" / "drop_page_cache.sh"
PROLOG = ROOT / "scripts" / "slurm" / "prolog_drop_caches.sh"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="runs the script as the user nobody: needs root and setpriv")


USED = ""


@pytest.fixture(autouse=True)
def drops_used(monkeypatch):
    """This test's own list of the drops already counted, in a folder nobody may write (pytest's
    tmp_path is root's alone)."""
    folder = tempfile.mkdtemp(prefix="unet3d-drops-used-")
    os.chmod(folder, 0o777)
    monkeypatch.setitem(globals(), "USED", os.path.join(folder, "drops"))
    yield
    shutil.rmtree(folder)


def as_nobody(script: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/", "UNET3D_CACHE_DROPS_USED": USED, **env}
    return subprocess.run([*NOBODY, "bash", str(script), "node1"], env=environment, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def prolog_dir():
    """A folder nobody can read, as /run/unet3d-drop-caches is."""
    folder = tempfile.mkdtemp(prefix="unet3d-prolog-")
    os.chmod(folder, 0o755)
    yield Path(folder)
    shutil.rmtree(folder)


def test_without_any_drop_one_line_names_the_fixes():
    proc = as_nobody(SCRIPT)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    for fix in ("sudo -n", "Prolog=", "UNET3D_CACHE_DROPPED_AT", "cache_clear is false"):
        assert fix in proc.stderr


def test_the_host_side_of_a_container_passes_the_time_of_its_drop():
    now = int(time.time())
    proc = as_nobody(SCRIPT, UNET3D_CACHE_DROPPED_AT=str(now - 5))
    assert proc.returncode == 0 and "dropped by the caller" in proc.stderr, proc.stderr
    stale = as_nobody(SCRIPT, UNET3D_CACHE_DROPPED_AT=str(now - 3600))  # one drop for a whole sweep
    assert stale.returncode == 1 and "not counted" in stale.stderr
    assert as_nobody(SCRIPT, UNET3D_CACHE_DROPPED_AT="yes").returncode == 1


def test_one_drop_counts_for_one_run_only(prolog_dir):
    """A second run started within the age limit with the same drop runs on a warm cache: its
    cache_clear must not say true."""
    dropped = str(int(time.time()) - 5)
    assert as_nobody(SCRIPT, UNET3D_CACHE_DROPPED_AT=dropped).returncode == 0
    again = as_nobody(SCRIPT, UNET3D_CACHE_DROPPED_AT=dropped)
    assert again.returncode == 1 and "counted for an earlier run already" in again.stderr, again.stderr
    (prolog_dir / "4242").write_text(f"{dropped}\n")
    env = {"UNET3D_PROLOG_DIR": str(prolog_dir), "SLURM_JOB_ID": "4242"}
    assert as_nobody(SCRIPT, **env).returncode == 0 and as_nobody(SCRIPT, **env).returncode == 1
    unwritable = as_nobody(SCRIPT, UNET3D_CACHE_DROPPED_AT=str(int(time.time()) - 1),
                           UNET3D_CACHE_DROPS_USED="/proc/nowhere")
    assert unwritable.returncode == 1 and "cannot note the drop" in unwritable.stderr


def test_a_slurm_prologs_drop_counts_for_its_job_only(prolog_dir):
    marker = prolog_dir / "4242"
    marker.write_text(f"{int(time.time()) - 10}\n")  # written by root, as slurmd runs the prolog
    env = {"UNET3D_PROLOG_DIR": str(prolog_dir)}
    proc = as_nobody(SCRIPT, SLURM_JOB_ID="4242", **env)
    assert proc.returncode == 0 and "SLURM prolog" in proc.stderr, proc.stderr
    assert as_nobody(SCRIPT, SLURM_JOB_ID="4243", **env).returncode == 1  # another job's
    os.chown(marker, 65534, 65534)  # a file the user could have written: not trusted
    assert as_nobody(SCRIPT, SLURM_JOB_ID="4242", **env).returncode == 1


def test_the_prolog_never_fails_a_job_and_its_epilog_removes_the_mark(prolog_dir):
    env = {"PATH": "/usr/bin:/bin", "UNET3D_PROLOG_DIR": str(prolog_dir), "SLURM_JOB_ID": "7"}
    proc = subprocess.run([*NOBODY, "bash", str(PROLOG)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "not dropped" in proc.stderr and not (prolog_dir / "7").exists()
    (prolog_dir / "7").write_text("1\n")
    epilog = subprocess.run(["bash", str(PROLOG)], env={**env, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"},
                            capture_output=True, text=True, timeout=60)
    assert epilog.returncode == 0 and not (prolog_dir / "7").exists()
