"""Pre-emption (SLURM's SIGTERM / SIGUSR1): remember the signal, let the loop stop cleanly."""
from __future__ import annotations

import signal
import threading


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1; the training loop checks it between steps."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: str | None = None
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
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
