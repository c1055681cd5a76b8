"""The one error type of reading and writing results, and their one way to write a file."""
from __future__ import annotations

from typing import Callable

from data_loading.atomic import atomic_write as write_atomically
from data_loading.write_errors import write_or_raise


class ReportError(Exception):
    """A user-facing problem: one line, exit code 1."""


def atomic_write(path: str, write: Callable) -> str:
    """:func:`data_loading.atomic.atomic_write` (temporary file beside ``path``, then rename:
    a reader never sees half a file), returning ``path``. A failure to write (full disk, quota,
    read-only) is one :class:`ReportError` naming ``path``."""
    write_or_raise(lambda: write_atomically(path, write),
                     lambda reason, _: ReportError(f"cannot write {path}: {reason}"))
    return path
