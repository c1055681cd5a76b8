"""``systems/<system>.json``: the fields ``mlperf_logging.system_desc_checker`` wants (ruleset
4.0.0, usage training), from a machine's facts (:func:`runtime.host.host_facts`): the runs' own
(``package``, from each run's ``run_description.json``) or this machine's (``describe``).

What a machine tells (Linux ``/proc`` and ``/sys``, ``os``, torch when installed): the CPU
model, sockets, cores and logical CPUs, its frequency and caches, the memory, the accelerators
(count, name, memory), the framework and the software stack, the operating system. What it
cannot tell (interconnects, network, storage type, cooling, memory configuration) is left empty
and listed by :func:`unfilled`, for the submitter to give with ``--system_fields FILE.json``.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys

from runtime import host as H

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


def software_text(found: dict) -> str:
    """``Python 3.11.7, CUDA 12.1, cuDNN 8902, ...``: the stack but the framework itself."""
    return ", ".join(f"{name} {version}" for name, version in found.items() if name != "PyTorch")


def fields(submitter: str, system_name: str, division: str, status: str, host: dict, found: dict, nodes: int,
           accelerators_per_node: int, notes: str, storage: str = "") -> dict:
    """The system description of ``nodes`` nodes like ``host`` (:func:`runtime.host.host_facts`),
    each with ``accelerators_per_node`` accelerators, running the software ``found``
    (:func:`runtime.host.software`); ``status`` is the MLPerf log's ``submission_status``
    (onprem, cloud, research, preview)."""
    accelerator = host.get("accelerators") or {}
    framework = f"PyTorch {found['PyTorch']}" if found.get("PyTorch") else \
        "PyTorch (not installed where this description was written)"
    description = {
        "submitter": submitter, "division": division, "status": STATUS.get(status, status),
        "system_name": system_name, "number_of_nodes": str(nodes),
        "host_processors_per_node": str(host.get("sockets", "")),
        "host_processor_model_name": host.get("cpu_model", ""),
        "host_processor_core_count": str(host.get("cores_per_socket", "")),
        "host_processor_vcpu_count": str(host.get("logical_cpus") or ""),
        "host_processor_frequency": host.get("cpu_frequency", ""), "host_processor_caches": host.get("cpu_caches", ""),
        "host_processor_interconnect": "", "host_memory_capacity": host.get("memory", ""),
        "host_storage_type": "", "host_storage_capacity": storage, "host_networking": "",
        "host_networking_topology": "", "host_memory_configuration": "",
        "accelerators_per_node": str(accelerators_per_node),
        "accelerator_model_name": accelerator.get("model", "N/A"), "accelerator_host_interconnect": "",
        "accelerator_frequency": "", "accelerator_on-chip_memories": "", "accelerator_memory_configuration": "",
        "accelerator_memory_capacity": accelerator.get("memory", "N/A"), "accelerator_interconnect": "",
        "accelerator_interconnect_topology": "", "cooling": "", "hw_notes": "", "framework": framework,
        "other_software_stack": software_text(found), "operating_system": host.get("operating_system", ""),
        "sw_notes": notes,
    }
    if not accelerators_per_node:  # no accelerator: nothing to tell about one
        description.update({key: "N/A" for key in description if key.startswith("accelerator_")})
    return description


def describe(submitter: str, system_name: str, division: str, status: str, nodes: int = 1,
             storage_path: str = ".") -> dict:
    """The system description of this machine (the one that runs this, not necessarily the one
    that trained: ``package`` describes the runs' machines from their records)."""
    host = H.host_facts()
    code = H.code_identity()
    try:
        storage = f"{shutil.disk_usage(storage_path).total / 2**40:.2f} TiB (the file system of the runs)"
    except OSError:
        storage = ""
    notes = (f"{code['project']} {code['version']}" + (f" (git {code['commit'][:12]})" if code["commit"] else "")
             + f"; described with {os.path.basename(sys.executable)} on {platform.node()}")
    return fields(submitter, system_name, division, status, host, H.software(), nodes,
                  host["accelerators"]["visible"], notes, storage)


FROM_THE_LOGS = ("submitter", "system_name", "division", "status")  # the runs' MLPerf logs name these


def unfilled(description: dict) -> list[str]:
    """The required fields left empty (the machine could not tell them)."""
    return [f for f in REQUIRED_FIELDS if f not in OPTIONAL_EMPTY and description.get(f, "") in ("", None)]
