"""Atomic file writes: nothing half-written survives a crash or an interrupt."""
from __future__ import annotations

import errno
import os
import secrets
from typing import BinaryIO, Callable

from data_loading.write_errors import probe_write_errno

TEMP_SUFFIX = ".tmp"


def _open_temporary(path: str) -> tuple[int, str]:
    """Create a new hidden temporary file beside ``path`` (``.<name>.<random>.tmp``), as
    ``mkstemp`` does: an unpredictable name opened with ``O_EXCL`` (never a file or link someone
    put there), but with the permissions ``open`` would give (0666 less the umask) instead of
    mkstemp's 0600, so the file renamed over ``path`` is readable as any other output."""
    folder, name = os.path.split(os.path.abspath(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        temp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
        try:
            return os.open(temp, flags, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", os.path.join(folder, f".{name}.*{TEMP_SUFFIX}"))


def _write_all(fd: int, write: Callable[[BinaryIO], None]) -> None:
    with open(fd, "wb") as handle:
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
    fd, temp = _open_temporary(path)
    try:
        _write_all(fd, write)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
