"""Atomic file writes: nothing half-written survives a crash or an interrupt."""
from __future__ import annotations

import os
from typing import BinaryIO, Callable

from data_loading.write_errors import probe_write_errno

TEMP_SUFFIX = ".tmp"


def temp_path_for(path: str) -> str:
    """The hidden temporary name ``path`` is written under: ``.<name>.<pid>.tmp`` beside it."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}{TEMP_SUFFIX}")


def _write_all(temp: str, write: Callable[[BinaryIO], None]) -> None:
    with open(temp, "wb") as handle:
        try:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as exc:
            if exc.errno is not None:
                raise
            # a short write without an errno (numpy's tofile): ask the file system why
            reason = probe_write_errno(handle)
            if reason is None:
                raise
            raise reason from exc


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync, then rename it over
    ``path``. On any failure the temporary file is removed and ``path`` is left as it was; a
    failure to write raises an exception that :func:`data_loading.write_errors.write_failure`
    explains (an ``OSError`` with its errno, or torch's wrapper of one)."""
    temp = temp_path_for(path)
    try:
        _write_all(temp, write)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
