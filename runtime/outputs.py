"""Where a run writes: checked before anything is read or logged, one run per ``--log_dir``.

* :func:`check_output_dir` / :func:`check_output_file`: a folder that can be created and written
  (by really creating a file in it: permission bits do not tell the truth for root or for
  read-only mounts), and a file path whose folder is such a folder and which is not a folder.
* :class:`RunLock`: ``<log_dir>/.unet3d.lock`` holds ``pid host``; a second run on the same
  folder is refused with one line naming the holder; a lock whose process is dead (same host)
  is taken over; released on every exit path.
* :func:`keep_previous`: an existing ``unet3d.log`` is renamed before a run writes its own, so
  each MLPerf log holds exactly one run.
"""
from __future__ import annotations

import errno
import os
import socket
import tempfile
import time

LOCK_NAME = ".unet3d.lock"


class OutputError(RuntimeError):
    """An output path that cannot be written (one-line message naming the flag and path)."""


def _reason(err: OSError) -> str:
    return err.strerror or errno.errorcode.get(err.errno or 0, type(err).__name__)


def check_output_dir(path: str, flag: str) -> None:
    """Create ``path`` if needed and prove it writable, or raise :class:`OutputError`."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path!r} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise OutputError(f"{flag} {path!r} cannot be written: {_reason(err)}") from None


def check_output_file(path: str, flag: str) -> None:
    """``path`` can be written as a file (its folder created if needed), or :class:`OutputError`."""
    if os.path.isdir(path):
        raise OutputError(f"{flag} {path!r} is a folder; give a file name such as {os.path.join(path, 'ckpt.pt')!r}")
    try:
        check_output_dir(os.path.dirname(os.path.abspath(path)), "its folder")
    except OutputError as err:
        raise OutputError(f"{flag} {path!r} cannot be written: {err}") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise OutputError(f"{flag} {path!r} exists and cannot be overwritten")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """``with RunLock(log_dir):`` - this run owns ``log_dir`` until the block ends."""

    def __init__(self, log_dir: str, enabled: bool = True):
        self.path = os.path.join(log_dir, LOCK_NAME)
        self.enabled = enabled
        self.held = False

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        return True

    def _holder(self) -> tuple[int | None, str]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                fields = handle.read().split()
            return int(fields[0]), fields[1]
        except (OSError, ValueError, IndexError):
            return None, "?"

    def acquire(self) -> "RunLock":
        if not self.enabled:
            return self
        for _ in range(2):
            if self._try_create():
                self.held = True
                return self
            pid, host = self._holder()
            if pid is not None and (host != socket.gethostname() or _alive(pid)):
                raise OutputError(f"another run (pid {pid} on {host}) is using --log_dir "
                                  f"{os.path.dirname(self.path)!r}; wait for it, use another --log_dir, or "
                                  f"remove {self.path!r} if that run is gone")
            try:  # stale: its process is dead (or the file is unreadable garbage)
                os.remove(self.path)
            except FileNotFoundError:
                pass
        raise OutputError(f"cannot take the lock {self.path!r}")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def keep_previous(path: str) -> str | None:
    """Rename an existing ``path`` to ``<stem>.<mtime>[.n]<ext>`` and return the new name."""
    if not os.path.exists(path):
        return None
    stem, ext = os.path.splitext(path)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
    target, n = f"{stem}.{stamp}{ext}", 1
    while os.path.exists(target):
        target, n = f"{stem}.{stamp}.{n}{ext}", n + 1
    os.replace(path, target)
    return target
