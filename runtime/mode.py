"""What an exec mode is (:class:`Mode`), the paths it writes (:class:`Output`) and what its body
gets from the lifecycle (:class:`Session`). Apart from ``runtime.app`` (the lifecycle and the
table of modes) so that the bodies, in their products' folders, import it without importing the
table that names them."""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable

from runtime import distributed as D
from runtime.arguments import Config
from runtime.outputs import RunLock, check_output_dir, check_output_file, checkpoint_lock
from runtime.signals import PreemptionFlag


@dataclass(frozen=True)
class Output:
    """A path a mode writes: a folder (its lock file inside) or, ``is_file``, one file (a lock
    file beside it)."""

    path: str
    flag: str
    is_file: bool = False

    def check(self) -> str | None:
        """Create/prove writable; the outermost folder created (see ``remove_if_empty``)."""
        return check_output_file(self.path, self.flag) if self.is_file else check_output_dir(self.path, self.flag)

    def folder(self) -> str:
        return os.path.dirname(os.path.abspath(self.path)) if self.is_file else self.path

    def lock(self, enabled: bool) -> RunLock:
        if self.is_file:
            return checkpoint_lock(self.path, enabled=enabled)
        return RunLock(self.path, enabled=enabled, flag=self.flag)


@dataclass(frozen=True)
class Mode:
    """One exec mode: its body and what the lifecycle and the shared start of a run ask of it."""

    body: Callable[["Session"], int]
    outputs: Callable[[Config], list[Output]] = lambda config: []
    stop_at_once: bool = True  # a signal stops the run now (outputs are atomic); False: at the next step
    # checks and inputs that need no process group: (config, data given by the caller) -> source
    source: Callable[[Config, object], object] = lambda config, data: data
    # an MLPerf training run: writes the MLPerf log (one run per folder: the last run's files are
    # moved aside first) and says in it whether the attempt started from a checkpoint
    mlperf_run: bool = False
    writes_metrics: bool = False  # writes log.json in --log_dir, when --log_dir is one of its outputs

    def writes_metrics_for(self, config: Config) -> bool:
        """Whether a run of ``config`` writes ``log.json``: a mode that writes it, into a
        ``--log_dir`` that is one of this run's outputs (checked and locked first)."""
        return self.writes_metrics and any(output.flag == "--log_dir" for output in self.outputs(config))


@dataclass
class Session:
    """What a mode's body gets from the lifecycle."""

    config: Config  # as parsed: the body resolves it (runtime.resolve)
    dist: D.DistInfo
    preempt: PreemptionFlag
    source: object  # the data source (train, evaluate, benchmark) or the scans (predict)
    on_exit: ExitStack  # callbacks run at teardown, before the locks are released
    mode: Mode
