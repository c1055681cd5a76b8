"""The package's system, code and recipe from the runs' own records.

Each training run writes ``run_description.json`` before ``run_start`` (``runtime/host.py``): the
machines of every process, the software, the code (commit, dirty, fingerprint) and the recipe
(main.py's flags, the launcher's settings). Here: the records read and checked to agree
(:func:`read_records`), the system description built from them (:func:`system_description`), the
code that ran found and packed (:func:`code_source`, :func:`pack_code`) and the implementation's
README, launch script and recipe file written (:func:`write_implementation`).
"""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from typing import Sequence

from runtime import host as H
from runtime.run_files import RUN_DESCRIPTION
from runtime.submission import system as S

PACKING_HOST_FLAG = "--system_from_packing_host"
# main.py's flags that differ from run to run, never part of the recipe: the seed, the paths
PER_RUN_FLAGS = ("--seed", "--data_dir", "--log_dir", "--save_ckpt_path", "--load_ckpt_path", "--resume",
                 "--cache_dir")
# settings recorded from the environment that belong to one run or one site, not to the recipe
PER_RUN_SETTINGS = ("SEED", "UNET3D_SEED_SOURCE", "DATASET_DIR", "DATA_DIR", "UNET3D_CACHE_CLEARED", "UNET3D_LOG_DIR",
                    "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                    "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "CONTAINER")
PER_RUN_SETTING_PREFIXES = ("SLURM_",)
# what the scripts derive and say, not a setting: the recipe's values the run overrode (scripts/lib/recipe.sh)
RECIPE_OVERRIDES = "UNET3D_RECIPE_OVERRIDES"
# the counts the runs tell: --system_fields may reword the rest, not contradict these
COUNTED_FIELDS = ("number_of_nodes", "host_processors_per_node", "accelerators_per_node")
# counts per node a given value must equal (a number, the same number)
COUNT_FIGURES = ("host_processor_core_count", "host_processor_vcpu_count")
# what a given memory capacity may differ from the records' MemTotal, which the kernel keeps a few
# percent below the memory installed: at least this share of it, at most this many times it
MEMORY_BELOW, MEMORY_ABOVE = 0.95, 1.15
# software whose name and version a given framework or software stack may name only as the runs had it
KNOWN_SOFTWARE = ("PyTorch", "TensorFlow", "MXNet", "JAX", "PaddlePaddle", "Python", "CUDA", "ROCm", "cuDNN",
                  "NCCL", "RCCL", "numpy", "scipy", "mlperf-logging")
SOFTWARE_FIELDS = ("framework", "other_software_stack", "operating_system", "sw_notes")
NOT_AN_ACCELERATOR = ("", "n/a", "na", "none", "0")


class RecordError(Exception):
    """A user-facing problem with the runs' records or their code: one line."""


_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def memory_bytes(text) -> float | None:
    """``"23.5 GiB"``, ``"2 TB"``, ``"1.5TiB"`` in bytes; None when ``text`` names no amount."""
    match = re.search(r"(\d+(?:\.\d+)?)\s*([kmgtp]i?b)\b", str(text), re.IGNORECASE)
    return float(match.group(1)) * _UNITS[match.group(2).lower()] if match else None


def software_named(text) -> dict[str, str | None]:
    """{name: version or None} of :data:`KNOWN_SOFTWARE` named in ``text`` (``PyTorch 2.3.0``,
    ``CUDA 12.1``; a name without a number after it: None)."""
    found = {}
    for name in KNOWN_SOFTWARE:
        for match in re.finditer(rf"(?<![\w-]){re.escape(name)}(?![\w-])\s*v?([0-9][\w.+-]*)?", str(text),
                                 re.IGNORECASE):
            found.setdefault(name, match.group(1).rstrip(".,;") if match.group(1) else None)
    return found


def _same_version(given: str, ran: str) -> bool:
    """``2.3.0`` names ``2.3.0+cu121`` (the local part may be left out); ``2.3`` does not."""
    return given == ran or given == ran.split("+", 1)[0]


