"""Where a run writes: checked before anything is read or logged, one run per ``--log_dir``.

* :func:`check_output_dir` / :func:`check_output_file`: a folder that can be created and written
  (by really creating a file in it: permission bits do not tell the truth for root or for
  read-only mounts), and a file path whose folder is such a folder and which is not a folder.
* :class:`RunLock`: ``<log_dir>/.unet3d.lock`` holds ``pid host``; a second run on the same
  folder is refused with one line naming the holder; a lock whose process is dead (same host)
  is taken over; released on every exit path. The same lock guards predict's ``--output_dir``
  and (:func:`checkpoint_lock`) the ``--save_ckpt_path`` file of a training run.
* :func:`remove_if_empty`: a run refused after its output folders were created removes them.
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


def _first_missing(path: str) -> str | None:
    """The outermost folder of ``path`` that does not exist yet (None: ``path`` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def check_output_dir(path: str, flag: str) -> str | None:
    """Create ``path`` if needed and prove it writable, or raise :class:`OutputError`.

    Returns the outermost folder this call created (None when ``path`` existed), so that a run
    refused later can remove what it made (:func:`remove_if_empty`)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path!r} is a file, not a folder")
    created = _first_missing(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        remove_if_empty(path, created)
        raise OutputError(f"{flag} {path!r} cannot be written: {_reason(err)}") from None
    return created


def remove_if_empty(path: str, created: str | None) -> None:
    """Remove ``path`` and its parents up to ``created`` (the outermost folder a run made), as
    long as they are empty: a refused run leaves no empty output folder behind."""
    if created is None:
        return
    path, created = os.path.abspath(path), os.path.abspath(created)
    while path == created or path.startswith(created + os.sep):
        try:
            os.rmdir(path)
        except OSError:  # not empty (or gone): keep it and everything above
            return
        path = os.path.dirname(path)


def check_output_file(path: str, flag: str) -> str | None:
    """``path`` can be written as a file (its folder created if needed), or :class:`OutputError`;
    returns the outermost folder created, as :func:`check_output_dir`."""
    if os.path.isdir(path):
        raise OutputError(f"{flag} {path!r} is a folder; give a file name such as {os.path.join(path, 'ckpt.pt')!r}")
    try:
        created = check_output_dir(os.path.dirname(os.path.abspath(path)), "its folder")
    except OutputError as err:
        raise OutputError(f"{flag} {path!r} cannot be written: {err}") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise OutputError(f"{flag} {path!r} exists and cannot be overwritten")
    return created


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """``with RunLock(folder):`` - this run owns ``folder`` (``--log_dir``, ``--output_dir``) or,
    with ``name``, one file in it (``--save_ckpt_path``) until the block ends."""

    def __init__(self, folder: str, enabled: bool = True, flag: str = "--log_dir", name: str = LOCK_NAME,
                 subject: str | None = None):
        self.path = os.path.join(folder, name)
        self.enabled, self.flag = enabled, flag
        self.subject = folder if subject is None else subject
        self.held = False

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as err:
            raise OutputError(f"{self.flag} {self.subject!r} cannot be locked: cannot write {self.path!r} "
                              f"({_reason(err)})") from None
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        except OSError as err:  # a full disk: the lock would be empty, i.e. unreadable garbage
            os.remove(self.path)
            raise OutputError(f"{self.flag} {self.subject!r} cannot be locked: cannot write {self.path!r} "
                              f"({_reason(err)})") from None
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
                raise OutputError(f"another run (pid {pid} on {host}) is using {self.flag} "
                                  f"{self.subject!r}; wait for it, use another {self.flag}, or "
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


def checkpoint_lock(path: str, enabled: bool = True) -> RunLock:
    """The lock of the checkpoint file ``path`` (``.<name>.lock`` beside it): two trainings that
    write one ``--save_ckpt_path`` (with different ``--log_dir``) would overwrite each other."""
    folder, name = os.path.split(os.path.abspath(path))
    return RunLock(folder, enabled=enabled and bool(path), flag="--save_ckpt_path", name=f".{name}.lock",
                   subject=path)


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
