"""torchrun for batch jobs: ``python launch.py [torchrun flags] main.py [main.py flags]``.

The same command line and the same launcher (``torch.distributed.run``), plus what a job
stopped by its scheduler needs:

- SIGUSR1 (the job's warning before its time limit, passed on by the job script) goes to the
  training processes, which save a checkpoint and exit 0. torchrun's own agent does not handle
  it and would die of it, leaving the workers behind.
- SIGTERM, SIGINT, SIGHUP (scancel, a requeue, a pre-emption): torchrun stops its workers (they
  save on SIGTERM) and raises ``SignalException``, whose traceback ends up in the job's log.
  Here that is one line, and the exit code 128 + the signal.
- A failed worker: one line per failed rank instead of torchrun's traceback and report.

The agent's informational warnings are left out of the log (its errors stay), and so is the
C++ stack that a node's agent prints when the rendezvous host has already left at the end of a
multi-node run (a warning: the run succeeded). So is the traceback of the agents' exit barrier
when it is the rendezvous host that is gone: the barrier runs only after this node's workers
succeeded, and the host's agent leaves as soon as the last agent has checked in, closing the
store while the last agent still waits for the answer ("Failed to recv, got 0 bytes"). The run
succeeded, the exit code says so. Any other failure of the barrier is one line.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers: they run in sessions of their
    own, so a process-group signal would miss them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def forward_when_ready(signum: int, timeout: float = 600.0) -> None:
    """Send ``signum`` to each worker as soon as it has a handler for it. A worker still
    importing torch would be killed by SIGUSR1 (its default action), and before the rendezvous
    there is no worker yet: the warning can come at any time, the first seconds of a job
    included."""
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = [pid for pid in children(os.getpid()) if pid not in done]
        if done and not waiting:
            return
        for pid in waiting:
            if catches(pid, signum):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
                done.add(pid)
        time.sleep(0.2)


def forward(signum, _frame) -> None:
    # A thread: the agent's own loop goes on meanwhile (it watches the workers end).
    threading.Thread(target=forward_when_ready, args=(signum,), daemon=True).start()


def failure_lines(error) -> list[str]:
    lines = []
    for rank, failure in sorted(error.failures.items()):
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        lines.append(f"torchrun: error: rank {rank} (pid {failure.pid} on {os.uname().nodename}) {how}")
    return lines or [f"torchrun: error: {error}"]


EXIT_BARRIER = "Error waiting on exit barrier"


class ExitBarrierFilter(logging.Filter):
    """The agent's "Error waiting on exit barrier" record: nothing when the store's host has
    closed the connection (it left after the barrier), else one line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(EXIT_BARRIER):
            return True
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and "connection was likely closed" in str(error).lower():
            return False
        detail = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""
        record.msg = "torchrun: warning: the agents' exit barrier failed after this node's workers succeeded" + (
            f": {type(error).__name__}: {detail}" if error is not None else "")
        record.args = ()
        record.exc_info = record.exc_text = None
        record.stack_info = None
        return True


def main() -> int:
    # First of all: the warning can come while torch is still loading (its default action
    # would kill this process and with it the job's requeue).
    signal.signal(signal.SIGUSR1, forward)
    # The agent's C++ warnings only: read once when torch loads, then the workers get the
    # caller's setting back.
    previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch  # noqa: F401  (loads c10 with the setting above)

    if previous is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = previous
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # Each of the agent's modules has a logger with a level of its own: quiet them one by one.
    # A filter sees only the records of its own logger (not those propagated to it): each one.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
            logging.getLogger(name).addFilter(ExitBarrierFilter())
    try:
        torchrun(sys.argv[1:])
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(f"torchrun: stopped by {name} on {os.uname().nodename}; the training processes were "
              "told to save their checkpoint and stop", file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    except ChildFailedError as error:
        print("\n".join(failure_lines(error)), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
