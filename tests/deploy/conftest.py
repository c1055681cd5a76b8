"""A real SLURM cluster for the job tests: scripts/cluster/start.sh once per session, stop.sh
at the end. Skips (printing the reason) where it cannot run: not root, not Linux. Where it can,
a cluster that does not start (packages that cannot be installed included) fails the tests
with start.sh's one-line reason."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent):        # slurm_cluster, and easy_data in tests/
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import easy_data  # noqa: E402
from slurm_cluster import ROOT, Cluster, free_port_range  # noqa: E402


def cluster_skip_reason() -> str | None:
    """Why the test cluster cannot run here at all (then the job tests skip, saying why)."""
    if shutil.which("bash") is None or not sys.platform.startswith("linux"):
        return "the test cluster needs Linux and bash"
    if os.geteuid() != 0:
        return "the test cluster must be started as root (munged, slurmctld, slurmd, /etc/hosts)"
    return None


# Time for start.sh, the installation of munge and slurm-wlm with apt-get included.
START_TIMEOUT = 600


@pytest.fixture(scope="session")
def cluster():
    reason = cluster_skip_reason()
    if reason:
        print(f"skipping the SLURM job tests: {reason}")
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="unet3d-slurm-"))
    os.chmod(folder, 0o755)
    tag = f"{os.getpid() % 100000}"
    nodes = [f"u3d{tag}-n1", f"u3d{tag}-n2"]
    env = dict(os.environ, CLUSTER_DIR=str(folder), CLUSTER_PORT=str(free_port_range(3)),
               CLUSTER_NODES=" ".join(nodes))
    stop_command = ["bash", str(ROOT / "scripts" / "cluster" / "stop.sh")]
    # Where it should run (root, Linux) a cluster that does not start is a failure, not a skip:
    # CI must not turn green without running a job. start.sh stops what it started on failure;
    # after a time-out stop.sh does.
    try:
        start = subprocess.run(["bash", str(ROOT / "scripts" / "cluster" / "start.sh")], env=env,
                               capture_output=True, text=True, timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        subprocess.run(stop_command, env=env, capture_output=True, text=True, timeout=300, check=False)
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"the test cluster did not start within {START_TIMEOUT} s (scripts/cluster/start.sh)",
                    pytrace=False)
    if start.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        lines = (start.stderr or start.stdout).strip().splitlines()
        pytest.fail("the test cluster did not start: "
                    + (lines[-1] if lines else f"start.sh exited {start.returncode}"), pytrace=False)
    try:
        yield Cluster(folder, nodes)
    finally:
        stop = subprocess.run(stop_command, env=env, capture_output=True, text=True, timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """13 easy cases (8 training, 5 evaluation) on the 'shared filesystem'."""
    folder = tmp_path_factory.mktemp("shared") / "kits19"
    return easy_data.write_dataset(str(folder), range(13))


