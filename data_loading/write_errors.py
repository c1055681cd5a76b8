"""What went wrong when a file could not be written: one classifier for every writer.

A full disk does not always arrive as ``OSError(ENOSPC)``:

* ``torch.save`` into a file object raises ``RuntimeError("[enforce fail at
  inline_container.cc] unexpected pos ... vs ...")`` from its zip writer, with the ``OSError``
  of the failed ``write`` as its ``__context__``;
* ``np.save`` into a real file writes the array with ``ndarray.tofile``, whose short write is an
  ``OSError("N requested and M written")`` without an errno (see :func:`probe_write_errno`).

:func:`write_error` finds the ``OSError`` with an errno in an exception's cause/context chain,
:func:`write_failure` gives its one-line reason ("No space left on device", "Read-only file
system", "Permission denied", "Disk quota exceeded", ...), or None when the exception is not a
failure to write (a bug: let it be seen), :func:`failure_reason` the same for a user's one-line
message about any file operation. :func:`append_bytes` appends to a log file all or nothing.
"""
from __future__ import annotations

import errno
import os
from typing import Callable

# The usual reasons (the README and docs/reliability.md name them); any errno found counts.
FULL_DISK = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG})
WRITE_ERRNOS = FULL_DISK | {errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
# torch's zip writer wraps the OSError of a failed write in these (torch 2.3 to 2.13)
_TORCH_WRITER_SIGNS = ("unexpected pos", "PytorchStreamWriter failed", "iostream error")


def _chain(exc: BaseException):
    """``exc`` and every exception it was raised from or while handling, once each."""
    seen, todo = set(), [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]


def write_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` (with an errno) behind a failed write, or None."""
    for item in _chain(exc):
        if isinstance(item, OSError) and item.errno is not None:
            return item
    return None


def write_failure(exc: BaseException) -> str | None:
    """One-line reason why a write failed (the errno's text), or None when ``exc`` is no write
    failure. A wrapped failure with no errno left (torch's writer given a path) is "write
    failed (disk full?)"."""
    found = write_error(exc)
    if found is not None:
        return found.strerror or os.strerror(found.errno)
    if any(sign in str(item) for item in _chain(exc) for sign in _TORCH_WRITER_SIGNS):
        return "write failed (disk full?)"
    return None


def failure_reason(exc: BaseException) -> str:
    """The reason a file operation failed, for a one-line message: :func:`write_failure`'s, else
    the exception's type (never empty)."""
    return write_failure(exc) or type(exc).__name__


def write_or_raise(write: Callable[[], object], error: Callable[[str, BaseException], Exception]):
    """``write()``'s result; a failure to write becomes ``error(reason, exc)`` (:func:`write_failure`'s
    one-line reason), raised without the chained traceback; anything else is raised as it is."""
    try:
        return write()
    except Exception as exc:  # noqa: BLE001 - a write failure is one line, anything else a bug
        reason = write_failure(exc)
        if reason is None:
            raise
        raise error(reason, exc) from None


def is_full_disk(exc: BaseException) -> bool:
    """True when ``exc`` is a write that failed for want of space (ENOSPC, EDQUOT, EFBIG)."""
    found = write_error(exc)
    return found is not None and found.errno in FULL_DISK


def probe_write_errno(handle, attempts: int = 4) -> OSError | None:
    """After a short write without an errno (``ndarray.tofile``), write zeros at the end of
    ``handle`` (a temporary file about to be deleted) until the system says why: the errno's
    ``OSError``, or None if the writes succeed (then the cause is not the disk)."""
    try:
        handle.flush()
    except OSError as exc:
        return exc
    block = bytes(1 << 16)
    for _ in range(attempts):
        try:
            os.write(handle.fileno(), block)
        except OSError as exc:
            return exc
    return None


def append_bytes(path: str, data: bytes) -> None:
    """Append ``data`` to ``path`` entirely or not at all: after a failed (or short) write the
    file is cut back to its previous size, so a log never ends in half a line. Raises the
    ``OSError`` of the failure."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if written == 0:  # no progress and no errno: say what it almost surely is
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                view = view[written:]
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
