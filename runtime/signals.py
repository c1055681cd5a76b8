"""Pre-emption (SLURM's SIGTERM / SIGUSR1, ``scancel``): stop cleanly in every mode.

Training sets a flag that the loop checks between steps (then saves and exits). Evaluation and
benchmarks have nothing to save: the handler raises :class:`Stopped` at once, so they end within
the current operation instead of running on for minutes.
"""
from __future__ import annotations

import signal
import threading


class Stopped(Exception):
    """Raised by the signal handler in ``interrupt`` mode; ``exit_code`` is 128 + the signal."""

    def __init__(self, name: str, number: int):
        super().__init__(f"stopped by {name}")
        self.name, self.exit_code = name, 128 + number


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1; the training loop checks it between steps. With
    ``interrupt=True`` the handler raises :class:`Stopped` instead."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, interrupt: bool = False):
        self.received: str | None = None
        self.number: int | None = None
        self.interrupt = interrupt
        self._previous = {}

    def __bool__(self) -> bool:
        return self.received is not None

    def install(self) -> "PreemptionFlag":
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.received, self.number = signal.Signals(signum).name, signum
        if self.interrupt:
            raise Stopped(self.received, signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
