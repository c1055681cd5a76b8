"""The bodies of ``--exec_mode train`` and of ``--benchmark`` (``runtime.mode.MODES``)."""
from __future__ import annotations

from runtime.clocked.start import started
from runtime.mode import Session
from runtime.results.plotter import CurvePlotter
from runtime.training.benchmark import benchmark_evaluate, benchmark_train
from runtime.training.loop import run_training


def train_body(session: Session) -> int:
    parts, _ = started(session, curves=CurvePlotter)  # --plot: curves.png redrawn after each evaluation
    if parts is None:
        return 0
    out, components = parts
    return run_training(components, out)


def benchmark_body(session: Session) -> int:
    parts, _ = started(session)
    if parts is None:
        return 0
    out, components = parts
    (benchmark_train if session.mode.trains else benchmark_evaluate)(components, out)
    return 0
