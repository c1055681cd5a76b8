"""How much memory this process may use: the machine's, or less where its job says so.

A SLURM job's ``--mem`` is enforced by the job's own cgroup, not by the node's memory; a
container's limit likewise. The cgroup is found as the kernel names it for this process
(``/proc/self/cgroup``: ``0::/path`` for cgroup v2, ``N:memory:/path`` for v1's memory
controller) under the hierarchy's mount point (``/proc/self/mountinfo``, the mount's own root
taken off the path: a container sees only its part), and every level from there up to the
mount is read, since a limit set on a parent (SLURM's job level above its step) binds too.

* :attr:`Memory.limit`: the most the process may ever hold: the smallest of the physical
  memory (``MemTotal``), the cgroup limits (``memory.max``; v1 ``memory.limit_in_bytes``) and
  SLURM's ``--mem`` (``SLURM_MEM_PER_NODE``, or ``SLURM_MEM_PER_CPU`` x ``SLURM_CPUS_ON_NODE``).
* :attr:`Memory.available`: what it may take now: the smallest of ``MemAvailable``, each
  limited cgroup's limit less its working set (usage less inactive file pages, which the kernel
  reclaims before it kills; the measure ``docker stats`` and the kubelet use) and SLURM's
  ``--mem``.

Each comes with the name of the source that set it, for the one line that says why a scan is
refused or a batch lowered. ``root`` prefixes every path read (tests use fixture trees).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class Memory:
    limit: int | None
    limit_source: str
    available: int | None
    available_source: str


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/")), encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _meminfo(root: str) -> dict[str, int]:
    values = {}
    for line in (_read(root, "/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return values


def _stat_value(text: str | None, *names: str) -> int:
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] in names and fields[1].isdigit():
            return int(fields[1])
    return 0


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) < UNLIMITED else None


def cgroup_folder(root: str = "/") -> tuple[str, str, str] | None:
    """(version "v2" or "v1", this process's memory cgroup folder, the hierarchy's mount point)
    or None where there is none (no cgroup, no memory controller mounted)."""
    membership = {}
    for line in (_read(root, "/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            membership["v2"] = path
        elif "memory" in controllers.split(","):
            membership["v1"] = path
    for line in (_read(root, "/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        fstype, options = after[0], after[2] if len(after) > 2 else ""
        mount_root, mount_point = fields[3], fields[4]
        if fstype == "cgroup2" and "v2" in membership and "v1" not in membership:
            version, path = "v2", membership["v2"]
        elif fstype == "cgroup" and "memory" in options.split(",") and "v1" in membership:
            version, path = "v1", membership["v1"]
        else:
            continue
        relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
        relative = "" if relative == "." else relative
        return version, os.path.normpath(os.path.join(mount_point, relative)), mount_point
    return None


def cgroup_memory(root: str = "/") -> tuple[int | None, int | None, str]:
    """(smallest limit, smallest headroom, the folder whose limit it is) over this process's
    memory cgroup and its parents up to the mount; (None, None, "") without a limit."""
    found = cgroup_folder(root)
    if found is None:
        return None, None, ""
    version, folder, mount = found
    names = {"v2": ("memory.max", "memory.current", ("inactive_file",)),
             "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file"))}
    limit_file, usage_file, inactive = names[version]
    limit = headroom = None
    where = ""
    while True:
        value = _number(_read(root, os.path.join(folder, limit_file)))
        if value is not None:
            usage = _number(_read(root, os.path.join(folder, usage_file))) or 0
            working = max(0, usage - _stat_value(_read(root, os.path.join(folder, "memory.stat")), *inactive))
            if limit is None or value < limit:
                limit, where = value, f"cgroup {version} {os.path.join(folder, limit_file)}"
            room = max(0, value - working)
            headroom = room if headroom is None else min(headroom, room)
        if os.path.normpath(folder) == os.path.normpath(mount) or folder in ("/", ""):
            break
        folder = os.path.dirname(folder)
    return limit, headroom, where


def slurm_memory(environ: Mapping[str, str] = os.environ) -> int | None:
    """SLURM's ``--mem`` (``SLURM_MEM_PER_NODE``, MB) or ``--mem-per-cpu`` times the job's CPUs
    on this node, in bytes; None outside a job that asked for memory (0 means "all")."""
    try:
        per_node = int(environ.get("SLURM_MEM_PER_NODE", "0") or 0)
        if per_node > 0:
            return per_node << 20
        per_cpu = int(environ.get("SLURM_MEM_PER_CPU", "0") or 0)
        cpus = int(environ.get("SLURM_CPUS_ON_NODE", "0") or 0)
    except ValueError:
        return None
    return (per_cpu * cpus) << 20 if per_cpu > 0 and cpus > 0 else None


def read_memory(root: str = "/", environ: Mapping[str, str] = os.environ) -> Memory:
    """This process's :class:`Memory` (see the module docstring)."""
    meminfo = _meminfo(root)
    limit_limits: list[tuple[int, str]] = []
    available: list[tuple[int, str]] = []
    if "MemTotal" in meminfo:
        limit_limits.append((meminfo["MemTotal"], "physical memory"))
    if "MemAvailable" in meminfo:
        available.append((meminfo["MemAvailable"], "MemAvailable"))
    cg_limit, cg_room, cg_where = cgroup_memory(root)
    if cg_limit is not None:
        limit_limits.append((cg_limit, f"the {cg_where} limit"))
        available.append((cg_room, f"the {cg_where} limit less its use"))
    slurm = slurm_memory(environ)
    if slurm is not None:
        limit_limits.append((slurm, "SLURM's --mem"))
        available.append((slurm, "SLURM's --mem"))
    limit = min(limit_limits) if limit_limits else (None, "")
    free = min(available) if available else (None, "")
    return Memory(limit[0], limit[1], free[0], free[1])
