"""Where a run writes: checked before anything is read or logged, one run per ``--log_dir``.

* :func:`check_output_dir` / :func:`check_output_file`: a folder that can be created and written
  (by really creating a file in it: permission bits do not tell the truth for root or for
  read-only mounts), and a file path whose folder is such a folder and which is not a folder.
* :class:`RunLock`: ``<log_dir>/.unet3d.lock`` names its holder (pid, host and boot, the
  process's start time, the SLURM job and attempt); a second run on the same folder is refused
  with one line naming the holder; a lock whose process is gone (same host) or that an earlier
  attempt of the same SLURM job left (a requeue after a hard kill, on any node) is taken over;
  released on every exit path. The same lock guards predict's ``--output_dir``
  and (:func:`checkpoint_lock`) the ``--save_ckpt_path`` file of a training run.
* :func:`remove_if_empty`: a run refused after its output folders were created removes them.
* :func:`keep_previous`: an existing file renamed to a dated name beside it.
* :func:`move_previous_run`: a new training run in a used ``--log_dir`` moves every file of the
  last run (``run_files.run_file_names``: its MLPerf logs, resumed attempts' included, log.json,
  eval_cases.csv, curves.png) and the last run's ``--save_ckpt_path`` into one folder of their
  own, ``<log_dir>/previous-<time>``; nothing is deleted or overwritten, and the report and the
  package still read it: an attempt of the folder (a crashed one counts as a failed run).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, fields

from data_loading.write_errors import failure_reason
from runtime.run_files import PREVIOUS_RUN_PREFIX, RESUMED_TIME_FORMAT, run_file_names

LOCK_NAME = ".unet3d.lock"


class OutputError(RuntimeError):
    """An output path that cannot be written (one-line message naming the flag and path)."""


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
        raise OutputError(f"{flag} {path!r} cannot be written: {failure_reason(err)}") from None
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


def _boot_id() -> str:
    """This machine's boot (``/proc/sys/kernel/random/boot_id``): a pid means the same process
    only within one boot of one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _started(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of
    ``/proc/PID/stat``), "" where it cannot be read: with the pid it names one process, not a
    later one given the same number."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _slurm_job() -> tuple[str, int]:
    """(SLURM job id, restart count) of this process, ("", 0) outside a SLURM job. An array
    task's id is its own job id (SLURM_JOB_ID), so two tasks of one array never share it."""
    try:
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restart = 0
    return os.environ.get("SLURM_JOB_ID", ""), restart


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to judge it after a hard failure (a lost node, SIGKILL, OOM)."""

    pid: int
    host: str
    boot: str = ""         # the host's boot id: a rebooted node's pids are new processes
    started: str = ""      # the process's start time: a reused pid is another process
    node: str = ""         # SLURMD_NODENAME (several slurmd may share one host)
    job: str = ""          # SLURM job id, "" outside SLURM
    restart: int = 0       # SLURM_RESTART_COUNT: the attempt of that job
    uid: int = -1
    time: str = ""

    @classmethod
    def me(cls) -> "Holder":
        job, restart = _slurm_job()
        return cls(pid=os.getpid(), host=socket.gethostname(), boot=_boot_id(), started=_started(os.getpid()),
                   node=os.environ.get("SLURMD_NODENAME", ""), job=job, restart=restart, uid=os.getuid(),
                   time=time.strftime("%Y-%m-%dT%H:%M:%S"))

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        """A lock's text: JSON, or ``pid host time`` as earlier versions wrote it; None: garbage."""
        try:
            data = json.loads(text)
            if isinstance(data, dict):
                known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
                return cls(**known) if isinstance(known.get("pid"), int) and "host" in known else None
        except (ValueError, TypeError):
            pass
        parts = text.split()
        try:
            return cls(pid=int(parts[0]), host=parts[1], time=" ".join(parts[2:]))
        except (ValueError, IndexError):
            return None

    def where(self) -> str:
        node = f" (node {self.node})" if self.node and self.node != self.host else ""
        job = f", SLURM job {self.job} attempt {self.restart + 1}" if self.job else ""
        return f"pid {self.pid} on {self.host}{node}{job}"

    def gone(self) -> bool:
        """True only when this holder's process is known to have ended: it ran on this host
        in this boot and its pid is dead or now another process. A holder on another host (or
        before a reboot, when its boot id is not recorded) cannot be checked from here."""
        if self.host != socket.gethostname():
            return False
        if self.boot and self.boot != _boot_id():   # this host rebooted since: its processes ended
            return True
        if not _alive(self.pid):
            return True
        return bool(self.started) and _started(self.pid) not in ("", self.started)

    def earlier_attempt_of(self, me: "Holder") -> bool:
        """This lock was taken by an earlier attempt of the same SLURM job (requeued after a
        node failure, an OOM kill or SIGKILL): that attempt has ended wherever it ran, since
        SLURM starts the next attempt only after the last one is gone."""
        return bool(self.job) and self.job == me.job and self.restart < me.restart and self.uid in (-1, me.uid)


