"""Where a run reports (:class:`Reporters`: the MLPerf log, ``log.json``, progress, the
pre-emption flag) and its MLPerf clock: :func:`start_clock`, :func:`stop_clock` and
:func:`abort_clock_on_error`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from mlperf_logging.mllog import constants as C

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.run_log import MetricsWriter, MLPerfLogger
from runtime.signals import PreemptionFlag


@dataclass
class Reporters:
    """Where a run reports: MLPerf log, metrics file, progress bars; and the pre-emption flag."""

    mlperf: MLPerfLogger = field(default_factory=lambda: MLPerfLogger("", enabled=False))
    metrics: MetricsWriter = field(default_factory=lambda: MetricsWriter("", enabled=False))
    progress: Callable = lambda it, **_: it
    preempt: PreemptionFlag = field(default_factory=PreemptionFlag)
    is_main: bool = True
    curves: object | None = None  # with --plot (rank 0): ``request()`` after each evaluation, ``close(timeout)``
    run_start: float | None = None  # time.time() at the MLPerf run_start (start_clock)
    run_stopped: bool = False  # run_stop logged (stop_clock): never twice
    # samples trained per epoch (the plan's, once the data is known): every epoch_num is epochs x this
    epoch_samples: int = 0

    def say(self, *args, **kwargs) -> None:
        if self.is_main:
            print(*args, **kwargs)


def start_clock(out: Reporters) -> None:
    """``init_stop``, every rank waits, ``run_start``: the MLPerf clock starts. Called before
    anything lists, opens, maps or uploads the data (the rules: "The clock must start before
    any part of the system touches the dataset")."""
    out.mlperf.end(C.INIT_STOP)
    D.barrier()
    out.mlperf.start(C.RUN_START)
    out.run_start = time.time()


def epoch_metadata(out: Reporters, epoch: int) -> dict:
    """An epoch's MLPerf metadata: ``epoch_num`` in samples trained (``epoch x`` the samples an
    epoch trains, padding not counted), the one unit of every ``epoch_num`` in the log, as the
    evaluations' (``clocked.evaluation.eval_metadata``); ``epoch`` the epoch index."""
    return {"epoch_num": epoch * out.epoch_samples, "epoch": epoch}


def stop_clock(out: Reporters, status: str, epoch: int) -> None:
    """``run_stop`` with MLPerf's ``status`` (success or aborted) after ``epoch`` epochs, once, and
    only after ``run_start``."""
    if out.run_start is None or out.run_stopped:
        return
    out.run_stopped = True
    out.mlperf.end(C.RUN_STOP, metadata={"status": status, **epoch_metadata(out, epoch)})


def abort_clock_on_error(out: Reporters, state: ckpt.TrainState):
    """An ``ExitStack.push`` callback: an error after ``run_start`` (bad data found by the
    loaders, a failed write, a bug) ends the MLPerf log with ``run_stop`` status aborted, then
    goes on (the one-line error and the exit code are the caller's). A failure to write that
    line gives way to the original error."""

    def on_exit(exc_type, exc, tb) -> bool:
        if exc_type is not None:
            try:
                stop_clock(out, "aborted", state.epoch)
            except Exception:  # noqa: BLE001 - the log itself failing: the first error is the one to tell
                pass
        return False

    return on_exit
