"""One lifecycle for every exec mode.

:func:`run` checks the mode's outputs, starts the process group, installs the signal handlers,
locks the outputs (rank 0 holds the locks, every rank learns the outcome), runs the mode's body
(which resolves the config once and builds what it computes with) and tears everything down in
reverse order; a run refused before it wrote anything leaves no empty folder behind.

A mode is one entry of :data:`runtime.mode.MODES` (:class:`runtime.mode.Mode`): what it does, the
outputs it writes, whether a signal stops it at once (nothing to save) or at the next step
(training saves), what it checks before the process group starts, and its body, in its
product's folder, imported here when the mode runs (:func:`function`). docs/development.md: "An
exec mode".
"""
from __future__ import annotations

import importlib
from contextlib import ExitStack
from typing import Callable

from runtime import distributed as D
from runtime.arguments import recipe_flags
from runtime.config import Config
from runtime.mode import Function, Mode, Output, Session
from runtime.outputs import OutputError, RunLock, remove_if_empty
from runtime.signals import PreemptionFlag


def function(named: Function) -> Callable:
    """A mode's body or source: the function itself, or ``"module:function"`` imported now (the
    table of modes imports no product)."""
    if callable(named):
        return named
    module, _, name = named.partition(":")
    return getattr(importlib.import_module(module), name)


def run(config: Config, data=None) -> int:
    """Run ``config``'s mode; returns the exit code. ``data``: the data source (default:
    ``data_loading.data_loader.data_source(config)``; tests pass their own)."""
    mode = config.mode
    body, source = function(mode.body), function(mode.source)
    outputs = mode.outputs(config)
    made = [(output.folder(), output.check()) for output in outputs]
    graceful = False
    try:
        code = run_in_process_group(config, mode, body, outputs, source(config, data))
        graceful = True
        return code
    finally:
        if not graceful:  # a refused run leaves no empty folder behind
            for folder, created in made:
                remove_if_empty(folder, created)


def run_in_process_group(config: Config, mode: Mode, body: Callable[[Session], int], outputs: list[Output],
                         source) -> int:
    dist_info = D.init_distributed(config.device, config.local_rank)
    preempt = PreemptionFlag(interrupt=mode.stop_at_once).install()
    graceful = True
    try:
        with ExitStack() as on_exit:
            for output in outputs:
                on_exit.callback(take_lock(output.lock(dist_info.is_main), dist_info).release)
            return body(Session(config, dist_info, preempt, source, on_exit, mode, recipe_flags(config)))
    except BaseException:
        graceful = False
        raise
    finally:
        preempt.restore()
        D.cleanup(graceful)


def take_lock(lock: RunLock, dist_info: D.DistInfo) -> RunLock:
    """``lock`` acquired on rank 0; every rank learns the outcome (a refusal is every rank's
    error, not a hang of the others at their next collective)."""
    problem = None
    try:
        lock.acquire()
    except OutputError as exc:
        problem = exc
    if not D.broadcast_int(int(problem is None), dist_info.device):
        raise problem or OutputError(f"{lock.flag} {lock.subject!r} is used by another run (rank 0 says why)")
    return lock