class RunLock:
    """``with RunLock(folder):`` - this run owns ``folder`` (``--log_dir``, ``--output_dir``) or,
    with ``name``, one file in it (``--save_ckpt_path``) until the block ends.

    The lock file is written whole before it appears (a temporary file hard-linked to its name,
    which fails if the name exists), so no run ever reads a half-written lock. A lock is taken
    over when its holder is known to be gone (same host and boot, dead or reused pid) or was an
    earlier attempt of this SLURM job (:meth:`Holder.earlier_attempt_of`); any other holder is
    refused with one line naming it."""

    def __init__(self, folder: str, enabled: bool = True, flag: str = "--log_dir", name: str = LOCK_NAME,
                 subject: str | None = None):
        self.path = os.path.join(folder, name)
        self.enabled, self.flag = enabled, flag
        self.subject = folder if subject is None else subject
        self.held = False

    def _error(self, err: OSError) -> OutputError:
        return OutputError(f"{self.flag} {self.subject!r} cannot be locked: cannot write {self.path!r} "
                           f"({failure_reason(err)})")

    def _try_create(self, me: Holder) -> bool:
        """Create the lock holding ``me``, complete before it is visible; False if it exists."""
        folder, name = os.path.split(self.path)
        try:
            fd, temporary = tempfile.mkstemp(dir=folder, prefix=f"{name}.")
        except OSError as err:
            raise self._error(err) from None
        try:
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(json.dumps(asdict(me)) + "\n")
                os.chmod(temporary, 0o644)
            except OSError as err:   # a full disk: never leave an empty lock behind
                raise self._error(err) from None
            try:
                os.link(temporary, self.path)
            except FileExistsError:
                return False
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                    raise self._error(err) from None
                return self._create_without_links(me)
            return True
        finally:
            try:
                os.remove(temporary)
            except FileNotFoundError:
                pass

    def _create_without_links(self, me: Holder) -> bool:
        """A filesystem without hard links: O_EXCL, written at once (the old way)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as err:
            raise self._error(err) from None
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(asdict(me)) + "\n")
        except OSError as err:
            os.remove(self.path)
            raise self._error(err) from None
        return True

    def _read(self) -> str | None:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise OutputError(f"{self.flag} {self.subject!r} cannot be locked: cannot read {self.path!r} "
                              f"({failure_reason(err)})") from None

    def _take_over(self, seen: str) -> None:
        """Remove the lock judged stale, provided it is still the one that was judged: it is
        renamed away first (atomic), and put back if another run replaced it meanwhile."""
        grave = f"{self.path}.stale.{socket.gethostname()}.{os.getpid()}"
        try:
            os.rename(self.path, grave)
        except FileNotFoundError:
            return
        try:
            with open(grave, encoding="utf-8", errors="replace") as handle:
                moved = handle.read()
            if moved != seen:   # another run took it over and locked it first: give it back
                try:
                    os.link(grave, self.path)
                except FileExistsError:
                    pass
        finally:
            os.remove(grave)

    def acquire(self) -> "RunLock":
        if not self.enabled:
            return self
        me = Holder.me()
        for _ in range(3):
            if self._try_create(me):
                self.held = True
                return self
            seen = self._read()
            if seen is None:   # released meanwhile
                continue
            holder = Holder.parse(seen)
            if holder is not None and not holder.gone() and not holder.earlier_attempt_of(me):
                raise OutputError(f"another run ({holder.where()}) is using {self.flag} "
                                  f"{self.subject!r}; wait for it, use another {self.flag}, or "
                                  f"remove {self.path!r} if that run is gone")
            # Stale: its process is gone, it was this job's earlier attempt, or garbage (never a
            # live run's: a lock is complete when it appears).
            self._take_over(seen)
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


def _free_name(path: str, suffix: str = "") -> str:
    """``path + suffix``, or ``path.N + suffix`` for the first N that does not exist."""
    target, n = path + suffix, 1
    while os.path.lexists(target):
        target, n = f"{path}.{n}{suffix}", n + 1
    return target


def move_previous_run(log_dir: str, checkpoint: str = "") -> list[str]:
    """Move the last run's files out of the way of a new run in ``log_dir``: every file
    ``run_files.run_file_names`` names, and the file at ``checkpoint`` (``--save_ckpt_path``,
    '' for none), go into ``<log_dir>/previous-<time>`` (the time of the newest of them; a
    checkpoint outside ``log_dir`` is renamed beside itself, ``<stem>.previous-<time><ext>``).
    Renames only (one filesystem): nothing is deleted, nothing overwritten. Returns one line per
    place something went, for the user; [] when there was nothing to move. :class:`OutputError`
    (one line) when a rename fails."""
    log_dir = os.path.abspath(log_dir)
    try:
        names = [n for n in run_file_names(os.listdir(log_dir)) if os.path.isfile(os.path.join(log_dir, n))]
    except FileNotFoundError:
        names = []
    except OSError as err:
        raise OutputError(f"--log_dir {log_dir!r} cannot be listed: {failure_reason(err)}") from None
    paths = [os.path.join(log_dir, n) for n in names]
    old_ckpt = os.path.abspath(checkpoint) if checkpoint and os.path.isfile(checkpoint) else ""
    if not paths and not old_ckpt:
        return []
    stamp = time.strftime(RESUMED_TIME_FORMAT, time.localtime(max(
        os.path.getmtime(p) for p in paths + ([old_ckpt] if old_ckpt else []))))
    lines = []
    try:
        if old_ckpt and os.path.dirname(old_ckpt) != log_dir:
            stem, ext = os.path.splitext(old_ckpt)
            target = _free_name(f"{stem}.{PREVIOUS_RUN_PREFIX}{stamp}", ext)
            os.rename(old_ckpt, target)
            lines.append(f"--save_ckpt_path: kept the previous run's checkpoint as {target}")
        elif old_ckpt:
            paths.append(old_ckpt)
        if paths:
            folder = _free_name(os.path.join(log_dir, PREVIOUS_RUN_PREFIX + stamp))
            os.mkdir(folder)
            for path in paths:
                os.rename(path, os.path.join(folder, os.path.basename(path)))
            lines.append(f"--log_dir: moved the previous run's files ({', '.join(os.path.basename(p) for p in paths)}) "
                         f"to {folder} (still an attempt of this folder for the report and the package)")
    except OSError as err:
        raise OutputError(f"cannot move the previous run's files in {log_dir!r} out of the way: "
                          f"{failure_reason(err)} ({err.filename})") from None
    return lines
