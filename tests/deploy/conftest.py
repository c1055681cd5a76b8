"""A real SLURM cluster for the job tests: scripts/cluster/start.sh once per session, stop.sh
at the end. Skips (with the reason) where it cannot start: not root, no packages."""
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


@pytest.fixture(scope="session")
def cluster():
    if shutil.which("bash") is None or not sys.platform.startswith("linux"):
        pytest.skip("the test cluster needs Linux and bash")
    folder = Path(tempfile.mkdtemp(prefix="unet3d-slurm-"))
    os.chmod(folder, 0o755)
    tag = f"{os.getpid() % 100000}"
    nodes = [f"u3d{tag}-n1", f"u3d{tag}-n2"]
    env = dict(os.environ, CLUSTER_DIR=str(folder), CLUSTER_PORT=str(free_port_range(3)),
               CLUSTER_NODES=" ".join(nodes))
    start = subprocess.run(["bash", str(ROOT / "scripts" / "cluster" / "start.sh")], env=env,
                           capture_output=True, text=True, timeout=900)
    if start.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        lines = (start.stderr or start.stdout).strip().splitlines()
        reason = f"no test cluster: {lines[-1] if lines else f'start.sh exited {start.returncode}'}"
        print(reason)
        pytest.skip(reason)
    try:
        yield Cluster(folder, nodes)
    finally:
        stop = subprocess.run(["bash", str(ROOT / "scripts" / "cluster" / "stop.sh")], env=env,
                              capture_output=True, text=True, timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """13 easy cases (8 training, 5 evaluation) on the 'shared filesystem'."""
    folder = tmp_path_factory.mktemp("shared") / "kits19"
    return easy_data.write_dataset(str(folder), range(13))


