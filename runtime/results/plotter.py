"""``<log_dir>/curves.png`` drawn while training runs (``--plot``).

``CurvePlotter(log_dir).request()`` after each evaluation renders in one background thread
(matplotlib's object API with the Agg canvas, never pyplot), so the training step never waits for
a picture. :func:`write_curves_in_subprocess` draws in a child process instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Callable

from runtime.results.figure import write_figure
from runtime.results.files import ReportError
from runtime.results.runs import load_run
from runtime.run_files import CURVES_PNG, QUALITY_THRESHOLD

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
_CHILD_CODE = ("import sys; sys.path.insert(0, sys.argv[1]); from runtime.results.plotter import main_curves; "
               "sys.exit(main_curves(sys.argv[2], float(sys.argv[3])))")


def write_curves(log_dir: str, quality_threshold: float = QUALITY_THRESHOLD) -> str:
    """Write ``<log_dir>/curves.png`` from the run's files in ``log_dir``; returns its path.

    Safe to call from a background thread while training writes the logs: it only reads them,
    uses no pyplot state, and replaces the picture atomically."""
    if not os.path.isdir(log_dir):
        raise ReportError(f"{log_dir}: no such folder")
    return write_figure([load_run(log_dir)], quality_threshold, os.path.join(log_dir, CURVES_PNG))


def main_curves(log_dir: str, quality_threshold: float) -> int:
    """write_curves with a one-line error on stderr and exit code 1 (the child process's entry)."""
    try:
        write_curves(log_dir, quality_threshold)
    except Exception as error:  # reported by the parent as one line
        print(str(error).splitlines()[0] if str(error) else type(error).__name__, file=sys.stderr)
        return 1
    return 0


def write_curves_in_subprocess(log_dir: str, quality_threshold: float = QUALITY_THRESHOLD) -> str:
    """write_curves in a child Python process, for ``CurvePlotter(..., write=...)``: a matplotlib
    failure or leak cannot touch the training process, and the drawing shares no GIL with it. It
    costs a Python start and a matplotlib import per picture; docs/performance.md ("Curve
    plotter") compares it with the thread."""
    proc = subprocess.run([sys.executable, "-c", _CHILD_CODE, _ROOT, os.path.abspath(log_dir),
                           repr(float(quality_threshold))], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise ReportError(lines[-1] if lines else f"drawing process exit code {proc.returncode}")
    return os.path.join(log_dir, CURVES_PNG)


class CurvePlotter:
    """Redraws ``<log_dir>/curves.png`` in one daemon thread whenever asked.

    ``request()`` never blocks: it marks a redraw as wanted and returns; requests made while a
    picture is being drawn are coalesced into one more drawing. The first failure (matplotlib
    missing, an unwritable folder) is reported once, as one line through ``say``; training goes
    on. ``close()`` waits for the drawing asked for last."""

    def __init__(self, log_dir: str, quality_threshold: float = QUALITY_THRESHOLD,
                 write: Callable[[str, float], str] = write_curves,
                 say: Callable[[str], None] | None = None):
        self.log_dir, self.quality_threshold = log_dir, quality_threshold
        self._write = write
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wake = threading.Condition()
        self._pending = self._closed = self._reported = False
        self._thread: threading.Thread | None = None
        self.drawn = 0  # pictures written, for tests and curiosity

    def request(self) -> None:
        with self._wake:
            if self._closed:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="curve-plotter", daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                self._pending = False
            try:
                self._write(self.log_dir, self.quality_threshold)
                self.drawn += 1
            except Exception as error:  # a picture is never worth stopping a training run
                if not self._reported:
                    self._reported = True
                    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                    self._say(f"{CURVES_PNG} not written in {self.log_dir}: {reason}")
