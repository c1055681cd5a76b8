"""Run records (run_description.json) for the package's tests: a run's record rewritten as if the
run had used this checkout's committed HEAD (the tests' runs use the working tree, which may have
uncommitted changes while someone develops), or other machines."""
from __future__ import annotations

import functools
import io
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

from runtime import host as H
from runtime.run_files import RUN_DESCRIPTION

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def fingerprint_of(commit: str, repo=ROOT) -> str:
    """The fingerprint of ``commit``'s files, from its own ``git archive``."""
    data = subprocess.run(["git", "archive", "--format=tar", commit], cwd=repo, capture_output=True,
                          check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(folder, filter="data")
        return H.fingerprint(folder)


@functools.lru_cache(maxsize=1)
def head_code() -> dict:
    commit = git("rev-parse", "HEAD").strip()
    return {"commit": commit, "dirty": False, "fingerprint": fingerprint_of(commit)}


def record(folder) -> dict:
    return json.loads((Path(folder) / RUN_DESCRIPTION).read_text())


def rewrite(folder, change) -> dict:
    """``folder``'s record after ``change(record)`` (in place)."""
    found = record(folder)
    change(found)
    (Path(folder) / RUN_DESCRIPTION).write_text(json.dumps(found))
    return found


def as_committed(folder) -> None:
    """The record says the run used this checkout's HEAD, clean."""
    rewrite(folder, lambda r: r["code"].update(head_code()))
