"""Atomic file writes: nothing half-written survives a crash or an interrupt."""
from __future__ import annotations

import os
from typing import BinaryIO, Callable

TEMP_SUFFIX = ".tmp"


def temp_path_for(path: str) -> str:
    """The hidden temporary name ``path`` is written under: ``.<name>.<pid>.tmp`` beside it."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}{TEMP_SUFFIX}")


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync, then rename it over
    ``path``. On any failure the temporary file is removed and ``path`` is left as it was."""
    temp = temp_path_for(path)
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
