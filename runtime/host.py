"""What a training run ran on, read where it runs: the machine (CPU, memory, accelerators, OS),
the software, the code (git commit and whether the tree was dirty; without git, the project's
version and a hash of its files) and the recipe (main.py's flags, the launcher's settings).

Training writes it once per run, before ``run_start``, as ``<log_dir>/run_description.json``
(``runtime/run_files.py``; :func:`run_description` from every process's :func:`process_facts`);
``python -m runtime.submission package`` builds the system description and the implementation's
README and launch script from it (``runtime/submission/``). Standard library at import (torch is
read inside the functions), so the package reads records without torch.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Mapping, Sequence

from data_loading.atomic import atomic_write
from data_loading.write_errors import failure_reason
from runtime import __version__
from runtime.outputs import OutputError
from runtime.run_files import RUN_DESCRIPTION

PROJECT = "unet3d-kits19"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_FORMAT = 1
# The files that run (a subset of .dockerignore's allow-list, so an image holds them all; the
# tests check it): what the code's fingerprint hashes and what a dirty tree is judged on.
CODE_PATHS = ("main.py", "preprocess_dataset.py", "evaluation_cases.txt", "run_and_time.sh", "requirements.txt",
              "data_loading", "model", "runtime", "scripts")
SKIPPED_DIRS = ("__pycache__",)
SKIPPED_SUFFIXES = (".pyc",)
# The settings that make a recipe, as the scripts take them from the environment (run_and_time.sh,
# scripts/slurm/common.sh, scripts/recipes/): recorded when set. The prefixes add the libraries'
# own switches (NCCL_ALGO, PYTORCH_CUDA_ALLOC_CONF, MIOPEN_FIND_MODE, ...).
RECIPE_ENV = (
    "UNET3D_RECIPE", "RECIPE", "SEED", "MAX_EPOCHS", "QUALITY_THRESHOLD", "START_EVAL_AT", "EVALUATE_EVERY",
    "OPTIMIZER", "LEARNING_RATE", "INIT_LEARNING_RATE", "LR_WARMUP_EPOCHS", "MOMENTUM", "BATCH_SIZE", "GA_STEPS",
    "NUM_WORKERS", "NPROC_PER_NODE", "GPUS_PER_NODE", "GPU_VENDOR", "NNODES", "CKPT_DURING_RUN", "EXTRA_ARGS",
    "CONTAINER", "STAGE", "CLEAR_CACHES", "UNET3D_CACHE_CLEARED", "DATASET_DIR", "DATA_DIR",
    "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_CPUS_PER_TASK",
    "SLURM_JOB_PARTITION", "SLURM_CLUSTER_NAME", "SLURM_JOB_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER",
)
RECIPE_ENV_PREFIXES = ("UNET3D_", "NCCL_", "RCCL_", "TORCH_", "PYTORCH_", "MIOPEN_", "HSA_")


# -- the machine --------------------------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _cpuinfo() -> list[dict[str, str]]:
    """One dict per logical CPU of /proc/cpuinfo (empty where there is none)."""
    cpus = []
    for block in _read("/proc/cpuinfo").split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if ":" in line:
                key, value = line.split(":", 1)
                fields[key.strip()] = value.strip()
        if fields:
            cpus.append(fields)
    return cpus


def _caches() -> str:
    """``L1d 32K, L1i 32K, L2 1024K, L3 32768K`` (per core, as sysfs gives them for CPU 0)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    parts = []
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not index.startswith("index"):
            continue
        level = _read(os.path.join(root, index, "level")).strip()
        kind = _read(os.path.join(root, index, "type")).strip()
        size = _read(os.path.join(root, index, "size")).strip()
        if level and size:
            suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
            parts.append(f"L{level}{suffix} {size}")
    return ", ".join(parts)


def _frequency(cpus: list[dict[str, str]]) -> str:
    khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").strip()
    if khz.isdigit():
        return f"{int(khz) / 1000:.0f} MHz (maximum)"
    mhz = cpus[0].get("cpu MHz") if cpus else None
    return f"{float(mhz):.0f} MHz" if mhz else ""


def _memory() -> str:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            kib = int(line.split()[1])
            return f"{kib / 2**20:.1f} GiB"
    return ""


