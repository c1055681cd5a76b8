"""``systems/<system>.json``: the fields ``mlperf_logging.system_desc_checker`` wants (ruleset
4.0.0, usage training), filled from the machine where they can be read from it.

What the machine tells (Linux ``/proc`` and ``/sys``, ``os``, torch when installed): the CPU
model, sockets, cores and logical CPUs, its frequency and caches, the memory, the accelerators
(count, name, memory), the framework and the software stack, the operating system. What it
cannot tell (interconnects, network, storage type, cooling, memory configuration) is left empty
and listed by :func:`unfilled`, for the submitter to give with ``--system_fields FILE.json``.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

# system_desc_checker.check_system_desc's required fields, in its order
REQUIRED_FIELDS = (
    "submitter", "division", "status", "system_name", "number_of_nodes", "host_processors_per_node",
    "host_processor_model_name", "host_processor_core_count", "host_processor_vcpu_count",
    "host_processor_frequency", "host_processor_caches", "host_processor_interconnect", "host_memory_capacity",
    "host_storage_type", "host_storage_capacity", "host_networking", "host_networking_topology",
    "host_memory_configuration", "accelerators_per_node", "accelerator_model_name",
    "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
    "accelerator_memory_configuration", "accelerator_memory_capacity", "accelerator_interconnect",
    "accelerator_interconnect_topology", "cooling", "hw_notes", "framework", "other_software_stack",
    "operating_system", "sw_notes",
)
# the MLPerf log's submission_status -> the system description's status (4.0.0's choices)
STATUS = {"onprem": "Available on-premise", "cloud": "Available cloud",
          "research": "Research, Development, or Internal (RDI)", "preview": "Preview"}
# fields no notes field needs filled; the rest, empty, are listed for the submitter
OPTIONAL_EMPTY = ("hw_notes", "sw_notes")


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


def _git_commit(repo: str) -> str:
    if shutil.which("git") is None:
        return ""
    try:
        proc = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def accelerators() -> tuple[int, str, str, list[str]]:
    """(accelerators per node, model name, memory capacity, software versions) from torch; a
    machine without torch or a GPU has 0 and the CPU training that this project also runs."""
    try:
        import torch
    except ImportError:
        return 0, "N/A", "N/A", []
    software = [f"Python {platform.python_version()}"]
    if getattr(torch.version, "hip", None):
        software.append(f"ROCm {torch.version.hip}")
    elif torch.version.cuda:
        software.append(f"CUDA {torch.version.cuda}")
    if torch.backends.cudnn.is_available() and not getattr(torch.version, "hip", None):
        software.append(f"cuDNN {torch.backends.cudnn.version()}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and hasattr(torch.cuda, "nccl"):
        try:
            software.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
        except (RuntimeError, AttributeError, TypeError):
            pass
    if not count:
        return 0, "N/A", "N/A", software
    props = torch.cuda.get_device_properties(0)
    return count, torch.cuda.get_device_name(0), f"{props.total_memory / 2**30:.0f} GiB", software


def describe(submitter: str, system_name: str, division: str, status: str, nodes: int = 1,
             storage_path: str = ".") -> dict:
    """The system description of this machine; ``status`` is the MLPerf log's
    ``submission_status`` (onprem, cloud, research, preview)."""
    cpus = _cpuinfo()
    sockets = len({c.get("physical id") for c in cpus if "physical id" in c}) or 1
    cores = cpus[0].get("cpu cores", "") if cpus else ""
    model = (cpus[0].get("model name") if cpus else "") or platform.processor()
    count, name, memory, software = accelerators()
    try:
        import torch

        framework = f"PyTorch {torch.__version__}"
    except ImportError:
        framework = "PyTorch (not installed where this description was written)"
    for distribution in ("numpy", "scipy", "mlperf-logging"):
        version = _version(distribution)
        if version:
            software.append(f"{distribution} {version}")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from runtime import __version__

    commit = _git_commit(repo)
    try:
        storage = f"{shutil.disk_usage(storage_path).total / 2**40:.2f} TiB (the file system of the runs)"
    except OSError:
        storage = ""
    description = {
        "submitter": submitter, "division": division, "status": STATUS.get(status, status),
        "system_name": system_name, "number_of_nodes": str(nodes), "host_processors_per_node": str(sockets),
        "host_processor_model_name": model, "host_processor_core_count": str(cores),
        "host_processor_vcpu_count": str(os.cpu_count() or ""), "host_processor_frequency": _frequency(cpus),
        "host_processor_caches": _caches(), "host_processor_interconnect": "", "host_memory_capacity": _memory(),
        "host_storage_type": "", "host_storage_capacity": storage, "host_networking": "",
        "host_networking_topology": "", "host_memory_configuration": "", "accelerators_per_node": str(count),
        "accelerator_model_name": name, "accelerator_host_interconnect": "", "accelerator_frequency": "",
        "accelerator_on-chip_memories": "", "accelerator_memory_configuration": "",
        "accelerator_memory_capacity": memory, "accelerator_interconnect": "",
        "accelerator_interconnect_topology": "", "cooling": "", "hw_notes": "", "framework": framework,
        "other_software_stack": ", ".join(software), "operating_system": _os_name(),
        "sw_notes": f"unet3d-kits19 {__version__}" + (f" (git {commit})" if commit else "")
                    + f"; described with {os.path.basename(sys.executable)} on {platform.node()}",
    }
    if not count:  # no accelerator: nothing to tell about one
        description.update({key: "N/A" for key in description if key.startswith("accelerator_")})
    return description


def unfilled(description: dict) -> list[str]:
    """The required fields left empty (the machine could not tell them)."""
    return [f for f in REQUIRED_FIELDS if f not in OPTIONAL_EMPTY and description.get(f, "") in ("", None)]