def given_field_problem(name: str, given, measured: dict, software: dict, accelerators_used: int) -> str:
    """Why the ``--system_fields`` value ``given`` of ``name`` contradicts the runs' records (their
    system description ``measured`` and ``software``), '' when it does not: an accelerator for runs
    that used none, a framework or software other than what ran, core or memory figures."""
    if name.startswith("accelerator") and not accelerators_used and str(given).strip().lower() not in \
            NOT_AN_ACCELERATOR:
        return "the runs used no accelerator"
    if name in COUNT_FIGURES and measured.get(name) not in ("", None) and str(given).strip() != measured[name]:
        return f"the runs' records say {measured[name]!r}"
    if name == "host_memory_capacity":
        ran, said = memory_bytes(measured.get(name, "")), memory_bytes(given)
        if ran and (said is None or not MEMORY_BELOW * ran <= said <= MEMORY_ABOVE * ran):
            return f"the runs' records say {measured[name]!r} (the memory their kernel saw)"
    if name in ("framework", "other_software_stack"):
        for software_name, version in software_named(given).items():
            ran = next((v for k, v in software.items() if k.lower() == software_name.lower()), None)
            if ran is None:
                return f"the runs did not run {software_name}"
            if version is not None and not _same_version(version, str(ran)):
                return f"the runs ran {software_name} {ran}"
        if name == "framework" and software.get("PyTorch") and "pytorch" not in str(given).lower():
            return f"the runs ran PyTorch {software['PyTorch']}"
    return ""


def changed_fields(measured: dict, given: dict) -> list[tuple[str, str, str]]:
    """(field, measured, given) of every given field that replaces a value the runs' records told
    (an empty one filled in is no change)."""
    return [(name, str(measured[name]), str(value)) for name, value in given.items()
            if measured.get(name) not in ("", None) and str(value) != str(measured[name])]


def changes_text(changes: Sequence[tuple[str, str, str]]) -> str:
    return "; ".join(f"{name}: given {value!r}, measured {measured!r}" for name, measured, value in changes)


@dataclass
class WhatRan:
    """What the counted runs ran on: ``record`` is the first run's (None: no run recorded one
    and the packing host describes the system, :data:`PACKING_HOST_FLAG`)."""

    record: dict | None
    folder: str
    runs: int = 0
    source: str = "runs"  # "runs" | "packing host"
    notes: list[str] = field(default_factory=list)
    # (field, measured, given) of each --system_fields value that replaced what the records tell
    changed: list[tuple[str, str, str]] = field(default_factory=list)


def record_path(folder: str) -> str:
    return os.path.join(folder, RUN_DESCRIPTION)


def read_record(folder: str) -> dict | None:
    path = record_path(folder)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError) as error:
        raise RecordError(f"{path}: not readable as JSON ({getattr(error, 'strerror', None) or error})") from None
    if not isinstance(record, dict) or not record.get("hosts") or "code" not in record or "recipe" not in record:
        raise RecordError(f"{path}: not a run description (no hosts, code or recipe)")
    return record