def _os_name() -> str:
    pretty = next((line.split("=", 1)[1].strip().strip('"') for line in _read("/etc/os-release").splitlines()
                   if line.startswith("PRETTY_NAME=")), "")
    return f"{pretty or platform.system()} (kernel {platform.release()})"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def software() -> dict[str, str]:
    """{name: version} of the stack a run uses: Python, PyTorch, CUDA or ROCm, cuDNN, NCCL (when a
    GPU is there), numpy, scipy, mlperf-logging."""
    found = {"Python": platform.python_version()}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        found["PyTorch"] = torch.__version__
        if getattr(torch.version, "hip", None):
            found["ROCm"] = str(torch.version.hip)
        elif torch.version.cuda:
            found["CUDA"] = str(torch.version.cuda)
        if torch.backends.cudnn.is_available() and not getattr(torch.version, "hip", None):
            found["cuDNN"] = str(torch.backends.cudnn.version())
        if torch.cuda.is_available() and torch.cuda.device_count() and hasattr(torch.cuda, "nccl"):
            try:
                found["NCCL"] = ".".join(map(str, torch.cuda.nccl.version()))
            except (RuntimeError, AttributeError, TypeError):
                pass
    for distribution in ("numpy", "scipy", "mlperf-logging"):
        version = _version(distribution)
        if version:
            found[distribution] = version
    return found


def accelerators(device_index: int = 0) -> dict:
    """The GPUs torch sees on this machine: {"visible": count, "model", "memory"} (of
    ``device_index``); 0 and "N/A" without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return {"visible": 0, "model": "N/A", "memory": "N/A"}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return {"visible": 0, "model": "N/A", "memory": "N/A"}
    index = device_index if 0 <= device_index < count else 0
    props = torch.cuda.get_device_properties(index)
    return {"visible": count, "model": torch.cuda.get_device_name(index),
            "memory": f"{props.total_memory / 2**30:.0f} GiB"}


def host_facts(device_index: int = 0) -> dict:
    """This machine as the system description needs it (what /proc, /sys, os and torch tell)."""
    cpus = _cpuinfo()
    return {
        "hostname": platform.node(),
        "cpu_model": (cpus[0].get("model name") if cpus else "") or platform.processor(),
        "sockets": len({c.get("physical id") for c in cpus if "physical id" in c}) or 1,
        "cores_per_socket": cpus[0].get("cpu cores", "") if cpus else "",
        "logical_cpus": os.cpu_count() or 0,
        "cpu_frequency": _frequency(cpus),
        "cpu_caches": _caches(),
        "memory": _memory(),
        "accelerators": accelerators(device_index),
        "operating_system": _os_name(),
        "container": _container(),
    }


def _container() -> str:
    """The container this process runs in, as far as it can tell ('' for none seen)."""
    for name in ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER"):
        if os.environ.get(name):
            return f"apptainer {os.environ[name]}"
    if os.path.exists("/.dockerenv"):
        return "docker"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    return ""


# -- the code -----------------------------------------------------------------------------------------------------


def _git(root: str, *args: str) -> str | None:
    """``git -C root ARGS``'s stdout, None when git is missing or fails (not a checkout, a
    container's copy, a checkout owned by another user)."""
    if shutil.which("git") is None:
        return None
    try:
        proc = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def code_files(root: str) -> list[str]:
    """The files under :data:`CODE_PATHS` of ``root`` (relative, '/'-separated, sorted), without
    caches."""
    found = []
    for top in CODE_PATHS:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            found.append(top)
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
            found += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names
                      if not n.endswith(SKIPPED_SUFFIXES) and os.path.isfile(os.path.join(folder, n))]
    return sorted(found)