def split_flags(flags: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["--a", "1", "--b"]`` -> ``[("--a", ["1"]), ("--b", [])]``."""
    groups: list[tuple[str, list[str]]] = []
    for token in flags:
        if token.startswith("--") or not groups:
            groups.append((token, []))
        else:
            groups[-1][1].append(token)
    return groups


def recipe_flags(record: dict) -> list[str]:
    """The run's main.py flags without :data:`PER_RUN_FLAGS`."""
    kept = []
    for option, values in split_flags(record["recipe"].get("flags") or []):
        if option not in PER_RUN_FLAGS:
            kept += [option, *values]
    return kept


def recipe_settings(record: dict) -> dict[str, str]:
    """The run's recorded environment settings without the per-run and site ones."""
    return {name: value for name, value in (record["recipe"].get("environment") or {}).items()
            if name not in PER_RUN_SETTINGS and name != RECIPE_OVERRIDES
            and not name.startswith(PER_RUN_SETTING_PREFIXES)}


def recipe_overrides(record: dict) -> list[str]:
    """The recipe's values that the run's environment or flags overrode, as its launcher said them
    (``VALUE (the recipe: VALUE)``), from the environment it recorded."""
    said = (record["recipe"].get("environment") or {}).get(RECIPE_OVERRIDES, "")
    return [item.strip() for item in said.split(";") if item.strip()]


def _node(host: dict) -> dict:
    used = host.get("accelerators_used", 0)
    return {"host processor": host.get("cpu_model"), "sockets": host.get("sockets"),
            "accelerators per node": used, "accelerator": (host.get("accelerators") or {}).get("model") if used else
            "N/A"}


def code_text(code: dict) -> str:
    if code.get("commit"):
        return f"commit {code['commit'][:12]}" + (" with uncommitted changes" if code.get("dirty") else "")
    return f"{code.get('project', H.PROJECT)} {code.get('version', '?')} without git, files {code.get('fingerprint')}"


def _code_key(code: dict):
    clean = code.get("commit") and code.get("dirty") is False
    return (code.get("commit"), None if clean else code.get("fingerprint"))


def signature(record: dict) -> list[tuple[str, object, str]]:
    """What every packed run must agree on: (what, value compared, value said)."""
    node = _node(record["hosts"][0])
    flags = recipe_flags(record)
    return [("number of nodes", record.get("nodes"), str(record.get("nodes"))),
            ("processes per node", record.get("processes_per_node"), str(record.get("processes_per_node"))),
            *[(name, value, str(value)) for name, value in node.items()],
            ("software", record.get("software"), S.software_text(record.get("software") or {})
             + f", PyTorch {(record.get('software') or {}).get('PyTorch')}"),
            ("code", _code_key(record["code"]), code_text(record["code"])),
            ("main.py flags (but the seed and paths)", flags, " ".join(flags))]


def _within(folder: str, record: dict) -> None:
    """One run's nodes alike (one system description describes every node) and one software."""
    nodes = [(_node(host), host.get("hostname")) for host in record["hosts"]]
    for node, hostname in nodes[1:]:
        for key, value in node.items():
            if value != nodes[0][0][key]:
                raise RecordError(f"{record_path(folder)}: the run's nodes differ in {key}: {nodes[0][0][key]!r} on "
                                  f"{nodes[0][1]}, {value!r} on {hostname} (a system description describes "
                                  "one kind of node)")
    if record.get("software_differs"):
        raise RecordError(f"{record_path(folder)}: ranks {record['software_differs']} ran other software than rank 0")


def read_records(folders: Sequence[str], packing_host: bool = False) -> WhatRan:
    """The records of the counted runs' ``folders`` (in start order), checked to agree. A run
    without one: refused, or with ``packing_host`` the packing host describes the system."""
    records = [(folder, read_record(folder)) for folder in folders]
    missing = [folder for folder, record in records if record is None]
    if missing:
        if not packing_host:
            raise RecordError(f"{missing[0]} holds no {RUN_DESCRIPTION} (a run made before runs recorded their "
                              f"machines: {len(missing)} of {len(records)}): package it with {PACKING_HOST_FLAG} "
                              "to describe this machine instead, or run again")
        return WhatRan(None, missing[0], len(records), "packing host",
                       [f"{len(missing)} of {len(records)} run(s) recorded no machine ({RUN_DESCRIPTION}): the "
                        f"system description is the packing host's ({PACKING_HOST_FLAG}), not the runs'"])
    first_folder, first = records[0]
    for folder, record in records:
        _within(folder, record)
    expected = signature(first)
    for folder, record in records[1:]:
        for (what, value, said), (_, first_value, first_said) in zip(signature(record), expected):
            if value != first_value:
                raise RecordError(f"the runs disagree on {what}: {said!r} in {folder}, {first_said!r} in "
                                  f"{first_folder} (one package holds the runs of one system, software, code "
                                  "and recipe)")
    return WhatRan(first, first_folder, len(records))


def system_description(what: WhatRan, org: str, system_name: str, division: str, status: str,
                       system_fields: dict | None, nodes: int | None, storage_path: str) -> dict:
    """``systems/<system>.json``: from the runs' record (or the packing host), then
    ``system_fields`` (what machines cannot tell); ``nodes`` (``--nodes``) must match the runs."""
    given = dict(system_fields or {})
    if what.record is None:
        description = S.describe(org, system_name, division, status, nodes or 1, storage_path=storage_path)
        description["sw_notes"] = f"described on the packing host, not the runs' ({PACKING_HOST_FLAG}); " \
                                  + description["sw_notes"]
    else:
        record = what.record
        if nodes is not None and nodes != record["nodes"]:
            raise RecordError(f"--nodes {nodes}: the runs ran on {record['nodes']} node(s) ({record_path(what.folder)})"
                              "; leave --nodes out")
        host = record["hosts"][0]
        code = record["code"]
        notes = (f"{code.get('project', H.PROJECT)} {code.get('version', '?')} ({code_text(code)}); "
                 f"{record['nodes']} node(s) x {record['processes_per_node']} process(es), described from the "
                 f"{what.runs} runs' own records ({RUN_DESCRIPTION})")
        description = S.fields(org, system_name, division, status, host, record.get("software") or {},
                               record["nodes"], host.get("accelerators_used", 0), notes)
        for name in COUNTED_FIELDS:
            if name in given and str(given[name]) != description[name]:
                raise RecordError(f"--system_fields gives {name} {given[name]!r}, the runs' records say "
                                  f"{description[name]!r} ({record_path(what.folder)}): remove it from the file")
        for name, value in given.items():
            why = given_field_problem(name, value, description, record.get("software") or {},
                                      host.get("accelerators_used", 0))
            if why:
                raise RecordError(f"--system_fields gives {name} {value!r}, but {why} ({record_path(what.folder)}): "
                                  "remove or correct it (a processor's marketing name may reword the records')")
    changes = changed_fields(description, given)
    what.changed = changes
    description.update(given)
    for notes_field, fields in (("hw_notes", None), ("sw_notes", SOFTWARE_FIELDS)):
        mine = [c for c in changes if (c[0] in fields if fields else c[0] not in SOFTWARE_FIELDS)]
        if mine:
            said = ("--system_fields changed what the runs' records tell: " + changes_text(mine))
            description[notes_field] = "; ".join(text for text in (description.get(notes_field), said) if text)
    return description


# -- the code ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeSource:
    """Where the packed code comes from: ``commit`` of the checkout ``repo``, or (no git there)
    the files of ``repo`` itself."""

    repo: str
    commit: str | None
    said: str


def _git(repo: str, *args: str, binary: bool = False):
    try:
        proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout if binary else proc.stdout.decode("utf-8", "replace")


def _extract(repo: str, commit: str, destination: str) -> int:
    """``git archive`` of ``commit`` unpacked into ``destination``; the number of files."""
    data = _git(repo, "archive", "--format=tar", commit, binary=True)
    if data is None:
        raise RecordError(f"git archive {commit} failed in {repo}")
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = [m for m in archive.getmembers() if m.isfile() or m.isdir() or m.issym()]
        if hasattr(tarfile, "data_filter"):  # Python's safe extraction, where it has it
            archive.extractall(destination, members=members, filter="data")
        else:  # pragma: no cover - older Pythons; git's own archive of this checkout
            archive.extractall(destination, members=members)
        return sum(1 for m in members if m.isfile())


def code_source(what: WhatRan, repo: str = H.ROOT) -> CodeSource:
    """The code the runs logged, found in the checkout ``repo``; refused in one line when a run
    logged a dirty tree, a commit ``repo`` lacks, or files that are not that commit's."""
    if what.record is None:  # older runs: the checkout, as it is (said in the report)
        return CodeSource(repo, None, "this checkout's files (the runs recorded no code)")
    code = what.record["code"]
    where = record_path(what.folder)
    if code.get("commit") and code.get("dirty"):
        raise RecordError(f"{where}: the run ran from a tree with uncommitted changes (commit "
                          f"{code['commit'][:12]}), so the code that ran cannot be packed: commit, run again, or "
                          "package with --no_code")
    has_git = _git(repo, "rev-parse", "--git-dir") is not None
    commit = code.get("commit")
    if commit is None:  # an image's copy without .git: the checkout's HEAD if its files are the same
        commit = (_git(repo, "rev-parse", "HEAD") or "").strip() or None if has_git else None
        if commit is None:
            if H.fingerprint(repo) != code.get("fingerprint"):
                raise RecordError(f"{where}: the runs' code (files {code.get('fingerprint')}) is not {repo}'s: "
                                  "package from a checkout of the code the runs used")
            return CodeSource(repo, None, f"{repo}'s files, the same as the runs' ({code.get('fingerprint')})")
    elif not has_git or _git(repo, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        raise RecordError(f"{where}: the runs' commit {commit} is not in {repo}: fetch it, or package from a "
                          "checkout that has it")
    with tempfile.TemporaryDirectory() as staging:
        _extract(repo, commit, staging)
        found = H.fingerprint(staging)
    if found != code.get("fingerprint"):
        what_ran = f"commit {code['commit'][:12]}" if code.get("commit") else "no git (an image's copy)"
        raise RecordError(f"{where}: the files that ran ({what_ran}, {code.get('fingerprint')}) are not those of "
                          f"commit {commit[:12]} of {repo} ({found}): package from a checkout of the code the runs "
                          "used")
    return CodeSource(repo, commit, f"git commit {commit}")


def pack_code(source: CodeSource, destination: str, copy_checkout) -> int:
    """The code of ``source`` written into ``destination`` (``copy_checkout(destination)``: the
    checkout's own files, where there is no commit); the number of files."""
    if source.commit is None:
        return copy_checkout(destination)
    os.makedirs(destination, exist_ok=True)
    return _extract(source.repo, source.commit, destination)


# -- the implementation's README, launch script and recipe ----------------------------------------------------------


def _q(text) -> str:
    return shlex.quote(str(text))


def launch_script(record: dict, implementation: str) -> str:
    """A script that runs the recipe of ``record`` with the packed code (``../<implementation>``)."""
    flags = recipe_flags(record)
    settings = recipe_settings(record)
    nodes, per_node = record["nodes"], record["processes_per_node"]
    lines = [
        "#!/usr/bin/env bash",
        "# The recipe of the packed runs (their run_description.json): the settings their launcher had in",
        "# its environment and main.py's flags, on the code in ../" + implementation + ".",
        "#   DATASET_DIR=/path/to/kits19/preprocessed [RESULTS_DIR=...] ./run_and_time.sh [SEED]",
        "# SEED: -1 or none draws one from the OS (closed: never a chosen one).",
        "set -euo pipefail",
        'HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)',
        f'CODE_DIR=${{CODE_DIR:-$HERE/../{implementation}}}',
        ': "${DATASET_DIR:?set DATASET_DIR to the preprocessed KiTS19 dataset}"',
        "SEED=${1:-${SEED:--1}}",
        "",
        "# the recipe's settings",
        *[f"export {name}={_q(value)}" for name, value in settings.items()],
    ]
    if not isinstance(per_node, int):
        lines.append(f"# the runs had {per_node} processes on their nodes: give NPROC_PER_NODE")
        per_node = "${NPROC_PER_NODE:?}"
    flag_text = " \\\n    ".join(" ".join(_q(t) for t in [option, *values]) for option, values in split_flags(flags))
    if nodes == 1:
        lines += ["", "# processes on this node (run_and_time.sh starts torchrun for more than one)",
                  f"export NPROC_PER_NODE={per_node}", "",
                  "# run_and_time.sh drops the page cache, times the run and passes these flags after its own",
                  'exec bash "$CODE_DIR/run_and_time.sh" "$SEED" \\', f"    {flag_text}" if flags else ""]
    else:
        lines += ["", f"# {nodes} nodes: run this on every node with NODE_RANK, MASTER_ADDR and MASTER_PORT set (the",
                  "# SLURM job $CODE_DIR/scripts/slurm/multi_node.sbatch does it, with these settings exported);",
                  "# drop each node's page cache first (docs/submission.md).",
                  'RESULTS_DIR=${RESULTS_DIR:-$PWD/results/run_and_time-seed$SEED}',
                  'exec torchrun --nnodes ' + str(nodes) + f' --nproc_per_node {per_node} --node_rank "${{NODE_RANK:?}}" \\',
                  '    --master_addr "${MASTER_ADDR:?}" --master_port "${MASTER_PORT:-29500}" "$CODE_DIR/main.py" \\',
                  '    --data_dir "$DATASET_DIR" --log_dir "$RESULTS_DIR" --seed "$SEED" \\',
                  f"    {flag_text}" if flags else ""]
    return "\n".join(lines).rstrip(" \\\n") + "\n"


def readme(what: WhatRan, description: dict, system_name: str, implementation: str, batches: Sequence[int],
           packed: int, code_said: str) -> str:
    lines = [f"# unet3d on {system_name}: what ran and how to run it again", ""]
    if what.record is None:
        return "\n".join(lines + [
            f"The runs recorded no machine, code or recipe ({RUN_DESCRIPTION}, written by runs of newer code): "
            f"`systems/{system_name}.json` describes the packing host, the machine that made this package "
            f"({PACKING_HOST_FLAG}), not necessarily the one that trained, and there is no launch script. Code: "
            f"{code_said}.", ""])
    record = what.record
    host = record["hosts"][0]
    used = host.get("accelerators_used", 0)
    accelerators = f"{used} x {description['accelerator_model_name']} per node" if used else "none (CPU processes)"
    flags = recipe_flags(record)
    settings = recipe_settings(record)
    lines += [
        f"Written by `python -m runtime.submission package` from the {what.runs} packed runs' own records "
        f"(`{RUN_DESCRIPTION}`, each written by the run before `run_start`); every run agreed on what is below.", "",
        "## What ran", "",
        f"- System: `{system_name}` (`systems/{system_name}.json`): {record['nodes']} node(s) x "
        f"{record['processes_per_node']} process(es) per node (world size {record['world_size']}), launched with "
        f"{record['recipe'].get('launcher', '?')}",
        f"- Accelerators: {accelerators}",
        f"- Host: {description['host_processor_model_name']}, {description['host_processors_per_node']} socket(s), "
        f"{description['host_processor_vcpu_count']} logical CPUs, {description['host_memory_capacity']} memory; "
        f"{description['operating_system']}" + (f"; container: {host['container']}" if host.get("container") else ""),
        f"- Software: {description['framework']}, {description['other_software_stack']}",
        f"- Code: `../{implementation}`, {code_said}",
        f"- Global batch size: {', '.join(map(str, batches)) or '?'} (the MLPerf logs' `global_batch_size`)",
        f"- Results: {packed} file(s) in `results/{system_name}/unet3d/`, each run with its own seed", "",
        "The recipe's settings (the launcher's environment"
        + (f", recipe `{settings.get('UNET3D_RECIPE') or settings.get('RECIPE')}`"
           if settings.get("UNET3D_RECIPE") or settings.get("RECIPE") else "") + "):", "",
    ]
    lines += [f"    {name}={shlex.quote(value)}" for name, value in settings.items()] or ["    (none set)"]
    overrides = recipe_overrides(record)
    if overrides:
        recipe_name = settings.get("UNET3D_RECIPE") or settings.get("RECIPE") or "?"
        lines += ["", f"**Not the recipe's values.** The runs overrode {len(overrides)} value(s) of the recipe "
                      f"`{recipe_name}` (from the environment, or a flag given after the recipe's), each said in a "
                      "line by the run; the RCP of the recipe does not stand behind them:", ""]
        lines += [f"- `{item}`" for item in overrides]
    lines += ["", "main.py's flags (the same in every run, but the seed and the paths):", "",
              "    " + (" ".join(_q(t) for t in flags) or "(none)"), "",
              "## Run it again", "",
              f"`run_and_time.sh` here runs that recipe with the code in `../{implementation}`:", "",
              "```bash",
              f"pip install -r ../{implementation}/requirements.txt   # the software above; PyTorch as listed",
              f"python ../{implementation}/preprocess_dataset.py --data_dir KITS19/data --results_dir DATA",
              "DATASET_DIR=DATA RESULTS_DIR=RESULTS/run_00 ./run_and_time.sh", "```", "",
              f"`{system_name}_{implementation}.json` holds the same recipe as data."]
    if record["nodes"] > 1:
        lines += ["", f"On {record['nodes']} nodes run it once per node with `NODE_RANK`, `MASTER_ADDR` and "
                      f"`MASTER_PORT` set, or use the code's SLURM job `scripts/slurm/multi_node.sbatch` with the "
                      "settings above exported."]
    return "\n".join(lines) + "\n"


def write_implementation(folder: str, what: WhatRan, description: dict, system_name: str, implementation: str,
                         batches: Sequence[int], packed: int, code_said: str) -> list[str]:
    """``implementations/<system>/``: README.md, and from a record run_and_time.sh and
    ``<system>_<implementation>.json``. Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    written = []

    def write(name: str, text: str, mode: int = 0o644) -> None:
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(path, mode)
        written.append(path)

    write("README.md", readme(what, description, system_name, implementation, batches, packed, code_said))
    if what.record is not None:
        record = what.record
        write("run_and_time.sh", launch_script(record, implementation), 0o755)
        recipe = {"system": system_name, "implementation": implementation, "nodes": record["nodes"],
                  "processes_per_node": record["processes_per_node"], "world_size": record["world_size"],
                  "launcher": record["recipe"].get("launcher"), "global_batch_size": list(batches),
                  "code": record["code"], "software": record.get("software"), "settings": recipe_settings(record),
                  "flags": recipe_flags(record), "recipe_overrides": recipe_overrides(record), "runs": what.runs}
        write(f"{system_name}_{implementation}.json", json.dumps(recipe, indent=2) + "\n")
    return written