def fingerprint(root: str) -> str:
    """``sha256:<hex>`` of the code under ``root``: each file of :func:`code_files`, its path and
    its bytes. The same files give the same hash in a checkout, an image's copy (/opt/unet3d) or
    a ``git archive`` of the commit."""
    total = hashlib.sha256()
    for name in code_files(root):
        digest = hashlib.sha256()
        with open(os.path.join(root, name), "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        total.update(name.encode() + b"\0" + digest.digest())
    return "sha256:" + total.hexdigest()


def code_identity(root: str = ROOT) -> dict:
    """{"project", "version", "commit" (None without git), "dirty" (uncommitted or untracked
    changes under :data:`CODE_PATHS`; None without git), "fingerprint"}."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--", *CODE_PATHS) if commit else None
    return {"project": PROJECT, "version": __version__, "commit": commit.strip() if commit else None,
            "dirty": (bool(status.strip()) if status is not None else None) if commit else None,
            "fingerprint": fingerprint(root)}


# -- the recipe and the record -------------------------------------------------------------------------------------


def recipe_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The recipe's settings among ``environ`` (default os.environ): :data:`RECIPE_ENV`'s names
    and :data:`RECIPE_ENV_PREFIXES`' families, sorted."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ)
            if name in RECIPE_ENV or name.startswith(RECIPE_ENV_PREFIXES)}


def process_facts(rank: int, device_type: str, device_index: int | None) -> dict:
    """What one process tells of itself (every rank's is gathered to rank 0)."""
    return {"rank": rank, "device": device_type if device_index is None else f"{device_type}:{device_index}",
            "host": host_facts(device_index or 0), "software": software()}


def run_description(processes: Sequence[dict], flags: Sequence[str], argv: Sequence[str] | None,
                    launcher: str, root: str = ROOT) -> dict:
    """The record of one run from every process's :func:`process_facts`: one entry per host
    (the node), its ranks and the accelerators they used, the software (rank 0's), the code and
    the recipe (``flags``: main.py's flags that were given; ``argv``: the command line as typed,
    when main.py was the program)."""
    processes = sorted(processes, key=lambda p: p["rank"])
    hosts: dict[str, dict] = {}
    for process in processes:
        facts = process["host"]
        entry = hosts.setdefault(facts["hostname"], {**facts, "ranks": [], "devices": []})
        entry["ranks"].append(process["rank"])
        if process["device"] not in entry["devices"]:
            entry["devices"].append(process["device"])
    nodes = list(hosts.values())
    for node in nodes:
        node["accelerators_used"] = sum(1 for d in node["devices"] if not d.startswith("cpu"))
    per_node = sorted({len(node["ranks"]) for node in nodes})
    return {
        "format": RECORD_FORMAT, "time": time.time(),
        "nodes": len(nodes), "world_size": len(processes),
        "processes_per_node": per_node[0] if len(per_node) == 1 else per_node,
        "device": processes[0]["device"].split(":")[0] if processes else "",
        "hosts": nodes, "software": processes[0]["software"] if processes else {},
        "software_differs": [p["rank"] for p in processes if p["software"] != processes[0]["software"]],
        "code": code_identity(root),
        "recipe": {"flags": list(flags), "argv": list(argv) if argv is not None else None, "launcher": launcher,
                   "python": sys.executable, "environment": recipe_environment()},
    }


def launcher_name(environ: Mapping[str, str] | None = None) -> str:
    """``torchrun`` when torchrun started the processes, else ``python``."""
    environ = os.environ if environ is None else environ
    return "torchrun" if "TORCHELASTIC_RUN_ID" in environ or "LOCAL_WORLD_SIZE" in environ else "python"


def record_run(flags: Sequence[str], log_dir: str, dist_info) -> str | None:
    """Every process's machine gathered to rank 0, which writes ``<log_dir>/run_description.json``
    (a collective: every rank calls it). ``flags``: main.py's command line rebuilt from the
    parsed flags (``runtime.arguments.recipe_flags``); ``dist_info``: the process group
    (``runtime.distributed.DistInfo``). Reads no file of the data: called before ``run_start``.
    Returns the path on rank 0."""
    from runtime import distributed as D

    device = dist_info.device
    processes = D.all_gather_objects(process_facts(dist_info.rank, device.type, device.index))
    if not dist_info.is_main:
        return None
    argv = sys.argv[1:] if os.path.basename(sys.argv[0] or "") == "main.py" else None
    record = run_description(processes, flags, argv, launcher_name())
    path = os.path.join(log_dir, RUN_DESCRIPTION)
    text = (json.dumps(record, indent=2) + "\n").encode("utf-8")
    try:
        atomic_write(path, lambda handle: handle.write(text))
    except OSError as exc:
        raise OutputError(f"cannot write {path!r}: {failure_reason(exc)}") from None
    return path
